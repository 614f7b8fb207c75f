"""One writer per folder: the exclusive lock a command holds on what it writes, for its whole run.

Two runs pointed at one output (two ``prepare`` into one ``--dest``, two trainings into one
``--save-dir``, two evaluations sharing a work dir) would interleave their files and both exit 0:
a table built from such a folder mixes models without saying so. Every command of the package
that writes a run or output folder (or an output file) therefore takes :func:`exclusive_use` on
it first, and a second command pointed at the same place is refused at once, in one line naming
the first one's pid and command.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on a file ``.NAME.lock`` BESIDE the path, not inside it:

* the kernel releases a flock when its holder's process ends, however it ends (kill -9, power
  loss of a container), so a lock left by a killed run never blocks the rerun; the file a killed
  run leaves is reused by the next one and removed when that one finishes;
* beside, because the folder need not exist yet, a lock file inside a data-bin would count as
  content a user put there, and a full disk mounted AT the folder must not stop the refusal.

The lock file is removed when its holder releases it. A second process that opened the file just
before that removal can still acquire the flock of the removed file, so after acquiring, a holder
checks that the path still names the file it locked (same inode) and otherwise tries again: at any
moment at most one process holds the lock of a path.

Locks are re-entrant within one process (a command that locks its output dir and then calls a
helper that locks the same dir holds it once). A folder's lock also covers what lies directly in
it: a process other than the holder and its descendants (a benchmark's own fairseq-train
writing its run folder inside the benchmark's) locking a file or folder there is refused too
(``evaluate --output OTHER_RUN/evaluation/results.json`` while that evaluation runs). Paths are
resolved first, so ``out`` and ``./out/../out`` are one lock; two names of one folder through a
symlink also resolve to one.
"""

import atexit
import contextlib
import errno
import fcntl
import os
import shlex
import sys
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple, Type, Union

PathLike = Union[str, Path]


class FolderInUseError(RuntimeError):
    """Another process holds the lock of the folder or file a command was about to write."""


_HELD: Dict[Path, Tuple[int, int]] = {}  # resolved path -> (fd, depth)
_REGISTRY = threading.Lock()


def lock_file(path: PathLike) -> Path:
    """The lock file of PATH: ``.NAME.lock`` in PATH's parent, PATH resolved first."""
    path = Path(path).resolve()
    return path.parent / f".{path.name}.lock"


def holder(path: PathLike) -> str:
    """What the lock file of PATH says about its holder (``pid 1234 (fairseq-train ...)``), or
    ``another process`` when it says nothing yet (the holder has not written it)."""
    try:
        text = lock_file(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    pid, _, command = text.partition(" ")
    if not pid.isdigit():
        return "another process"
    return f"pid {pid}" + (f" ({command[:200]})" if command else "")


def current_holder(path: PathLike) -> Optional[int]:
    """The pid of the live process holding the lock of PATH, or None (no lock file, or one a
    killed run left). Read without locking, so a status query never makes a starting run fail."""
    try:
        pid = lock_file(path).read_text(encoding="utf-8", errors="replace").split(" ", 1)[0].strip()
    except OSError:
        return None
    if not pid.isdigit():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return int(pid)


def _this_process_and_its_ancestors() -> set:
    """This process's pid and its ancestors' (a command's own children, such as the fairseq-train
    of a benchmark writing into the benchmark's folder, are the same writer as the command)."""
    pids, pid = {os.getpid()}, os.getppid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:  # Linux: the parent's pid is the 4th field of /proc/PID/stat, after "(comm)"
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _acquire(path: Path, error: Type[Exception], what: str, shown: PathLike) -> int:
    lock = lock_file(path)
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:  # a read-only parent, a parent that is a file...
            raise error(f"{what} {shown} is not writable (cannot create {lock}: {e.strerror or e}); "
                        "give a folder you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise error(f"{what} {shown} is in use by {holder(path)}: one run writes a folder at a time; "
                        "wait for it to finish, or give another path") from None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                break
        except FileNotFoundError:  # removed by the holder that released it: ours is stale
            pass
        os.close(fd)
    command = shlex.join([os.path.basename(sys.argv[0]) or "python", *sys.argv[1:]]) if sys.argv else "python"
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {command}\n".encode("utf-8", errors="replace"))
    return fd


def _release(path: Path, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(lock_file(path))  # while still holding it: see the module docstring
    os.close(fd)


def acquire(path: PathLike, *, error: Type[Exception] = FolderInUseError, what: str = "") -> Path:
    """Take the lock of PATH for this process (re-entrant); ERROR (one line naming the holder)
    if another process holds it. WHAT names the path in that line (``--dest``). Returns the
    resolved path, which :func:`release` takes."""
    resolved = Path(path).resolve()
    with _REGISTRY:
        if resolved in _HELD:
            fd, depth = _HELD[resolved]
            _HELD[resolved] = (fd, depth + 1)
        else:
            fd = _acquire(resolved, error, what or "output", path)
            owner = current_holder(resolved.parent)
            if owner is not None and owner not in _this_process_and_its_ancestors() and resolved.parent not in _HELD:
                _release(resolved, fd)  # a file or folder directly inside a folder another run holds
                raise error(f"{what or 'output'} {path} is in {resolved.parent}, which is in use by "
                            f"{holder(resolved.parent)}: one run writes a folder at a time; wait for it to "
                            "finish, or give another path")
            _HELD[resolved] = (fd, 1)
    return resolved


def release(resolved: Path) -> None:
    """Undo one :func:`acquire` of RESOLVED; the last one gives the lock up."""
    with _REGISTRY:
        fd, depth = _HELD[resolved]
        if depth > 1:
            _HELD[resolved] = (fd, depth - 1)
        else:
            del _HELD[resolved]
            _release(resolved, fd)


@contextlib.contextmanager
def exclusive_use(path: PathLike, *, error: Type[Exception] = FolderInUseError, what: str = ""):
    """Hold the lock of PATH (a folder or a file, existing or not) for the block."""
    resolved = acquire(path, error=error, what=what)
    try:
        yield resolved
    finally:
        release(resolved)


def hold_until_exit(path: PathLike, *, error: Type[Exception] = FolderInUseError, what: str = "") -> None:
    """Hold the lock of PATH until this process exits (for a folder that another program's
    ``main`` writes, such as fairseq-train's ``--save-dir``)."""
    resolved = acquire(path, error=error, what=what)
    atexit.register(lambda: resolved in _HELD and release(resolved))


def is_held_here(path: PathLike) -> bool:
    """Whether this process holds the lock of PATH."""
    return Path(path).resolve() in _HELD
