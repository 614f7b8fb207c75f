"""WMT17 Chinese-English on News Commentary v12 (the DMA paper's zh-en setting).

Train: ``training/news-commentary-v12.zh-en.{zh,en}`` of ``training-parallel-nc-v12.tgz``
(about 227k pairs; the CWMT and UN corpora of the full WMT17 task are not used). Valid:
newsdev2017 (``dev.tgz``, 2002 sentences); test: newstest2017 (``test.tgz``, 2001 sentences),
both read from their SGM files and never cleaned.

Chinese: non-printing characters removed, then segmented into words with jieba's default
dictionary (``jieba.Tokenizer().cut(s, HMM=True)``: dictionary DAG + Viterbi over its HMM for
unknown words, deterministic, no sampling). English: Moses ``normalize-punctuation.perl``,
``remove-non-printing-char.perl``, ``tokenizer.perl`` (default escaping, no ``-a``); the case
is kept (no lower-casing or truecasing). One BPE per language (``--vocab separate``, subword-nmt:
25000 merges zh, 20000 en, the paper's Table 3; ``--src-bpe-size`` / ``--tgt-bpe-size``) and
two dictionaries, so models share the decoder's input/output embeddings only
(``--share-decoder-input-output-embed``, not ``--share-all-embeddings``). Train cleaned with
``clean-corpus-n -ratio 9 ... 1 250`` (Moses' default ratio: Chinese words and English tokens
differ in length more than German and English do) on the BPE tokens.
"""

from pathlib import Path
from typing import List, Sequence

from ..atomic_files import write_lines
from .readers import read_parallel, read_parallel_segments
from .steps import Steps
from .subwords import add_subword_args, check_subword_args
from .summary import Summary
from .text_settings import TextSettings, tokenize_lines
from .wmt import Archive, Member, add_clean_args, check_clean_args, finish, locate_members

DESCRIPTION = "WMT17 zh-en (News Commentary v12; newsdev2017 / newstest2017), jieba + Moses, separate BPE"
DEFAULT_DEST = "data-bin/wmt17_zh_en"
SRC, TGT = "zh", "en"

# Size and sha256: TensorFlow Datasets, tensorflow_datasets/url_checksums/wmt17_translate.txt.
# md5: sacreBLEU's dataset table (wmt17/dev, wmt17).
ARCHIVES = {a.name: a for a in [
    Archive("training-parallel-nc-v12.tgz", "http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz",
            size=168591139, sha256="2b45f30ef1d550d302fd17dd3a5cbe19134ccc4c2cf50c2dae534aee600101a2"),
    Archive("dev.tgz", "http://data.statmt.org/wmt17/translation-task/dev.tgz",
            md5="9b1aa63c1cf49dccdd20b962fe313989"),
    Archive("test.tgz", "http://data.statmt.org/wmt17/translation-task/test.tgz",
            md5="86a1724c276004aa25455ae2a04cef26"),
]}
TRAIN = {lang: Member("training-parallel-nc-v12.tgz", f"training/news-commentary-v12.zh-en.{lang}")
         for lang in (SRC, TGT)}
VALID = {SRC: Member("dev.tgz", "dev/newsdev2017-zhen-src.zh.sgm"),
         TGT: Member("dev.tgz", "dev/newsdev2017-zhen-ref.en.sgm")}
TEST = {SRC: Member("test.tgz", "test/newstest2017-zhen-src.zh.sgm"),
        TGT: Member("test.tgz", "test/newstest2017-zhen-ref.en.sgm")}


def add_args(parser):
    g = parser.add_argument_group("WMT17 zh-en options")
    add_clean_args(g, ratio=9.0, max_len=250)
    add_subword_args(parser, joint_size=40000, src_size=25000, tgt_size=20000, vocab="separate")


#: every split (and the demo, which reads them from the data-bin): Chinese non-printing
#: characters removed, then jieba; English remove-non-printing-char, normalize-punctuation, Moses
SETTINGS = {SRC: TextSettings(SRC, tokenizer="jieba", remove_non_printing=True),
            TGT: TextSettings(TGT, remove_non_printing=True, normalize=True)}


def segment_zh(lines: Sequence[str]) -> List[str]:
    """Chinese word segmentation with jieba's default dictionary (deterministic), after
    remove-non-printing-char."""
    return tokenize_lines(lines, SETTINGS[SRC])


def tokenize_en(lines: Sequence[str], workers: int) -> List[str]:
    return tokenize_lines(lines, SETTINGS[TGT], workers=workers)


def prepare(args) -> Summary:
    check_subword_args(args)
    check_clean_args(args)
    work = Path(args.work_dir)
    steps = Steps(work)
    sets = {"train": TRAIN, "valid": VALID, "test": TEST}
    members = [m for s in sets.values() for m in s.values()]
    raw = locate_members(members, ARCHIVES, args.raw_dir, work, steps, download=not args.no_download)
    tok_dir = work / "tok"

    for split, files in sets.items():
        def run(out_src, out_tgt, _files=files, _split=split):
            src_path, tgt_path = raw[_files[SRC].path], raw[_files[TGT].path]
            if _split == "train":
                src, tgt = read_parallel(src_path, tgt_path)
            else:
                src, tgt = read_parallel_segments(src_path, tgt_path)
            write_lines(out_src, segment_zh(src))
            write_lines(out_tgt, tokenize_en(tgt, args.workers))

        steps.run(f"tokenize-{split}", [tok_dir / f"{split}.{SRC}", tok_dir / f"{split}.{TGT}"], run,
                  inputs=[raw[files[SRC].path], raw[files[TGT].path]], params={"zh": "jieba", "en": "moses"})

    return finish(args, steps, work, "wmt17 zh-en", SRC, TGT, clean_splits=("train",), text_settings=SETTINGS, notes=[
        "train: news-commentary-v12 zh-en; valid: newsdev2017; test: newstest2017",
        "Chinese segmented with jieba (default dictionary); English Moses-tokenised, case kept",
    ])
