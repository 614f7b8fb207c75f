"""The ``fairseq-modattn`` command (see ``main.py``)."""
