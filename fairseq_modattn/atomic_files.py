"""Files written whole or not at all: the one place every command of the package writes through.

A file (or a new folder) is written under a temporary sibling name ``.NAME.tmp-PID`` and renamed
onto its path only when the writing succeeded, so a reader sees the old file or the complete new
one, and an interrupted run leaves no half-written output that a rerun would trust.

    atomic_path(path)                 context manager yielding the temporary; renamed on success
    atomic_write(path, write)         the same for a writer that takes a file name (torch.save)
    atomic_copy(src, dst)             a copy of a file that replaces DST whole or not at all
    write_lines(path, lines)          one line per item, UTF-8, ``\\n``
    write_json_atomically(obj, path)  indented JSON for people (results, summaries of commands)
    write_marked_section(path, name, text) / check_marked_section(path, name)
                                      a command's own part of a page people also edit
    save_json(path, obj) / load_json  sorted JSON records of data preparation, and reading them back
    check_output_file(path, flag)     the up-front refusal of an output flag that names a folder
    is_temporary / remove_stale_temporaries / remove_path
                                      recognising and clearing what a killed run left behind

Two rules hold everywhere: an existing *directory* is never replaced (deleting it would delete
whatever a user keeps there), and a path that is itself a temporary is written in place, so
temporaries never nest (``..NAME.tmp-PID.tmp-PID`` would escape the clean-up after a kill).

A write that finds the disk full raises ``disk_space.DiskFullError``, one line naming the folder,
the space the file needs (``expected_size`` where the writer knows it) and the space free there,
with the temporary already removed.

Used by ``data/`` (every recipe step), ``analysis/`` (checkpoints, figures), ``cli/`` (result
files) and ``compat`` fix 13 (fairseq's checkpoints); it depends only on ``disk_space``.
"""

import contextlib
import glob
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

from .disk_space import reporting_disk_full, size_of

PathLike = Union[str, Path]

_TEMPORARY = re.compile(r"\..+\.tmp-\d+")


def is_temporary(path: PathLike) -> bool:
    """Whether PATH is named like a temporary of ``atomic_path`` (``.NAME.tmp-PID``)."""
    return _TEMPORARY.fullmatch(Path(path).name) is not None


def check_output_file(path: Optional[PathLike], flag: str = "--output", error=IsADirectoryError):
    """Raise ERROR if the output file PATH of FLAG is an existing directory: commands call this
    before their work, so a typo never costs hours and never deletes a folder (``atomic_path``
    refuses too, but only at the end). Each caller passes its own error class (``DataError``,
    ``AnalysisError``), the one its command prints as a one-line message."""
    if path is not None and Path(path).is_dir():
        raise error(f"{flag} {path} is a directory; give a file path")


