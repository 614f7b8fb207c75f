"""The shared text pipeline of the data recipes: read, normalise, tokenise, clean, BPE, binarise.

Every recipe (``multi30k.py``, ``iwslt14.py``, ``wmt14.py``, ``wmt17.py``) is a list of calls
into this module; recipes differ only in their corpus lists and options. The API below is
stable (later changes only add to it):

Errors
    ``DataError(message, path=None, line=None)``: the message names the file (and the 1-based
    line) and says what was expected. The CLI prints it without a traceback.

Reading
    ``iter_lines(path)`` / ``read_lines(path)``: strict UTF-8 lines without their newline,
    ``.gz`` transparently; a UTF-8 byte-order mark (U+FEFF) at the start of the file is
    dropped (it would otherwise become part of the first token); a missing file, a folder, an
    empty file, a broken gzip stream or non-UTF-8 bytes raise ``DataError`` naming the file
    (and line). Only ``\\n`` ends a line (U+2028 and friends stay inside the sentence, unlike
    ``str.splitlines``).
    ``read_parallel(src_path, tgt_path)``: two aligned files; different line counts raise
    ``DataError`` naming both files and both counts.
    ``read_segments(path)`` / ``read_parallel_segments(src, tgt)``: the text of the
    ``<seg id="N"> ... </seg>`` lines of IWSLT XML and WMT SGM files (one format).
    ``strip_metadata(lines)``: drop the ``<url>``, ``<talkid>`` ... lines of IWSLT ``train.tags``.

Writing (nothing half-written, nothing deleted that this package did not write)
    ``atomic_path(path)`` (context manager yielding a temporary sibling path ``.NAME.tmp-PID``,
    renamed onto ``path`` only when the block succeeds), ``write_lines(path, lines)``,
    ``atomic_dir(path)`` (the same, for a new folder). An existing *directory* at PATH is never
    replaced (``IsADirectoryError``, before the block runs); a PATH that is itself such a
    temporary is yielded as is, so temporaries never nest (``..NAME.tmp-PID.tmp-PID``).
    ``check_output_file(path, flag)``: the up-front check commands make of an output file
    flag (one line: ``--output X is a directory; give a file path``).

Resumable steps
    ``Steps(work_dir)``; ``steps.run(name, outputs, fn, inputs=(), params=None)`` calls
    ``fn(*tmp_outputs)`` with temporary sibling paths of ``outputs``, renames them into place
    and only then writes the step's marker (atomically). A step whose marker matches its
    params, the checksums of its inputs and the sizes of its outputs is skipped; an
    interrupted step leaves no marker, so a rerun redoes it (and overwrites its own outputs,
    never other files). A rerun first removes the temporaries a killed run left beside the
    step's outputs (``.NAME.tmp-*``, and the nested ``..NAME.tmp-*`` of older versions).

Text processing
    ``normalize_punctuation``, ``tokenize`` (Moses via sacremoses, optional aggressive dash
    splitting ``@-@``, optional lower-casing, ``workers`` processes), ``lowercase``,
    ``clean_corpus`` (Moses ``clean-corpus-n.perl``: min/max tokens and length ratio; returns
    the kept pairs and a ``CleanStats``). The recipes reach them through
    ``text_settings.tokenize_lines`` (their settings as data, shared with the demo).

Subwords
    ``learn_bpe`` / ``apply_bpe`` (subword-nmt), ``train_sentencepiece`` /
    ``apply_sentencepiece`` (sentencepiece, optional dependency).

Binarising
    ``fairseq_preprocess(dest, src, tgt, trainpref, validpref, testpref, joined=True, ...)``
    runs fairseq's own ``fairseq-preprocess`` into a temporary folder and renames it to
    ``dest``, a new folder (an existing one is refused). The child process dies with its
    parent (Linux: ``PR_SET_PDEATHSIG``), also when the parent is killed with SIGKILL, and is
    stopped when the parent raises (KeyboardInterrupt included).

Recipe building blocks (resumable steps over folders of ``{split}.{lang}`` text files)
    ``add_subword_args`` / ``check_subword_args`` (--subword, --vocab, --bpe-size ...),
    ``subword_steps``, ``binarize_step``, ``text_summary``, ``subword_binarize_summary`` (all
    three plus the summary), ``save_json`` / ``load_json``.
    ``binarize_step`` writes the data-bin file by file and records the files it wrote in
    ``DEST/prepare-manifest.json`` (``MANIFEST``), with the text settings of each language
    (``text_settings.py``: the steps above and the subword model, which the demo reuses); other files in DEST (a user's notes) are
    left alone on every rerun. ``check_prepare_paths`` (run by ``data.prepare`` before any
    work) refuses, in one line, a --dest that is not empty and holds no such manifest (another
    tool's folder, a parent of data-bins), a --dest holding another corpus's data-bin, an
    unwritable --dest / --work-dir, and a --summary-json that is a directory.

Raw files
    ``RawFile(name, url, size=None, sha256=None)``, ``fetch_raw_files(files, raw_dir,
    download=True)``: local lookup first (size / sha256 checked; a folder where a file should
    be is an error: "is a directory, expected a file"), download with a progress bar only for
    missing files; when a file cannot be had, one ``DataError`` lists every missing file with
    its URL and the exact path to place it at.

Summary
    ``Summary`` collects sentences per split, vocabulary sizes, dropped pairs; ``.print()``.
"""

