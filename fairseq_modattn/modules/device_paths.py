"""Which device's code path a computation takes, and a switch to take another device's path.

A few computations here have one form for the CPU and another for GPUs, chosen by the
device of their tensors: DMA's attention (the fused CPU kernel or two SDPA calls,
``DisentangledMaskAttention.uses_fused_kernel``), the log-softmax over a short cluster axis
(``gmm.log_softmax_over_clusters``) and the blocks of sentences of the T x S tables
(``blocking``). Each asks ``path_device(tensor)`` instead of ``tensor.device.type``.

``emulate(device_type)`` makes every such choice take ``device_type``'s path while the
tensors stay where they are. Its use is counting: the operators a step calls, hence the
kernels a GPU launches, can be counted on a machine without a GPU by running the CUDA path
on the CPU (``benchmarks/bench_dma.py --count-ops``). Numerically the paths agree (tests
compare them), so emulation changes which kernels run, not the results.
"""

import contextlib
from typing import Iterator, Optional, Union

import torch
from torch import Tensor

_emulated: Optional[str] = None


def path_device(t: Union[Tensor, torch.device]) -> str:
    """The device type whose code path a computation on ``t`` (a tensor or a device) takes:
    its own, or the emulated one."""
    if _emulated is not None:
        return _emulated
    return t.type if isinstance(t, torch.device) else t.device.type


@contextlib.contextmanager
def emulate(device_type: str) -> Iterator[None]:
    """Take ``device_type``'s code paths (e.g. "cuda") inside the block, whatever the tensors'
    device (module docstring). Not thread-safe: it is a switch for a benchmark process."""
    global _emulated
    previous, _emulated = _emulated, device_type
    try:
        yield
    finally:
        _emulated = previous
