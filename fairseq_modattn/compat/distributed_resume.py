"""Fix 7: a distributed run can be resumed under torch >= 2.6.

fairseq 0.12 resumes a distributed run by loading the checkpoint on rank 0 and sending it to the
other ranks (``Trainer.load_checkpoint`` -> ``distributed_utils.broadcast_object`` ->
``_broadcast_object_slow``), which pickles the state with ``torch.save`` and unpickles it with a
bare ``torch.load``. Under torch >= 2.6 that load is ``weights_only=True`` and refuses the
omegaconf ``DictConfig`` in the state, so every rank but 0 crashes and no multi-GPU or
multi-node run can be resumed. The bytes are not a file: rank 0 of the same job produced them a
moment earlier from a checkpoint it has already loaded with the safe loader (fix 4), so the
receiving side unpickles them with ``weights_only=False`` (``broadcast_pickled_object``).

When it can go: ``apply`` replaces ``_broadcast_object_slow`` only where its source calls
``torch.load(`` without saying ``weights_only``; once fairseq passes it, the fix is a no-op.
"""

import io

import torch
from fairseq.distributed import utils as distributed_utils

from ._fairseq_source import source_of


def broadcast_pickled_object(obj, src_rank, group, dist_device):
    """fairseq's ``_broadcast_object_slow``: rank ``src_rank`` pickles ``obj`` and broadcasts
    length and bytes; every other rank unpickles them without the file loader's
    ``weights_only`` restriction, as they come from this job's own rank."""
    if distributed_utils.get_rank(group) == src_rank:
        pickled = io.BytesIO()
        torch.save(obj, pickled)
        payload = torch.ByteTensor(pickled.getbuffer()).to(dist_device)
        distributed_utils.broadcast(torch.LongTensor([payload.numel()]).to(dist_device), src=src_rank, group=group)
        distributed_utils.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.LongTensor([0]).to(dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    payload = torch.ByteTensor(int(length.item())).to(dist_device)
    distributed_utils.broadcast(payload, src=src_rank, group=group)
    return torch.load(io.BytesIO(payload.cpu().numpy()), map_location="cpu", weights_only=False)


def _unpickles_with_default_loader(broadcast_slow) -> bool:
    source = source_of(broadcast_slow)
    return "torch.load(" in source and "weights_only" not in source


_FAIRSEQ_BROADCAST_OBJECT_SLOW = getattr(distributed_utils, "_broadcast_object_slow", None)


def apply() -> None:
    """broadcast_object and broadcast_tensors look it up as a module global at call time."""
    if _FAIRSEQ_BROADCAST_OBJECT_SLOW is not None and \
            getattr(distributed_utils, "_broadcast_object_slow", None) is _FAIRSEQ_BROADCAST_OBJECT_SLOW and \
            _unpickles_with_default_loader(_FAIRSEQ_BROADCAST_OBJECT_SLOW):
        distributed_utils._broadcast_object_slow = broadcast_pickled_object
