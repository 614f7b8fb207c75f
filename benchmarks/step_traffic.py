"""The matmul FLOPs and the memory traffic of a piece of work, on any device (imports torch only).

A GPU step whose kernels are few runs at the speed of the bytes they move (a memory-bound
kernel) or of their matmuls. Both are properties of the work, not of the device, so the CPU
can count them for a GPU (``bench_dma.py --traffic``):

* FLOPs: torch's ``FlopCounterMode`` (matmuls and attention kernels), plus the ``tl.dot``
  FLOPs that the package's Triton kernels report (``triton_support.report_traffic``);
* bytes: every ATen operator that runs a kernel reads each of its tensor operands and writes
  each result once, alone: the traffic of the step's operators as separate kernels, none
  fused with another, no result left in a cache for the next. A broadcast (stride 0) axis
  counts once, an operand given twice once; an operator that only fills or overwrites its
  output (``WRITE_ONLY_OPS``) reads none of it. Views, metadata and allocations move nothing
  (``kernel_calls.NO_KERNEL_OPS``). The Triton kernels report their own loads and stores,
  derived from the tiles their programs visit (each kernel module's ``_traffic``).

The operators are seen below autograd (``TorchDispatchMode``): what runs, forward and backward,
after composite operators are decomposed. A compiled graph's generated kernels are not ATen
operators and are not seen: count an eager path.
"""

from collections import Counter
from typing import Callable, Dict, NamedTuple

import torch
from kernel_calls import NO_KERNEL_OPS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: operators that write their output without reading it (their output operand is not a read)
WRITE_ONLY_OPS = frozenset(("copy_", "zero_", "fill_", "normal_", "uniform_", "random_", "bernoulli_",
                            "exponential_"))


class Traffic(NamedTuple):
    flops: int
    bytes: int
    by_op: Dict[str, int]  # bytes by operator or kernel name


def addressed_bytes(t: torch.Tensor) -> int:
    """The bytes of the distinct elements a tensor view addresses (a stride-0 axis once)."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= size
    return count * t.element_size() if t.numel() else 0


class _OperatorBytes(TorchDispatchMode):
    """Adds each kernel-running operator's reads and writes to ``totals`` (module docstring)."""

    def __init__(self, totals: Counter):
        super().__init__()
        self.totals = totals

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        full = f"aten::{name}"
        if full in NO_KERNEL_OPS or func.is_view or name.startswith("_local_scalar"):
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        written = {t.data_ptr() for t in outputs} if name in WRITE_ONLY_OPS else set()
        seen, moved = set(), 0
        for t in tree_leaves((args, kwargs)):
            if not isinstance(t, torch.Tensor):
                continue
            key = (t.data_ptr(), t.shape, t.stride(), t.dtype)
            if key in seen or t.data_ptr() in written:
                continue
            seen.add(key)
            moved += addressed_bytes(t)
        moved += sum(addressed_bytes(t) for t in outputs)
        self.totals[full] += moved
        return out


def count_traffic(fn: Callable[[], object]) -> Traffic:
    """The matmul FLOPs and the bytes (module docstring) of ``fn()``."""
    from torch.utils.flop_counter import FlopCounterMode

    from fairseq_modattn.modules import triton_support

    totals: Counter = Counter()
    kernel_flops = [0]

    def kernel(name, traffic):
        totals[triton_support.KERNEL_EVENT_PREFIX + name] += traffic.read + traffic.written
        kernel_flops[0] += traffic.flops

    triton_support.TRAFFIC_COUNTERS.append(kernel)
    try:
        flop_counter = FlopCounterMode(display=False)
        with flop_counter, _OperatorBytes(totals):
            fn()
    finally:
        triton_support.TRAFFIC_COUNTERS.remove(kernel)
    return Traffic(flop_counter.get_total_flops() + kernel_flops[0], sum(totals.values()), dict(totals))


def extrapolate(first: Traffic, second: Traffic, first_batch: int, second_batch: int, batch: int) -> Traffic:
    """The traffic of a step of ``batch`` sentences from counts at two other batch sizes of the
    same sentence length: at a fixed length every operator's bytes and FLOPs are a constant (the
    parameters, their gradients) plus a multiple of the batch (every activation, the T x S
    tables per sentence included), so two counts fix the line. For kernels that run too slowly
    to count at full size (Triton's interpreter)."""
    def at(a: float, b: float) -> float:
        return a + (b - a) * (batch - first_batch) / (second_batch - first_batch)

    names = set(first.by_op) | set(second.by_op)
    return Traffic(round(at(first.flops, second.flops)), round(at(first.bytes, second.bytes)),
                   {n: round(at(first.by_op.get(n, 0), second.by_op.get(n, 0))) for n in names})
