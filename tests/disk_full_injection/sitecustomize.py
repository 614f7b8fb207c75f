"""TEST INJECTION, not a real disk: makes one folder behave as a filesystem of a fixed size.

tests/test_faults_disk_full.py runs the real commands with this folder first on PYTHONPATH, so
Python imports this file at start-up in those child processes only (never in pytest's own). With
``FAIRSEQ_MODATTN_TEST_FULL_DIR=DIR`` and ``FAIRSEQ_MODATTN_TEST_DISK_BYTES=N`` in the
environment, DIR holds at most N bytes, counted as the sizes of the files under it:

* a file opened for writing under DIR with Python's ``open`` (``builtins.open``, ``io.open``,
  ``pathlib``) writes until DIR holds N bytes, writes the part that fits, and then raises
  ``OSError(ENOSPC)``, as a full filesystem does (a partial write, then "No space left on device");
* ``shutil.disk_usage`` reports N as DIR's size and what is left as its free space;
* ``shutil`` copies go through ``write`` (``shutil._USE_CP_SENDFILE = False``), since the
  kernel's ``sendfile`` would bypass this file.

Deleting a file gives its space back, since the sizes are counted at each write. Writes that do
not go through Python's file objects (``os.write`` on a raw descriptor, torch's C++ writer given a
file name) are not limited: the tests mount a real small tmpfs for those where they can.
"""

import builtins
import errno
import io
import os
import shutil

_FOLDER = os.environ.get("FAIRSEQ_MODATTN_TEST_FULL_DIR")
_CAPACITY = int(os.environ.get("FAIRSEQ_MODATTN_TEST_DISK_BYTES", "0"))


def _inside(path) -> bool:
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep)


def _used() -> int:
    total = 0
    for folder, _, files in os.walk(_ROOT):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # removed while we counted
    return total


class _FileOfFullDisk(io.FileIO):
    """A raw file under the limited folder: ``write`` stops where the folder is full."""

    def write(self, data):
        view = memoryview(data).cast("B")
        room = _CAPACITY - _used()
        if len(view) > room:
            if room > 0:
                super().write(view[:room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(view)


def _open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None):
    writing = any(flag in mode for flag in "wax+")
    if not writing or isinstance(file, int) or not _inside(file):
        return _REAL_OPEN(file, mode, buffering, encoding, errors, newline, closefd, opener)
    raw = _FileOfFullDisk(file, mode.replace("t", ""), closefd, opener)
    if buffering == 0 and "b" in mode:
        return raw
    size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
    buffered = io.BufferedRandom(raw, size) if "+" in mode else io.BufferedWriter(raw, size)
    if "b" in mode:
        return buffered
    return io.TextIOWrapper(buffered, encoding, errors, newline, line_buffering=buffering == 1)


def _disk_usage(path):
    if _inside(path):
        used = _used()
        return shutil._ntuple_diskusage(_CAPACITY, used, max(_CAPACITY - used, 0))
    return _REAL_DISK_USAGE(path)


if _FOLDER:
    _ROOT = os.path.realpath(_FOLDER)
    _REAL_OPEN, _REAL_DISK_USAGE = builtins.open, shutil.disk_usage
    builtins.open = io.open = _open
    shutil.disk_usage = _disk_usage
    shutil._USE_CP_SENDFILE = False
