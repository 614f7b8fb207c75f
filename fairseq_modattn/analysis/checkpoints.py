"""Finding, averaging and atomically saving fairseq checkpoints.

The paper reports BLEU on "the average of the last 5 epoch checkpoints" (docs/design.md,
"Evaluation definitions"). fairseq's own ``scripts/average_checkpoints.py`` is not part of the
pip package, so this module provides the same selection rules (``checkpointEPOCH.pt`` and
``checkpoint_EPOCH_UPDATES.pt``, the last N, an optional upper bound) and the same arithmetic
(element-wise mean of the model parameters), with three differences:

* files are read with torch's safe loader (``weights_only=True``);
  ``fairseq_modattn.compat.checkpoint_globals`` allow-lists what fairseq writes into checkpoints
  (``argparse.Namespace``, numeric numpy arrays), anything else is refused; a damaged file is
  named with the intact checkpoints beside it;
* parameters are summed in float64 and cast back, and integer buffers must agree across the
  checkpoints instead of being integer-divided;
* the result is written to a temporary file and renamed, so a crash never leaves half a file, and
  a full disk is one line naming the folder and the space needed.
"""

import logging
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..atomic_files import atomic_write
from ..dictionaries import describe, recorded_fingerprint, same_fingerprints
from ..disk_space import tensor_bytes
from . import AnalysisError

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

_EPOCH_NAME = re.compile(r"^checkpoint(\d+)\.pt$")
_UPDATE_NAME = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")


# ------------------------------------------------------------------ selection
def _numbered_checkpoints(directory: Path, by_update: bool) -> Dict[int, Path]:
    """{epoch or update number: path} of the fairseq-named checkpoints in DIRECTORY."""
    pattern, group = (_UPDATE_NAME, 2) if by_update else (_EPOCH_NAME, 1)
    found = {}
    for entry in directory.iterdir():
        match = pattern.match(entry.name)
        if match and entry.is_file():
            found[int(match.group(group))] = entry
    return found


def find_checkpoints(
    directory: PathLike,
    num_epoch_checkpoints: Optional[int] = None,
    num_update_checkpoints: Optional[int] = None,
    upper_bound: Optional[int] = None,
    allow_fewer: bool = False,
) -> List[Path]:
    """The last N epoch (``checkpointEPOCH.pt``) or update (``checkpoint_EPOCH_UPDATES.pt``)
    checkpoints of a fairseq save dir, oldest first.

    Exactly one of ``num_epoch_checkpoints`` / ``num_update_checkpoints`` must be given, as in
    fairseq's ``average_checkpoints.py``. ``upper_bound`` ignores checkpoints whose epoch (or
    update) number is larger, to average e.g. "the 5 epochs up to epoch 40". Finding fewer than
    N is an error (averaging fewer models than the paper's recipe silently changes the
    result) unless ``allow_fewer``, which only warns; finding none is always an error.
    """
    if (num_epoch_checkpoints is None) == (num_update_checkpoints is None):
        raise AnalysisError("give exactly one of num_epoch_checkpoints / num_update_checkpoints")
    by_update = num_update_checkpoints is not None
    wanted = num_update_checkpoints if num_update_checkpoints is not None else num_epoch_checkpoints
    assert wanted is not None  # exactly one of the two is given (checked above)
    kind = "update" if by_update else "epoch"
    if wanted < 1:
        raise AnalysisError(f"the number of {kind} checkpoints must be >= 1, got {wanted}")
    directory = Path(directory)
    if not directory.is_dir():
        raise AnalysisError(f"checkpoint directory {directory} does not exist or is not a directory")

    found = _numbered_checkpoints(directory, by_update)
    if upper_bound is not None:
        found = {n: p for n, p in found.items() if n <= upper_bound}
    chosen = [found[n] for n in sorted(found)[-wanted:]]
    bound = f" with {kind} <= {upper_bound}" if upper_bound is not None else ""
    names = ", ".join(p.name for p in chosen) or "none"
    pattern = "checkpoint_EPOCH_UPDATES.pt" if by_update else "checkpointEPOCH.pt"
    if not chosen:
        raise AnalysisError(f"no {kind} checkpoints ({pattern}){bound} in {directory}")
    if len(chosen) < wanted:
        message = f"need the last {wanted} {kind} checkpoints{bound} in {directory} but found {len(chosen)}: {names}"
        if not allow_fewer:
            raise TooFewCheckpointsError(message)
        logger.warning("%s; averaging those %d", message, len(chosen))
    return chosen


class TooFewCheckpointsError(AnalysisError):
    """``find_checkpoints`` found fewer than the N checkpoints asked for (the caller may name its
    own way out: evaluate's ``--allow-fewer``, say)."""


# ------------------------------------------------------------------ averaging
def load_checkpoint_safely(path: PathLike) -> dict:
    """``torch.load(path, weights_only=True)`` on CPU, every failure turned into an AnalysisError.

    ``fairseq_modattn`` is imported first, which applies ``compat``: it allow-lists what fairseq
    writes into its checkpoints besides tensors, ``argparse.Namespace`` (legacy model args) and
    numeric numpy arrays (the ``--eval-bleu`` metrics), fix 4. Files holding any other class, or
    numpy arrays of objects, are refused, exactly as torch's safe loader refuses them.
    """
    # importing it imports fairseq_modattn, whose compat.apply() installs the allow-list
    from fairseq_modattn.compat.damaged_checkpoints import describe_load_failure  # the one-line load errors

    path = Path(path)
    if not path.is_file():
        raise AnalysisError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        # one line: a damaged file and what to restore it from, a refused class, or the error
        raise AnalysisError(describe_load_failure(path, e)) from e
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise AnalysisError(f"{path} is not a fairseq checkpoint: expected a dict with a 'model' state dict")
    return state


