"""Data preparation recipes: raw corpus -> tokenised, BPE'd text -> fairseq data-bin.

``fairseq-modattn prepare CORPUS --raw-dir DIR --dest data-bin/NAME [...]`` looks CORPUS up in
``RECIPES`` (name -> module path, imported only when used, so ``import fairseq_modattn`` stays
light). A recipe module defines

    DESCRIPTION: str                      one line for ``fairseq-modattn prepare -h``
    DEFAULT_DEST: str                     e.g. "data-bin/iwslt14.tokenized.de-en"
    add_args(parser)                      its own flags (the common ones are added here)
    prepare(args) -> summary.Summary      does the work (resumable), returns the summary

and is built from the shared modules of this package, each one concept:

    errors.py     DataError, the one-line error of bad or missing input
    readers.py    strict UTF-8 / gzip line readers, IWSLT XML and WMT SGM segments
    downloads.py  raw files: found in --raw-dir and checked, or downloaded, or listed as missing
    steps.py      resumable steps: atomic outputs, then a marker of what they were made from
    moses.py      Moses punctuation normalisation, tokenisation, lower-casing, corpus cleaning
    subword_model.py  a subword model by name: its data-bin file, loading and applying it
    subwords.py   learning subword-nmt and sentencepiece models, and the recipes' subword steps
    binarize.py   fairseq-preprocess, run safely, and the recipes' "binarize" step
    manifest.py   the data-bin's prepare-manifest.json, and the checks of prepare's paths
    text_pipeline.py  one raw sentence <-> the model's token ids, as the recorded settings say
                  (the demo's and the Python API's text steps)
    summary.py    what a recipe reports, and the common tail of the recipes

Files are written through ``fairseq_modattn/atomic_files.py`` (whole or not at all). A recipe's
text steps are ``text_settings.TextSettings`` (run by ``text_settings.tokenize_lines``), and
those of the test split are recorded in the data-bin's ``prepare-manifest.json``, where the
demo reads them.
"""

import argparse
import importlib
from pathlib import Path

from ..help_format import DefaultsHelpFormatter

RECIPES = {
    "multi30k": "fairseq_modattn.data.multi30k",
    "iwslt14": "fairseq_modattn.data.iwslt14",
    "wmt14_en_de": "fairseq_modattn.data.wmt14",
    "wmt17_zh_en": "fairseq_modattn.data.wmt17",
}


def recipe_module(name: str):
    """The recipe module registered as NAME (KeyError lists the known ones)."""
    if name not in RECIPES:
        raise KeyError(f"unknown corpus {name!r}; choose from: {', '.join(sorted(RECIPES))}")
    return importlib.import_module(RECIPES[name])


def add_common_args(parser: argparse.ArgumentParser, default_dest: str):
    """Flags every recipe takes: where raw files are, where outputs go, downloads, workers."""
    g = parser.add_argument_group("common data-preparation options")
    g.add_argument("--raw-dir", type=Path, default=Path("raw"),
                   help="folder holding the raw corpus files (missing ones are downloaded into it)")
    g.add_argument("--dest", type=Path, default=Path(default_dest),
                   help="output data-bin folder for fairseq-train: a new or empty folder, or one an earlier "
                        "prepare of the same corpus wrote (it lists its files in prepare-manifest.json; a "
                        "rerun replaces only those, other files stay); anything else is refused")
    g.add_argument("--work-dir", type=Path, default=None,
                   help="folder for the tokenised/BPE'd text and step markers (default: DEST.work); "
                        "a rerun resumes from it and removes temporaries of killed runs")
    g.add_argument("--no-download", action="store_true",
                   help="never download: list the missing raw files and where to place them")
    g.add_argument("--workers", type=int, default=1, help="processes for tokenisation and fairseq-preprocess")
    g.add_argument("--summary-json", type=Path, default=None,
                   help="also write the summary as JSON to this file (a directory is refused)")
    return g


def build_parser(name: str, prog: str = None) -> argparse.ArgumentParser:
    """The full argument parser of recipe NAME."""
    mod = recipe_module(name)
    parser = argparse.ArgumentParser(
        prog=prog or f"fairseq-modattn prepare {name}", description=mod.DESCRIPTION,
        formatter_class=DefaultsHelpFormatter)
    add_common_args(parser, mod.DEFAULT_DEST)
    mod.add_args(parser)
    return parser


def parse_args(name: str, argv):
    args = build_parser(name).parse_args(argv)
    if args.work_dir is None:
        args.work_dir = args.dest.parent / (args.dest.name + ".work")
    args.corpus = name
    return args


def prepare(name: str, argv):
    """Parse ARGV for recipe NAME, check its output paths (``manifest.check_prepare_paths``:
    before any work, one-line DataError), run it, print (and optionally save) its summary."""
    from ..folder_lock import exclusive_use
    from .errors import DataError
    from .manifest import check_prepare_paths

    args = parse_args(name, argv)
    mod = recipe_module(name)
    # one writer per folder: a second prepare into the same DEST or work dir is refused before
    # it reads anything, not interleaved (its markers would vouch for the other run's files)
    with exclusive_use(args.dest, error=DataError, what="--dest"), \
            exclusive_use(args.work_dir, error=DataError, what="--work-dir"):
        check_prepare_paths(name, args.dest, args.work_dir, args.summary_json,
                            src=getattr(args, "src", None) or getattr(mod, "SRC", None),
                            tgt=getattr(args, "tgt", None) or getattr(mod, "TGT", None))
        summary = mod.prepare(args)
        summary.print()
        if args.summary_json:
            with exclusive_use(args.summary_json, error=DataError, what="--summary-json"):
                summary.save(args.summary_json)
    return summary
