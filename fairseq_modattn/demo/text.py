"""A raw sentence -> the subword tokens a model was trained on, and back.

The data recipes (``fairseq_modattn/data``) make the training text in three steps, and a
sentence typed into the demo has to go through the same ones:

    Moses tokenisation (``--tokenizer moses``, Moses' default escaping), or jieba word
    segmentation for Chinese (``jieba``, as the WMT17 zh-en recipe), or none (white space), lower-casing when the recipe lower-cased (Multi30k and IWSLT14 by default),
    and the subword model shipped in the data-bin (subword-nmt ``code`` / ``code.SRC`` or
    sentencepiece ``spm.model`` / ``spm.SRC.model``).

Output goes the other way: subword marks removed, then Moses detokenisation.

Control and format characters (which no recipe keeps) are dropped and white space is collapsed;
any other character is kept, and a subword the dictionary does not hold becomes ``<unk>``, which
``encode`` reports so that the caller can tell the user.
"""

import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from . import DemoError

TOKENIZERS = ("auto", "moses", "jieba", "none")
SUBWORDS = ("auto", "subword_nmt", "sentencepiece", "none")
LOWERCASE = ("auto", "yes", "no")


def find_subword_model(data: Path, source_lang: str) -> Tuple[str, Optional[Path]]:
    """(kind, path) of the subword model a data recipe copied into the data-bin ``data``."""
    for kind, names in (("subword_nmt", (f"code.{source_lang}", "code")),
                        ("sentencepiece", (f"spm.{source_lang}.model", "spm.model"))):
        for name in names:
            if (data / name).is_file():
                return kind, data / name
    raise DemoError(
        f"no subword model in {data} (looked for code, code.{source_lang}, spm.model, "
        f"spm.{source_lang}.model, which `fairseq-modattn prepare` copies there): pass --bpe "
        "subword_nmt or sentencepiece with --bpe-codes PATH, or --bpe none for text that is "
        "already split into the dictionary's tokens"
    )


def default_tokenizer(source_lang: str, subword: str) -> str:
    """What ``--tokenizer auto`` means: the recipes' choice for this language and subword model
    (jieba for Chinese, none before sentencepiece, Moses otherwise)."""
    if source_lang == "zh":
        return "jieba"
    return "none" if subword == "sentencepiece" else "moses"


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
    """``encode(text)`` for the source language, ``decode(ids)`` for the target language."""

    def __init__(self, src_dict, tgt_dict, source_lang: str, target_lang: str, *, tokenizer: str = "moses",
                 lowercase: bool = True, subword: str = "subword_nmt", subword_model: Optional[Path] = None):
        if tokenizer not in TOKENIZERS[1:]:
            raise DemoError(f"--tokenizer must be one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
        if subword not in SUBWORDS[1:]:
            raise DemoError(f"--bpe must be one of {', '.join(SUBWORDS)}, got {subword!r}")
        if subword != "none" and (subword_model is None or not Path(subword_model).is_file()):
            raise DemoError(f"subword model {subword_model} does not exist (--bpe-codes)")
        self.src_dict, self.tgt_dict = src_dict, tgt_dict
        self.source_lang, self.target_lang = source_lang, target_lang
        self.tokenizer, self.lowercase, self.subword = tokenizer, lowercase, subword
        self.subword_model = Path(subword_model) if subword_model is not None else None
        if tokenizer == "moses":
            from sacremoses import MosesTokenizer

            self._tok = MosesTokenizer(lang=source_lang)
        # the recipes' target side is Moses-tokenised whenever it is tokenised at all
        self._detok = None
        if tokenizer != "none":
            from sacremoses import MosesDetokenizer

            self._detok = MosesDetokenizer(lang=target_lang)
        if subword == "subword_nmt":
            from subword_nmt.apply_bpe import BPE

            with open(self.subword_model, encoding="utf-8") as f:
                self._bpe = BPE(f)
        elif subword == "sentencepiece":
            import sentencepiece

            self._spm = sentencepiece.SentencePieceProcessor(model_file=str(self.subword_model))

    def describe(self) -> dict:
        return {"tokenizer": self.tokenizer, "lowercase": self.lowercase, "bpe": self.subword,
                "bpe_model": str(self.subword_model) if self.subword_model else None,
                "source_lang": self.source_lang, "target_lang": self.target_lang}

    def subwords(self, text: str) -> List[str]:
        """Cleaned raw text -> subword tokens, the steps of the data recipes."""
        if self.tokenizer == "moses":
            # escape=True: the recipes tokenise with Moses' default escaping (& -> &amp;)
            text = self._tok.tokenize(text, return_str=True, escape=True)
        elif self.tokenizer == "jieba":
            from ..data.wmt17 import segment_zh

            text = segment_zh([text])[0]
        if self.lowercase:
            text = text.lower()
        if self.subword == "subword_nmt":
            text = self._bpe.process_line(text)
        elif self.subword == "sentencepiece":
            return self._spm.encode(text, out_type=str)
        return text.split()

    def encode(self, text: str) -> Encoded:
        cleaned = clean_text(text)
        pieces = self.subwords(cleaned)
        ids = self.src_dict.encode_line(" ".join(pieces), add_if_not_exist=False, append_eos=True).long()
        unknown = [p for p, i in zip(pieces, ids.tolist()) if i == self.src_dict.unk()]
        return Encoded(cleaned, pieces, ids, unknown)

    def target_subwords(self, ids) -> List[str]:
        """Target ids (the final </s> included or not) -> subword strings."""
        return [self.tgt_dict[i] for i in ids if i != self.tgt_dict.eos()]

    def decode(self, ids) -> str:
        """Target ids -> detokenised text."""
        pieces = self.target_subwords(ids)
        if self.subword == "sentencepiece":
            text = self._spm.decode(pieces)
        else:
            text = " ".join(pieces)
            if self.subword == "subword_nmt":
                text = (text + " ").replace("@@ ", "").rstrip()
        if self._detok is not None:
            text = self._detok.detokenize(text.split())
        return text