def _layout(model: Dict[str, object]) -> Dict[str, object]:
    """What every other checkpoint must match: (shape, dtype) of floating tensors, the value of
    anything else (non-floating tensors are copied: they must be equal, not just alike)."""
    return {
        key: ((tuple(v.shape), v.dtype) if v.is_floating_point() else v.detach().clone())
        if torch.is_tensor(v) else v
        for key, v in model.items()
    }


def _check_same_layout(reference: Dict[str, object], model: Dict[str, object], path: Path, first: Path):
    """Same keys, floating tensors of the same shape and dtype, equal everything else."""
    missing, extra = sorted(set(reference) - set(model)), sorted(set(model) - set(reference))
    if missing or extra:
        key = (missing or extra)[0]
        where = f"missing from {path}" if missing else f"in {path} but not in {first}"
        raise AnalysisError(f"model key {key!r} is {where}: checkpoints of different models cannot be averaged")
    for key, value in model.items():
        ref = reference[key]
        if isinstance(ref, tuple):  # a floating tensor's (shape, dtype)
            if not torch.is_tensor(value) or (tuple(value.shape), value.dtype) != ref:
                got = (tuple(value.shape), value.dtype) if torch.is_tensor(value) else type(value).__name__
                raise AnalysisError(f"model key {key!r} is {got} in {path} but {ref} in {first}")
        elif torch.is_tensor(ref):
            if not torch.is_tensor(value) or value.shape != ref.shape or not torch.equal(value, ref):
                raise AnalysisError(f"non-floating model tensor {key!r} differs between {first} and {path}; "
                                    "only floating-point parameters are averaged, the rest must be equal")
        elif value != ref:
            raise AnalysisError(f"model entry {key!r} differs between {first} and {path}")


def _check_same_dictionaries(reference: Optional[Tuple[torch.Tensor, Path]], state: dict, path: Path):
    """(fingerprint, file) of the dictionaries the checkpoints up to PATH record, after checking
    that the checkpoint STATE of PATH records those of REFERENCE (the first that recorded any):
    token id i of one model means another word in a model of other dictionaries, and their mean
    is neither. A checkpoint that records none (saved without the plugin) cannot be checked."""
    recorded = recorded_fingerprint(state)
    if recorded is None:
        return reference
    if reference is None:
        return recorded, path
    if not same_fingerprints(recorded, reference[0]):
        raise AnalysisError(f"{path} was trained with other dictionaries than {reference[1]} (source "
                            f"{describe(recorded[0])}, target {describe(recorded[1])} against source "
                            f"{describe(reference[0][0])}, target {describe(reference[0][1])}): checkpoints of "
                            "different dictionaries cannot be averaged")
    return reference


def average_checkpoints(paths: Sequence[PathLike]) -> dict:
    """The last checkpoint's dict with its ``model`` replaced by the element-wise mean of all
    the checkpoints' floating-point tensors (what fairseq's ``average_checkpoints.py`` writes).

    The mean is accumulated in float64 and cast back to each tensor's dtype, so averaging fp16
    or many fp32 models loses no precision. Non-floating tensors (step counters, index buffers)
    must be identical in every checkpoint and are kept. Only one checkpoint and the running sum
    are held in memory at a time.
    """
    files = [Path(p) for p in paths]
    if not files:
        raise AnalysisError("no checkpoints to average")
    first = files[0]
    layout: Dict[str, object] = {}
    sums: Dict[str, torch.Tensor] = {}
    state: dict = {}
    dictionaries: Optional[Tuple[torch.Tensor, Path]] = None
    for index, path in enumerate(files):
        state = load_checkpoint_safely(path)
        model = state["model"]
        dictionaries = _check_same_dictionaries(dictionaries, state, path)
        if index == 0:
            layout = _layout(model)
        else:
            _check_same_layout(layout, model, path, first)
        for key, value in model.items():
            if torch.is_tensor(value) and value.is_floating_point():
                if key in sums:
                    sums[key].add_(value.to(torch.float64))
                else:
                    sums[key] = value.to(torch.float64, copy=True)
        del model
    averaged = {}
    for key, value in state["model"].items():
        if key in sums:
            averaged[key] = sums.pop(key).div_(len(files)).to(value.dtype)
        else:
            averaged[key] = value
    state["model"] = averaged
    return state


# ------------------------------------------------------------------ saving
def save_checkpoint_atomically(state: dict, path: PathLike) -> Path:
    """``torch.save`` STATE to PATH atomically (``atomic_files.atomic_write``), so a later
    ``fairseq-generate`` never reads a half-written checkpoint. A full disk raises
    ``disk_space.DiskFullError``, whose line names PATH's folder, the bytes STATE needs and the
    bytes free there."""
    def write(tmp_name):
        with open(tmp_name, "wb") as f:  # a Python file object: torch's error then carries the ENOSPC
            torch.save(state, f)

    return atomic_write(Path(path), write, expected_size=tensor_bytes(state))
