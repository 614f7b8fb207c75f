"""Multi30k task 1 (Elliott et al., 2016): image-caption translation, 29k/1,014/1,000 sentences.

Input: the raw task-1 files ``train.{L}.gz``, ``val.{L}.gz``, ``test_2016_flickr.{L}.gz`` of the
public multi30k/dataset repository (``data/task1/raw``) in ``--raw-dir``; missing ones are
downloaded from there.

Steps (each resumable):
  text      Moses tokenisation and lower-casing (``--tokenizer none`` keeps the raw text, e.g.
            for sentencepiece; ``--no-lowercase`` keeps the case); train pairs are cleaned like
            clean-corpus-n (1..--clean-max tokens, --clean-ratio); ``--max-train-sentences N``
            keeps the first N training pairs; val -> valid, test_2016_flickr -> test
  subword   subword-nmt BPE (joint 10,000 merges by default) or a sentencepiece BPE model
            (``--subword sentencepiece``, 8,000 pieces is a good size here), joint or separate
  binarize  fairseq-preprocess into --dest
"""

from pathlib import Path

from ..atomic_files import _write_lines_now
from .downloads import RawFile, fetch_raw_files
from .errors import DataError
from .moses import CleanStats, clean_corpus
from .readers import read_parallel
from .steps import Steps
from .subwords import add_subword_args, check_subword_args
from .summary import Summary, subword_binarize_summary
from .text_settings import TextSettings, tokenize_lines

DESCRIPTION = "Multi30k task 1 (raw .gz files) -> tokenised, BPE'd (or sentencepiece) data-bin"
DEFAULT_DEST = "data-bin/multi30k.de-en"
URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{}"
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
LANGS = ("de", "en", "fr", "cs")


def raw_files(src, tgt):
    return [RawFile(f"{stem}.{lang}.gz", url=URL.format(f"{stem}.{lang}.gz"))
            for stem in SPLITS.values() for lang in (src, tgt)]


def add_args(parser):
    g = parser.add_argument_group("Multi30k options")
    g.add_argument("--src", choices=LANGS, default="de", help="source language")
    g.add_argument("--tgt", choices=LANGS, default="en", help="target language")
    g.add_argument("--tokenizer", choices=("moses", "none"), default="moses",
                   help="Moses tokenisation (sacremoses) or none (whitespace kept as is)")
    g.add_argument("--no-lowercase", action="store_true", help="keep the case")
    g.add_argument("--max-train-sentences", type=int, default=None,
                   help="use only the first N training pairs (quick experiments, tests)")
    g.add_argument("--clean-ratio", type=float, default=9.0, help="clean-corpus-n -ratio (train only)")
    g.add_argument("--clean-max", type=int, default=250, help="clean-corpus-n maximum tokens (train only)")
    add_subword_args(parser, joint_size=10000, src_size=8000, tgt_size=8000)


def prepare(args) -> Summary:
    check_subword_args(args)
    src, tgt = args.src, args.tgt
    if src == tgt:
        raise DataError(f"--src and --tgt are both {src!r}")
    if args.max_train_sentences is not None and args.max_train_sentences <= 0:
        raise DataError(f"--max-train-sentences must be positive, got {args.max_train_sentences}")
    files = fetch_raw_files(raw_files(src, tgt), args.raw_dir, download=not args.no_download)
    work = Path(args.work_dir)
    steps = Steps(work)
    tok = work / "tok"
    lower = not args.no_lowercase
    # every split, both languages: Moses (or none) and lower-casing; recorded for the demo
    settings = {lang: TextSettings(lang, tokenizer=args.tokenizer, lowercase=lower) for lang in (src, tgt)}
    stats_path = tok / "clean-stats.json"
    outputs = [tok / f"{split}.{lang}" for split in SPLITS for lang in (src, tgt)] + [stats_path]
    inputs = [files[f"{stem}.{lang}.gz"] for stem in SPLITS.values() for lang in (src, tgt)]

    def text(*tmps):
        out = dict(zip(outputs, tmps))
        stats = CleanStats()
        for split, stem in SPLITS.items():
            s_path, t_path = files[f"{stem}.{src}.gz"], files[f"{stem}.{tgt}.gz"]
            s_lines, t_lines = read_parallel(s_path, t_path)
            if split == "train" and args.max_train_sentences:
                s_lines, t_lines = s_lines[:args.max_train_sentences], t_lines[:args.max_train_sentences]
            s_lines = tokenize_lines(s_lines, settings[src], workers=args.workers)
            t_lines = tokenize_lines(t_lines, settings[tgt], workers=args.workers)
            if split == "train":
                s_lines, t_lines, stats = clean_corpus(s_lines, t_lines, ratio=args.clean_ratio,
                                                       min_len=1, max_len=args.clean_max)
            _write_lines_now(out[tok / f"{split}.{src}"], s_lines)
            _write_lines_now(out[tok / f"{split}.{tgt}"], t_lines)
        stats.save(out[stats_path])

    steps.run("text", outputs, text, inputs=inputs,
              params={"tokenizer": args.tokenizer, "lower": lower, "max_train": args.max_train_sentences,
                      "ratio": args.clean_ratio, "max": args.clean_max})
    sub_dir = work / ("spm" if args.subword == "sentencepiece" else "bpe")
    return subword_binarize_summary(steps, args, tok, sub_dir, tuple(SPLITS), src, tgt,
                                    f"multi30k {src}-{tgt}", clean_stats=stats_path,
                                    text_settings=settings)