import contextlib
import ctypes
import functools
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

PathLike = Union[str, Path]

__all__ = [
    "DataError", "iter_lines", "read_lines", "read_parallel", "read_segments",
    "read_parallel_segments", "strip_metadata", "atomic_path", "atomic_dir", "write_lines",
    "sha256sum", "Steps", "normalize_punctuation", "tokenize", "lowercase", "clean_corpus",
    "CleanStats", "learn_bpe", "apply_bpe", "train_sentencepiece", "apply_sentencepiece",
    "fairseq_preprocess", "RawFile", "fetch_raw_files", "Summary", "count_lines",
    "check_output_file", "check_prepare_paths", "MANIFEST",
]


class DataError(Exception):
    """Bad or missing input: the message names the file (and 1-based line) and what was expected."""

    def __init__(self, message: str, path: Optional[PathLike] = None, line: Optional[int] = None):
        self.path = None if path is None else str(path)
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


# --------------------------------------------------------------------------------------- reading

def _open_bytes(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_lines(path: PathLike, allow_empty: bool = False) -> Iterator[str]:
    """Yield the lines of PATH (UTF-8, ``.gz`` allowed) without their line ending.

    A UTF-8 byte-order mark (U+FEFF) at the very start of the file is dropped (editors on
    Windows write one; kept, it would glue onto the first token and become a dictionary entry);
    U+FEFF anywhere else is text and stays. Raises DataError for a missing file, a folder, an
    empty file (unless ALLOW_EMPTY), a corrupt gzip stream, or bytes that are not UTF-8 (naming
    the line).
    """
    path = Path(path)
    if not path.exists():
        raise DataError("file not found", path)
    refuse_non_file(path)
    lineno = 0
    try:
        with _open_bytes(path) as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at column {e.start + 1}); "
                        "convert the file to UTF-8", path, lineno) from None
                if lineno == 1 and text.startswith("\ufeff"):
                    text = text[1:]
                if text.endswith("\n"):
                    text = text[:-1]
                    if text.endswith("\r"):
                        text = text[:-1]
                yield text
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise DataError("file not found", path) from None
        raise DataError(f"cannot read ({e}); expected a{' gzip' if path.suffix == '.gz' else ''} text file",
                        path, lineno + 1 if lineno else None) from None
    if lineno == 0 and not allow_empty:
        raise DataError("file is empty; expected one sentence per line", path)


def refuse_non_file(path: PathLike, what: str = ""):
    """DataError if PATH exists but is not a regular file (a folder where a raw file belongs is
    otherwise reported as missing); WHAT says what the file should be."""
    path = Path(path)
    if path.exists() and not path.is_file():
        kind = "is a directory" if path.is_dir() else "is not a regular file"
        raise DataError(f"{kind}, expected a file{f' ({what})' if what else ''}", path)


def read_lines(path: PathLike, allow_empty: bool = False) -> List[str]:
    """All lines of PATH (see ``iter_lines``)."""
    return list(iter_lines(path, allow_empty=allow_empty))


def count_lines(path: PathLike) -> int:
    """Number of lines of PATH (``\\n``-terminated, plus a final unterminated one)."""
    n = 0
    last = b"\n"
    with _open_bytes(Path(path)) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def check_parallel(src: Sequence[str], tgt: Sequence[str], src_path: PathLike, tgt_path: PathLike):
    """Raise DataError naming both files and counts if SRC and TGT differ in length."""
    if len(src) != len(tgt):
        raise DataError(
            f"{len(src)} lines in {src_path} but {len(tgt)} lines in {tgt_path}; "
            "parallel files must have one sentence per line in the same order")


