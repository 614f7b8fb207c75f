"""COMET (Rei et al., 2020) of detokenized translations, through the optional ``unbabel-comet``
package (``pip install 'fairseq-modattn[comet]'``): ``fairseq-modattn evaluate --comet MODEL``.

COMET is a neural metric: it scores each (source, hypothesis, reference) triple with a trained
model, and the system score is the mean of the sentence scores. Which model scored is part of
the number (scores of two COMET models are not comparable), so the results always name it.

The package is optional because it pins its own dependency ranges (``numpy < 2``,
``pytorch-lightning``, ``transformers``), which an environment built for fairseq may not
satisfy; and its models are downloaded from the Hugging Face hub. :func:`load_comet_model` is
therefore called before any translation work, so a missing package or an unreachable model
costs a second, not a generation run: it raises an :class:`AnalysisError` of one line naming
the model and the cause.
"""

from pathlib import Path
from typing import Any, Sequence

from . import AnalysisError

INSTALL_HINT = "pip install 'fairseq-modattn[comet]'"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__


def comet_version() -> str:
    """The installed unbabel-comet version (for the results' ``versions``)."""
    from importlib.metadata import version

    return version("unbabel-comet")


def load_comet_model(model: str) -> Any:
    """The COMET model MODEL: a local checkpoint file (``.../checkpoints/model.ckpt``), a folder
    holding one (a downloaded model: ``MODEL/checkpoints/model.ckpt``), or a model name of the
    Hugging Face hub (``Unbabel/wmt22-comet-da``) that comet's ``download_model`` fetches, or
    finds in its cache. An AnalysisError of one line when unbabel-comet is not installed or the
    model cannot be loaded."""
    try:
        import comet
    except ImportError as e:  # also a broken dependency of comet (numpy, lightning): say which
        raise AnalysisError(f"--comet {model}: unbabel-comet cannot be imported ({_first_line(e)}); "
                            f"install it with {INSTALL_HINT}, or leave --comet out") from None
    path = Path(model).expanduser()
    try:
        if path.is_dir():
            checkpoint = path / "checkpoints" / "model.ckpt"
            if not checkpoint.is_file():
                raise FileNotFoundError(f"{path} holds no checkpoints/model.ckpt (a downloaded COMET model does)")
        elif path.is_file():
            checkpoint = path
        else:
            checkpoint = Path(comet.download_model(model))
        return comet.load_from_checkpoint(str(checkpoint))
    except Exception as e:  # comet raises bare Exceptions and KeyErrors; any failure means no model
        where = "the local model" if path.exists() else "a Hugging Face hub model (no such local path)"
        raise AnalysisError(f"--comet {model}: cannot load the COMET model, tried as {where}: "
                            f"{_first_line(e)}") from None


def comet_system_score(model: Any, sources: Sequence[str], hyps: Sequence[str], refs: Sequence[str], *,
                       gpus: int = 0, batch_size: int = 16) -> float:
    """COMET's system score (the mean of its sentence scores) of HYPS, with their SOURCES and
    REFS (one each, detokenized), on GPUS GPUs (0: the CPU)."""
    if not len(sources) == len(hyps) == len(refs):
        raise AnalysisError(f"COMET needs one source and one reference per hypothesis: got {len(sources)} "
                            f"sources, {len(hyps)} hypotheses, {len(refs)} references")
    samples = [{"src": s, "mt": h, "ref": r} for s, h, r in zip(sources, hyps, refs)]
    prediction = model.predict(samples, batch_size=batch_size, gpus=gpus, progress_bar=False)
    return float(prediction.system_score)
