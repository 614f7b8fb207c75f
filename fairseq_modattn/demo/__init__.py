"""The translation demo: ``fairseq-modattn serve`` (a Flask app with a Plotly page).

    translator.py  one checkpoint: beam search, then the teacher-forced forward of the best
                   hypothesis read out per layer and head (attention, DMA clusters and masks,
                   TIM competition, RIM activation)
    app.py         the HTTP API and the page (``static/``), one translation at a time

Raw sentences become the model's subword tokens, and back, as the data recipes made them, in
``fairseq_modattn/data/text_pipeline.py`` (shared with the Python API, ``from_pretrained``).

Flask and plotly are the ``demo`` extra (``pip install 'fairseq-modattn[demo]'``); nothing here
is imported by ``fairseq_modattn/__init__.py``.
"""

#: the default cap of one JSON answer (``--max-response-bytes``; ``translator.py`` says how it holds)
MAX_RESPONSE_BYTES = 4_000_000


class DemoError(Exception):
    """Bad start-up input (checkpoint, data-bin, subword model): the message says what and where."""
