"""Fix 9: a damaged checkpoint file is one line naming what to restore it from.

fairseq 0.12 ``checkpoint_utils.load_checkpoint_to_cpu`` hands the file to ``torch.load``
unchecked, so a truncated ``checkpoint_last.pt`` (fairseq writes it with a non-atomic
``PathManager.copy``; a run killed or out of disk during that copy leaves half a file) ends
``fairseq-train`` (resume), ``fairseq-generate`` and ``fairseq-interactive`` with a ~125-line
traceback about a "central directory". When the load fails and the file is not a complete torch
archive, ``load_checkpoint_to_cpu_reporting_damage`` raises ``DamagedCheckpointError``, whose
one line names the file and the newest intact ``checkpoint_E_U.pt`` / ``checkpointE.pt`` /
``checkpoint_best.pt`` of its folder to restore from; an uncaught one is printed as that line
alone (fix 15's ``sys.excepthook``). The package's own loaders (``analysis.checkpoints``,
``analysis.loading``) report the same line through ``describe_load_failure``, which also words
the refusals of fix 4's allow-list.

When it can go: ``apply`` wraps ``load_checkpoint_to_cpu`` only where its source calls
``torch.load(`` (and is not this wrapper); the fix stays useful as long as fairseq's loader lets
torch's own error about a cut-short zip archive through.
"""

import os
import pickle
import re
import zipfile
from pathlib import Path
from typing import List, Optional

from fairseq import checkpoint_utils

from ._fairseq_source import source_of


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file that is not a complete torch archive; the message is one line naming
    the file and the intact checkpoints beside it to restore from."""


#: the damage of a file that never was a checkpoint (a text file given as --path, say)
NOT_A_CHECKPOINT = "not a torch checkpoint (neither a zip archive nor a pickle)"

_UPDATE_CHECKPOINT = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")
_EPOCH_CHECKPOINT = re.compile(r"^checkpoint(\d+)\.pt$")


def checkpoint_damage(path) -> Optional[str]:
    """Why the file PATH is not a complete checkpoint ("truncated ..."), or None when it looks
    whole. torch >= 1.6 writes checkpoints as zip archives: every member's CRC is checked (this
    reads the file, so it runs only after a load has failed). A legacy (non-zip) file is only
    judged damaged when empty."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None  # a missing or unreadable file is not "damaged": keep the loader's own error
    if size == 0:
        return "empty file"
    if head[:2] != b"PK":
        return None if head[:1] == b"\x80" else NOT_A_CHECKPOINT
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        return f"truncated or corrupt: {size} bytes without a readable zip directory, {e}"
    if bad is not None:
        return f"corrupt data in its member {bad}"
    return None


