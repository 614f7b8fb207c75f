"""WMT14 English-German, as fairseq's ``examples/translation/prepare-wmt14en2de.sh --icml17``
prepares it (the data-bin of fairseq's and the DMA paper's WMT14 en-de results).

Train: Europarl v7 + CommonCrawl + News Commentary v9 (about 4.5M pairs). Each side goes through
Moses ``normalize-punctuation.perl``, ``remove-non-printing-char.perl`` and
``tokenizer.perl -a`` (aggressive hyphen splitting: ``well-known`` -> ``well @-@ known``;
Moses' default ``&apos;`` escaping kept), via sacremoses. Valid: every 100th training pair
(fairseq's recipe; ``--valid-set newstest2013`` uses newstest2013 instead and keeps every
training pair). Test: newstest2014 (full, 3003 sentences) read from the SGM files, ``’`` -> ``'``,
tokenised with ``-a`` (no punctuation normalisation, as fairseq). One joint BPE (subword-nmt,
``--bpe-size`` merges, 40000 by default; the paper's dictionary ablations use other sizes) learned
on the training text of both languages; train and valid cleaned as Moses
``clean-corpus-n.perl -ratio 1.5 ... 1 250`` on the BPE tokens (test untouched); one joined
dictionary (``fairseq-preprocess --joined-dictionary``, for ``--share-all-embeddings``).
The data-bin records the test settings (``testset_settings``), which the demo applies to its input.
"""

import shutil
from pathlib import Path

from ..atomic_files import write_lines
from .readers import read_lines, read_parallel, read_parallel_segments
from .steps import Steps
from .subwords import add_subword_args, check_subword_args
from .summary import Summary
from .text_settings import TextSettings, tokenize_lines
from .wmt import Archive, Member, add_clean_args, check_clean_args, finish, locate_members

DESCRIPTION = "WMT14 en-de (Europarl v7 + CommonCrawl + News Commentary v9; newstest2014), fairseq's recipe"
DEFAULT_DEST = "data-bin/wmt14_en_de"
SRC, TGT = "en", "de"

