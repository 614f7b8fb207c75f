"""Strict readers of corpus text: every problem with an input file is a ``DataError`` naming it.

    iter_lines(path) / read_lines(path)   UTF-8 lines without their newline, ``.gz`` transparently
    count_lines(path)                     the number of lines, without decoding them
    read_parallel(src, tgt)               two aligned files (different line counts are an error)
    read_segments(path) / read_parallel_segments(src, tgt)
                                          the ``<seg id="N"> ... </seg>`` lines of IWSLT XML and
                                          WMT SGM files (one format)
    strip_metadata(lines)                 IWSLT ``train.tags`` without its ``<url>``, ``<talkid>`` ... lines
    refuse_non_file(path)                 a folder where a file belongs is an error, not "missing"

A UTF-8 byte-order mark at the start of a file is dropped (it would otherwise become part of the
first token); a missing file, a folder, an empty file, a broken gzip stream or non-UTF-8 bytes
raise ``DataError`` naming the file (and line). Only ``\\n`` ends a line: U+2028 and friends stay
inside the sentence, unlike ``str.splitlines``.
"""

import gzip
import re
import zlib
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence, Tuple

from ..atomic_files import PathLike
from .errors import DataError


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