def read_parallel(src_path: PathLike, tgt_path: PathLike) -> Tuple[List[str], List[str]]:
    """The lines of two aligned files; DataError if their line counts differ."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    check_parallel(src, tgt, src_path, tgt_path)
    return src, tgt


_SEG = re.compile(r"^\s*<seg\s+id\s*=\s*\"?\s*([^\">\s]*)\s*\"?\s*>(.*)</seg>\s*$", re.I)


def read_segments(path: PathLike, unescape: bool = False) -> List[str]:
    """The text of every ``<seg id="N"> ... </seg>`` line of an IWSLT XML / WMT SGM file.

    Leading/trailing whitespace is stripped. A ``<seg`` line that does not close on the same
    line, or a file without any segment, raises DataError. UNESCAPE decodes XML entities
    (``&amp;`` ...) for files that use them.
    """
    import html

    out = []
    for lineno, line in enumerate(iter_lines(path), 1):
        if "<seg" not in line.lower():
            continue
        m = _SEG.match(line)
        if m is None:
            raise DataError("malformed <seg> line; expected '<seg id=\"N\"> text </seg>' on one line",
                            path, lineno)
        text = m.group(2).strip()
        out.append(html.unescape(text) if unescape else text)
    if not out:
        raise DataError("no <seg id=...> lines; expected an IWSLT .xml or WMT .sgm file", path)
    return out


def read_parallel_segments(src_path: PathLike, tgt_path: PathLike, unescape: bool = False):
    """Segments of two aligned XML/SGM files; DataError if their segment counts differ."""
    src, tgt = read_segments(src_path, unescape), read_segments(tgt_path, unescape)
    if len(src) != len(tgt):
        raise DataError(f"{len(src)} <seg> lines in {src_path} but {len(tgt)} in {tgt_path}; "
                        "the two sides of a test set must align")
    return src, tgt


def strip_metadata(lines: Iterable[str]) -> List[str]:
    """Drop IWSLT ``train.tags`` metadata: every line whose first non-blank character is '<'
    (``<url>``, ``<talkid>``, ``<keywords>``, ``<speaker>``, ``<reviewer>``, ``<translator>``,
    ``<title>``, ``<description>``, ``<doc ...>``, ``</doc>``)."""
    return [s for s in lines if not s.lstrip().startswith("<")]


# --------------------------------------------------------------------------------------- writing

_TEMPORARY = re.compile(r"\..+\.tmp-\d+")


def is_temporary(path: PathLike) -> bool:
    """Whether PATH is named like a temporary of ``atomic_path`` (``.NAME.tmp-PID``)."""
    return _TEMPORARY.fullmatch(Path(path).name) is not None


def check_output_file(path: Optional[PathLike], flag: str = "--output", error=None):
    """Raise ERROR (default DataError) if the output file PATH of FLAG is an existing
    directory: commands call this before their work, so a typo never costs hours and never
    deletes a folder (``atomic_path`` refuses too, but only at the end)."""
    if path is not None and Path(path).is_dir():
        raise (error or DataError)(f"{flag} {path} is a directory; give a file path")


@contextlib.contextmanager
def atomic_path(path: PathLike):
    """Yield a temporary path ``.NAME.tmp-PID`` beside PATH; rename it onto PATH when the block
    succeeds, remove it when the block raises. Works for files, and for folders that do not
    exist yet.

    An existing directory at PATH is never replaced (a rename would have to delete it, and
    with it whatever it holds): ``IsADirectoryError`` is raised before the block runs. A PATH
    that is itself a temporary of this function (a step's output handed to a helper that
    writes atomically too) is yielded as is: the outer rename already makes it atomic, and
    temporaries of temporaries (``..NAME.tmp-PID.tmp-PID``) would escape the stale-temporary
    cleanup of ``Steps.run`` after a kill."""
    path = Path(path)
    if is_temporary(path):
        yield path
        return
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f"{path} is a directory; give a file path (an existing folder is never replaced)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    _remove(tmp)
    try:
        yield tmp
        if not tmp.exists():
            raise RuntimeError(f"{tmp} was not written")
        if path.is_dir() and not path.is_symlink():  # appeared while the block ran
            raise IsADirectoryError(f"{path} is a directory; give a file path (an existing folder is never replaced)")
        os.replace(tmp, path)
    finally:
        _remove(tmp)


atomic_dir = atomic_path  # a new folder: same rules (an existing folder is refused)


def _remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_lines(path: PathLike, lines: Iterable[str]):
    """Write LINES (one per line, UTF-8, ``\\n``) to PATH atomically."""
    with atomic_path(path) as tmp:
        _write_lines_now(tmp, lines)


def _write_lines_now(path: PathLike, lines: Iterable[str]):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for s in lines:
            f.write(s)
            f.write("\n")


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file, or of a folder's files (names and contents, sorted)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def remove_stale_temporaries(path: PathLike):
    """Remove the temporaries of PATH that killed runs left (``.NAME.tmp-*``, ``.NAME.old-*``
    and the nested ``..NAME.tmp-*`` of versions before temporaries stopped nesting)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    name = glob.escape(path.name)
    for pattern in (f".{name}.tmp-*", f"..{name}.tmp-*", f".{name}.old-*"):
        for stale in path.parent.glob(pattern):
            _remove(stale)


# ------------------------------------------------------------------------------ resumable steps

