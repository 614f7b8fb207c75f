"""IWSLT14 German-English (TED talks), following fairseq's ``examples/translation/prepare-iwslt14.sh``.

Input: the ``de-en.tgz`` archive of the IWSLT 2014 release (``--archive``, default
``RAW_DIR/de-en.tgz``), holding ``de-en/train.tags.de-en.{de,en}`` and the dev/test XML files
``de-en/IWSLT14.TED.{dev2010,tst2010,tst2011,tst2012}.de-en.{de,en}.xml`` and
``de-en/IWSLT14.TEDX.dev2012.de-en.{de,en}.xml``.

Steps (each resumable):
  extract   the 12 needed members (a wrong archive is named with what it lacks)
  train     train.tags minus metadata lines (every line starting with '<': <url>, <talkid>,
            <keywords>, <speaker>, <reviewer>, <translator>, <title>, <description>, <doc>),
            Moses tokenisation (tokenizer.perl defaults), lower-casing, clean-corpus-n with
            ratio 1.5, 1..175 tokens; every 23rd remaining pair -> valid, the rest -> train
  test      the <seg> text of TED dev2010 + TEDX dev2012 + TED tst2010 + tst2011 + tst2012 (in
            fairseq's order), ’ -> ', tokenised and lower-cased
  subword   joint BPE with 10,000 merges on train.de + train.en (fairseq's recipe), or
            --vocab separate: one BPE per language (8,000 de / 6,000 en merges by default)
  binarize  fairseq-preprocess (--joined-dictionary for the joint BPE) into --dest
"""

import tarfile
from pathlib import Path

from ..atomic_files import _write_lines_now
from .downloads import RawFile, fetch_raw_files
from .errors import DataError
from .moses import clean_corpus
from .readers import read_lines, read_parallel_segments, refuse_non_file, strip_metadata
from .steps import Steps
from .subwords import add_subword_args, check_subword_args
from .summary import Summary, subword_binarize_summary
from .text_settings import TextSettings, tokenize_lines

DESCRIPTION = "IWSLT14 de-en (de-en.tgz) -> tokenised, lower-cased, BPE'd data-bin (fairseq's recipe)"
DEFAULT_DEST = "data-bin/iwslt14.tokenized.de-en"
SRC, TGT = "de", "en"
ARCHIVE = RawFile(
    "de-en.tgz", url="http://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz",
    note="the IWSLT 2014 de-en archive (also at https://wit3.fbk.eu/2014-01, texts/de/en/de-en.tgz)",
)
TRAIN_STEM = "train.tags.de-en"
# the test set, in the order fairseq's prepare-iwslt14.sh concatenates it
TEST_SETS = ["IWSLT14.TED.dev2010", "IWSLT14.TEDX.dev2012", "IWSLT14.TED.tst2010",
             "IWSLT14.TED.tst2011", "IWSLT14.TED.tst2012"]
VALID_EVERY = 23


def member_names():
    names = [f"{TRAIN_STEM}.{lang}" for lang in (SRC, TGT)]
    names += [f"{t}.de-en.{lang}.xml" for t in TEST_SETS for lang in (SRC, TGT)]
    return names


def add_args(parser):
    g = parser.add_argument_group("IWSLT14 options")
    g.add_argument("--archive", type=Path, default=None,
                   help="the de-en.tgz archive (default: RAW_DIR/de-en.tgz, downloaded if missing)")
    g.add_argument("--clean-ratio", type=float, default=1.5, help="clean-corpus-n -ratio")
    g.add_argument("--clean-min", type=int, default=1, help="clean-corpus-n minimum tokens")
    g.add_argument("--clean-max", type=int, default=175, help="clean-corpus-n maximum tokens")
    g.add_argument("--no-lowercase", action="store_true", help="keep the case (fairseq lower-cases)")
    add_subword_args(parser, joint_size=10000, src_size=8000, tgt_size=6000)


def extract(archive: Path, out_dir: Path, steps: Steps):
    """The "extract" step: the needed members of ARCHIVE into OUT_DIR (flat)."""
    names = member_names()
    outputs = [out_dir / n for n in names]

    def run(*tmps):
        try:
            tar = tarfile.open(archive)
        except (tarfile.TarError, OSError) as e:
            raise DataError(f"not a readable tar archive ({e}); expected the IWSLT14 de-en.tgz", archive) from None
        with tar:
            members = {}
            for m in tar.getmembers():
                if m.isfile():
                    members.setdefault(Path(m.name).name, m)
            missing = [n for n in names if n not in members]
            if missing:
                raise DataError(
                    f"not the IWSLT14 de-en archive: it lacks {', '.join(missing)} "
                    f"(expected de-en/{TRAIN_STEM}.{{de,en}} and de-en/IWSLT14.*.xml)", archive)
            for name, tmp in zip(names, tmps):
                src = tar.extractfile(members[name])
                with open(tmp, "wb") as out:
                    while True:
                        chunk = src.read(1 << 20)
                        if not chunk:
                            break
                        out.write(chunk)

    steps.run("extract", outputs, run, inputs=[archive], params={"members": names})
    return {n: p for n, p in zip(names, outputs)}


