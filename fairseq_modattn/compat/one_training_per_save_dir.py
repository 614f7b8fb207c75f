"""Fix 12: a second ``fairseq-train`` into a ``--save-dir`` in use stops at once.

fairseq 0.12 ``fairseq_cli/train.py`` checks ``--save-dir`` with
``checkpoint_utils.verify_checkpoint_directory`` (it creates the folder and writes and removes a
file called ``dummy``) and never asks whether another training writes there: two
``fairseq-train`` runs given one ``--save-dir`` both ran to the end and exited 0, and
``checkpoint_last.pt`` and half the interval checkpoints were one model, the rest the other
(resuming either then failed or continued the wrong model). ``verify_checkpoint_directory_locked``
takes the package's folder lock (``folder_lock``: flocks on ``.NAME.lock`` beside the folder and
on the folder itself, which every path to it meets, a bind mount included; held until the
process exits and released by the kernel however it exits) before fairseq's check; a second
training into the folder, or into a folder around it or inside it, stops at once with one line
naming the first one's pid and command (``FolderInUseError``, printed as that line by fix 15's
``sys.excepthook``). A save dir that did not exist is locked by its name first and, once
fairseq's check has created it, by its identity too. fairseq calls the check on the master rank
only, so the ranks of one distributed job do not refuse each other.

When it can go: ``apply`` wraps the check only where its source writes ``dummy`` and takes no
lock (no ``flock`` / ``folder_lock``); once fairseq locks its save dir itself, the fix is a no-op.
"""

from fairseq import checkpoint_utils

from .. import folder_lock
from ._fairseq_source import source_of


def verify_checkpoint_directory_locked(save_dir: str) -> None:
    """fairseq's ``checkpoint_utils.verify_checkpoint_directory``, after taking the lock of
    SAVE_DIR for the rest of this process: FolderInUseError while another process holds it."""
    folder_lock.hold_until_exit(save_dir, what="--save-dir")
    _FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY(save_dir)
    # fairseq has just created a new save dir: held by its identity from now on (a bind mount
    # of it made while this training runs meets the lock)
    folder_lock.hold_until_exit(save_dir, what="--save-dir")


def _verifies_without_lock(verify) -> bool:
    source = source_of(verify)
    return "dummy" in source and "flock" not in source and "folder_lock" not in source


_FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY = checkpoint_utils.verify_checkpoint_directory


def apply() -> None:
    """fairseq_cli/train.py calls it as ``checkpoint_utils.verify_checkpoint_directory`` at call
    time; --user-dir imports the plugin while the arguments are parsed, before train's ``main``
    runs."""
    if checkpoint_utils.verify_checkpoint_directory is _FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY and \
            getattr(_FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY, "__module__", "") != __name__ and \
            _verifies_without_lock(_FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY):
        checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory_locked
