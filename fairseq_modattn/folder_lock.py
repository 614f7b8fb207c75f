"""One writer per folder: the exclusive lock a command holds on what it writes, for its whole run.

Two runs pointed at one output (two ``prepare`` into one ``--dest``, two trainings into one
``--save-dir``, two evaluations sharing a work dir) would interleave their files and both exit 0:
a table built from such a folder mixes models without saying so. Every command of the package
that writes a run or output folder (or an output file) therefore takes :func:`exclusive_use` on
it first, and a second command pointed at the same place is refused at once, in one line naming
the first one's pid and command.

All locks are the kernel's ``flock`` (non-blocking), which the kernel releases when the holder's
process ends, however it ends (kill -9, power loss of a container): what a killed run leaves
never blocks the rerun. Whether a path is held is asked of the lock itself, never decided from a
recorded pid alone: a pid that a killed run wrote down may belong to an unrelated process today.

Where the locks are. A path P is locked by up to two objects, both on P's own filesystem:

* its NAME: the lock file ``.NAME.lock`` beside P (created if need be, removed on release). It
  exists before P does (a ``--save-dir`` that fairseq creates later, an output file written by
  renaming a temporary over it), it names P's entry in its parent (one lock through every
  spelling of the parent: a symlink, a bind mount of the parent), and it holds the record of
  the holder (``PID COMMAND``) that refusals quote. A lock file inside P would count as content
  a user put there (a data-bin) and could not be created on a full disk mounted at P.
* its IDENTITY, when P is a folder that exists: the folder itself (``flock`` works on an open
  folder). The kernel keys that lock on the folder's inode, so every path to the folder (a bind
  mount ``mount --bind ck ck2``, a docker volume, a folder renamed while a run writes it) meets
  one lock. Nothing is written for it, so a writable folder in a read-only parent, where no
  lock file can sit beside it, is still locked (by identity alone; its refusals then name the
  holder from ``/proc/locks``).

No lock lives in a common place (``$XDG_RUNTIME_DIR``, a per-user folder under /tmp) keyed by
identity instead: such a place is per user and per container (two users sharing a folder, a
training in a container and an evaluation on the host through a volume would not meet), it is
emptied at logout (``/run/user``) or by age (/tmp cleaners) under a run of several days, and it
never holds on another host. The folder's filesystem is shared by everything that writes the
folder. Where that filesystem locks no folders (NFS refuses an exclusive flock on a folder,
which cannot be opened for writing), the name alone locks, as before identities.

A lock file that a holder removes on release may have been opened just before by another
process, which can then acquire the flock of the removed file; so after acquiring, a holder
checks that the path still names the file it locked (same inode) and otherwise tries again.

Nesting. A folder's lock and a lock on anything inside it, at any depth, conflict in both
orders: while P is held, every folder above P is held SHARED by P's holder (a folder's identity
lock, in ``LOCK_SH``), and the name lock of every folder above P is tested. An exclusive lock on
a folder F therefore fails while anything inside F is held (their shared locks on F), and a lock
inside F fails while F is held (its exclusive lock refuses the shared one, or its name lock is
held: F locked by name before it existed). The holder's descendants are exempt from the second
(a benchmark's own fairseq-train writes its run folder inside the benchmark's folder): the pid
that holds F is compared with this process's ancestors. Each side takes its own lock before it
tests the other's (a holder of F: F's name, then F's identity if F exists by then; a holder
inside F: creates F, takes F's identity shared, then tests F's name), and the kernel orders the
flocks, so of two runs that start together at least one sees the other (both may be refused,
never both admitted). The one gap: a folder locked by its name before it existed and given a
second spelling (a bind mount) during the run is not seen through that spelling, unless its
holder locks it again once it exists (fairseq-train does, compat fix 12).

Locks are re-entrant within one process (a command that locks its output dir and then calls a
helper that locks the same dir holds it once, and a process that holds a folder may lock what
lies in it). A test of a lock (:func:`current_holder`, the tests of the folders above a path)
holds it shared for microseconds, so an acquisition that meets a lock retries for a tenth of a
second before it refuses: a status query never makes a starting run fail. Paths are resolved
first, so ``out`` and ``./out/../out`` are one lock.
"""

