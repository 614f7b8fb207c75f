"""A subword model by name: its method, its file in a data-bin, and applying it to text.

This is what both sides of the pipeline share. The recipes learn models and apply them to
whole splits (``subwords.py``); the text settings record which model a language went through,
and the demo applies that model to one typed sentence (``text_settings.py``,
``fairseq_modattn/data/text_pipeline.py``). Both import from here, so neither imports the other.

    SUBWORD_METHODS      the subword models: ``subword-nmt`` (BPE with ``@@ `` continuation
                         marks) and ``sentencepiece``; ``NO_SUBWORD`` (``none``) is text the
                         model reads as it is
    subword_method       a name in the pipeline's spelling (earlier spellings accepted)
    subword_model_name   the model's file name in a data-bin, joint or per language
    SubwordModel         a loaded model: ``apply`` a line, ``decode`` pieces
    require_sentencepiece  the optional ``sentencepiece`` package, or a DataError saying how
                         to install it
"""

from pathlib import Path
from typing import List, Optional, Sequence

from ..atomic_files import PathLike
from .errors import DataError

SUBWORD_METHODS = ("subword-nmt", "sentencepiece")
NO_SUBWORD = "none"
#: earlier spellings accepted on input
SUBWORD_ALIASES = {"subword_nmt": "subword-nmt", "bpe": "subword-nmt", "spm": "sentencepiece"}


def subword_method(name: str) -> str:
    """NAME in the recipes' spelling (``subword_nmt`` -> ``subword-nmt``)."""
    return SUBWORD_ALIASES.get(name, name)


def check_subword_method(method: str, what: str) -> None:
    """ValueError unless METHOD is one of ``SUBWORD_METHODS`` or ``NO_SUBWORD``; WHAT names the
    value in the message."""
    if method not in SUBWORD_METHODS and method != NO_SUBWORD:
        choices = ", ".join((*SUBWORD_METHODS, NO_SUBWORD))
        raise ValueError(f"{what} must be one of {choices}, got {method!r}")


def subword_model_name(method: str, lang: Optional[str] = None) -> str:
    """The file name of a subword model in a data-bin: joint (LANG None) or per language."""
    if subword_method(method) == "sentencepiece":
        return f"spm.{lang}.model" if lang else "spm.model"
    return f"code.{lang}" if lang else "code"


def require_sentencepiece():
    """The ``sentencepiece`` module; it is an optional dependency, needed only by recipes and
    data-bins that choose it."""
    try:
        import sentencepiece
    except ImportError:
        raise DataError("the sentencepiece option needs the `sentencepiece` package: "
                        "pip install sentencepiece") from None
    return sentencepiece


class SubwordModel:
    """A loaded subword model: ``apply(line)`` -> the line in space-separated subwords."""

    def __init__(self, method: str, path: Optional[PathLike]):
        self.method = subword_method(method)
        check_subword_method(self.method, "subword method")
        self.path = Path(path) if path is not None else None
        if self.method == "subword-nmt":
            from subword_nmt.apply_bpe import BPE

            with open(self.path, encoding="utf-8") as f:
                self._bpe = BPE(f)
        elif self.method == "sentencepiece":
            spm = require_sentencepiece()
            self._spm = spm.SentencePieceProcessor(model_file=str(self.path))

    def apply(self, line: str) -> str:
        if self.method == "subword-nmt":
            return self._bpe.process_line(line)
        if self.method == "sentencepiece":
            return " ".join(self._spm.encode(line, out_type=str))
        return line

    def decode(self, pieces: Sequence[str]) -> str:
        """Subword strings -> text (the subword marks removed)."""
        if self.method == "sentencepiece":
            return self._spm.decode(list(pieces))
        text = " ".join(pieces)
        return (text + " ").replace("@@ ", "").rstrip() if self.method == "subword-nmt" else text

    def apply_lines(self, lines) -> List[str]:
        if self.method == "sentencepiece":
            return [" ".join(p) for p in self._spm.encode(list(lines), out_type=str)]
        return [self.apply(s) for s in lines]
