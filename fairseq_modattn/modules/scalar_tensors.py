"""Python floats as 0-d device tensors, made once per value and device.

A value that changes between training steps (DMA's annealed gamma) enters a compiled graph or
a Triton kernel as a tensor: as a Python float it would be a constant of the graph (one
recompile per value) or, read back from a tensor, a host-device synchronisation per call.
"""

from typing import Dict, Tuple

import torch
from torch import Tensor

#: values kept per process before the cache starts over (gamma takes a new value each update)
CACHE_SIZE = 16
_cache: Dict[Tuple[float, torch.device], Tensor] = {}


def scalar_tensor(value: float, device: torch.device) -> Tensor:
    """``value`` as a 0-d fp32 tensor on ``device`` (the same tensor for the same value, so
    that steps at a constant value copy nothing to the device)."""
    key = (float(value), torch.device(device))
    tensor = _cache.get(key)
    if tensor is None:
        if len(_cache) >= CACHE_SIZE:
            _cache.clear()
        tensor = _cache[key] = torch.tensor(float(value), dtype=torch.float32, device=device)
    return tensor
