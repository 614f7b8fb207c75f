"""Fix 13: fairseq's checkpoints are written whole or not at all, and a full disk is one line.

fairseq 0.12 ``checkpoint_utils.save_checkpoint`` writes its first checkpoint (say
``checkpoint_1_4.pt``) with ``torch_persistent_save`` and then copies it over
``checkpoint_best.pt`` and ``checkpoint_last.pt`` with ``PathManager.copy``, which without iopath
is ``shutil.copyfile`` (with iopath a copy just as direct): the destination itself is rewritten,
so a full disk or a kill during the copy leaves a fragment where the last complete checkpoint was
(a 10 MB ``--save-dir`` kept 3.6 MB of a 6.9 MB ``checkpoint_last.pt``; the rerun then stopped at
fix 9's "damaged checkpoint" line). ``torch_persistent_save`` writes ``NAME.tmp`` and renames it,
but a failed write leaves ``NAME.tmp`` behind (5.7 MB on a 12 MB disk) and is retried twice into
the same, half-written file object, 2.5 s apart, before its traceback is logged; torch's zip
writer reports ENOSPC as ``RuntimeError: [enforce fail at inline_container.cc:672] ...
unexpected pos``, which never says the disk is full.

For local paths (iopath URLs keep fairseq's code): ``checkpoint_utils.PathManager`` becomes a
subclass whose ``copy`` writes a temporary ``.NAME.tmp-PID`` beside the destination, fsyncs it
and renames it (``atomic_files.atomic_copy``), and ``torch_persistent_save`` writes the same way
(each retry into a fresh temporary); both first remove the temporaries a killed save left
(``.NAME.tmp-*``, fairseq's ``NAME.tmp``), and a failed write removes its own. A write that finds
the disk full (``disk_space.is_disk_full``: ENOSPC in the error's chain, or torch's RuntimeError
while the filesystem has less room than the write still needed) raises ``DiskFullError`` at once:
one line naming the folder, the bytes the file needs (the checkpoint's tensor bytes, or the
copied file's size), the bytes free, and that ``checkpoint_last.pt`` is intact and a rerun
resumes from it (on the first save, which complete checkpoint to copy there); an uncaught one is
printed as that line alone (fix 15's ``sys.excepthook``). The price: replacing
``checkpoint_last.pt`` needs room for the old and the new file side by side for a moment, which
the in-place copy did not.

When it can go: each part is applied only where the installed ``save_checkpoint`` copies with
``PathManager.copy`` (``_copies_in_place``) / ``torch_persistent_save`` writes a ``.tmp`` it never
removes (``_leaves_temporary_on_failure``); once fairseq saves atomically, both are no-ops.
"""

import logging
import os
import time
from pathlib import Path

import torch
from fairseq import checkpoint_utils, file_io

from ..atomic_files import atomic_copy, atomic_write, remove_stale_temporaries
from ..disk_space import DiskFullError, tensor_bytes
from ._fairseq_source import source_of
from .damaged_checkpoints import restore_candidates

logger = logging.getLogger(__name__)


def _is_local_file_name(path) -> bool:
    """Whether PATH names a file of the local filesystem (not an iopath URL such as s3://, which
    fairseq's own code keeps handling)."""
    return isinstance(path, (str, os.PathLike)) and not file_io.PathManager.path_requires_pathmanager(str(path))


def _remove_checkpoint_temporaries(path):
    """Before a checkpoint is written: the temporaries a killed save left beside it (ours,
    ``.NAME.tmp-PID``, and fairseq's own ``NAME.tmp``), which also hold disk space."""
    remove_stale_temporaries(path)
    fairseq_temporary = Path(f"{path}.tmp")
    if fairseq_temporary.is_file():
        fairseq_temporary.unlink()


def checkpoint_disk_full_message(error: DiskFullError, path) -> str:
    """DiskFullError's line about the checkpoint PATH, and what state its folder is left in."""
    last = Path(path).parent / "checkpoint_last.pt"
    if last.is_file() and last != Path(path):
        state = f"{last} is intact; rerunning the same command once there is room resumes from it"
    elif last.is_file():
        state = f"{last} is intact (the previous one); rerunning the same command once there is room resumes from it"
    else:  # the first save of the run: what fix 9 would offer to restore from, if anything
        intact = [c for c in restore_candidates(last) if c.name != "checkpoint_best.pt"]
        state = "no checkpoint_last.pt was saved yet: a rerun starts from the beginning"
        if intact:
            state += f", or resumes from the complete {intact[0].name} after: cp {intact[0]} {last}"
    return f"{error}; {state}"


