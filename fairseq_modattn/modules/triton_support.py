"""Whether and how this package's Triton kernels can run (``--dma-backend triton``).

Triton is an optional dependency: the plugin imports, trains and decodes without it, and only
the ``triton`` backend of DMA needs it. Its kernels run

    * on CUDA tensors, compiled by Triton for the GPU;
    * on CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` in the environment
      before the kernels are first imported), which executes the same kernel code with numpy,
      one program at a time. That is how the tests prove the kernels on a machine without a
      GPU; it is far too slow to train with.

``kernel_device_error(t)`` says in one line why a tensor's device cannot run them, or None.
"""

import importlib.util
import os
from typing import Callable, List, NamedTuple, Optional

import torch
from torch import Tensor

#: the release the kernels are written and tested against (torch 2.13's CUDA wheels pin it)
TRITON_VERSION = "3.7.1"
#: each launch of the package's Triton kernels is recorded as one profiler event named with this
#: prefix, as its C kernels are (``benchmarks/kernel_calls.py`` counts them as launches)
KERNEL_EVENT_PREFIX = "fairseq_modattn::triton_"


def triton_available() -> bool:
    """Whether ``import triton`` would succeed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def kernel_device_error(t: Tensor) -> Optional[str]:
    """Why the Triton kernels cannot run on ``t``'s device, in one line, or None if they can."""
    if not triton_available():
        return (f"--dma-backend triton needs the triton package (pip install triton=={TRITON_VERSION}); "
                "it is not installed")
    if t.device.type == "cuda":
        return None
    if t.device.type == "cpu" and interpreting():
        return None
    return (f"--dma-backend triton runs on CUDA devices; this model is on {t.device.type} "
            "(on the CPU its kernels run only in Triton's interpreter, TRITON_INTERPRET=1, which the tests use)")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for fp32 operands: TF32 where torch's own fp32 matmuls use it
    (``torch.backends.cuda.matmul.allow_tf32``, off by default), so that the kernels round as
    the rest of the model does; exact IEEE fp32 otherwise. Half-precision operands ignore it."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def draw_seed() -> int:
    """A Philox key for the kernels' attention dropout, from torch's CPU generator: no device
    work, and reproducible after ``torch.manual_seed``."""
    return int(torch.randint(0, 2**31 - 1, ()))


class KernelTraffic(NamedTuple):
    """What one launch of a kernel moves and computes, derived from its tiles: the bytes its
    programs load (an operand that several programs read counts once per program that reads it,
    as on a GPU without cache reuse between programs) and store, and its ``tl.dot`` FLOPs (the
    products the matmul FLOPs of a step count; the broadcast sums over the clusters are not).
    ``reread``: the part of ``read`` that programs load again after another program of the
    launch loaded it, so that ``read - reread`` reads each operand once, the rule by which every
    other kernel of a step is counted (on a GPU most re-reads of a tile are hits in L2)."""

    read: int
    written: int
    flops: int = 0
    reread: int = 0


#: the active counters of the kernels' traffic (``benchmarks/step_traffic.py``): each is called
#: at every launch with the kernel's name and its ``KernelTraffic``
TRAFFIC_COUNTERS: List[Callable[[str, KernelTraffic], None]] = []


def report_traffic(name: str, traffic: Callable[[], KernelTraffic]):
    """Give each active counter ``traffic()`` of one launch of ``name`` (computed only when one is)."""
    if TRAFFIC_COUNTERS:
        result = traffic()
        for counter in TRAFFIC_COUNTERS:
            counter(name, result)


def nbytes(*tensors: Optional[Tensor]) -> int:
    """The bytes of the given tensors' elements (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
