"""Evaluation and analysis of trained checkpoints (no training code here).

    checkpoints.py  averaging the last N epoch/update checkpoints, atomically written
    scoring.py      BLEU as fairseq prints it, detokenized sacreBLEU, chrF and TER, compound-split BLEU
    comet_scoring.py COMET through the optional unbabel-comet package (evaluate --comet)
    loading.py      any supported checkpoint -> (model, task), batches of a data split
    capture.py      per-head attention weights, queries and DMA posteriors via forward hooks
    redundancy.py   the attention-redundancy metrics LR and HR (docs/design.md, "Evaluation definitions")
    plots.py        headless matplotlib figures (PNG)

Nothing here is imported by ``fairseq_modattn/__init__.py``: ``--user-dir`` stays light.
"""


class AnalysisError(Exception):
    """Bad input to an evaluation/analysis command: the message says what and where."""
