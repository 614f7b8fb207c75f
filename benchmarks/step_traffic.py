"""The matmul FLOPs and the memory traffic of a piece of work, on any device (imports torch only).

A GPU step whose kernels are few runs at the speed of the bytes they move (a memory-bound
kernel) or of their matmuls. Both are properties of the work, not of the device, so the CPU
can count them for a GPU (``bench_dma.py --traffic``):

* FLOPs: those of the operators in torch's FLOP registry (matmuls and attention kernels, as
  ``FlopCounterMode`` counts them), plus the ``tl.dot`` FLOPs that the package's Triton kernels
  report (``triton_support.report_traffic``);
* bytes: every ATen operator that runs a kernel reads each of its tensor operands and writes
  each result once, alone: the traffic of the step's operators as separate kernels, none
  fused with another, no result left in a cache for the next. A broadcast (stride 0) axis
  counts once, an operand given twice once; an operator that only fills or overwrites its
  output (``WRITE_ONLY_OPS``) reads none of it. Views, metadata and allocations move nothing
  (``kernel_calls.NO_KERNEL_OPS``). The Triton kernels report their own loads and stores,
  derived from the tiles their programs visit (each kernel module's ``_traffic``), and which
  of those loads re-read a row that another program of the launch loaded (``Traffic.reread``):
  ``Traffic.once`` counts every kernel by the rule above, each operand once, as an attention
  operator such as the transformer's ``scaled_dot_product_attention`` is counted; ``bytes``
  counts the Triton kernels' re-reads too, as a GPU without reuse in its L2 cache would move.

The operators are seen below autograd (``TorchDispatchMode``): what runs, forward and backward,
after composite operators are decomposed.

Compiled graphs (``compiled_graph_counting``): the counter lets ``torch.compile`` run its
graphs compiled, and sees the ATen operators they still call (matmuls, as ``mm.out``; operators
of their own, such as the Triton kernels', whose launches report themselves). The kernels that
inductor generates are not operators: ``counting_inductor`` compiles with inductor and takes
each generated kernel's bytes from inductor's own count (``GraphLowering.count_bytes``: the
buffers a fused kernel reads from outside it and writes for outside it, once each, which is
this module's rule for one kernel), and adds them at every run of the graph.
"""

import contextlib
from collections import Counter
from typing import Callable, Dict, List, NamedTuple

import torch
from kernel_calls import NO_KERNEL_OPS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

#: operators that write their output without reading it (their output operand is not a read)
WRITE_ONLY_OPS = frozenset(("copy_", "zero_", "fill_", "normal_", "uniform_", "random_", "bernoulli_",
                            "exponential_"))


class Traffic(NamedTuple):
    flops: int
    bytes: int
    by_op: Dict[str, int]  # bytes by operator or kernel name
    reread: int = 0  # of ``bytes``: the Triton kernels' loads of a row that another program loaded

    @property
    def once(self) -> int:
        """The bytes with each kernel's operands read once (module docstring)."""
        return self.bytes - self.reread


def addressed_bytes(t: torch.Tensor) -> int:
    """The bytes of the distinct elements a tensor view addresses (a stride-0 axis once)."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= size
    return count * t.element_size() if t.numel() else 0


#: operator namespaces whose kernels report their own traffic (``triton_support.report_traffic``)
SELF_REPORTING_NAMESPACES = ("fairseq_modattn_ops",)

#: called with (name, bytes) for each run of a compiled graph's generated kernels (``counting_inductor``)
GRAPH_COUNTERS: List[Callable[[str, int], None]] = []


class _OperatorBytes(TorchDispatchMode):
    """Adds each kernel-running operator's reads and writes to ``totals`` and its matmul FLOPs
    to ``flops[0]`` (module docstring)."""

    def __init__(self, totals: Counter, flops: List[int]):
        super().__init__()
        self.totals = totals
        self.flops = flops

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile runs its graphs compiled under this mode (otherwise dynamo runs them
        # eagerly for it) and gives it only the operators the compiled code calls
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func._schema.name.split("::")
        full = f"aten::{name}"
        if (namespace in SELF_REPORTING_NAMESPACES or full in NO_KERNEL_OPS or func.is_view
                or name.startswith("_local_scalar")):
            return out
        if func._overloadpacket in flop_registry:
            self.flops[0] += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        written = {t.data_ptr() for t in outputs} if name in WRITE_ONLY_OPS else set()
        # an out= argument (``mm.out``, as compiled graphs call it) is written, not read
        out_arguments = [a.name for a in func._schema.arguments if a.is_out]
        operands = (args, {k: v for k, v in kwargs.items() if k not in out_arguments})
        seen, moved = set(), 0
        for t in tree_leaves(operands):
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
    from fairseq_modattn.modules import triton_support

    totals: Counter = Counter()
    flops, reread = [0], [0]

    def kernel(name, traffic):
        totals[triton_support.KERNEL_EVENT_PREFIX + name] += traffic.read + traffic.written
        flops[0] += traffic.flops
        reread[0] += traffic.reread

    def graph(name, moved):
        totals[name] += moved

    triton_support.TRAFFIC_COUNTERS.append(kernel)
    GRAPH_COUNTERS.append(graph)
    try:
        with _OperatorBytes(totals, flops):
            fn()
    finally:
        triton_support.TRAFFIC_COUNTERS.remove(kernel)
        GRAPH_COUNTERS.remove(graph)
    return Traffic(flops[0], sum(totals.values()), dict(totals), reread[0])


# ----------------------------------------------------------------------------- compiled graphs
#: the by-op names of a compiled graph's generated kernels, forward and backward
GRAPH_NAMES = ("inductor::generated_forward", "inductor::generated_backward")


class _CountingLog:
    """Stands in for inductor's "inductor_metrics" logger while a graph compiles: enabled, so
    that inductor counts its kernels' bytes, and silent (its record is a dict of every node; a
    process may have silenced logging altogether, as the benchmarks' harness does)."""

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging.Logger's name
        return True

    def info(self, *args, **kwargs) -> None:
        pass


