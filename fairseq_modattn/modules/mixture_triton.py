"""The diagonal GMM's passes over its points as Triton kernels (``--dma-backend triton``): the
GPU's counterpart of ``mixture_kernels.c``, with the same equations and the same interface as
``native_mixture`` (``forward`` and ``backward``), which ``gmm._MixtureStatistics`` calls.

``gmm._MixtureStatistics`` otherwise computes a GMM's statistics and their gradients with ~20
torch calls a direction, each a kernel that streams a (G, M, d) tensor as large as a layer's
input (points, squares, products with the (C, d) parameters, the gradient's terms). Here each
direction is one kernel that reads a point once: a program takes a block of points of one group,
keeps their (BLOCK_P, d) rows in registers, and runs over the C clusters (a static loop of
broadcast products: C is 1-16, below ``tl.dot``'s inner size on a GPU). With a = ``scale``,
sigma^-2 = inv_var, mu sigma^-2 = scaled_means, log N_c = log_norm (``gmm._MixtureStatistics``
gives the derivation):

    forward   J_c  = log N_c + sum_k z_k (a (mu sigma^-2)_ck - a^2 z_k sigma_ck^-2 / 2)
              LP   = J - logsumexp_c J,   P = exp(LP)
              T_c  = -offset_c - sum_k x_k (a (mu sigma^-2)_ck - a^2 x_k sigma_ck^-2 / 2) + LP_c
              KL   = sum_c P_c T_c - kl_const                        (with the KL; T is kept)
    backward  G^LP' = G^LP + P G^P + G^KL P (T + kl_shift),   G^J' = G^J + G^LP' - P sum_c G^LP'
              W = G^KL P;  dz-part a G^J' (mu sigma^-2) - a^2 (G^J' sigma^-2) * z,
              dx-part -a W (mu sigma^-2) + a^2 (W sigma^-2) * x;
              column sums over the points: weight = W - G^J', kl_weight = W,
              first = -a G^J' z + a W x,  second = -a^2 G^J' z^2 + a^2 W x^2.

The column sums are written per block of points (no atomics: the result does not depend on
the order programs finish) and added up by one torch sum each. Statistics in the accumulation
dtype: fp32 for fp32 points (the GMM runs in fp32 whatever the model's dtype), fp64 for fp64.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.profiler import record_function

from .interpolated_attention_triton import TL_DTYPES
from .triton_support import KERNEL_EVENT_PREFIX, KernelTraffic, nbytes, report_traffic

#: points a program takes (the (BLOCK_P, d) rows of x and z stay in registers) and its warps,
#: by padded width (``block_shape``): at d = 64 and 128 both kernels compile for sm_80 and sm_90
#: without register spills at C = 8 (benchmarks/triton_compile.py); 32 points with 4 warps
#: spilled 100-400 bytes in backward
BLOCK_SHAPES = {16: (32, 4), 32: (32, 4), 64: (32, 8), 128: (32, 8)}


def block_shape(dim: int) -> Tuple[int, int]:
    """(points a program, warps) for points of ``dim`` values (``BLOCK_SHAPES``; wider points
    take the widest entry's shape with fewer points)."""
    width = max(16, triton.next_power_of_2(dim))
    if width in BLOCK_SHAPES:
        return BLOCK_SHAPES[width]
    points, warps = BLOCK_SHAPES[128]
    return max(1, points * 128 // width), warps
#: the cluster counts the kernels unroll for
MAX_CLUSTERS = 16


def available(points: Tensor, num_clusters: int) -> bool:
    """Whether the kernels take these (G, M, d) points: fp32 or fp64, each point's d values
    contiguous, at most ``MAX_CLUSTERS`` clusters."""
    return points.dtype in TL_DTYPES and points.stride(-1) == 1 and num_clusters <= MAX_CLUSTERS


@triton.jit
def _column(t, offs_c, c):
    """Column c of a (rows, BLOCK_C) tile, as a (rows,) vector."""
    return tl.sum(tl.where(offs_c[None, :] == c, t, 0.0), 1)


@triton.jit
def _forward_kernel(
    X, Z, IV, SM, LN, OFF, J, LP, P, KL, TERMS,
    s_xg, s_xm, s_zg, s_zm, M, scale, kl_const,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, CLUSTERS: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr, NEED_KL: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    p_ok = offs_p < M
    d_ok = offs_d < DIM
    c_ok = offs_c < CLUSTERS
    pd_mask = p_ok[:, None] & d_ok[None, :]
    z = tl.load(Z + g * s_zg + offs_p[:, None] * s_zm + offs_d[None, :], mask=pd_mask, other=0.0).to(ACC)
    half_a2 = 0.5 * scale * scale
    joint = tl.full((BLOCK_P, BLOCK_C), float("-inf"), ACC)
    for c in tl.static_range(CLUSTERS):
        iv = tl.load(IV + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)
        sm = tl.load(SM + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)
        product = tl.sum(z * (scale * sm[None, :] - half_a2 * z * iv[None, :]), 1)
        joint = tl.where(offs_c[None, :] == c, (tl.load(LN + g * CLUSTERS + c).to(ACC) + product)[:, None], joint)
    top = tl.max(joint, 1)
    total = tl.sum(tl.exp(joint - top[:, None]), 1)
    # (J - max) - log sum exp(J - max), as torch's log_softmax
    log_post = (joint - top[:, None]) - tl.log(total)[:, None]
    post = tl.exp(log_post)
    out = (g * M + offs_p[:, None]) * CLUSTERS + offs_c[None, :]
    pc_mask = p_ok[:, None] & c_ok[None, :]
    tl.store(J + out, joint, mask=pc_mask)
    tl.store(LP + out, log_post, mask=pc_mask)
    tl.store(P + out, post, mask=pc_mask)
    if NEED_KL:
        x = tl.load(X + g * s_xg + offs_p[:, None] * s_xm + offs_d[None, :], mask=pd_mask, other=0.0).to(ACC)
        terms = tl.zeros((BLOCK_P, BLOCK_C), ACC)
        for c in tl.static_range(CLUSTERS):
            iv = tl.load(IV + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)
            sm = tl.load(SM + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)
            product = tl.sum(x * (scale * sm[None, :] - half_a2 * x * iv[None, :]), 1)
            term = -tl.load(OFF + g * CLUSTERS + c).to(ACC) - product
            terms = tl.where(offs_c[None, :] == c, term[:, None], terms)
        terms = tl.where(c_ok[None, :], terms + log_post, 0.0)
        tl.store(TERMS + out, terms, mask=pc_mask)
        tl.store(KL + g * M + offs_p, tl.sum(post * terms, 1) - kl_const, mask=p_ok)


@triton.jit
def _backward_kernel(
    X, Z, IV, SM, P, TERMS, GJ, GLP, GP, GKL, OUT_A, OUT_B, WEIGHT, KL_WEIGHT, FIRST, SECOND,
    s_xg, s_xm, s_zg, s_zm, s_ag, s_am, s_bg, s_bm, G, M, scale, kl_shift,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, CLUSTERS: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr, WITH_KL: tl.constexpr, HAS_GJ: tl.constexpr, HAS_GLP: tl.constexpr,
    HAS_GP: tl.constexpr, HAS_A: tl.constexpr, A_WITH_MEAN: tl.constexpr, HAS_B: tl.constexpr,
    NEED_FIRST: tl.constexpr, NEED_SECOND: tl.constexpr, ACC: tl.constexpr,
):
    """OUT_A: the dz-part (plus the dx-part with ``A_WITH_MEAN``: dx + dz); OUT_B: the dx-part
    alone; WEIGHT, KL_WEIGHT (blocks, G, C) and FIRST, SECOND (blocks, G, C, d): this block's
    column sums."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    offs_p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    p_ok = offs_p < M
    d_ok = offs_d < DIM
    c_ok = offs_c < CLUSTERS
    pd_mask = p_ok[:, None] & d_ok[None, :]
    pc_mask = p_ok[:, None] & c_ok[None, :]
    at = (g * M + offs_p[:, None]) * CLUSTERS + offs_c[None, :]
    p = tl.load(P + at, mask=pc_mask, other=0.0).to(ACC)
    grad_lp = tl.zeros((BLOCK_P, BLOCK_C), ACC)
    weighted = tl.zeros((BLOCK_P, BLOCK_C), ACC)
    if WITH_KL:
        gk = tl.load(GKL + g * M + offs_p, mask=p_ok, other=0.0).to(ACC)
        weighted = p * gk[:, None]
        shifted = gk[:, None] * kl_shift + tl.zeros((BLOCK_P, BLOCK_C), ACC)
        if HAS_GP:
            shifted += tl.load(GP + at, mask=pc_mask, other=0.0).to(ACC)
        grad_lp = (shifted + gk[:, None] * tl.load(TERMS + at, mask=pc_mask, other=0.0).to(ACC)) * p
    elif HAS_GP:
        grad_lp = p * tl.load(GP + at, mask=pc_mask, other=0.0).to(ACC)
    if HAS_GLP:
        grad_lp += tl.load(GLP + at, mask=pc_mask, other=0.0).to(ACC)
    grad_j = grad_lp - p * tl.sum(grad_lp, 1)[:, None]
    if HAS_GJ:
        grad_j += tl.load(GJ + at, mask=pc_mask, other=0.0).to(ACC)
    sums = (pid * G + g) * CLUSTERS + offs_c
    tl.store(WEIGHT + sums, tl.sum(weighted - grad_j, 0), mask=c_ok)
    if WITH_KL:
        tl.store(KL_WEIGHT + sums, tl.sum(weighted, 0), mask=c_ok)

    z = tl.load(Z + g * s_zg + offs_p[:, None] * s_zm + offs_d[None, :], mask=pd_mask, other=0.0).to(ACC)
    x = z  # read with weight 0 without the KL
    if WITH_KL:
        x = tl.load(X + g * s_xg + offs_p[:, None] * s_xm + offs_d[None, :], mask=pd_mask, other=0.0).to(ACC)
    a2 = scale * scale
    out_a = tl.zeros((BLOCK_P, BLOCK_D), ACC)
    out_b = tl.zeros((BLOCK_P, BLOCK_D), ACC)
    first = tl.zeros((BLOCK_C, BLOCK_D), ACC)
    second = tl.zeros((BLOCK_C, BLOCK_D), ACC)
    for c in tl.static_range(CLUSTERS):
        iv = tl.load(IV + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)[None, :]
        sm = tl.load(SM + (g * CLUSTERS + c) * DIM + offs_d, mask=d_ok, other=0.0).to(ACC)[None, :]
        gj_c = _column(grad_j, offs_c, c)[:, None]
        w_c = _column(weighted, offs_c, c)[:, None]
        if HAS_A:
            if A_WITH_MEAN:
                out_a += scale * (gj_c - w_c) * sm + iv * (-a2 * gj_c * z + a2 * w_c * x)
            else:
                out_a += scale * gj_c * sm - a2 * iv * gj_c * z
        if HAS_B:
            out_b += -scale * w_c * sm + a2 * iv * w_c * x
        if NEED_FIRST:
            first_c = tl.sum(-scale * gj_c * z + scale * w_c * x, 0)
            first = tl.where(offs_c[:, None] == c, first_c[None, :], first)
            if NEED_SECOND:
                second_c = tl.sum(-a2 * gj_c * z * z + a2 * w_c * x * x, 0)
                second = tl.where(offs_c[:, None] == c, second_c[None, :], second)
    if HAS_A:
        tl.store(OUT_A + g * s_ag + offs_p[:, None] * s_am + offs_d[None, :], out_a, mask=pd_mask)
    if HAS_B:
        tl.store(OUT_B + g * s_bg + offs_p[:, None] * s_bm + offs_d[None, :], out_b, mask=pd_mask)
    if NEED_FIRST:
        moments = ((pid * G + g) * CLUSTERS + offs_c[:, None]) * DIM + offs_d[None, :]
        cd_mask = c_ok[:, None] & d_ok[None, :]
        tl.store(FIRST + moments, first, mask=cd_mask)
        if NEED_SECOND:
            tl.store(SECOND + moments, second, mask=cd_mask)


def _shape_constants(point: Tensor, clusters: int) -> dict:
    """The kernels' compile-time shape and their launch's warps."""
    dim = point.size(-1)
    points, warps = block_shape(dim)
    return dict(DIM=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)), CLUSTERS=clusters,
                BLOCK_C=max(2, triton.next_power_of_2(clusters)), BLOCK_P=points, ACC=TL_DTYPES[point.dtype],
                num_warps=warps)


def _traffic(point: Tensor, streamed, parameters, stored) -> KernelTraffic:
    """One pass over the points: each streamed (G, M, *) tensor read once, the (G, C, *)
    parameters once per program (a program takes one group's), the results stored once."""
    programs = triton.cdiv(point.size(1), block_shape(point.size(-1))[0])
    return KernelTraffic(nbytes(*streamed) + programs * nbytes(*parameters), nbytes(*stored),
                         reread=(programs - 1) * nbytes(*parameters))


def forward(x: Tensor, point: Tensor, scale: float, kl_const: float, need_kl: bool, inv_var: Tensor,
            scaled_means: Tensor, log_norm: Tensor, offset: Optional[Tensor]
            ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``native_mixture.forward`` by the Triton kernel: J, LP, P (G, M, C), KL (G, M) and
    T (G, M, C), the last two None without ``need_kl``."""
    groups, num_points, dim = point.shape
    clusters = inv_var.size(1)
    shape = (groups, num_points, clusters)
    log_joint, log_post, post = (point.new_empty(shape) for _ in range(3))
    kl = point.new_empty(groups, num_points) if need_kl else log_joint
    terms = point.new_empty(shape) if need_kl else log_joint
    constants = [c.contiguous() for c in (inv_var, scaled_means, log_norm)]
    off = offset.contiguous() if need_kl and offset is not None else constants[2]
    mean = x if need_kl else point
    with record_function(KERNEL_EVENT_PREFIX + "gmm_forward"):
        _forward_kernel[(triton.cdiv(num_points, block_shape(dim)[0]), groups)](
            mean, point, *constants, off, log_joint, log_post, post, kl, terms,
            mean.stride(0), mean.stride(1), point.stride(0), point.stride(1), num_points, float(scale),
            float(kl_const), NEED_KL=need_kl, **_shape_constants(point, clusters))
    report_traffic("gmm_forward", lambda: _traffic(
        point, (mean, point) if need_kl else (point,), constants + [off] if need_kl else constants,
        (log_joint, log_post, post, kl, terms) if need_kl else (log_joint, log_post, post)))
    if not need_kl:
        return log_joint, log_post, post, None, None
    return log_joint, log_post, post, kl, terms


def backward(x: Optional[Tensor], point: Tensor, scale: float, kl_shift: float, inv_var: Tensor,
             scaled_means: Tensor, post: Tensor, terms: Optional[Tensor], grad_joint: Optional[Tensor],
             grad_log_post: Optional[Tensor], grad_post: Optional[Tensor], grad_kl: Optional[Tensor],
             need_x: bool, need_point: bool, need_first: bool, need_second: bool, sum_blocks: bool = True):
    """``native_mixture.backward`` by the Triton kernel: (grad_x, grad_point, weight, kl_weight,
    first, second), each None where not asked for or zero by construction; without
    ``sum_blocks`` the last four are each block's sums, (blocks, G, C[, d]), for the caller to
    add up (a compiled graph fuses that sum with its use)."""
    groups, num_points, dim = point.shape
    clusters = inv_var.size(1)
    with_kl = grad_kl is not None and terms is not None
    if with_kl and x is None:
        raise ValueError("the KL's gradient needs the means x")
    grads = [None if g is None else g.contiguous() for g in (grad_joint, grad_log_post, grad_post, grad_kl)]
    grad_x = grad_point = None
    out_a = out_b = None
    a_with_mean = False
    if need_x and need_point:
        grad_x = out_a = torch.empty_like(point)
        a_with_mean = with_kl
    else:
        if need_point:
            grad_point = out_a = torch.empty_like(point)
        if need_x and with_kl:
            grad_x = out_b = torch.empty_like(point)
    blocks = triton.cdiv(num_points, block_shape(dim)[0])
    weight = point.new_empty(blocks, groups, clusters)
    kl_weight = point.new_empty(blocks, groups, clusters) if with_kl else None
    first = point.new_empty(blocks, groups, clusters, dim) if need_first or need_second else None
    second = point.new_empty(blocks, groups, clusters, dim) if need_second else None
    read = [inv_var.contiguous(), scaled_means.contiguous(), post.contiguous(),
            terms.contiguous() if with_kl and terms is not None else None]
    placeholder = post  # any tensor: a pointer the kernel never reads where its flag is off
    mean = x if with_kl and x is not None else point

    def pointer(t):
        return placeholder if t is None else t

    target_strides = [stride for t in (out_a, out_b) for stride in ((0, 0) if t is None else t.stride()[:2])]

    with record_function(KERNEL_EVENT_PREFIX + "gmm_backward"):
        _backward_kernel[(blocks, groups)](
            mean, point, *(pointer(t) for t in read), *(pointer(g) for g in grads),
            pointer(out_a), pointer(out_b), weight, pointer(kl_weight), pointer(first), pointer(second),
            mean.stride(0), mean.stride(1), point.stride(0), point.stride(1),
            *target_strides,
            groups, num_points, float(scale), float(kl_shift),
            WITH_KL=with_kl, HAS_GJ=grads[0] is not None, HAS_GLP=grads[1] is not None, HAS_GP=grads[2] is not None,
            HAS_A=out_a is not None, A_WITH_MEAN=a_with_mean, HAS_B=out_b is not None,
            NEED_FIRST=first is not None, NEED_SECOND=second is not None, **_shape_constants(point, clusters))
    report_traffic("gmm_backward", lambda: _traffic(
        point, (mean, point, read[2], read[3], *grads) if mean is not point else (point, read[2], read[3], *grads),
        read[:2], (out_a, out_b, weight, kl_weight, first, second)))
    sums = (weight, kl_weight, first, second)
    return (grad_x, grad_point, *(t if t is None or not sum_blocks else t.sum(0) for t in sums))
