"""How a recipe turns a raw sentence into the text it binarises, as data: ``TextSettings``.

One ``TextSettings`` per language and split kind says which steps a recipe runs, in this order:

    apostrophe           ``’`` -> ``'`` (fairseq's ``sed "s/’/'/g"`` on the IWSLT14 / WMT14 test sets)
    remove_non_printing  Moses ``remove-non-printing-char.perl`` (``\\p{C}`` -> space)
    normalize            Moses ``normalize-punctuation.perl -l LANG``
    tokenizer            ``moses`` (``tokenizer.perl -l LANG``; ``escape``: Moses' default
                         ``&amp;`` escaping; ``aggressive_dash_splits``: ``-a``), ``jieba`` (Chinese
                         word segmentation, default dictionary) or ``none`` (white space collapsed)
    lowercase            ``lowercase.perl``
    subword              ``subword-nmt`` / ``sentencepiece`` / ``none``, with the model file
                         ``subword_model`` (a file name inside the data-bin)

``tokenize_lines(lines, settings)`` runs the steps before the subword model and
``SubwordModel(method, path).apply(line)`` (``subword_model.py``) the subword model;
``process_sentence`` is both, for one sentence. The recipes (``multi30k.py``, ``iwslt14.py``,
``wmt14.py``, ``wmt17.py``) make their text with these functions, and ``binarize_step`` records
the settings of the test split of each language (what the model is evaluated on: new text,
never cleaned) in the data-bin's ``prepare-manifest.json`` under ``"text"``. The text
pipeline of the demo and of the Python API (``fairseq_modattn/data/text_pipeline.py``) reads
them back (``recorded_settings``) and calls the same functions, so the two cannot drift.
"""

import functools
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..atomic_files import PathLike
from . import moses
from .errors import DataError
from .manifest import MANIFEST, read_manifest
from .subword_model import NO_SUBWORD, SubwordModel, check_subword_method, subword_method, subword_model_name

TOKENIZERS = ("moses", "jieba", "none")