def copy_checkpoint_atomically(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
    """fairseq's ``PathManager.copy`` as ``checkpoint_utils.save_checkpoint`` uses it: a local
    copy is written aside and renamed, so ``checkpoint_last.pt`` / ``checkpoint_best.pt`` are the
    old file or the whole new one; a full disk raises a one-line DiskFullError."""
    if not (_is_local_file_name(src_path) and _is_local_file_name(dst_path)):
        return _FAIRSEQ_PATH_MANAGER.copy(src_path, dst_path, overwrite=overwrite)
    if not overwrite and os.path.exists(dst_path):
        return False  # iopath's answer; fairseq's save_checkpoint always overwrites
    _remove_checkpoint_temporaries(dst_path)
    try:
        atomic_copy(src_path, dst_path, durable=True)
    except DiskFullError as e:
        raise DiskFullError(checkpoint_disk_full_message(e, dst_path)) from e
    return True


class AtomicCopyPathManager(file_io.PathManager):
    """fairseq's ``PathManager`` for ``checkpoint_utils`` alone, with an atomic ``copy``."""

    copy = staticmethod(copy_checkpoint_atomically)


def torch_persistent_save_atomically(obj, filename, async_write: bool = False):
    """fairseq's ``checkpoint_utils.torch_persistent_save``: the checkpoint is written to a
    temporary beside FILENAME, fsync'ed and renamed, and a failed write removes its temporary.
    A full disk raises DiskFullError at once (one line: the folder, the bytes the checkpoint needs,
    the bytes free); any other failure is retried twice 2.5 s apart, as fairseq does, each time
    into a fresh temporary (fairseq retried into the same, half-written file object)."""
    if async_write or not _is_local_file_name(filename):
        return _FAIRSEQ_TORCH_PERSISTENT_SAVE(obj, filename, async_write=async_write)

    def write(tmp_name):
        with open(tmp_name, "wb") as f:  # a file object: its ENOSPC OSError reaches the error's chain
            torch.save(obj, f)

    _remove_checkpoint_temporaries(filename)
    needed = tensor_bytes(obj)
    for attempt in range(3):
        try:
            atomic_write(filename, write, expected_size=needed, durable=True)
            return None
        except DiskFullError as e:
            raise DiskFullError(checkpoint_disk_full_message(e, filename)) from e
        except Exception:
            if attempt == 2:
                raise
            logger.warning("saving checkpoint %s failed, retrying in 2.5 s", filename, exc_info=True)
            time.sleep(2.5)


def _copies_in_place(save_checkpoint, path_manager) -> bool:
    """fairseq 0.12 ``save_checkpoint`` copies its first checkpoint with ``PathManager.copy``,
    whose local copy (``shutil.copyfile`` or iopath's) writes into the destination itself."""
    return "PathManager.copy(" in source_of(save_checkpoint) and \
        getattr(path_manager.copy, "__module__", "") != __name__


def _leaves_temporary_on_failure(torch_persistent_save) -> bool:
    """fairseq 0.12 writes ``FILENAME.tmp`` and renames it, with nothing that removes it when the
    write fails."""
    source = source_of(torch_persistent_save)
    return '".tmp"' in source and "finally" not in source and "DiskFullError" not in source


_FAIRSEQ_PATH_MANAGER = checkpoint_utils.PathManager
_FAIRSEQ_TORCH_PERSISTENT_SAVE = checkpoint_utils.torch_persistent_save


def apply() -> None:
    """save_checkpoint looks PathManager up as a module global of checkpoint_utils, and
    Trainer.save_checkpoint calls checkpoint_utils.torch_persistent_save, both at call time; only
    checkpoint_utils' name is replaced, fairseq.file_io.PathManager stays as it is for everything
    else."""
    if checkpoint_utils.PathManager is _FAIRSEQ_PATH_MANAGER and \
            getattr(_FAIRSEQ_PATH_MANAGER, "copy", None) is not None and \
            _copies_in_place(checkpoint_utils.save_checkpoint, _FAIRSEQ_PATH_MANAGER):
        checkpoint_utils.PathManager = AtomicCopyPathManager
    if checkpoint_utils.torch_persistent_save is _FAIRSEQ_TORCH_PERSISTENT_SAVE and \
            getattr(_FAIRSEQ_TORCH_PERSISTENT_SAVE, "__module__", "") != __name__ and \
            _leaves_temporary_on_failure(_FAIRSEQ_TORCH_PERSISTENT_SAVE):
        checkpoint_utils.torch_persistent_save = torch_persistent_save_atomically