@contextlib.contextmanager
def atomic_path(path: PathLike, expected_size: Optional[int] = None, durable: bool = False):
    """Yield a temporary path ``.NAME.tmp-PID`` beside PATH; rename it onto PATH when the block
    succeeds, remove it when the block raises. Works for files, and for folders that do not
    exist yet.

    A block that fails because the disk is full raises ``DiskFullError`` (EXPECTED_SIZE, the
    bytes PATH will take, is what its message says is needed; without it, more than what was
    written). DURABLE also ``fsync``s a file before the rename, so after a crash of the machine
    PATH holds the old contents or all of the new ones (checkpoints; a killed process needs no
    fsync, the rename alone is atomic).

    An existing directory at PATH is never replaced (a rename would have to delete it, and
    with it whatever it holds): ``IsADirectoryError`` is raised before the block runs. A PATH
    that is itself a temporary of this function (a step's output handed to a helper that
    writes atomically too) is yielded as is: the outer rename already makes it atomic, and
    temporaries of temporaries (``..NAME.tmp-PID.tmp-PID``) would escape the stale-temporary
    cleanup of ``data.steps.Steps.run`` after a kill."""
    path = Path(path)
    if is_temporary(path):
        yield path
        return
    if path.is_dir() and not path.is_symlink():
        raise IsADirectoryError(f"{path} is a directory; give a file path (an existing folder is never replaced)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    remove_path(tmp)
    try:
        with reporting_disk_full(path, expected_size, partial=[tmp]):
            yield tmp
            if durable and tmp.is_file():
                _fsync(tmp)  # some filesystems (delayed allocation, NFS) report ENOSPC only here
        if not tmp.exists():
            raise RuntimeError(f"{tmp} was not written")
        if path.is_dir() and not path.is_symlink():  # appeared while the block ran
            raise IsADirectoryError(f"{path} is a directory; give a file path (an existing folder is never replaced)")
        os.replace(tmp, path)
    finally:
        remove_path(tmp)


def _fsync(path: Path):
    """Flush the file PATH's data to its disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Path):
    """Remove the file, link or folder PATH if there is one (a link is removed, not followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_stale_temporaries(path: PathLike):
    """Remove the temporaries of PATH that killed runs left (``.NAME.tmp-*``, ``.NAME.old-*``
    and the nested ``..NAME.tmp-*`` of versions before temporaries stopped nesting)."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    name = glob.escape(path.name)
    for pattern in (f".{name}.tmp-*", f"..{name}.tmp-*", f".{name}.old-*"):
        for stale in path.parent.glob(pattern):
            remove_path(stale)


def atomic_write(path: PathLike, write: Callable[[str], None], expected_size: Optional[int] = None,
                 durable: bool = False) -> Path:
    """Create PATH by ``write(temporary_name)`` (for writers that want a file name, such as
    ``torch.save``) under :func:`atomic_path`'s rules; returns PATH."""
    with atomic_path(path, expected_size, durable) as tmp:
        write(str(tmp))
    return Path(path)


def atomic_copy(src: PathLike, dst: PathLike, durable: bool = False) -> Path:
    """Copy the file SRC to DST under :func:`atomic_path`'s rules: DST is the old file or the
    whole copy, never a part of it, whatever interrupts the copy (a full disk, a kill); the
    temporaries of earlier copies that were killed are removed first. Returns DST."""
    remove_stale_temporaries(dst)
    with atomic_path(dst, size_of(src), durable) as tmp:
        shutil.copyfile(src, tmp)
    return Path(dst)


def write_lines(path: PathLike, lines: Iterable[str]):
    """Write LINES (one per line, UTF-8, ``\\n``) to PATH atomically."""
    with atomic_path(path) as tmp:
        _write_lines_now(tmp, lines)


def _write_lines_now(path: PathLike, lines: Iterable[str]):
    """``write_lines`` straight into PATH, for a path that is already a temporary (a step's
    output) or a scratch file nobody else reads."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for s in lines:
            f.write(s)
            f.write("\n")


def write_json_atomically(obj, path: PathLike) -> Path:
    """Write OBJ as indented JSON (non-ASCII text kept as is) through a temporary file and a
    rename (never half a file); returns PATH. The format of the files people read: results,
    summaries, run records of the commands."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return Path(path)


def save_json(path: PathLike, obj):
    """Write OBJ as JSON to PATH atomically, with sorted keys, so the records of data
    preparation (cleaning counts, step outputs) come out byte for byte the same on a rerun."""
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def load_json(path: PathLike):
    """The JSON document in PATH (what ``save_json`` or ``write_json_atomically`` wrote)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _section_markers(name: str):
    return f"<!-- {name}: begin (written by the command; edits here are replaced) -->", f"<!-- {name}: end -->"


def check_marked_section(path: PathLike, name: str, error=FileExistsError):
    """Raise ERROR unless ``write_marked_section(PATH, NAME, ...)`` can write: PATH is missing, or
    a file holding the markers of section NAME once each, in order. Commands call it before
    their work, as ``check_output_file``."""
    path = Path(path)
    begin, end = _section_markers(name)
    if path.is_dir():
        raise error(f"{path} is a directory; give a file path")
    if path.exists():
        old = path.read_text(encoding="utf-8")
        if old.count(begin) != 1 or old.count(end) != 1 or old.index(begin) > old.index(end):
            raise error(f"{path} exists and has no '{name}' section (the lines {begin} and {end}) "
                        "to replace; add them where the report belongs, or give another file")


def write_marked_section(path: PathLike, name: str, text: str, error=FileExistsError) -> Path:
    """Put TEXT into PATH between the markers of section NAME, atomically, leaving the rest of
    the file as it is: a command's report can live in a page whose other parts people write.
    A missing PATH is created holding the section alone; an existing PATH without both markers
    is refused with ERROR (``check_marked_section``), since writing it would replace what the
    command did not write. Returns PATH."""
    path = Path(path)
    check_marked_section(path, name, error)
    begin, end = _section_markers(name)
    section = f"{begin}\n{text.rstrip()}\n{end}"
    old = path.read_text(encoding="utf-8") if path.exists() else f"{begin}{end}\n"
    new = old[: old.index(begin)] + section + old[old.index(end) + len(end):]
    with atomic_path(path) as tmp:
        tmp.write_text(new, encoding="utf-8")
    return path