def _generated_kernel_bytes(gm, example_inputs, **kwargs):
    """``compile_fx_inner`` (inductor's compile of one forward or backward graph), returning a
    callable that reports the bytes of the graph's generated kernels at each run.

    Inductor counts them only where its "inductor_metrics" logger is enabled for INFO (torch
    2.13's ``compile_fx`` asks ``compile_fx.inductor_metrics_log`` at each compile, then runs
    ``GraphLowering.count_bytes`` into ``metrics.nodes_num_elem`` as (scheduler node, bytes //
    4)): ``_CountingLog`` stands in for that logger during the compile. Its extern nodes
    (matmuls, fallback operators) are left out here, as the operator counter sees them run.
    Sizes are the graph's size hints, those of the inputs it was compiled at: compile at the
    shapes counted (``compiled_graph_counting``)."""
    from torch._inductor import compile_fx, metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    first, log = len(metrics.nodes_num_elem), compile_fx.inductor_metrics_log
    compile_fx.inductor_metrics_log = _CountingLog()
    try:
        compiled = compile_fx.compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        compile_fx.inductor_metrics_log = log
    moved = sum(4 * quarter for node, quarter in metrics.nodes_num_elem[first:]
                if not isinstance(node, ExternKernelSchedulerNode))
    name = GRAPH_NAMES[bool(kwargs.get("is_backward"))]

    def run(args):
        for counter in GRAPH_COUNTERS:
            counter(name, moved)
        return compiled(args)

    run._boxed_call = True  # AOTAutograd calls it with one list of inputs, as inductor's own
    return run


def counting_inductor(gm, example_inputs):
    """A ``torch.compile`` backend: inductor, whose generated kernels report their bytes to
    ``count_traffic`` (``_generated_kernel_bytes``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_generated_kernel_bytes)


@contextlib.contextmanager
def compiled_graph_counting():
    """DMA's compiled graphs (``dma_compiled``) built by ``counting_inductor`` inside the block,
    with inductor's and AOTAutograd's caches off (a graph from a cache is not compiled, and so
    not counted). Call ``recompile()`` before a counted step at new shapes: the graphs are
    dynamic, and inductor's count takes the sizes they were compiled at."""
    from fairseq_modattn.modules import dma_compiled

    previous = dma_compiled.BACKEND
    dma_compiled.BACKEND = counting_inductor
    dma_compiled.reset()
    no_caches = (torch._inductor.config.patch(fx_graph_cache=False),
                 torch._functorch.config.patch(enable_autograd_cache=False))
    try:
        with no_caches[0], no_caches[1]:
            yield recompile
    finally:
        dma_compiled.BACKEND = previous
        dma_compiled.reset()
        torch._dynamo.reset()


def recompile():
    """Forget DMA's compiled graphs (and dynamo's caches), so that the next step compiles them
    at its shapes."""
    from fairseq_modattn.modules import dma_compiled

    dma_compiled.reset()
    torch._dynamo.reset()


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
                   {n: round(at(first.by_op.get(n, 0), second.by_op.get(n, 0))) for n in names},
                   round(at(first.reread, second.reread)))
