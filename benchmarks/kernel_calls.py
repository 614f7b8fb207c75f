"""Counting the kernel launches of a piece of work on any device (imports torch only).

On a GPU a step made of many small operator calls runs at the speed of its kernel launches
(about 10 µs each), not of its arithmetic. Which operators a step calls is the same on every
device, so the CPU can count what a GPU pays. ``count_kernel_calls(fn)`` runs ``fn`` under
``torch.profiler`` and counts, by name:

* every ATen operator called from Python or by the autograd engine that runs a kernel. The
  operators it calls in turn are its own implementation (they differ between devices) and are
  not counted again. Operators that only make views, read metadata or may return their input
  as it is (``NO_KERNEL_OPS``) count only when an operator they call does work (a ``to`` or a
  ``contiguous`` that copies);
* every compiled kernel: a kernel that inductor generated (C++ on the CPU, Triton on a GPU)
  runs inside its wrapper's ``## Call CompiledFxGraph ...`` region without an ATen operator;
  each appears as one profiler event named after the kernel (``cpp_fused_*``,
  ``triton_*``; torch 2.13 prefixes the graph, ``graph_0_cpp_fused_*``) once inductor's
  ``cpp.enable_kernel_profile`` is on, which ``count_kernel_calls`` switches on for its run
  (it must be on when the graph is compiled: inductor writes the event into the kernel's
  wrapper). An extern kernel of a compiled graph (a matmul it leaves to ATen) is an ATen call
  and counts as such;
* every call of the package's own C kernels (``modules/native_normal.py``), recorded as one
  ``fairseq_modattn::...`` event each.
"""

import contextlib
import itertools
import re
from collections import Counter
from typing import Callable, Dict, Iterable, Iterator

#: ATen ops that make views, read metadata or may return their input as it is: they run no
#: kernel unless an op they call does (a copying ``to``, ``reshape`` or ``contiguous``)
NO_KERNEL_OPS = frozenset(f"aten::{op}" for op in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "view_as", "as_strided", "t", "transpose",
    "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "expand", "expand_as",
    "select", "slice", "narrow", "unsqueeze", "squeeze", "flatten", "unflatten", "split",
    "split_with_sizes", "chunk", "unbind", "alias", "detach", "detach_", "lift_fresh", "resolve_conj",
    "resolve_neg", "contiguous", "to", "_to_copy", "type_as", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "result_type", "promote_types", "size", "stride", "numel", "dim",
    "is_nonzero", "item", "_local_scalar_dense", "numpy_T", "broadcast_tensors", "broadcast_to",
    "_has_compatible_shallow_copy_type", "is_same_size", "set_", "requires_grad_",
))

#: name prefixes of the events that inductor's generated kernels record (one launch each)
COMPILED_KERNEL_PREFIXES = ("cpp_fused_", "triton_", "cpp_kernel", "cuda_fused_")
#: the events of the package's own C kernels (``torch.profiler.record_function`` around each call)
NATIVE_KERNEL_PREFIX = "fairseq_modattn::"
#: the same, after the ``graph_<n>_`` that torch 2.13's C++ wrapper puts before the kernel's name
_COMPILED_KERNEL = re.compile(r"(graph_\d+_)?(" + "|".join(map(re.escape, COMPILED_KERNEL_PREFIXES)) + ")")


def _children_ops(node) -> Iterator:
    """The ATen op events directly under ``node``, looking through non-ATen events (autograd
    nodes, record_function ranges) in between."""
    from torch._C._profiler import _EventType

    for child in node.children:
        if child.tag == _EventType.TorchOp and child.name.startswith("aten::"):
            yield child
        else:
            yield from _children_ops(child)


def runs_kernel(node) -> bool:
    """Whether an ATen op node (or an op it calls) runs a kernel."""
    if node.name not in NO_KERNEL_OPS:
        return True
    return any(runs_kernel(child) for child in _children_ops(node))


def is_compiled_kernel(node) -> bool:
    return _COMPILED_KERNEL.match(node.name) is not None


def kernel_calls(nodes: Iterable, math_sdpa_as_fused: bool = False) -> Iterator[str]:
    """The names of the counted calls under ``nodes`` of the profiler's event tree (module
    docstring), one per call.

    ``math_sdpa_as_fused``: count a ``scaled_dot_product_attention`` that ran torch's math
    path (the CPU's, where an attention bias needs a gradient) as the one fused kernel that a
    GPU's memory-efficient attention runs, forward and backward: its backward's decomposed
    operators (matmuls, softmax backward, ...) count as one call,
    ``scaled_dot_product_attention [backward]``.
    """
    from torch._C._profiler import _EventType

    math_sdpa = {}  # sequence number of an op inside a math-path SDPA -> that SDPA's index
    sdpa_index = itertools.count()
    counted_backward = set()

    def mark_math_sdpa(node, index):
        for child in node.children:
            if child.tag == _EventType.TorchOp and child.extra_fields.sequence_number >= 0:
                math_sdpa[child.extra_fields.sequence_number] = index
            mark_math_sdpa(child, index)

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.TorchOp and node.name.startswith("aten::"):
                if math_sdpa_as_fused and node.name == "aten::scaled_dot_product_attention" and any(
                    c.name == "aten::_scaled_dot_product_attention_math" for c in _children_ops(node)
                ):
                    mark_math_sdpa(node, next(sdpa_index))
                if runs_kernel(node):
                    yield node.name
                continue  # what an op calls in turn is its own implementation
            if node.tag == _EventType.TorchOp and node.name.startswith("autograd::engine::evaluate_function"):
                index = math_sdpa.get(node.extra_fields.sequence_number)
                if index is not None:
                    if index not in counted_backward:
                        counted_backward.add(index)
                        yield "aten::scaled_dot_product_attention [backward]"
                    continue
            if is_compiled_kernel(node) or node.name.startswith(NATIVE_KERNEL_PREFIX):
                yield node.name
                continue
            yield from walk(node.children)

    yield from walk(nodes)


@contextlib.contextmanager
def _compiled_kernels_recorded():
    """inductor records each generated C++ kernel as a profiler event only with
    ``cpp.enable_kernel_profile`` (Triton launches are recorded by their launcher)."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:  # a torch without inductor compiles nothing
        yield
        return
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        yield


def count_kernel_calls(fn: Callable[[], object], math_sdpa_as_fused: bool = False) -> Dict[str, int]:
    """{op or kernel name: calls} of the kernel launches of ``fn()`` (module docstring;
    ``math_sdpa_as_fused`` as in ``kernel_calls``)."""
    from torch.profiler import ProfilerActivity, profile

    with _compiled_kernels_recorded(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return dict(Counter(kernel_calls(prof.profiler.kineto_results.experimental_event_tree(), math_sdpa_as_fused)))


def total(counts: Dict[str, int]) -> int:
    return sum(counts.values())