import atexit
import contextlib
import errno
import fcntl
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Type, Union

PathLike = Union[str, Path]
Key = Tuple[int, int]  # (st_dev, st_ino) of a lock file or a folder


class FolderInUseError(RuntimeError):
    """Another process holds the lock of the folder or file a command was about to write."""


class _Lock:
    """One flock this process holds, shared by the holds that need it (a folder above several
    held paths is held shared once). Never downgraded while in use: a conversion drops the old
    lock before it takes the new one (flock(2)), which would let another run in between."""

    __slots__ = ("fd", "exclusive", "users", "unlink")

    def __init__(self, fd: int, exclusive: bool, unlink: Optional[Path] = None):
        self.fd, self.exclusive, self.users, self.unlink = fd, exclusive, 0, unlink


class _Hold:
    """What one held path takes: the keys of its locks (its name, its identity, the folders
    above it), and how many times this process holds it."""

    __slots__ = ("keys", "depth", "identity")

    def __init__(self):
        self.keys: List[Key] = []
        self.depth = 1
        self.identity: Optional[Key] = None


_LOCKS: Dict[Key, _Lock] = {}
_HELD: Dict[Path, _Hold] = {}  # resolved path -> its hold
_REGISTRY = threading.Lock()

#: how long an acquisition retries a lock that another process holds: a test of a lock holds it
#: for microseconds, a holder for its whole run
_PATIENCE_S = 0.1
_BUSY = (errno.EAGAIN, errno.EACCES)  # flock's "held by another" (EWOULDBLOCK is EAGAIN)


def lock_file(path: PathLike) -> Path:
    """The name lock of PATH: ``.NAME.lock`` in PATH's parent, PATH resolved first."""
    return _name_lock(Path(path).resolve())


def _name_lock(resolved: Path) -> Path:
    return resolved.parent / f".{resolved.name}.lock"


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


def _command() -> str:
    return shlex.join([os.path.basename(sys.argv[0]) or "python", *sys.argv[1:]]) if sys.argv else "python"


def _key(fd: int) -> Key:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_folder(path: Path) -> Optional[int]:
    """PATH opened for its identity lock, or None (not a folder, gone, not readable)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None


def _open_existing(path: Path) -> Optional[int]:
    """An existing lock file opened to test it (never created: a test writes nothing)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None


def _try(fd: int, operation: int, patience: float = _PATIENCE_S) -> Optional[bool]:
    """flock(FD, OPERATION | LOCK_NB), retried for PATIENCE seconds: True when taken, False when
    another process holds a conflicting lock, None when the filesystem locks no such file (NFS:
    no exclusive flock on a file open read-only, such as a folder)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in _BUSY:
                return None
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _is_free(fd: int) -> bool:
    """Whether no process holds FD's file exclusively, by taking it shared for a moment: the test
    is a lock of its own open file, which conflicts even with this process's own exclusive lock
    and whose release releases only itself."""
    taken = _try(fd, fcntl.LOCK_SH, patience=0)
    if taken:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return taken is not False


# ------------------------------------------------------------------------------ who holds a lock
def _lock_owners(fd: int, exclusive: bool) -> List[int]:
    """The pids that ``/proc/locks`` (Linux) names as holding a flock on FD's file, exclusive or
    shared; [] where there is no such list or it keys the file otherwise (btrfs subvolumes)."""
    st = os.fstat(fd)
    wanted = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    mode = "WRITE" if exclusive else "READ"
    owners = []
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != mode:  # "->": a waiter
            continue
        try:
            major, minor, inode = fields[5].split(":")
            pid = int(fields[4])
            if (int(major, 16), int(minor, 16), int(inode)) == wanted and pid > 0:
                owners.append(pid)
        except ValueError:
            continue
    return owners


def _record(lock: Path) -> Tuple[Optional[int], str]:
    """The ``PID COMMAND`` a lock file's holder wrote in it; (None, "") when it says nothing."""
    try:
        text = lock.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None, ""
    pid, _, command = text.partition(" ")
    return (int(pid), command) if pid.isdigit() else (None, "")