class Steps:
    """Resumable, atomic pipeline steps whose completion markers live in WORK_DIR/.steps/.

    ``run(name, outputs, fn, inputs=(), params=None)``: if the marker of NAME exists and
    records the same PARAMS (JSON-able), the same sha256 of every INPUT and the current size
    of every OUTPUT, the step is skipped (returns False). Otherwise ``fn(*tmp_paths)`` writes
    each output to a temporary sibling path, the runner renames them into place and then
    writes the marker atomically (returns True). An exception in FN removes the temporaries
    and leaves the step unmarked, so nothing it touched is trusted by a rerun.
    """

    def __init__(self, work_dir: PathLike, log: Callable[[str], None] = None):
        self.work_dir = Path(work_dir)
        self.marker_dir = self.work_dir / ".steps"
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.ran: List[str] = []
        self.skipped: List[str] = []

    def marker(self, name: str) -> Path:
        return self.marker_dir / f"{name}.done.json"

    def _record(self, name, outputs, inputs, params, output_sizes=None):
        return {
            "step": name,
            "params": json.loads(json.dumps(params, default=str)),
            "inputs": {str(p): sha256sum(p) for p in inputs},
            "outputs": output_sizes or {str(p): _size(p) for p in outputs},
        }

    def is_done(self, name: str, outputs: Sequence[PathLike], inputs: Sequence[PathLike] = (),
                params=None) -> bool:
        marker = self.marker(name)
        if not marker.is_file():
            return False
        try:
            recorded = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        outputs = [Path(p) for p in outputs]
        if any(not p.exists() for p in outputs):
            return False
        for p in outputs:
            if recorded.get("outputs", {}).get(str(p)) != _size(p):
                return False
        want = self._record(name, [], [Path(p) for p in inputs], params, output_sizes={})
        return recorded.get("params") == want["params"] and recorded.get("inputs") == want["inputs"]

    def run(self, name: str, outputs: Sequence[PathLike], fn: Callable, inputs: Sequence[PathLike] = (),
            params=None) -> bool:
        outputs = [Path(p) for p in outputs]
        inputs = [Path(p) for p in inputs]
        if self.is_done(name, outputs, inputs, params):
            self.log(f"[{name}] up to date, skipped")
            self.skipped.append(name)
            return False
        self.log(f"[{name}] running")
        marker = self.marker(name)
        if marker.exists():
            marker.unlink()
        for p in outputs:  # temporaries of a run that was killed outright (SIGKILL, power loss)
            remove_stale_temporaries(p)
        with contextlib.ExitStack() as stack:
            tmps = [stack.enter_context(atomic_path(p)) for p in outputs]
            fn(*tmps)
            # leaving the stack renames every temporary onto its output (in reverse order)
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        record = self._record(name, outputs, inputs, params)
        with atomic_path(marker) as tmp:
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
        self.ran.append(name)
        return True


# ------------------------------------------------------------------------------ text processing

_WORKER = {}