def prepare(args) -> Summary:
    check_subword_args(args)
    work = Path(args.work_dir)
    steps = Steps(work)
    archive = args.archive
    if archive is None:
        archive = fetch_raw_files([ARCHIVE], args.raw_dir, download=not args.no_download)[ARCHIVE.name]
    else:
        refuse_non_file(archive, "--archive: the de-en.tgz archive")
    if not Path(archive).is_file():
        raise DataError(f"--archive: file not found; download it from {ARCHIVE.url}", archive)
    files = extract(Path(archive), work / "orig", steps)
    tok = work / "tok"
    lower = not args.no_lowercase
    # Moses and lower-casing; the test sets first get ’ -> ' (fairseq's recipe): the test
    # settings are those recorded for the demo
    train_settings = {lang: TextSettings(lang, lowercase=lower) for lang in (SRC, TGT)}
    test_settings = {lang: TextSettings(lang, apostrophe=True, lowercase=lower) for lang in (SRC, TGT)}

    def train_valid(tr_s, tr_t, va_s, va_t, stats_json):
        src_path, tgt_path = files[f"{TRAIN_STEM}.{SRC}"], files[f"{TRAIN_STEM}.{TGT}"]
        src = strip_metadata(read_lines(src_path))
        tgt = strip_metadata(read_lines(tgt_path))
        if len(src) != len(tgt):
            raise DataError(
                f"after removing metadata lines, {len(src)} sentences in {src_path} but {len(tgt)} "
                f"in {tgt_path}; the train.tags files must align line by line")
        for path, lines in ((src_path, src), (tgt_path, tgt)):
            if not lines:
                raise DataError("no sentences left after removing metadata lines", path)
        src = tokenize_lines(src, train_settings[SRC], workers=args.workers)
        tgt = tokenize_lines(tgt, train_settings[TGT], workers=args.workers)
        src, tgt, stats = clean_corpus(src, tgt, ratio=args.clean_ratio, min_len=args.clean_min,
                                       max_len=args.clean_max)
        if not src:
            raise DataError("no training pair survives cleaning", src_path)
        valid = [i % VALID_EVERY == VALID_EVERY - 1 for i in range(len(src))]  # awk NR%23==0
        _write_lines_now(tr_s, (s for s, v in zip(src, valid) if not v))
        _write_lines_now(tr_t, (s for s, v in zip(tgt, valid) if not v))
        _write_lines_now(va_s, (s for s, v in zip(src, valid) if v))
        _write_lines_now(va_t, (s for s, v in zip(tgt, valid) if v))
        stats.save(stats_json)

    stats_path = tok / "clean-stats.json"
    steps.run("train", [tok / f"{s}.{lang}" for s in ("train", "valid") for lang in (SRC, TGT)] + [stats_path],
              train_valid, inputs=[files[f"{TRAIN_STEM}.{lang}"] for lang in (SRC, TGT)],
              params={"ratio": args.clean_ratio, "min": args.clean_min, "max": args.clean_max,
                      "lower": lower, "valid_every": VALID_EVERY})

    def test(te_s, te_t):
        for lang, out in ((SRC, te_s), (TGT, te_t)):
            lines = []
            for name in TEST_SETS:
                src_seg, tgt_seg = read_parallel_segments(files[f"{name}.de-en.{SRC}.xml"],
                                                          files[f"{name}.de-en.{TGT}.xml"])
                lines += src_seg if lang == SRC else tgt_seg
            _write_lines_now(out, tokenize_lines(lines, test_settings[lang], workers=args.workers))

    test_inputs = [files[f"{n}.de-en.{lang}.xml"] for n in TEST_SETS for lang in (SRC, TGT)]
    steps.run("test", [tok / f"test.{SRC}", tok / f"test.{TGT}"], test, inputs=test_inputs,
              params={"lower": lower, "sets": TEST_SETS})

    return subword_binarize_summary(steps, args, tok, work / "bpe", ("train", "valid", "test"), SRC, TGT,
                                    "iwslt14 de-en", clean_stats=stats_path,
                                    text_settings=test_settings)