def _looks_complete(path: Path) -> bool:
    """A quick check for the restore candidates: a zip archive whose directory can be read and
    whose members all lie within the file (a copy or write cut short fails it)."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            return bool(archive.infolist()) and all(
                info.header_offset + info.compress_size <= size for info in archive.infolist())
    except (zipfile.BadZipFile, EOFError, OSError, ValueError):
        return False


def restore_candidates(damaged) -> List[Path]:
    """The complete fairseq checkpoints in DAMAGED's folder, newest first: ``checkpoint_E_U.pt``
    and ``checkpointE.pt`` by (epoch, updates) (an epoch's own checkpoint after its update
    checkpoints), then ``checkpoint_best.pt`` and ``checkpoint_last.pt``; DAMAGED excluded."""
    damaged = Path(damaged)
    numbered, named = [], []
    try:
        entries = list(damaged.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name == damaged.name:
            continue
        update, epoch = _UPDATE_CHECKPOINT.match(entry.name), _EPOCH_CHECKPOINT.match(entry.name)
        if update:
            numbered.append(((int(update.group(1)), int(update.group(2))), entry))
        elif epoch:
            numbered.append(((int(epoch.group(1)), float("inf")), entry))
        elif entry.name in ("checkpoint_best.pt", "checkpoint_last.pt"):
            named.append(entry)
    ordered = [p for _, p in sorted(numbered, key=lambda item: item[0], reverse=True)] + sorted(named)
    return [p for p in ordered if p.is_file() and _looks_complete(p)]


def damaged_checkpoint_message(path, damage: str) -> str:
    """One line: which file is damaged and which checkpoints of its folder to restore from."""
    path = Path(path)
    if damage == NOT_A_CHECKPOINT:
        # maybe the user's own file given by mistake: no advice to delete or overwrite it
        return f"cannot load checkpoint {path}: it is {damage}; pass a .pt file that fairseq-train saved"
    intact = restore_candidates(path)
    message = f"cannot load checkpoint {path}: the file is damaged ({damage})"
    if not intact:
        if not _fairseq_checkpoint_name(path.name):
            return message + "; pass an intact .pt file that fairseq-train saved"
        return message + (f"; no intact checkpoint in {path.parent} to restore from: delete it to start "
                          "again without it")
    others = ", ".join(p.name for p in intact[1:4]) + (f" and {len(intact) - 4} more" if len(intact) > 4 else "")
    if _UPDATE_CHECKPOINT.match(path.name) or _EPOCH_CHECKPOINT.match(path.name):
        message += f"; intact checkpoints in {path.parent}: {intact[0].name}"
        return message + (f", {others}" if others else "")
    message += f"; restore it from the newest intact one: cp {intact[0]} {path}"
    return message + (f" (also intact there: {others})" if others else "")


def _fairseq_checkpoint_name(name: str) -> bool:
    """Whether NAME is one fairseq-train gives its checkpoints (only those are advised deleted)."""
    return bool(_UPDATE_CHECKPOINT.match(name) or _EPOCH_CHECKPOINT.match(name)
                or name in ("checkpoint_best.pt", "checkpoint_last.pt"))


def load_checkpoint_to_cpu_reporting_damage(path, *args, **kwargs):
    """fairseq's ``checkpoint_utils.load_checkpoint_to_cpu``: a file that is not a complete
    checkpoint raises DamagedCheckpointError with a one-line message instead."""
    try:
        return _FAIRSEQ_LOAD_CHECKPOINT_TO_CPU(path, *args, **kwargs)
    except Exception as e:
        damage = checkpoint_damage(path) if isinstance(path, (str, os.PathLike)) else None
        if damage is None:
            raise
        raise DamagedCheckpointError(damaged_checkpoint_message(path, damage)) from e


def _loads_without_checking_file(load_checkpoint_to_cpu) -> bool:
    source = source_of(load_checkpoint_to_cpu)
    return "torch.load(" in source and "DamagedCheckpointError" not in source


def describe_load_failure(path, error: BaseException) -> str:
    """One line saying why loading the checkpoint PATH with torch's safe loader failed: a damaged
    file (with what to restore from), a class refused by fix 4's allow-list, else the first line
    of the error."""
    damage = checkpoint_damage(path)
    if damage is not None:
        return damaged_checkpoint_message(path, damage)
    text = str(error)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return (f"cannot load checkpoint {path} with torch.load(weights_only=True): it holds {refused.group(1)}, "
                "which is not among what fairseq writes into checkpoints (argparse.Namespace, numeric numpy "
                "arrays); refused as unsafe")
    guard = re.search(r"^.*refused.*allowed.*$", text, re.MULTILINE)  # the guards of fix 4
    if isinstance(error, pickle.UnpicklingError) and guard:
        return f"cannot load checkpoint {path} with torch.load(weights_only=True): {guard.group(0).strip()}"
    first_line = (text.strip().splitlines() or [""])[0][:300]
    return f"cannot load checkpoint {path} with torch.load(weights_only=True): {type(error).__name__}: {first_line}"


_FAIRSEQ_LOAD_CHECKPOINT_TO_CPU = checkpoint_utils.load_checkpoint_to_cpu


def apply() -> None:
    """Trainer.load_checkpoint calls checkpoint_utils.load_checkpoint_to_cpu, and
    load_model_ensemble_and_task (fairseq-generate, -interactive, our analysis loader) calls it as
    a module global of checkpoint_utils: both look it up at call time."""
    if checkpoint_utils.load_checkpoint_to_cpu is _FAIRSEQ_LOAD_CHECKPOINT_TO_CPU and \
            getattr(_FAIRSEQ_LOAD_CHECKPOINT_TO_CPU, "__module__", "") != __name__ and \
            _loads_without_checking_file(_FAIRSEQ_LOAD_CHECKPOINT_TO_CPU):
        checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu_reporting_damage
