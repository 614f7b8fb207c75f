"""What the WMT recipes (``wmt14.py``, ``wmt17.py``) share beyond the modules all recipes use:
raw files that are members of the official ``.tgz`` archives, taken either already extracted
from --raw-dir or out of the archive (found there, or downloaded with
``downloads.fetch_raw_files``), and the checks of a raw line before Moses sees it.

A member ``training/europarl-v7.de-en.en`` of ``training-parallel-europarl-v7.tgz`` is looked
up, in this order, as ``RAW/training/europarl-v7.de-en.en``, ``RAW/europarl-v7.de-en.en``
(the file extracted by hand) and otherwise as ``RAW/training-parallel-europarl-v7.tgz``, whose
wanted members are extracted once into ``WORK/extracted/`` (a resumable, atomic step).

The public archives' checksums come from two published tables: size + sha256 of the training
archives from TensorFlow Datasets (``tensorflow_datasets/url_checksums/wmt14_translate.txt``,
``wmt17_translate.txt``), md5 of the test/dev archives from sacreBLEU's dataset table
(``sacrebleu/dataset/__init__.py``: ``wmt14/full``, ``wmt17``, ``wmt17/dev``).
"""

import hashlib
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..atomic_files import load_json, save_json, write_lines
from .binarize import binarize_step
from .downloads import RawFile, fetch_raw_files
from .errors import DataError
from .moses import clean_corpus
from .readers import read_lines, refuse_non_file
from .steps import Steps
from .subwords import subword_steps
from .summary import text_summary
from .text_settings import manifest_text, remove_control_chars  # noqa: F401 (remove_control_chars: API)

__all__ = ["Archive", "Member", "locate_members", "remove_control_chars", "add_clean_args",
           "check_clean_args", "finish"]


@dataclass
class Archive(RawFile):
    """A public archive (a ``downloads.RawFile``) that may also carry an md5 (sacreBLEU's tables
    publish md5, not sha256)."""
    md5: Optional[str] = None

    def check(self, path: Path):
        super().check(path)
        if self.md5 is not None:
            h = hashlib.md5()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != self.md5:
                raise DataError(f"md5 {h.hexdigest()} differs from the expected {self.md5} "
                                f"(a wrong or corrupt download of {self.url})", path)


@dataclass(frozen=True)
class Member:
    """File PATH (as stored in the archive, e.g. ``training/europarl-v7.de-en.en``) of ARCHIVE."""
    archive_name: str
    path: str

    @property
    def basename(self) -> str:
        return Path(self.path).name


def _candidates(raw_dir: Path, m: Member) -> List[Path]:
    return [raw_dir / m.path, raw_dir / m.basename]


def _extract(archive_path: Path, wanted: Sequence[str], outputs: Sequence[Path]):
    """Copy the members WANTED of ARCHIVE_PATH to OUTPUTS (same order), streaming."""
    todo = {name: out for name, out in zip(wanted, outputs)}
    try:
        with tarfile.open(archive_path, "r:*") as tar:
            for info in tar:
                name = info.name[2:] if info.name.startswith("./") else info.name
                if name in todo and info.isfile():
                    out = todo.pop(name)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(info) as src, open(out, "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                    if not todo:
                        break
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot read the archive ({e}); expected a .tgz from its public URL "
                        "(delete it to download it again)", archive_path) from None
    if todo:
        raise DataError(f"has no member(s) {', '.join(sorted(todo))}; expected the official archive",
                        archive_path)


def locate_members(members: Sequence[Member], archives: Dict[str, Archive], raw_dir: Path,
                   work_dir: Path, steps: Steps, download: bool = True) -> Dict[str, Path]:
    """{member path: local file} for MEMBERS: already-extracted files in RAW_DIR when present,
    otherwise extracted from their archives (fetched with ``downloads.fetch_raw_files``: checked,
    downloaded when missing and allowed). When archives can be had neither way, one DataError
    lists every missing archive (URL, where to put it) and the extracted files that would do
    instead."""
    raw_dir = Path(raw_dir)
    found: Dict[str, Path] = {}
    need: Dict[str, List[Member]] = {}
    for m in members:
        for cand in _candidates(raw_dir, m):
            refuse_non_file(cand, f"an extracted member of {m.archive_name}")
            if cand.is_file():
                found[m.path] = cand
                break
        else:
            need.setdefault(m.archive_name, []).append(m)
    if not need:
        return found
    try:
        paths = fetch_raw_files([archives[name] for name in need], raw_dir, download=download)
    except DataError as e:
        if e.path is not None:  # a present archive failed its check: not a missing-file list
            raise
        alt = [f"  {' or '.join(str(c) for c in _candidates(raw_dir, m))}"
               for ms in need.values() for m in ms]
        raise DataError(f"{e}\ninstead of an archive, its extracted files will do:\n" + "\n".join(alt)) from None
    for name, ms in need.items():
        stem = name[:-len(".tgz")] if name.endswith(".tgz") else name
        outputs = [Path(work_dir) / "extracted" / stem / m.path for m in ms]
        wanted = [m.path for m in ms]
        steps.run(f"extract-{stem}", outputs,
                  lambda *tmps, _a=paths[name], _w=wanted: _extract(_a, _w, [Path(t) for t in tmps]),
                  inputs=[paths[name]], params={"members": wanted})
        found.update({m.path: out for m, out in zip(ms, outputs)})
    return found