def _command_of(pid: int) -> str:
    """PID's command line as a record shows it (the script, not the interpreter that runs it)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", errors="replace").split("\0")[:-1]
    except OSError:
        return ""
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and not argv[1].startswith("-"):
        argv = argv[1:]
    return shlex.join([os.path.basename(argv[0]), *argv[1:]]) if argv else ""


def _exclusive_holder(fd: int, record: Optional[Path]) -> Tuple[Optional[int], str]:
    """The pid and command of the process that holds FD's file exclusively (known to be held).
    RECORD: the lock file whose record may name it, trusted only while that file is itself held
    (a killed run's record names a pid that may be anyone's today)."""
    owners = [pid for pid in _lock_owners(fd, exclusive=True) if pid != os.getpid()]
    pid, command = None, ""
    if record is not None:
        record_fd = _open_existing(record)
        if record_fd is not None:
            try:
                if not _is_free(record_fd):
                    pid, command = _record(record)
            finally:
                os.close(record_fd)
    if owners and pid not in owners:  # the record is not yet rewritten by the holder that took it
        pid, command = owners[0], _command_of(owners[0])
    return pid, command


def _named(pid: Optional[int], command: str) -> str:
    if pid is None:
        return "another process"
    command = " ".join(command.split())[:200]  # a ``python -c`` program's lines: the refusal is one line
    return f"pid {pid}" + (f" ({command})" if command else "")


def _holder_of(resolved: Path) -> Optional[Tuple[Optional[int], str]]:
    """Who holds RESOLVED's lock (its name or its identity), or None when nobody does."""
    if resolved in _HELD:
        return os.getpid(), _command()
    lock = _name_lock(resolved)
    for opener, path in ((_open_existing, lock), (_open_folder, resolved)):
        fd = opener(path)
        if fd is None:
            continue
        try:
            mine = _LOCKS.get(_key(fd))
            if mine is not None:
                if mine.exclusive:
                    return os.getpid(), _command()
                continue  # held shared by this process only: something inside it is held here
            if not _is_free(fd):
                return _exclusive_holder(fd, lock)
        finally:
            os.close(fd)
    return None


def holder(path: PathLike) -> str:
    """Who holds the lock of PATH: ``pid 1234 (fairseq-train ...)``, or ``another process`` when
    that cannot be told (or nobody does)."""
    with _REGISTRY:
        found = _holder_of(Path(path).resolve())
    return _named(*found) if found else "another process"


def current_holder(path: PathLike) -> Optional[int]:
    """The pid of the process holding the lock of PATH, or None (nobody holds it: no lock file,
    or one a killed run left, whatever pid it names). Asked of the lock by holding it shared for
    a moment, so a starting run that meets the test retries rather than fail."""
    with _REGISTRY:
        found = _holder_of(Path(path).resolve())
    return found[0] if found else None


# ------------------------------------------------------------------------------ taking the locks
def _in_use(what: str, shown: PathLike, who: str, where: str = "", inside: bool = False) -> str:
    return (f"{what} {shown} {where}is in use by {who}{', which writes inside it' if inside else ''}: one run "
            "writes a folder at a time; wait for it to finish, or give another path")


def _keep(hold: _Hold, key: Key, lock: Optional[_Lock] = None) -> None:
    """Count KEY's lock (LOCK, when newly taken) as used by HOLD."""
    if lock is not None:
        _LOCKS[key] = lock
    _LOCKS[key].users += 1
    hold.keys.append(key)