# Sizes and sha256: TensorFlow Datasets, tensorflow_datasets/url_checksums/wmt14_translate.txt.
# md5: sacreBLEU's dataset table (wmt14/full; wmt17/dev).
ARCHIVES = {a.name: a for a in [
    Archive("training-parallel-europarl-v7.tgz", "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
            size=657632379, sha256="0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    Archive("training-parallel-commoncrawl.tgz", "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
            size=918311367, sha256="c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    Archive("training-parallel-nc-v9.tgz", "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
            size=80418416, sha256="cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    Archive("test-full.tgz", "http://statmt.org/wmt14/test-full.tgz", md5="a8cd784e006feb32ac6f3d9ec7eb389a"),
    Archive("dev.tgz", "http://data.statmt.org/wmt17/translation-task/dev.tgz",
            md5="9b1aa63c1cf49dccdd20b962fe313989"),
]}

# (corpus name, archive, member path without the language suffix), in fairseq's order
TRAIN = [
    ("europarl-v7", "training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en"),
    ("commoncrawl", "training-parallel-commoncrawl.tgz", "commoncrawl.de-en"),
    ("news-commentary-v9", "training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en"),
]
TEST = {SRC: Member("test-full.tgz", "test-full/newstest2014-deen-src.en.sgm"),
        TGT: Member("test-full.tgz", "test-full/newstest2014-deen-ref.de.sgm")}
NEWSTEST2013 = {lang: Member("dev.tgz", f"dev/newstest2013.{lang}") for lang in (SRC, TGT)}


def add_args(parser):
    g = parser.add_argument_group("WMT14 en-de options")
    g.add_argument("--valid-set", choices=["split", "newstest2013"], default="split",
                   help="split: every 100th training pair (fairseq's recipe); newstest2013: the "
                        "official dev set from dev.tgz (all training pairs kept)")
    add_clean_args(g, ratio=1.5, max_len=250)
    # --bpe-size: joint BPE merges (fairseq 40000; the paper's dictionary ablations change it)
    add_subword_args(parser, joint_size=40000, src_size=40000, tgt_size=40000)


def train_settings(lang) -> TextSettings:
    """remove-non-printing-char.perl | normalize-punctuation.perl | tokenizer.perl -a."""
    return TextSettings(lang, remove_non_printing=True, normalize=True, aggressive_dash_splits=True)


def testset_settings(lang) -> TextSettings:
    """fairseq's test processing: ``sed "s/’/'/g" | tokenizer.perl -a`` (no normalisation); the
    settings recorded in the data-bin for the demo."""
    return TextSettings(lang, apostrophe=True, aggressive_dash_splits=True)


def tokenize_train(lines, lang, workers):
    return tokenize_lines(lines, train_settings(lang), workers=workers)


def tokenize_test(lines, lang, workers):
    return tokenize_lines(lines, testset_settings(lang), workers=workers)


def prepare(args) -> Summary:
    check_subword_args(args)
    check_clean_args(args)
    work = Path(args.work_dir)
    steps = Steps(work)
    members = [Member(archive, f"{stem}.{lang}") for _, archive, stem in TRAIN for lang in (SRC, TGT)]
    members += list(TEST.values())
    if args.valid_set == "newstest2013":
        members += list(NEWSTEST2013.values())
    raw = locate_members(members, ARCHIVES, args.raw_dir, work, steps, download=not args.no_download)
    tok_dir = work / "tok"
    tok = {(split, lang): tok_dir / f"{split}.{lang}" for split in ("all", "train", "valid", "test")
           for lang in (SRC, TGT)}

    def tokenize_all(out_src, out_tgt):
        with open(out_src, "w", encoding="utf-8", newline="\n") as fs, \
                open(out_tgt, "w", encoding="utf-8", newline="\n") as ft:
            for _, _, stem in TRAIN:  # one corpus at a time (CommonCrawl alone is 2.4M pairs)
                src, tgt = read_parallel(raw[f"{stem}.{SRC}"], raw[f"{stem}.{TGT}"])
                for f, lines, lang in ((fs, src, SRC), (ft, tgt, TGT)):
                    f.writelines(s + "\n" for s in tokenize_train(lines, lang, args.workers))

    train_raw = [raw[f"{stem}.{lang}"] for _, _, stem in TRAIN for lang in (SRC, TGT)]
    steps.run("tokenize-train", [tok["all", SRC], tok["all", TGT]], tokenize_all, inputs=train_raw,
              params={"corpora": [c for c, _, _ in TRAIN]})

    def split(tr_s, tr_t, va_s, va_t):
        if args.valid_set == "split":  # awk 'NR%100 == 0' -> valid, the rest -> train
            for lang, tr, va in ((SRC, tr_s, va_s), (TGT, tr_t, va_t)):
                lines = read_lines(tok["all", lang])
                write_lines(tr, (s for i, s in enumerate(lines, 1) if i % 100))
                write_lines(va, (s for i, s in enumerate(lines, 1) if i % 100 == 0))
        else:
            src, tgt = read_parallel(raw[NEWSTEST2013[SRC].path], raw[NEWSTEST2013[TGT].path])
            for lang, tr, va, lines in ((SRC, tr_s, va_s, src), (TGT, tr_t, va_t, tgt)):
                shutil.copyfile(tok["all", lang], tr)
                write_lines(va, tokenize_test(lines, lang, args.workers))

    split_inputs = [tok["all", SRC], tok["all", TGT]]
    if args.valid_set == "newstest2013":
        split_inputs += [raw[m.path] for m in NEWSTEST2013.values()]
    steps.run("split-valid", [tok["train", SRC], tok["train", TGT], tok["valid", SRC], tok["valid", TGT]],
              split, inputs=split_inputs, params={"valid_set": args.valid_set})

    def tokenize_testset(out_src, out_tgt):
        src, tgt = read_parallel_segments(raw[TEST[SRC].path], raw[TEST[TGT].path])
        write_lines(out_src, tokenize_test(src, SRC, args.workers))
        write_lines(out_tgt, tokenize_test(tgt, TGT, args.workers))

    steps.run("tokenize-test", [tok["test", SRC], tok["test", TGT]], tokenize_testset,
              inputs=[raw[m.path] for m in TEST.values()], params={})

    clean_splits = ("train", "valid") if args.valid_set == "split" else ("train",)
    return finish(args, steps, work, "wmt14 en-de", SRC, TGT, clean_splits,
                  text_settings={lang: testset_settings(lang) for lang in (SRC, TGT)}, notes=[
        f"valid: {'every 100th training pair' if args.valid_set == 'split' else 'newstest2013'}; "
        "test: newstest2014 (full, 3003 sentences)",
    ])