def add_clean_args(group, ratio: float, max_len: int, min_len: int = 1):
    group.add_argument("--clean-ratio", type=float, default=ratio,
                       help="clean-corpus-n -ratio, on the subword tokens of train and valid")
    group.add_argument("--clean-min", type=int, default=min_len, help="clean-corpus-n minimum tokens")
    group.add_argument("--clean-max", type=int, default=max_len, help="clean-corpus-n maximum tokens")


def check_clean_args(args):
    if args.clean_ratio <= 0 or args.clean_min < 0 or args.clean_max < max(args.clean_min, 1):
        raise DataError(f"--clean-ratio {args.clean_ratio}, --clean-min {args.clean_min}, --clean-max "
                        f"{args.clean_max}: expected ratio > 0 and 0 <= clean-min <= clean-max")


def finish(args, steps, work, name, src, tgt, clean_splits=("train", "valid"), notes=(), text_settings=None):
    """The common end of the WMT recipes, from WORK/tok/{train,valid,test}.{SRC,TGT}: subword
    model(s) learned on train and applied everywhere (WORK/bpe), CLEAN_SPLITS cleaned with
    clean-corpus-n on the subword tokens as fairseq does (WORK/final; official dev/test sets
    are never cleaned), fairseq-preprocess into --dest (TEXT_SETTINGS, {lang:
    ``text_settings.TextSettings``} of the test split, recorded in its manifest), and the
    summary."""
    splits = ("train", "valid", "test")
    bpe_dir, final = work / "bpe", work / "final"
    joint = args.vocab == "joint"
    models = subword_steps(steps, work / "tok", bpe_dir, splits, src, tgt, method=args.subword,
                           joint=joint, joint_size=args.bpe_size, src_size=args.src_bpe_size,
                           tgt_size=args.tgt_bpe_size)
    stats_path = final / "clean-stats.json"
    outs = [final / f"{split}.{lang}" for split in splits for lang in (src, tgt)]

    def clean(*tmps):
        tmp = dict(zip(outs, tmps))
        stats = {}
        for split in splits:
            s_lines = read_lines(bpe_dir / f"{split}.{src}")
            t_lines = read_lines(bpe_dir / f"{split}.{tgt}")
            if split in clean_splits:
                s_lines, t_lines, st = clean_corpus(s_lines, t_lines, ratio=args.clean_ratio,
                                                    min_len=args.clean_min, max_len=args.clean_max)
                if not s_lines:
                    raise DataError(f"no {split} pair survives cleaning", bpe_dir / f"{split}.{src}")
                stats[split] = {"too_short": st.too_short, "too_long": st.too_long, "bad_ratio": st.bad_ratio}
            write_lines(tmp[final / f"{split}.{src}"], s_lines)
            write_lines(tmp[final / f"{split}.{tgt}"], t_lines)
        save_json(tmps[-1], stats)

    steps.run("clean", outs + [stats_path], clean, inputs=[bpe_dir / p.name for p in outs],
              params={"ratio": args.clean_ratio, "min": args.clean_min, "max": args.clean_max,
                      "splits": list(clean_splits)})
    binarize_step(steps, final, args.dest, src, tgt, joined=joint, workers=args.workers, extra_files=models,
                  corpus=getattr(args, "corpus", None),
                  text=manifest_text(text_settings, args.subword, joint) if text_settings else None)

    stats = load_json(stats_path)
    dropped = {f"{split} {why}": n for split, st in stats.items() for why, n in st.items() if n}
    summary = text_summary(name, args.dest, final, splits, src, tgt, dropped)
    kind = ("joint (one joined dictionary: --share-all-embeddings)" if joint
            else "separate (one dictionary per language: --share-decoder-input-output-embed)")
    sizes = (f"{args.bpe_size}" if joint else f"{src} {args.src_bpe_size} / {tgt} {args.tgt_bpe_size}")
    summary.notes += list(notes) + [
        f"{args.subword} {kind}, size {sizes}; model(s) copied into {args.dest}",
        f"clean-corpus-n on {'/'.join(clean_splits)}: ratio {args.clean_ratio}, "
        f"{args.clean_min}..{args.clean_max} tokens; text: {final}",
    ]
    return summary