@functools.lru_cache(maxsize=16)
def _moses(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits) -> dict:
    """The sacremoses objects of one configuration (built once per process: the demo calls
    ``tokenize`` once a sentence)."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return dict(norm=MosesPunctNormalizer(lang=lang) if normalize else None,
                tok=MosesTokenizer(lang=lang) if tokenize_ else None,
                lower=lower, escape=escape, dash=aggressive_dash_splits)


def _init_worker(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits):
    _WORKER.clear()
    _WORKER.update(_moses(lang, normalize, tokenize_, lower, escape, aggressive_dash_splits))


def _process_one(line: str, w: Optional[dict] = None) -> str:
    w = _WORKER if w is None else w
    if w["norm"] is not None:
        line = w["norm"].normalize(line)
    if w["tok"] is not None:
        line = w["tok"].tokenize(line, return_str=True, escape=w["escape"],
                                 aggressive_dash_splits=w["dash"])
    else:
        line = " ".join(line.split())
    if w["lower"]:
        line = line.lower()
    return line


def _process_chunk(lines: List[str]) -> List[str]:
    return [_process_one(s) for s in lines]


def tokenize(lines: Sequence[str], lang: str, *, normalize: bool = False, tokenize: bool = True,
             lower: bool = False, escape: bool = True, aggressive_dash_splits: bool = False,
             workers: int = 1) -> List[str]:
    """Moses pipeline on LINES: optional punctuation normalisation (``normalize-punctuation.perl``),
    tokenisation (``tokenizer.perl -l LANG``; ESCAPE as Moses' default ``&amp;`` escaping,
    AGGRESSIVE_DASH_SPLITS as ``-a``, which WMT14 en-de uses), optional lower-casing
    (``lowercase.perl``). WORKERS > 1 splits the work over processes (same output)."""
    config = (lang, normalize, tokenize, lower, escape, aggressive_dash_splits)
    lines = list(lines)
    if workers <= 1 or len(lines) < 2000:
        w = _moses(*config)  # not the process-global _WORKER: the demo's threads call this too
        return [_process_one(s, w) for s in lines]
    import multiprocessing

    size = 1000
    chunks = [lines[i:i + size] for i in range(0, len(lines), size)]
    with multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork").Pool(
            workers, initializer=_init_worker, initargs=config) as pool:
        out = []
        for part in pool.imap(_process_chunk, chunks):
            out.extend(part)
    return out


def normalize_punctuation(lines: Sequence[str], lang: str, workers: int = 1) -> List[str]:
    """Moses ``normalize-punctuation.perl -l LANG`` (sacremoses), without tokenising."""
    return tokenize(lines, lang, normalize=True, tokenize=False, workers=workers)


def lowercase(lines: Iterable[str]) -> List[str]:
    """Moses ``lowercase.perl`` (Unicode lower-casing)."""
    return [s.lower() for s in lines]


@dataclass
class CleanStats:
    kept: int = 0
    too_short: int = 0
    too_long: int = 0
    bad_ratio: int = 0

    @property
    def dropped(self) -> int:
        return self.too_short + self.too_long + self.bad_ratio

    def save(self, path: PathLike):
        """Write the counts as JSON (atomically), so a skipped rerun can still report them."""
        save_json(path, {"too_short": self.too_short, "too_long": self.too_long,
                         "bad_ratio": self.bad_ratio, "kept": self.kept})

    @classmethod
    def load(cls, path: PathLike) -> "CleanStats":
        return cls(**load_json(path))

    def reasons(self) -> Dict[str, int]:
        return {"too_short": self.too_short, "too_long": self.too_long, "bad_ratio": self.bad_ratio}


def clean_corpus(src: Sequence[str], tgt: Sequence[str], *, ratio: float = 9.0, min_len: int = 1,
                 max_len: int = 175) -> Tuple[List[str], List[str], CleanStats]:
    """Moses ``clean-corpus-n.perl -ratio RATIO src tgt out MIN MAX`` on aligned token lists.

    Whitespace is collapsed; a pair is dropped if either side has fewer than MIN_LEN or more
    than MAX_LEN tokens, or if one side is more than RATIO times longer than the other.
    Returns (kept src, kept tgt, CleanStats)."""
    if len(src) != len(tgt):
        raise DataError(f"clean_corpus: {len(src)} source but {len(tgt)} target lines")
    out_s, out_t, st = [], [], CleanStats()
    for s, t in zip(src, tgt):
        ws, wt = s.split(), t.split()
        ns, nt = len(ws), len(wt)
        if ns < min_len or nt < min_len:
            st.too_short += 1
        elif ns > max_len or nt > max_len:
            st.too_long += 1
        elif ns / nt > ratio or nt / ns > ratio:
            st.bad_ratio += 1
        else:
            out_s.append(" ".join(ws))
            out_t.append(" ".join(wt))
    st.kept = len(out_s)
    return out_s, out_t, st


# ------------------------------------------------------------------------------------- subwords

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
    from .text_settings import SubwordModel

    return SubwordModel("subword-nmt", codes_path).apply_lines(lines)


def _require_sentencepiece():
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        raise DataError("the sentencepiece option needs the `sentencepiece` package: "
                        "pip install sentencepiece") from None
    return sentencepiece


def train_sentencepiece(texts: Sequence[Sequence[str]], model_prefix: PathLike, vocab_size: int,
                        model_type: str = "bpe", character_coverage: float = 1.0):
    """Train a SentencePiece model on TEXTS; writes MODEL_PREFIX.model and .vocab atomically
    (single-threaded and unshuffled, so reruns give identical models)."""
    spm = _require_sentencepiece()
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
    from .text_settings import SubwordModel

    return SubwordModel("sentencepiece", model_path).apply_lines(lines)


# ------------------------------------------------------------------------------------ binarising

# Runs fairseq-preprocess as the child of a small wrapper: it leads its own process group (so
# its --workers pool processes can be stopped with it) and, on SIGTERM, kills that whole group.
_CHILD_WRAPPER = (
    "import os, runpy, signal, sys\n"
    "signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))\n"
    "sys.argv[0] = 'fairseq-preprocess'\n"
    "runpy.run_module('fairseq_cli.preprocess', run_name='__main__', alter_sys=True)\n"
)
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """A ``preexec_fn`` making the child get SIGTERM when this process dies.

    Why: a ``subprocess`` child outlives its parent. When ``prepare`` is killed with SIGKILL
    (no ``finally`` runs), fairseq-preprocess would go on for minutes or hours and finish a
    data-bin into a temporary folder nobody renames. Linux's ``prctl(PR_SET_PDEATHSIG)`` makes
    the kernel signal the child when its parent dies, whatever kills it; the wrapper above then
    kills the child's process group (its worker pool too). libc is loaded in the parent (no
    dlopen between fork and exec). Elsewhere this is a no-op; the parent still stops the child
    on any exception, KeyboardInterrupt included (``_run_child``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    parent = os.getpid()

    def preexec():
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _run_child(cmd: Sequence[str]) -> Tuple[int, str]:
    """Run CMD (a Python child) to completion: (exit status, stdout + stderr). The child leads
    its own process group, dies with this process (``_die_with_parent``), and the group is
    killed when this process raises while waiting (Ctrl-C included)."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent())
    try:
        out, _ = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        raise
    return proc.returncode, out or ""


def _preprocess_command(src, tgt, trainpref, validpref, testpref, joined, workers, nwordssrc, nwordstgt,
                        extra_args) -> List[str]:
    cmd = [sys.executable, "-c", _CHILD_WRAPPER, "--source-lang", src, "--target-lang", tgt,
           "--trainpref", str(trainpref), "--workers", str(workers)]
    if validpref:
        cmd += ["--validpref", str(validpref)]
    if testpref:
        cmd += ["--testpref", str(testpref)]
    if joined:
        cmd += ["--joined-dictionary"]
    if nwordssrc > 0:
        cmd += ["--nwordssrc", str(nwordssrc)]
    if nwordstgt > 0:
        cmd += ["--nwordstgt", str(nwordstgt)]
    return cmd + list(extra_args)


def _preprocess_into(outdir: Path, cmd: Sequence[str], dest_for_messages: PathLike, log_dest: PathLike):
    """Run fairseq-preprocess CMD into the (new) folder OUTDIR; its preprocess.log names LOG_DEST."""
    code, output = _run_child(list(cmd) + ["--destdir", str(outdir)])
    if code != 0:
        raise DataError(f"fairseq-preprocess failed (exit {code}):\n{output[-3000:]}", dest_for_messages)
    log = Path(outdir) / "preprocess.log"
    if log.is_file():
        text = log.read_text(encoding="utf-8").replace(str(outdir), str(log_dest))
        log.write_text(text, encoding="utf-8")


def fairseq_preprocess(dest: PathLike, src: str, tgt: str, trainpref: PathLike,
                       validpref: Optional[PathLike] = None, testpref: Optional[PathLike] = None,
                       joined: bool = True, workers: int = 1, nwordssrc: int = -1, nwordstgt: int = -1,
                       extra_files: Sequence[PathLike] = (), extra_args: Sequence[str] = (),
                       log_dest: Optional[PathLike] = None):
    """Run fairseq's ``fairseq-preprocess`` (``--joined-dictionary`` if JOINED) into a temporary
    folder, copy EXTRA_FILES (BPE codes, sentencepiece model) into it, and rename it onto DEST,
    which must not exist yet (an existing folder is refused with DataError, never replaced; the
    recipes' ``binarize_step`` updates a data-bin file by file instead).
    Its ``preprocess.log`` names LOG_DEST (default DEST), not the temporary folder, so reruns
    write identical bytes. The child process dies with this one (see ``_die_with_parent``)."""
    dest = Path(dest)
    if dest.is_dir() and not dest.is_symlink() and not is_temporary(dest):
        raise DataError("already exists; fairseq_preprocess writes a new folder (remove it or give another)", dest)
    cmd = _preprocess_command(src, tgt, trainpref, validpref, testpref, joined, workers, nwordssrc, nwordstgt,
                              extra_args)
    with atomic_path(dest) as tmp:
        _remove(tmp)
        _preprocess_into(tmp, cmd, dest, log_dest or dest)
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)


# ------------------------------------------------------------------------------------- raw files

@dataclass
class RawFile:
    """A raw corpus file: NAME inside --raw-dir, its public URL, and optional checks."""
    name: str
    url: Optional[str] = None
    size: Optional[int] = None
    sha256: Optional[str] = None
    note: str = ""

    def check(self, path: Path):
        if self.size is not None and path.stat().st_size != self.size:
            raise DataError(f"has {path.stat().st_size} bytes, expected {self.size} "
                            f"(a truncated or wrong file? {self.url or ''})".rstrip(), path)
        if self.sha256 is not None and sha256sum(path) != self.sha256:
            raise DataError(f"sha256 differs from the expected {self.sha256} (a wrong or corrupt file)", path)


def _download(url: str, dest: Path, timeout: float = 30.0):
    import urllib.request

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    with atomic_path(dest) as tmp:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=dest.name, file=sys.stderr) if tqdm else None
            for chunk in iter(lambda: resp.read(1 << 16), b""):
                out.write(chunk)
                if bar:
                    bar.update(len(chunk))
            if bar:
                bar.close()


def fetch_raw_files(files: Sequence[RawFile], raw_dir: PathLike, download: bool = True,
                    log: Callable[[str], None] = None) -> Dict[str, Path]:
    """{name: path} of FILES inside RAW_DIR. Files present are checked (size / sha256); missing
    ones are downloaded (progress bar, checked, written atomically) when DOWNLOAD allows and
    the network answers. Otherwise one DataError lists every missing file: where to place it
    and where it comes from."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    raw_dir = Path(raw_dir)
    found, missing = {}, []
    offline = False
    for f in files:  # a folder (or fifo...) where a file belongs: say so, before any work
        refuse_non_file(raw_dir / f.name)
    for f in files:
        path = raw_dir / f.name
        if path.is_file():
            f.check(path)
            found[f.name] = path
            continue
        if download and f.url and not offline:
            log(f"downloading {f.url} -> {path}")
            try:
                _download(f.url, path)
                f.check(path)
                found[f.name] = path
                continue
            except DataError:
                path.unlink(missing_ok=True)
                raise
            except Exception as e:  # network errors of any kind: fall through to the message
                log(f"  download failed: {e}")
                offline = True  # do not wait for every other URL to time out too
        missing.append((f, path))
    if missing:
        lines = [f"{len(missing)} raw file(s) missing"
                 + (" and could not be downloaded (offline?)" if download else " (downloads disabled)")
                 + "; place each file at the path shown and rerun:"]
        for f, path in missing:
            extra = f" [{f.size} bytes]" if f.size else ""
            lines.append(f"  {path}{extra}\n      from {f.url or '(no public URL)'}"
                         + (f"\n      {f.note}" if f.note else ""))
        raise DataError("\n".join(lines))
    return found


# ---------------------------------------------------------------------------------------- summary

@dataclass
class Summary:
    """What a recipe produced: sentences per split, vocabulary sizes, dropped pairs."""
    name: str
    dest: str = ""
    sentences: Dict[str, int] = field(default_factory=dict)
    vocab: Dict[str, int] = field(default_factory=dict)
    dropped: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)

    def read_vocab(self, dest: PathLike, langs: Sequence[str]):
        """Fill ``vocab`` from DEST/dict.LANG.txt (+4 fairseq special symbols)."""
        for lang in langs:
            d = Path(dest) / f"dict.{lang}.txt"
            if d.is_file():
                self.vocab[lang] = count_lines(d) + 4

    def to_dict(self):
        return {"name": self.name, "dest": self.dest, "sentences": self.sentences,
                "vocab": self.vocab, "dropped": self.dropped, "notes": self.notes}

    def format(self) -> str:
        out = [f"== {self.name} -> {self.dest}"]
        out.append("sentences: " + ", ".join(f"{k} {v:,}" for k, v in self.sentences.items()))
        out.append("vocabulary (fairseq dict incl. 4 specials): "
                   + ", ".join(f"{k} {v:,}" for k, v in self.vocab.items()))
        total = sum(self.dropped.values())
        out.append(f"dropped pairs: {total:,}" + (
            " (" + ", ".join(f"{k} {v:,}" for k, v in self.dropped.items()) + ")" if self.dropped else ""))
        out.extend(self.notes)
        return "\n".join(out)

    def print(self, file=None):
        print(self.format(), file=file or sys.stdout, flush=True)

    def save(self, path: PathLike):
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ recipe building blocks
# Higher-level steps shared by the recipes: subword learning/application, binarisation and the
# summary, all over a folder of plain-text files named {split}.{lang}.

SUBWORD_METHODS = ("subword-nmt", "sentencepiece")


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
        from .text_settings import subword_model_name

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


MANIFEST = "prepare-manifest.json"
_WRITTEN_BY = "fairseq-modattn prepare"


def data_bin_files(src: str, tgt: str, splits: Sequence[str], extra_files: Sequence[PathLike] = ()) -> List[str]:
    """Names of the files fairseq-preprocess (plus EXTRA_FILES) writes into a data-bin."""
    names = [f"dict.{src}.txt", f"dict.{tgt}.txt", "preprocess.log"]
    names += [f"{s}.{src}-{tgt}.{lang}.{ext}" for s in splits for lang in (src, tgt) for ext in ("bin", "idx")]
    return names + [Path(f).name for f in extra_files]


def read_manifest(dest: PathLike) -> Optional[dict]:
    """DEST's ``prepare-manifest.json`` (what prepare wrote there), or None."""
    try:
        manifest = load_json(Path(dest) / MANIFEST)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("written_by") == _WRITTEN_BY else None


def binarize_step(steps: Steps, text_dir: PathLike, dest: PathLike, src: str, tgt: str, *,
                  joined: bool, workers: int = 1, extra_files: Sequence[PathLike] = (),
                  splits: Sequence[str] = ("train", "valid", "test"), corpus: Optional[str] = None,
                  text: Optional[Dict[str, dict]] = None):
    """Resumable "binarize" step: fairseq-preprocess of TEXT_DIR/{train,valid,test}.{src,tgt}
    into DEST (joined or separate dictionaries); EXTRA_FILES are copied into DEST.
    TEXT (``text_settings.manifest_text``: per language, the text steps and subword model of the
    test split) is recorded in the manifest under ``"text"``, where the demo reads it.

    fairseq-preprocess writes into a temporary folder in the work dir; its files are then moved
    into DEST one by one (each atomically), together with ``prepare-manifest.json`` naming
    CORPUS, the languages and every file written. Nothing else in DEST is touched: a user's
    files survive reruns; files a previous run wrote that this one does not (``code.de`` after
    switching to a joint BPE) are removed, as the old manifest lists them."""
    text_dir, dest = Path(text_dir), Path(dest)
    prefs = {s: text_dir / s for s in splits}
    inputs = [text_dir / f"{s}.{lang}" for s in splits for lang in (src, tgt)] + [Path(f) for f in extra_files]
    names = data_bin_files(src, tgt, splits, extra_files)
    outputs = [dest / n for n in names] + [dest / MANIFEST]  # the manifest is renamed into place first
    manifest = {"written_by": _WRITTEN_BY, "corpus": corpus, "src": src, "tgt": tgt,
                "files": sorted(names + [MANIFEST])}
    if text:
        manifest["text"] = text
    stage_prefix = ".binarize.tmp-"
    if steps.work_dir.is_dir():
        for stale in steps.work_dir.glob(stage_prefix + "*"):  # left by a killed run
            _remove(stale)

    def binarize(*tmps):
        stage = steps.work_dir / f"{stage_prefix}{os.getpid()}"
        _remove(stage)
        stage.parent.mkdir(parents=True, exist_ok=True)
        try:
            cmd = _preprocess_command(src, tgt, prefs["train"], prefs.get("valid"), prefs.get("test"), joined,
                                      workers, -1, -1, ())
            _preprocess_into(stage, cmd, dest, dest)
            for f in extra_files:
                shutil.copyfile(f, stage / Path(f).name)
            missing = [n for n in names if not (stage / n).is_file()]
            if missing:
                raise DataError(f"fairseq-preprocess did not write {', '.join(missing)}", dest)
            for name, tmp in zip(names, tmps):
                shutil.move(str(stage / name), str(tmp))  # the work dir may be on another filesystem
            Path(tmps[-1]).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            old = read_manifest(dest) or {}
            for name in old.get("files", []):
                gone = dest / str(name)
                if name not in manifest["files"] and gone.parent == dest and gone.is_file():
                    gone.unlink()
        finally:
            _remove(stage)

    steps.run("binarize", outputs, binarize, inputs=inputs,
              params={"joined": joined, "src": src, "tgt": tgt, "files": manifest["files"], "corpus": corpus,
                      **({"text": text} if text else {})})


def _check_writable(path: Path, flag: str):
    """DataError (one line) unless PATH is, or can be created as, a folder this process can write in."""
    if path.exists() and not path.is_dir():
        raise DataError(f"{flag} {path} is a file, expected a folder")
    ancestor = path
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DataError(f"{flag} {path}: {ancestor} is a file, expected a folder")
    try:  # os.access says yes to root on a read-only mount: try it
        os.rmdir(tempfile.mkdtemp(prefix=".fairseq-modattn-probe-", dir=ancestor))
    except OSError as e:
        raise DataError(f"{flag} {path} is not writable ({ancestor}: {e.strerror or e}); "
                        "give a folder you can write to") from None


def check_prepare_paths(corpus: str, dest: PathLike, work_dir: PathLike, summary_json: Optional[PathLike] = None,
                        src: Optional[str] = None, tgt: Optional[str] = None):
    """The checks ``prepare`` makes before any work, each failing with a one-line DataError:
    SUMMARY_JSON must not be a directory; DEST and WORK_DIR must be (creatable) writable
    folders; a non-empty DEST must be a data-bin this command wrote (``prepare-manifest.json``,
    or for data-bins of older versions the "binarize" marker in WORK_DIR) for the same CORPUS
    (and SRC-TGT, when given). Temporaries left by a killed run do not count as content."""
    dest, work_dir = Path(dest), Path(work_dir)
    check_output_file(summary_json, "--summary-json")
    if summary_json is not None:
        _check_writable(Path(summary_json).parent, "--summary-json")
    _check_writable(dest, "--dest")
    _check_writable(work_dir, "--work-dir")
    if not dest.is_dir():
        return
    content = [p for p in dest.iterdir() if not is_temporary(p)]
    if not content:
        return
    manifest = read_manifest(dest)
    if manifest is None:
        marker = Steps(work_dir).marker("binarize")
        try:
            recorded = load_json(marker).get("outputs", {})
        except (OSError, ValueError, AttributeError):
            recorded = {}
        if str(dest) in recorded:  # a data-bin of a version without manifests, with its work dir
            return
        raise DataError(f"--dest {dest} is not empty and was not created by fairseq-modattn prepare "
                        f"(no {MANIFEST}); give a new or empty folder, e.g. {dest / corpus}")
    if manifest.get("corpus") not in (None, corpus) or (
            src and tgt and (manifest.get("src"), manifest.get("tgt")) != (src, tgt)):
        raise DataError(f"--dest {dest} holds the {manifest.get('corpus')} {manifest.get('src')}-"
                        f"{manifest.get('tgt')} data-bin; give another --dest for {corpus}"
                        + (f" {src}-{tgt}" if src and tgt else ""))


def text_summary(name: str, dest: PathLike, text_dir: PathLike, splits: Sequence[str], src: str, tgt: str,
                 dropped: Optional[Dict[str, int]] = None) -> Summary:
    """A Summary from the files of a finished recipe (works after a fully skipped rerun)."""
    summary = Summary(name=name, dest=str(dest))
    for split in splits:
        summary.sentences[split] = count_lines(Path(text_dir) / f"{split}.{src}")
    summary.read_vocab(dest, [src, tgt])
    summary.dropped = dict(dropped or {})
    return summary


def save_json(path: PathLike, obj):
    """Write OBJ as JSON to PATH atomically."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def load_json(path: PathLike):
    return json.loads(Path(path).read_text(encoding="utf-8"))


def subword_binarize_summary(steps: Steps, args, text_dir: PathLike, sub_dir: PathLike,
                             splits: Sequence[str], src: str, tgt: str, name: str,
                             clean_stats: Optional[PathLike] = None, text_settings=None) -> Summary:
    """The common tail of a recipe: ``subword_steps`` (flags of ``add_subword_args``),
    ``binarize_step`` into ``args.dest`` and the Summary (dropped pairs read from CLEAN_STATS,
    a ``CleanStats.save`` file). TEXT_SETTINGS ({lang: ``text_settings.TextSettings``} of the
    test split) are recorded in the manifest with the subword model."""
    from .text_settings import manifest_text

    joint = args.vocab == "joint"
    models = subword_steps(steps, text_dir, sub_dir, splits, src, tgt, method=args.subword, joint=joint,
                           joint_size=args.bpe_size, src_size=args.src_bpe_size, tgt_size=args.tgt_bpe_size)
    binarize_step(steps, sub_dir, args.dest, src, tgt, joined=joint, workers=args.workers,
                  extra_files=models, splits=splits, corpus=getattr(args, "corpus", None),
                  text=manifest_text(text_settings, args.subword, joint) if text_settings else None)
    dropped = CleanStats.load(clean_stats).reasons() if clean_stats else {}
    summary = text_summary(name, args.dest, sub_dir, splits, src, tgt, dropped)
    summary.notes.append(f"tokenised text: {text_dir}; subword text: {sub_dir}; "
                         f"subword model(s) copied into {args.dest}")
    return summary
