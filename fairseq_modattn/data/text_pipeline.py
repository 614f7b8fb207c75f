"""A raw sentence -> the subword tokens a model was trained on, and back: ``TextPipeline``.

The demo (``fairseq-modattn serve``, ``demo/translator.py``) and the Python API
(``Model.from_pretrained(...).translate``, ``models/hub_interface.py``) both translate raw text
with it, so the two cannot tokenise differently.

The data recipes (``fairseq_modattn/data``) make their text with the functions of
``fairseq_modattn/data/text_settings.py``, and ``fairseq-modattn prepare`` records in the
data-bin's ``prepare-manifest.json`` the settings of each language's test split: punctuation
normalisation, ``’`` -> ``'``, non-printing characters, the tokenizer (Moses with its escaping
and ``-a`` dash splitting, jieba for Chinese, or none), lower-casing, and the subword model it
copied there (subword-nmt ``code`` / ``code.SRC`` or sentencepiece ``spm.model`` /
``spm.SRC.model``). ``TextPipeline.from_data_bin`` reads them, and ``encode`` calls the same
``text_settings.process_sentence`` the recipes use, so a sentence of the test set gets exactly
the tokens the model was evaluated on. ``--tokenizer``, ``--lowercase`` and ``--bpe`` (with
``--bpe-codes``) override single settings; their ``auto`` default takes the recorded one.

A data-bin without recorded settings (made by plain ``fairseq-preprocess``, or by a prepare of an
earlier version) gets the earlier guesses, and ``describe()`` says so: Moses with its default
escaping (no normalisation, no ``-a``), jieba for Chinese, none before sentencepiece;
lower-casing when the source dictionary holds no upper-case letter; the subword model found in
the data-bin. Control and format characters are then dropped before tokenisation.

Output goes the other way: subword marks removed, then Moses detokenisation (when the target
side was Moses-tokenised).

A text with no printable character is refused; a subword the dictionary does not hold becomes
``<unk>``, which ``encode`` reports so that the caller can tell the user.
"""

import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import List, Optional, Tuple

from . import text_settings as T
from .manifest import MANIFEST
from .subword_model import NO_SUBWORD, SUBWORD_METHODS, SubwordModel, subword_method, subword_model_name

TOKENIZERS = ("auto",) + T.TOKENIZERS
SUBWORDS = ("auto", *SUBWORD_METHODS, NO_SUBWORD)
LOWERCASE = ("auto", "yes", "no")


class TextPipelineError(ValueError):
    """The pipeline cannot be built (a bad setting, a missing subword model, a malformed record):
    one line saying what and where. The demo reports it as its own ``DemoError``."""


def subword_choice(name: str) -> str:
    """A --bpe value in the pipeline's spelling: ``subword_nmt`` (the demo's earlier spelling)
    is ``subword-nmt``."""
    return subword_method(name)


def find_subword_model(data: Path, source_lang: str) -> Tuple[str, Optional[Path]]:
    """(kind, path) of the subword model a data recipe copied into the data-bin ``data``."""
    for kind in SUBWORD_METHODS:
        for name in (subword_model_name(kind, source_lang), subword_model_name(kind)):
            if (data / name).is_file():
                return kind, data / name
    raise TextPipelineError(
        f"no subword model in {data} (looked for code, code.{source_lang}, spm.model, "
        f"spm.{source_lang}.model, which `fairseq-modattn prepare` copies there): pass --bpe "
        "subword-nmt or sentencepiece with --bpe-codes PATH, or --bpe none for text that is "
        "already split into the dictionary's tokens"
    )


def default_tokenizer(source_lang: str, subword: str) -> str:
    """What ``--tokenizer auto`` means without recorded settings: the recipes' usual choice for
    this language and subword model (jieba for Chinese, none before sentencepiece, Moses otherwise)."""
    if source_lang == "zh":
        return "jieba"
    return "none" if subword_choice(subword) == "sentencepiece" else "moses"


def dictionary_is_lowercase(dictionary) -> bool:
    """True when no symbol of the fairseq dictionary (special symbols aside) holds an upper-case
    letter: the recipe lower-cased its text, so input must be lower-cased too."""
    specials = set(dictionary.symbols[: dictionary.nspecial])
    return not any(ch.isupper() for sym in dictionary.symbols if sym not in specials for ch in sym)


