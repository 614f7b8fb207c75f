"""The diagonal GMM's passes over its points on the CPU: ``mixture_kernels.c``, built on first use.

``gmm._MixtureStatistics`` computes a GMM's posteriors and KL of (G, M, d) points, and their
gradients, with matmuls against the (C, d) parameters: ~20 torch calls a GMM forward and
backward, each a pass over a tensor as large as a layer's input. On the CPU those passes are
bound by memory, and ``mixture_kernels.c`` makes one pass a direction instead, per point
(docs/design.md, "The GMMs on the CPU"). Same equations; the sums over d run in another order,
so results differ from the matmul path by fp32 rounding (tests/test_native_mixture.py compares
both with an fp64 run).

The library is built like the noise generator (``native_build``). Where it cannot be, on a
GPU's code path, for dtypes other than fp32, or with ``FAIRSEQ_MODATTN_NATIVE_GMM=0``,
``gmm.py`` keeps its matmuls: ``available`` says which.
"""

import ctypes
import logging
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import native_build
from .device_paths import path_device

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("mixture_kernels.c")
#: -fno-math-errno: expf and logf without errno (``flags`` adds the OpenMP flag)
FLAGS = ("-O3", "-fPIC", "-shared", "-fno-math-errno")
#: set to 0 to keep the matmul GMM on the CPU too
DISABLE_VARIABLE = "FAIRSEQ_MODATTN_NATIVE_GMM"
#: the kernels' limit on clusters (MAX_CLUSTERS in the C file): per-point arrays on the stack
MAX_CLUSTERS = 64
#: points a part holds at least: below, a thread's hand-over outweighs its share
MIN_PART = 2048

_looked_for = False
_library: Optional[ctypes.CDLL] = None


class _Points(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("group_stride", ctypes.c_int64), ("point_stride", ctypes.c_int64)]


class _Target(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("group_stride", ctypes.c_int64), ("point_stride", ctypes.c_int64),
                ("with_sampled", ctypes.c_int), ("with_mean", ctypes.c_int)]


_SIZES = [ctypes.c_int64] * 4  # groups, num_points, dim, clusters
_FLOAT_POINTERS = ctypes.c_void_p


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p = _FLOAT_POINTERS
    lib.modattn_gmm_forward.argtypes = [_Points, _Points, *_SIZES, p, p, p, p, ctypes.c_float, ctypes.c_float,
                                        p, p, p, p, p, ctypes.c_int]
    lib.modattn_gmm_forward.restype = ctypes.c_int
    lib.modattn_gmm_backward.argtypes = [_Points, _Points, *_SIZES, p, p, p, p, p, p, p, p, ctypes.c_float,
                                         ctypes.c_float, _Target, _Target, p, p, p, p, ctypes.c_int]
    lib.modattn_gmm_backward.restype = ctypes.c_int
    return lib


def flags(cc: list) -> Tuple[str, ...]:
    """``FLAGS`` and ``native_build.openmp_flags``: the points run in parts on torch's OpenMP
    threads where they can, else as one part."""
    return FLAGS + native_build.openmp_flags(cc)