def _not_writable(what: str, shown: PathLike, lock: Path, e: OSError) -> str:
    return (f"{what} {shown} is not writable (cannot create {lock}: {e.strerror or e}); "
            "give a folder you can write to")


def _take_name(resolved: Path, hold: _Hold, error: Type[Exception], what: str, shown: PathLike) -> None:
    """Hold RESOLVED's name lock. Where no lock file can be created beside it (a read-only
    parent), an existing folder goes on with its identity lock; anything else is not writable
    (it could not be created there either)."""
    lock = _name_lock(resolved)
    while True:
        try:
            resolved.parent.mkdir(parents=True, exist_ok=True)
            fd, writable = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644), True
        except OSError as e:  # a read-only parent, a parent that is a file, another user's lock file...
            # another user's lock file can be locked unwritten, but a file or a new folder needs
            # its parent writable: refused now, not when it is written
            usable = resolved.is_dir() or os.access(resolved.parent, os.W_OK)
            existing = _open_existing(lock) if usable else None
            if existing is None:
                if resolved.is_dir():
                    return
                raise error(_not_writable(what, shown, lock, e)) from None
            fd, writable = existing, False
        key = _key(fd)
        if key in _LOCKS:  # this process's already, through another spelling of the parent
            os.close(fd)
            _keep(hold, key)
            return
        taken = _try(fd, fcntl.LOCK_EX)
        if taken is None:  # a filesystem that takes no flock on this file
            os.close(fd)
            if resolved.is_dir():
                return
            raise error(f"{what} {shown} cannot be locked: the filesystem of {lock} takes no flock; "
                        "give a path on a local filesystem")
        if not taken:
            who = _exclusive_holder(fd, lock)
            os.close(fd)
            raise error(_in_use(what, shown, _named(*who))) from None
        try:
            st = os.stat(lock, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == key:
                break
        except FileNotFoundError:  # removed by the holder that released it: ours is stale
            pass
        os.close(fd)
    if writable:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {_command()}\n".encode("utf-8", errors="replace"))
    _keep(hold, key, _Lock(fd, True, unlink=lock))


def _take_identity(resolved: Path, hold: _Hold, error: Type[Exception], what: str, shown: PathLike) -> None:
    """Hold the folder RESOLVED exclusively by its identity, if it is a folder (its name lock is
    held already, so no process of the same spelling can be here)."""
    fd = _open_folder(resolved)
    if fd is None:
        return
    key = _key(fd)
    mine = _LOCKS.get(key)
    if mine is not None:
        os.close(fd)
        if not mine.exclusive:  # held shared: this process holds something inside it
            if not _convert_to_exclusive(mine.fd):
                raise error(_in_use(what, shown, _inside_holder(mine.fd), inside=True)) from None
            mine.exclusive = True
        _keep(hold, key)
        hold.identity = key
        return
    taken = _try(fd, fcntl.LOCK_EX)
    if taken is None:  # a filesystem that locks no folders: the name alone locks
        os.close(fd)
        return
    if not taken:
        try:
            if _is_free(fd):  # only shared locks: runs writing inside it
                message = _in_use(what, shown, _inside_holder(fd), inside=True)
            else:  # another spelling of it (a bind mount, a renamed folder) is held
                message = _in_use(what, shown, _named(*_exclusive_holder(fd, None)))
        finally:
            os.close(fd)
        raise error(message)
    _keep(hold, key, _Lock(fd, True))
    hold.identity = key


def _convert_to_exclusive(fd: int) -> bool:
    """Turn this process's shared lock on FD into an exclusive one, retried like :func:`_try`.
    A conversion that fails has dropped the shared lock (flock(2)): it is taken back at once
    after each try, so that the folders inside which this process holds something stay marked
    for all but microseconds."""
    deadline = time.monotonic() + _PATIENCE_S
    while True:
        if _try(fd, fcntl.LOCK_EX, patience=0):
            return True
        _try(fd, fcntl.LOCK_SH, patience=0)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _inside_holder(fd: int) -> str:
    owners = [pid for pid in _lock_owners(fd, exclusive=False) if pid != os.getpid()]
    return _named(owners[0], _command_of(owners[0])) if owners else "another process"


def _mark_folders_above(resolved: Path, hold: _Hold, error: Type[Exception], what: str, shown: PathLike) -> None:
    """Hold every folder above RESOLVED shared, and test their name locks: refused where one is
    held by a process other than this one and its ancestors."""
    ancestors: Optional[set] = None

    def refuse_unless_ancestor(folder: Path, who: Tuple[Optional[int], str]) -> None:
        nonlocal ancestors
        if ancestors is None:
            ancestors = _this_process_and_its_ancestors()
        if who[0] is None or who[0] not in ancestors:
            raise error(_in_use(what, shown, _named(*who), f"is in {folder}, which ")) from None

    for folder in resolved.parents:
        fd = _open_folder(folder)
        if fd is not None:
            key = _key(fd)
            if key in _LOCKS:
                os.close(fd)
                _keep(hold, key)
            else:
                taken = _try(fd, fcntl.LOCK_SH)
                if taken:
                    _keep(hold, key, _Lock(fd, False))
                else:
                    who = _exclusive_holder(fd, _name_lock(folder)) if taken is False else None
                    os.close(fd)
                    if who is not None:
                        refuse_unless_ancestor(folder, who)
        if not folder.name:  # the root has no name to lock
            continue
        lock = _name_lock(folder)
        fd = _open_existing(lock)
        if fd is None:
            continue
        try:
            if _key(fd) in _LOCKS or _try(fd, fcntl.LOCK_SH) is not False:
                continue  # this process's own, free, or a filesystem without flock
            who = _exclusive_holder(fd, lock)
        finally:
            os.close(fd)
        refuse_unless_ancestor(folder, who)


def _let_go(hold: _Hold) -> None:
    for key in reversed(hold.keys):
        lock = _LOCKS[key]
        lock.users -= 1
        if lock.users == 0:
            del _LOCKS[key]
            if lock.unlink is not None:
                with contextlib.suppress(OSError):
                    os.unlink(lock.unlink)  # while still holding it: see the module docstring
            os.close(lock.fd)
    hold.keys.clear()


def acquire(path: PathLike, *, error: Type[Exception] = FolderInUseError, what: str = "") -> Path:
    """Take the lock of PATH for this process (re-entrant); ERROR (one line naming the holder)
    if another process holds it, or something inside it, or a folder above it. WHAT names the
    path in that line (``--dest``). Returns the resolved path, which :func:`release` takes."""
    resolved = Path(path).resolve()
    what = what or "output"
    with _REGISTRY:
        hold = _HELD.get(resolved)
        if hold is not None:
            if hold.identity is None:  # locked by name before it existed: by identity too, if it does now
                _take_identity(resolved, hold, error, what, path)
            hold.depth += 1
            return resolved
        hold = _Hold()
        try:
            _take_name(resolved, hold, error, what, path)
            _take_identity(resolved, hold, error, what, path)
            if not hold.keys:
                raise error(f"{what} {path} cannot be locked: no lock file can be created beside it and its "
                            "filesystem locks no folders; give a folder in a folder you can write to")
            _mark_folders_above(resolved, hold, error, what, path)
        except BaseException:
            _let_go(hold)
            raise
        _HELD[resolved] = hold
    return resolved


def release(resolved: Path) -> None:
    """Undo one :func:`acquire` of RESOLVED; the last one gives the lock up."""
    with _REGISTRY:
        hold = _HELD[resolved]
        hold.depth -= 1
        if hold.depth == 0:
            del _HELD[resolved]
            _let_go(hold)


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

    def let_go() -> None:
        if resolved in _HELD:
            release(resolved)

    atexit.register(let_go)


def is_held_here(path: PathLike) -> bool:
    """Whether this process holds the lock of PATH."""
    return Path(path).resolve() in _HELD