def clean_text(text: str) -> str:
    """Drop control / format characters (NUL, zero-width joiners, BOM...) and collapse spaces."""
    kept = "".join(" " if ch in "\t\n\r" else ch for ch in text
                   if ch in "\t\n\r" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn"))
    return " ".join(kept.split())


@dataclass
class Encoded:
    """One source sentence: its cleaned text, subword tokens (without the final </s>), their
    dictionary ids (with </s>), and the subwords the dictionary does not hold."""

    text: str
    subwords: List[str]
    ids: "object"  # torch.LongTensor (T,)
    unknown: List[str] = field(default_factory=list)


class TextPipeline:
    """``encode(text)`` for the source language, ``decode(ids)`` for the target language.

    ``from_data_bin`` is how the demo builds one (the recorded settings, or the guesses). Made
    directly, it runs SETTINGS (a ``text_settings.TextSettings``; RECORDED: a data-bin's record,
    run on the text as typed) when given, else the guessed steps: TOKENIZER with Moses' default
    escaping, LOWERCASE, SUBWORD with SUBWORD_MODEL, on ``clean_text`` of the input. ORIGIN
    says where the settings come from (``describe``)."""

    def __init__(self, src_dict, tgt_dict, source_lang: str, target_lang: str, *, tokenizer: str = "moses",
                 lowercase: bool = True, subword: str = "subword-nmt", subword_model: Optional[Path] = None,
                 settings: Optional[T.TextSettings] = None, target_tokenizer: Optional[str] = None,
                 recorded: bool = False, origin: Optional[str] = None):
        subword = subword_choice(subword)
        if settings is None:
            if tokenizer not in T.TOKENIZERS:
                raise TextPipelineError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
            if subword == "auto" or subword not in SUBWORDS:
                raise TextPipelineError(f"--bpe must be one of {', '.join(SUBWORDS)}, got {subword!r}")
            # the demo's steps before data-bins recorded theirs (jieba: as the WMT17 recipe)
            settings = T.TextSettings(source_lang, tokenizer=tokenizer, remove_non_printing=tokenizer == "jieba",
                                      lowercase=bool(lowercase), subword=subword,
                                      subword_model=Path(subword_model).name if subword_model else None)
        self.recorded = recorded  # SETTINGS are a data-bin's record: run them on the text as typed
        self.origin = origin or ("given" if recorded else "guessed")
        if settings.subword != NO_SUBWORD and (subword_model is None or not Path(subword_model).is_file()):
            raise TextPipelineError(f"subword model {subword_model} does not exist (--bpe-codes)")
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.source_lang, self.target_lang = source_lang, target_lang
        self.settings = settings
        self.tokenizer, self.lowercase, self.subword = settings.tokenizer, settings.lowercase, settings.subword
        self.subword_model = Path(subword_model) if settings.subword != NO_SUBWORD else None
        self._subword = SubwordModel(settings.subword, self.subword_model)
        # without a record of the target side: Moses-tokenised whenever the source is tokenised
        if target_tokenizer is None:
            target_tokenizer = "moses" if settings.tokenizer != "none" else "none"
        self._detok = None
        if target_tokenizer == "moses":
            from sacremoses import MosesDetokenizer

            self._detok = MosesDetokenizer(lang=target_lang)

    @classmethod
    def from_data_bin(cls, data, src_dict, tgt_dict, source_lang: str, target_lang: str, *,
                      tokenizer: str = "auto", lowercase: str = "auto", bpe: str = "auto",
                      bpe_codes: Optional[Path] = None) -> "TextPipeline":
        """The pipeline of data-bin DATA: the settings ``prepare`` recorded in its manifest, each
        ``auto`` flag taking the recorded value and any other value overriding it; without
        recorded settings, the guesses of the module docstring."""
        data = Path(data)
        bpe = subword_choice(bpe)
        for flag, value, choices in (("--tokenizer", tokenizer, TOKENIZERS), ("--lowercase", lowercase, LOWERCASE),
                                     ("--bpe", bpe, SUBWORDS)):
            if value not in choices:
                raise TextPipelineError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
        if bpe == "auto" and bpe_codes is not None:
            raise TextPipelineError("--bpe-codes needs --bpe subword-nmt or sentencepiece (which model is it?)")
        try:
            recorded = T.recorded_settings(data, source_lang)
            target = T.recorded_settings(data, target_lang)
        except ValueError as e:
            raise TextPipelineError(str(e)) from None
        if recorded is None:
            return cls._guessed(data, src_dict, tgt_dict, source_lang, target_lang, tokenizer, lowercase, bpe,
                                bpe_codes)
        settings, overridden = recorded, []
        if tokenizer != "auto" and tokenizer != settings.tokenizer:  # the other recorded steps stay
            settings = replace(settings, tokenizer=tokenizer)
            overridden.append(f"--tokenizer {tokenizer}")
        if lowercase != "auto" and (lowercase == "yes") != settings.lowercase:
            settings = replace(settings, lowercase=lowercase == "yes")
            overridden.append(f"--lowercase {lowercase}")
        model = None
        if bpe == "auto" or (bpe == settings.subword and bpe_codes is None):
            if settings.subword != NO_SUBWORD:
                model = data / settings.subword_model
                if not model.is_file():
                    raise TextPipelineError(f"{data / MANIFEST} names the subword model {settings.subword_model}, "
                                    f"which is not in {data}: put it back, or pass --bpe and --bpe-codes")
        else:
            model = bpe_codes
            settings = replace(settings, subword=bpe, subword_model=Path(bpe_codes).name if bpe_codes else None)
            overridden.append(f"--bpe {bpe}" + (f" --bpe-codes {bpe_codes}" if bpe_codes else ""))
        origin = f"recorded by fairseq-modattn prepare in {data / MANIFEST}"
        if overridden:
            origin += " (overridden: " + ", ".join(overridden) + ")"
        return cls(src_dict, tgt_dict, source_lang, target_lang, settings=settings, subword_model=model,
                   target_tokenizer=target.tokenizer if target is not None else None, recorded=True,
                   origin=origin)

    @classmethod
    def _guessed(cls, data, src_dict, tgt_dict, source_lang, target_lang, tokenizer, lowercase, bpe, bpe_codes):
        guessed = []
        if bpe == "auto":
            bpe, bpe_codes = find_subword_model(data, source_lang)
            guessed.append(f"the subword model {bpe_codes.name}")
        if tokenizer == "auto":
            tokenizer = default_tokenizer(source_lang, bpe)
            guessed.append("the tokenizer from the language and subword model")
        lower = {"yes": True, "no": False}.get(lowercase)
        if lower is None:
            lower = dictionary_is_lowercase(src_dict)
            guessed.append("lower-casing from the source dictionary")
        origin = (f"guessed: {data} records no text settings (a data-bin of plain fairseq-preprocess or of an "
                  f"earlier fairseq-modattn prepare), so no punctuation normalisation or dash splitting"
                  + (f"; {', '.join(guessed)} guessed" if guessed else ""))
        return cls(src_dict, tgt_dict, source_lang, target_lang, tokenizer=tokenizer, lowercase=lower,
                   subword=bpe, subword_model=bpe_codes, origin=origin)

    def describe(self) -> dict:
        return {"tokenizer": self.tokenizer, "lowercase": self.lowercase, "bpe": self.subword,
                "bpe_model": str(self.subword_model) if self.subword_model else None,
                "source_lang": self.source_lang, "target_lang": self.target_lang,
                "steps": self.settings.steps(), "settings": "recorded" if self.recorded else "guessed",
                "settings_origin": self.origin}

    def subwords(self, text: str) -> List[str]:
        """Raw text -> subword tokens: ``text_settings.process_sentence``, the recipes' own steps.

        With recorded settings the text goes in as typed (line breaks as spaces: a line of a
        corpus holds none), as the recipe read its test set; with guessed ones, cleaned first
        (``clean_text``), as the demo always did."""
        if self.recorded:
            text = text.replace("\r", " ").replace("\n", " ")
        else:
            text = clean_text(text)
        return T.process_sentence(text, self.settings, self._subword)

    def encode(self, text: str) -> Encoded:
        cleaned = clean_text(text)
        pieces = self.subwords(text) if cleaned else []
        ids = self.src_dict.encode_line(" ".join(pieces), add_if_not_exist=False, append_eos=True).long()
        unknown = [p for p, i in zip(pieces, ids.tolist()) if i == self.src_dict.unk()]
        return Encoded(cleaned, pieces, ids, unknown)

    def target_subwords(self, ids) -> List[str]:
        """Target ids (the final </s> included or not) -> subword strings."""
        return [self.tgt_dict[i] for i in ids if i != self.tgt_dict.eos()]

    def decode(self, ids) -> str:
        """Target ids -> detokenised text."""
        text = self._subword.decode(self.target_subwords(ids))
        if self._detok is not None:
            text = self._detok.detokenize(text.split())
        return text