@dataclass(frozen=True)
class TextSettings:
    """The text steps a recipe runs on one language (see the module docstring)."""

    lang: str
    tokenizer: str = "moses"
    apostrophe: bool = False
    remove_non_printing: bool = False
    normalize: bool = False
    escape: bool = True
    aggressive_dash_splits: bool = False
    lowercase: bool = False
    subword: str = NO_SUBWORD
    subword_model: Optional[str] = None

    def __post_init__(self):
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"tokenizer must be one of {', '.join(TOKENIZERS)}, got {self.tokenizer!r}")
        object.__setattr__(self, "subword", subword_method(self.subword))
        check_subword_method(self.subword, "subword")

    def with_subword(self, method: str, joint: bool) -> "TextSettings":
        """These settings followed by METHOD's model (joint, or this language's own)."""
        method = subword_method(method)
        model = None if method == NO_SUBWORD else subword_model_name(method, None if joint else self.lang)
        return replace(self, subword=method, subword_model=model)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, record) -> "TextSettings":
        """The settings a manifest records; ValueError for anything else."""
        if not isinstance(record, dict):
            raise ValueError(f"expected an object, got {record!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - known)
        if unknown:
            raise ValueError(f"unknown text setting(s) {', '.join(unknown)}")
        if "lang" not in record:
            raise ValueError("no 'lang'")
        return cls(**record)

    def steps(self) -> str:
        """One line naming the steps, e.g. ``moses -a, normalize-punctuation, lowercase, subword-nmt code``."""
        out = []
        if self.apostrophe:
            out.append("’ -> '")
        if self.remove_non_printing:
            out.append("remove-non-printing-char")
        if self.normalize:
            out.append("normalize-punctuation")
        if self.tokenizer == "moses":
            out.append("moses" + (" -a" if self.aggressive_dash_splits else "")
                       + ("" if self.escape else " -no-escape"))
        else:
            out.append(f"{self.tokenizer} tokenizer" if self.tokenizer != "none" else "no tokenizer")
        if self.lowercase:
            out.append("lowercase")
        out.append(self.subword + (f" {self.subword_model}" if self.subword_model else ""))
        return ", ".join(out)


# ----------------------------------------------------------------------------------- the steps

def remove_control_chars(lines: Sequence[str]) -> List[str]:
    """Moses ``remove-non-printing-char.perl``: every Unicode "other" character (``\\p{C}``:
    controls, format characters such as zero-width spaces, unassigned) becomes a space."""
    import regex  # a dependency of sacremoses

    pattern = regex.compile(r"\p{C}")
    return [pattern.sub(" ", s) for s in lines]


@functools.lru_cache(maxsize=1)
def _jieba_tokenizer():
    import logging

    try:
        import jieba
    except ImportError:
        raise DataError("Chinese is segmented with `jieba` (the WMT17 zh-en recipe): pip install jieba") from None
    jieba.setLogLevel(logging.WARNING)
    return jieba.Tokenizer()  # the default dictionary, cached by jieba in the temp folder


def segment_zh(lines: Sequence[str]) -> List[str]:
    """Chinese word segmentation with jieba's default dictionary (deterministic: dictionary DAG
    plus Viterbi over its HMM for unknown words), white space collapsed first."""
    tokenizer = _jieba_tokenizer()
    return [" ".join(w for w in tokenizer.cut(" ".join(s.split()), HMM=True) if not w.isspace()) for s in lines]


def tokenize_lines(lines: Sequence[str], settings: TextSettings, workers: int = 1) -> List[str]:
    """LINES through the steps of SETTINGS before the subword model (WORKERS processes for Moses)."""
    lines = list(lines)
    if settings.apostrophe:
        lines = [s.replace("\u2019", "'") for s in lines]
    if settings.remove_non_printing:
        lines = remove_control_chars(lines)
    if settings.tokenizer == "jieba":
        if settings.normalize:
            lines = moses.normalize_punctuation(lines, settings.lang, workers=workers)
        lines = segment_zh(lines)
        return moses.lowercase(lines) if settings.lowercase else lines
    return moses.tokenize(lines, settings.lang, normalize=settings.normalize, tokenize=settings.tokenizer == "moses",
                          lower=settings.lowercase, escape=settings.escape,
                          aggressive_dash_splits=settings.aggressive_dash_splits, workers=workers)


def process_sentence(text: str, settings: TextSettings, subword: SubwordModel) -> List[str]:
    """One raw sentence -> its subword tokens: exactly the recipe's text steps and subword model
    (``tokenize_lines`` then ``SubwordModel.apply``)."""
    return subword.apply(tokenize_lines([text], settings)[0]).split()


# ------------------------------------------------------------------------------- the manifest

def manifest_text(settings: Dict[str, TextSettings], method: str, joint: bool) -> Dict[str, dict]:
    """The manifest's ``"text"`` entry: per language, SETTINGS followed by the subword model."""
    return {lang: s.with_subword(method, joint).to_dict() for lang, s in settings.items()}


def recorded_settings(data_bin: PathLike, lang: str) -> Optional[TextSettings]:
    """The settings ``prepare`` recorded for LANG in DATA_BIN's manifest; None for a data-bin
    without them (plain fairseq-preprocess, or a prepare of an earlier version). ValueError
    when the record is there but malformed."""
    manifest = read_manifest(data_bin)
    text = (manifest or {}).get("text")
    if not isinstance(text, dict) or lang not in text:
        return None
    try:
        settings = TextSettings.from_dict(text[lang])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(data_bin) / MANIFEST}: text settings of {lang!r}: {e}") from None
    if settings.lang != lang:
        raise ValueError(f"{Path(data_bin) / MANIFEST}: text settings of {lang!r} name language {settings.lang!r}")
    return settings
