"""A full disk, recognised and reported in one line that names the folder and the space needed.

A write that runs out of space shows up in three forms: ``OSError`` with errno ENOSPC (or EDQUOT,
a quota) from Python's own writes and ``shutil``; and, from ``torch.save``, a ``RuntimeError`` of
its zip writer (``[enforce fail at inline_container.cc:...] unexpected pos``) that says nothing
about space: when torch writes to a Python file object, the ENOSPC ``OSError`` is that error's
``__context__``, and when it writes to a file name (its own C++ stream) no errno survives at all.
``is_disk_full`` recognises the first two by the errno anywhere in the exception's chain, and a
torch ``RuntimeError`` without one by the filesystem itself: it has less room left than what
remained to be written (checked before the partial file is deleted, which frees its space).

    reporting_disk_full(target, ...)  context manager: a disk-full error in the block becomes a
                                      DiskFullError whose message names TARGET's folder, the bytes
                                      needed and the bytes free there; the partial outputs are
                                      removed first, so the free space reported is what is left
    DiskFullError                     an OSError (errno ENOSPC) with that one-line message
    tensor_bytes(obj)                 the bytes of the tensors in OBJ: what torch.save needs

Used by ``atomic_files`` (every atomic write of the package), ``compat`` fix 13 (fairseq's
checkpoint saves) and ``data.steps`` (data preparation); it depends on nothing else in the package.
"""

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional, Union

PathLike = Union[str, os.PathLike]

#: the errors a write gets from a filesystem that has no room left for it
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

#: a torch RuntimeError without an errno counts as a full disk only when the filesystem has less
#: than this left (besides less than what remained to be written): a nearly full disk
NEARLY_FULL_BYTES = 1 << 20


class DiskFullError(OSError):
    """A write found no space left; ``str()`` is one line naming the folder, the bytes needed and
    the bytes free there (and, where the writer adds it, what is intact and how to go on)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.errno = errno.ENOSPC  # for callers that test the errno; str() stays the message


def human_bytes(n: int) -> str:
    """N bytes as people read a disk's size: "812 B", "96.0 KB", "4.0 MB", "1.2 GB" (powers of 1000,
    as ``df -H`` and file managers print them)."""
    for unit, scale in (("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _existing_folder(path: Path) -> Path:
    """PATH's folder, or its nearest existing ancestor (the filesystem the folder will be on)."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def free_bytes(path: PathLike) -> int:
    """Bytes an unprivileged writer can still use on the filesystem of PATH (its folder's)."""
    return shutil.disk_usage(_existing_folder(Path(path))).free


def size_of(path: PathLike) -> int:
    """Bytes in the file PATH, or in the files under the folder PATH; 0 where there is nothing."""
    path = Path(path)
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        return path.lstat().st_size
    except OSError:
        return 0


def tensor_bytes(obj) -> int:
    """The bytes of the distinct tensor storages in OBJ (dicts, lists, tuples, tensors, nested):
    close to what ``torch.save`` writes for a checkpoint, whose pickle around them is small."""
    import torch

    seen, total, stack = set(), 0, [obj]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            storage = item.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def _errnos(error: BaseException) -> Iterable[int]:
    """The errnos of the OSErrors in ERROR's chain (itself, its ``__cause__`` and ``__context__``)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            yield error.errno
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException, folder: PathLike, remaining: int = 0) -> bool:
    """Whether ERROR, raised by a write into FOLDER, means the filesystem had no room: an ENOSPC /
    EDQUOT errno in its chain, or a torch ``RuntimeError`` (no errno) while FOLDER's filesystem has
    less free than both REMAINING (the bytes the write still had to do) and NEARLY_FULL_BYTES.
    Call it before the partial output is deleted."""
    if isinstance(error, DiskFullError) or any(e in DISK_FULL_ERRNOS for e in _errnos(error)):
        return True
    if not isinstance(error, RuntimeError):
        return False
    try:
        free = free_bytes(folder)
    except OSError:
        return False
    return free < max(remaining, 1) and free < NEARLY_FULL_BYTES


def disk_full_message(target: PathLike, needed: Optional[int], written: int, free: int,
                      inputs_size: Optional[int] = None, what: Optional[str] = None) -> str:
    """One line: no space in the folder of TARGET (a file or folder being written), what writing
    it (or WHAT) needs: NEEDED bytes, or, unknown, more than the WRITTEN bytes it had written and
    the size of its inputs, and how much is free there."""
    target = Path(target)
    folder = target.parent
    if needed:
        need = f"about {human_bytes(needed)}"
    else:
        need = f"more than the {human_bytes(written)} written when the disk filled"
        if inputs_size:
            need += f" (its inputs are {human_bytes(inputs_size)})"
    message = f"no space left on the device of {folder}: writing {what or target.name} needs {need}, " \
              f"{human_bytes(free)} free"
    if needed and needed > free:
        message += f"; free at least {human_bytes(needed - free)} there"
    return message


@contextlib.contextmanager
def reporting_disk_full(target: PathLike, needed: Optional[int] = None, partial: Iterable[PathLike] = (),
                        inputs_size: Optional[int] = None, what: Optional[str] = None, remove_partial: bool = True):
    """Within the block, which writes TARGET (NEEDED bytes when known) through the temporaries
    PARTIAL, an error that means the disk is full (``is_disk_full``) raises DiskFullError with
    ``disk_full_message``; a DiskFullError from an inner block passes unchanged, other errors too.
    The partial temporaries are removed first (REMOVE_PARTIAL), so the free space reported is
    what the user has once the failed write is gone."""
    partial = [Path(p) for p in partial]
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        written = sum(size_of(p) for p in partial)
        if not is_disk_full(e, target, (needed or 0) - written):
            raise
        if remove_partial:
            for p in partial:
                with contextlib.suppress(OSError):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        try:
            free = free_bytes(target)
        except OSError:
            free = 0
        raise DiskFullError(disk_full_message(target, needed, written, free, inputs_size, what)) from e


def describe_disk_full(error: BaseException, folder: Optional[PathLike] = None) -> Optional[str]:
    """For a command's last-resort handler: ERROR's one line if it means a disk is full (a
    DiskFullError's own message; for a bare ENOSPC, one naming the folder of the file in the error,
    else FOLDER, and the free space there), else None."""
    if isinstance(error, DiskFullError):
        return str(error)
    if not any(e in DISK_FULL_ERRNOS for e in _errnos(error)):
        return None
    filename = getattr(error, "filename", None)
    where = Path(os.fsdecode(filename)).parent if filename else folder
    if where is None:
        return f"no space left on device ({error}); free space and rerun"
    try:
        free = human_bytes(free_bytes(where))
    except OSError:
        free = "an unknown amount"
    return f"no space left on the device of {where}: {free} free there; free space and rerun"
