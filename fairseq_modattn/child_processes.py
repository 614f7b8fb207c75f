"""The fairseq commands the package runs as child processes (fairseq-preprocess, fairseq-train,
fairseq-generate), started so that they never outlive the command that started them.

Why: a ``subprocess`` child outlives its parent. A ``quickstart``, ``ablate`` or benchmark
stopped by a job scheduler (SIGTERM at the time limit) or killed with SIGKILL left its
fairseq-train running for hours, still writing checkpoints into the run's folder, where the
rerun that is meant to continue the run starts a second fairseq-train on the same files.

    die_with_parent()     a ``preexec_fn``: the kernel sends the child SIGTERM when its parent dies
    start(cmd, **popen)   ``subprocess.Popen`` with that, the child recorded as running
    running(cmd, **popen) ``start`` as a context, stopping the child if the block raises
    stop_all()            SIGTERM to every recorded child still running (then SIGKILL)
    stopping_on_sigterm() the calling command's SIGTERM becomes KeyboardInterrupt, after
                          stop_all(), so it ends as Ctrl-C does: "interrupted; rerun to continue"

Linux only for ``die_with_parent`` (``prctl(PR_SET_PDEATHSIG)``); elsewhere it is a no-op and
the parent still stops its children on any exception. The kernel signals the child when the
*thread* that started it ends, so a child must be waited for by the thread that started it, as
every caller here does.

A process forked while ``stopping_on_sigterm``'s handler is installed (a ``multiprocessing``
worker: the Moses tokeniser's pool in ``prepare``) starts with SIGTERM at its default again
(``_forked_child``): that handler is the command's, not the worker's. A worker that kept it
turned the SIGTERM of ``Pool.terminate()`` into "stop the parent's children, then
KeyboardInterrupt", which printed ``Process ForkPoolWorker-3: Traceback ... KeyboardInterrupt``
whenever the pool's terminate reached a worker still exiting (a race, seen on a busy machine),
and made a worker stop fairseq processes that were its parent's.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from typing import Sequence, Set

_PR_SET_PDEATHSIG = 1
_RUNNING: Set[subprocess.Popen] = set()
_LOCK = threading.Lock()
#: set by stop_all: no child starts after it (a pool's queued runs would start new ones)
_STOPPING = threading.Event()


def die_with_parent():
    """A ``preexec_fn`` making the child get SIGTERM when the thread that started it dies,
    whatever kills it (SIGKILL included: no ``finally`` of the parent runs then). libc is
    loaded in the parent (no dlopen between fork and exec); a child whose parent died before
    prctl took effect exits at once."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    parent = os.getpid()

    def preexec():
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def start(cmd: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen_kwargs)`` that dies with this process and is stopped by
    ``stop_all``; call ``finished(proc)`` once it has been waited for. Raises KeyboardInterrupt
    once ``stop_all`` has run (the command is being interrupted)."""
    with _LOCK:
        if _STOPPING.is_set():
            raise KeyboardInterrupt
        proc = subprocess.Popen(list(cmd), preexec_fn=die_with_parent(), **popen_kwargs)
        _RUNNING.add(proc)
    return proc


def finished(proc: subprocess.Popen) -> None:
    with _LOCK:
        _RUNNING.discard(proc)


@contextlib.contextmanager
def running(cmd: Sequence[str], **popen_kwargs):
    """``start`` as a context: the child is stopped if the block raises (an interruption, an
    error while reading its output) and forgotten when the block ends."""
    proc = start(cmd, **popen_kwargs)
    try:
        yield proc
    except BaseException:
        _stop(proc)
        raise
    finally:
        finished(proc)


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_all() -> None:
    """Stop every running child (SIGTERM, SIGKILL after 10 s) and start no new ones."""
    _STOPPING.set()
    with _LOCK:
        procs = list(_RUNNING)
    for proc in procs:
        _stop(proc)


def _stop_and_interrupt(signum, frame):
    """``stopping_on_sigterm``'s SIGTERM handler (one module-level function, so that the fork
    hooks below can tell it is the one installed)."""
    stop_all()
    raise KeyboardInterrupt


@contextlib.contextmanager
def stopping_on_sigterm():
    """While the block runs in the main thread, SIGTERM stops the children and raises
    KeyboardInterrupt there, so the command ends as on Ctrl-C; the previous handler comes back
    afterwards. Elsewhere (a thread, where Python cannot install handlers) it does nothing.
    Processes forked meanwhile do not inherit the handler (module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    # a new command in this process may start children again; the flag is not cleared on the way
    # out, where the interrupted command's pool threads may still be picking up queued runs
    _STOPPING.clear()
    signal.signal(signal.SIGTERM, _stop_and_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Forked children and the handler. Why fork hooks and not a ``Pool(initializer=...)`` that
# resets SIGTERM: they cover every fork of the process (the Moses pool, a torch DataLoader's
# workers, ``subprocess`` with a ``preexec_fn``) without each call site having to know, and they
# leave no window. An initializer runs only once the worker is up, so a SIGTERM
# before it still meets the inherited handler; and CPython clears the signals pending for its
# handlers in a child's after-fork bookkeeping, so a SIGTERM that arrived between fork() and that
# point would be lost, leaving ``Pool.terminate()`` waiting for a worker that never ends. Here the
# forking thread blocks SIGTERM across fork(), and the child sets SIGTERM to its default before
# it unblocks it: a SIGTERM sent at any moment is held by the kernel, then kills the child. The
# hooks cannot be unregistered, so they are registered once and act only while
# ``_stop_and_interrupt`` is the installed handler: other forks are left exactly as they were.
_FORK = threading.local()  # the forking thread's signal mask before fork, while SIGTERM is held


def _handler_installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is _stop_and_interrupt


def _before_fork() -> None:
    _FORK.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if _handler_installed() else None


def _restore_mask() -> None:
    mask, _FORK.mask = getattr(_FORK, "mask", None), None
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _forked_child() -> None:
    if _handler_installed():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # the parent's children are not this process's to stop
        _RUNNING.clear()
    _restore_mask()


if hasattr(os, "register_at_fork") and hasattr(signal, "pthread_sigmask"):
    os.register_at_fork(before=_before_fork, after_in_parent=_restore_mask, after_in_child=_forked_child)
