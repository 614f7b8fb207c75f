"""Subword models: learning and applying them, as functions and as the recipes' resumable steps.

    learn_bpe / apply_bpe                      subword-nmt (``@@ `` continuation marks)
    train_sentencepiece / apply_sentencepiece  sentencepiece (an optional dependency)
    add_subword_args / check_subword_args      the flags choosing the model (--subword, --vocab,
                                               --bpe-size, --src-bpe-size, --tgt-bpe-size)
    subword_steps                              learn on train, apply to every split: two steps
                                               over a folder of ``{split}.{lang}`` text files

Applying goes through ``subword_model.SubwordModel``, the same code the demo runs on a sentence.
"""

import os
import tempfile
from pathlib import Path
from typing import Iterable, List, Sequence

from ..atomic_files import PathLike, _write_lines_now, atomic_path
from .errors import DataError
from .readers import read_lines
from .steps import Steps
from .subword_model import SUBWORD_METHODS, SubwordModel, require_sentencepiece, subword_model_name


def learn_bpe(texts: Sequence[Sequence[str]], codes_path: PathLike, merges: int, min_frequency: int = 2):
    """subword-nmt ``learn_bpe.py -s MERGES`` on the concatenation of TEXTS (each a list of
    lines); writes the codes to CODES_PATH (atomically)."""
    from subword_nmt.learn_bpe import learn_bpe as _learn

    with atomic_path(codes_path) as tmp:
        lines = (s + "\n" for text in texts for s in text)
        with open(tmp, "w", encoding="utf-8", newline="\n") as out:
            _learn(lines, out, merges, min_frequency=min_frequency)


def apply_bpe(lines: Iterable[str], codes_path: PathLike) -> List[str]:
    """subword-nmt ``apply_bpe.py -c CODES`` (``@@ `` continuation marks)."""
    return SubwordModel("subword-nmt", codes_path).apply_lines(lines)


def train_sentencepiece(texts: Sequence[Sequence[str]], model_prefix: PathLike, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 1.0):
    """Train a SentencePiece model on TEXTS; writes MODEL_PREFIX.model and .vocab atomically
    (single-threaded and unshuffled, so reruns give identical models)."""
    spm = require_sentencepiece()
    prefix = Path(model_prefix)
    # named .PREFIX.tmp-..., so a rerun's stale-temporary cleanup removes it after a kill
    with tempfile.TemporaryDirectory(dir=prefix.parent, prefix=f".{prefix.name.lstrip('.')}.tmp-") as tmpdir:
        corpus = Path(tmpdir) / "corpus.txt"
        _write_lines_now(corpus, (s for text in texts for s in text))
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmpdir) / "m"), vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage, num_threads=1,
            shuffle_input_sentence=False, minloglevel=2, hard_vocab_limit=False,
        )
        for ext in ("vocab", "model"):  # .model last: its presence means "trained"
            os.replace(Path(tmpdir) / f"m.{ext}", f"{prefix}.{ext}")


def apply_sentencepiece(lines: Sequence[str], model_path: PathLike) -> List[str]:
    """Encode LINES into space-separated SentencePiece pieces."""
    return SubwordModel("sentencepiece", model_path).apply_lines(lines)


# ------------------------------------------------------------------ resumable steps of the recipes

def add_subword_args(parser, *, joint_size: int, src_size: int, tgt_size: int, vocab: str = "joint",
                     method: str = "subword-nmt"):
    """Flags choosing the subword model: --subword, --vocab joint|separate, --bpe-size,
    --src-bpe-size, --tgt-bpe-size (merges for subword-nmt, vocabulary size for sentencepiece)."""
    g = parser.add_argument_group("subword options")
    g.add_argument("--subword", choices=SUBWORD_METHODS, default=method,
                   help="subword-nmt BPE (@@ marks; generate with --remove-bpe) or a sentencepiece "
                        "BPE model (generate with --remove-bpe sentencepiece)")
    g.add_argument("--vocab", choices=("joint", "separate"), default=vocab,
                   help="one subword model and one joined fairseq dictionary for both languages, "
                        "or one per language (separate dictionaries)")
    g.add_argument("--bpe-size", type=int, default=joint_size,
                   help="joint model: merge operations (subword-nmt) or vocabulary size (sentencepiece)")
    g.add_argument("--src-bpe-size", type=int, default=src_size, help="separate model of the source language")
    g.add_argument("--tgt-bpe-size", type=int, default=tgt_size, help="separate model of the target language")
    return g


def check_subword_args(args):
    for flag in ("bpe_size", "src_bpe_size", "tgt_bpe_size"):
        if getattr(args, flag) <= 0:
            raise DataError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


def subword_steps(steps: Steps, text_dir: PathLike, out_dir: PathLike, splits: Sequence[str],
                  src: str, tgt: str, *, method: str = "subword-nmt", joint: bool = True,
                  joint_size: int = 10000, src_size: int = 10000, tgt_size: int = 10000) -> List[Path]:
    """Learn the subword model(s) on TEXT_DIR/train.{src,tgt} and apply them to every
    TEXT_DIR/{split}.{lang}, writing OUT_DIR/{split}.{lang}. Two resumable steps ("subword-learn",
    "subword-apply"). Returns the model files (to ship with the data-bin)."""
    text_dir, out_dir = Path(text_dir), Path(out_dir)
    if method not in SUBWORD_METHODS:
        raise DataError(f"unknown subword method {method!r}; choose from {', '.join(SUBWORD_METHODS)}")
    train = {lang: text_dir / f"train.{lang}" for lang in (src, tgt)}
    spm = method == "sentencepiece"
    if joint:
        groups = {"joint": ([src, tgt], joint_size)}
    else:
        groups = {src: ([src], src_size), tgt: ([tgt], tgt_size)}

    def model_file(group):
        return out_dir / subword_model_name(method, group if group != "joint" else None)

    models = [model_file(g) for g in groups]

    def learn(*tmps):
        for (group, (langs, size)), tmp in zip(groups.items(), tmps):
            texts = [read_lines(train[lang]) for lang in langs]
            if spm:
                prefix = Path(f"{tmp}.spm")
                train_sentencepiece(texts, prefix, size)
                os.replace(f"{prefix}.model", tmp)
                os.replace(f"{prefix}.vocab", model_file(group).with_suffix(".vocab"))
            else:
                learn_bpe(texts, tmp, size)

    params = {"method": method, "groups": {g: v for g, v in groups.items()}}
    steps.run("subword-learn", models, learn, inputs=list(train.values()), params=params)

    outputs = [out_dir / f"{split}.{lang}" for split in splits for lang in (src, tgt)]
    inputs = [text_dir / f"{split}.{lang}" for split in splits for lang in (src, tgt)]

    def apply(*tmps):
        for inp, tmp in zip(inputs, tmps):
            lang = inp.suffix[1:]
            model = model_file("joint" if joint else lang)
            lines = read_lines(inp, allow_empty=True)
            out = apply_sentencepiece(lines, model) if spm else apply_bpe(lines, model)
            _write_lines_now(tmp, out)

    steps.run("subword-apply", outputs, apply, inputs=inputs + models, params=params)
    return models