def build(directory: Path, cc: list) -> Path:
    """The compiled kernels in ``directory`` (``native_build.build``)."""
    return native_build.build(SOURCE, flags(cc), directory, cc)


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, built on the first call; None where it cannot be (module docstring)."""
    global _library, _looked_for
    if not _looked_for:
        _library, _looked_for = _open(), True
    return _library


def _open() -> Optional[ctypes.CDLL]:
    return native_build.open_library(SOURCE, build, load, DISABLE_VARIABLE, logger,
                                     "DMA's GMMs run as matmuls on the CPU, which is slower "
                                     "(docs/design.md, \"The GMMs on the CPU\")")


def available(points: Tensor, num_clusters: int) -> bool:
    """Whether ``points`` (G, M, d) take the kernels: fp32 on the CPU's code path, each point's d
    values contiguous, at most ``MAX_CLUSTERS`` clusters, and the library built."""
    # a graph being compiled (``dma_compiled``) keeps the matmuls, which the compiler fuses
    return (points.dtype == torch.float32 and points.device.type == "cpu" and path_device(points) == "cpu"
            and not torch.compiler.is_compiling() and points.stride(-1) == 1 and num_clusters <= MAX_CLUSTERS
            and library() is not None)


def _parts(num_points: int) -> int:
    """How many parts of the points run at once: torch's number of threads, fewer for few points.
    The parts run on OpenMP's threads, which are torch's own where its CPU operators use OpenMP
    (``flags``); a library built without OpenMP runs them as one part."""
    return max(1, min(torch.get_num_threads(), num_points // MIN_PART))


def _loaded() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"{SOURCE.name} is not available (see the log)")
    return lib


def _points(t: Optional[Tensor]) -> _Points:
    if t is None:
        return _Points(None, 0, 0)
    return _Points(t.data_ptr(), t.stride(0), t.stride(1))


def _pointer(t: Optional[Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def forward(x: Tensor, point: Tensor, scale: float, kl_const: float, need_kl: bool, inv_var: Tensor,
            scaled_means: Tensor, log_norm: Tensor, offset: Optional[Tensor]
            ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``gmm.mixture_statistics`` by the kernel: J, LP, P (G, M, C), KL (G, M) and T (G, M, C),
    the last two None without ``need_kl``. ``offset``: -(log N_c - s^2 tr_c / 2) as there."""
    groups, num_points, dim = point.shape
    clusters = inv_var.size(1)
    shape = (groups, num_points, clusters)
    log_joint, log_post, post = (point.new_empty(shape) for _ in range(3))
    kl = point.new_empty(groups, num_points) if need_kl else None
    terms = point.new_empty(shape) if need_kl else None
    # bound to names, so that no contiguous copy is freed before the call reads it
    constants = [c.contiguous() for c in (inv_var, scaled_means, log_norm)]
    offset = offset.contiguous() if need_kl and offset is not None else None
    with torch.profiler.record_function("fairseq_modattn::gmm_forward"):
        done = _loaded().modattn_gmm_forward(
            _points(x if need_kl else None), _points(point), groups, num_points, dim, clusters,
            *(c.data_ptr() for c in constants), _pointer(offset), scale, kl_const,
            log_joint.data_ptr(), log_post.data_ptr(), post.data_ptr(), _pointer(kl), _pointer(terms),
            _parts(num_points))
    if not done:
        raise ValueError(f"the native GMM takes at most {MAX_CLUSTERS} clusters, got {clusters}")
    return log_joint, log_post, post, kl, terms


def backward(x: Optional[Tensor], point: Tensor, scale: float, kl_shift: float, inv_var: Tensor,
             scaled_means: Tensor, post: Tensor, terms: Optional[Tensor], grad_joint: Optional[Tensor],
             grad_log_post: Optional[Tensor], grad_post: Optional[Tensor], grad_kl: Optional[Tensor],
             need_x: bool, need_point: bool, need_first: bool, need_second: bool):
    """The point gradients and the parameters' sums of ``gmm._MixtureStatistics._backward`` by
    the kernel: (grad_x, grad_point, weight, kl_weight, first, second), each None where not
    asked for or zero by construction (weight and kl_weight (G, C), first and second (G, C, d)).
    grad_x is dx + dz when both are needed (that class's docstring)."""
    groups, num_points, dim = point.shape
    clusters = inv_var.size(1)
    with_kl = grad_kl is not None and terms is not None
    if with_kl and x is None:
        raise ValueError("the KL's gradient needs the means x")
    grads = [None if g is None else g.contiguous() for g in (grad_joint, grad_log_post, grad_post, grad_kl)]
    grad_x = grad_point = None
    targets = []
    if need_x and need_point:
        grad_x = torch.empty_like(point)
        targets.append(_Target(grad_x.data_ptr(), grad_x.stride(0), grad_x.stride(1), 1, 1))
    else:
        if need_point:
            grad_point = torch.empty_like(point)
            targets.append(_Target(grad_point.data_ptr(), grad_point.stride(0), grad_point.stride(1), 1, 0))
        if need_x and with_kl:
            grad_x = torch.empty_like(point)
            targets.append(_Target(grad_x.data_ptr(), grad_x.stride(0), grad_x.stride(1), 0, 1))
    targets += [_Target(None, 0, 0, 0, 0)] * (2 - len(targets))
    # the column sums, one set a part of the points (``_parts``), added up after
    parts = _parts(num_points)
    weight = point.new_zeros(parts, groups, clusters)
    kl_weight = point.new_zeros(parts, groups, clusters) if with_kl else None
    first = point.new_zeros(parts, groups, clusters, dim) if need_first or need_second else None
    second = point.new_zeros(parts, groups, clusters, dim) if need_second else None
    # bound to names, so that no contiguous copy is freed before the call reads it
    read = [inv_var.contiguous(), scaled_means.contiguous(), post.contiguous(),
            terms.contiguous() if with_kl and terms is not None else None, *grads]

    with torch.profiler.record_function("fairseq_modattn::gmm_backward"):
        done = _loaded().modattn_gmm_backward(
            _points(x if with_kl else None), _points(point), groups, num_points, dim, clusters,
            *(_pointer(t) for t in read), scale, kl_shift, *targets,
            *(_pointer(t) for t in (weight, kl_weight, first, second)), parts)
    if not done:
        raise ValueError(f"the native GMM takes at most {MAX_CLUSTERS} clusters, got {clusters}")
    return (grad_x, grad_point, *(None if t is None else t.sum(0) for t in (weight, kl_weight, first, second)))
