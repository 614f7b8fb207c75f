"""L_Dxq's token-pair critic as Triton kernels (``--dma-backend triton``): the scores of
``mi_bounds._InfoNCEBound`` and their gradient in one pass over the keys each, with no N x N
table in memory.

For query posteriors Q (B, H, N, C), the real tokens ``valid`` (B, N) and the critic
f_ij = <Q_i, Q_j> + k_j (k_j = 0 on a real key, ``mi_bounds._PADDED_KEY_CRITIC`` on a padded
one; padded tokens' Q count as 0, so whatever they hold reaches no sum),

    s_hi  = f_ii - lse_i,     lse_i = log sum_j exp f_ij                       (forward)
    dQ_i  = a [ 2 g_i Q_i - sum_j (g_i W_ij + g_j W_ji) Q_j ],   W_ij = exp(f_ij - lse_i)  (backward)

with g the incoming gradient of each token's score (``_InfoNCEBound``'s g is the same for every
head; the compiled graph's may differ by head) and a its scale. The forward kernel (a program
per block of queries of one head) keeps a running max and sum over key blocks and writes s and
lse; the backward kernel (the same programs) recomputes each tile's <Q_i, Q_j> once and uses
it for both W_ij and W_ji = exp(<Q_i, Q_j> + k_i - lse_j), so dQ needs no atomics and no second
pass. The products over the C clusters are broadcast sums (C is below ``tl.dot``'s inner size
on a GPU). Accumulation in fp32 (fp64 for fp64 posteriors).
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.profiler import record_function

from .interpolated_attention_triton import TL_DTYPES, _semantic_mask
from .triton_support import KERNEL_EVENT_PREFIX, KernelTraffic, report_traffic

BLOCK = 32
#: warps of each kernel's programs: the gradient kernel spilled 40 bytes of registers on sm_90
#: with 4 (benchmarks/triton_compile.py, fp32, C = 8), none with 8
WARPS = {"scores": 4, "gradient": 8}


def available(post: Tensor) -> bool:
    """Whether the kernels take these (B, H, N, C) posteriors: fp32 or fp64, C <= 16."""
    return post.dtype in TL_DTYPES and post.size(-1) <= 16


@triton.jit
def _key_critic(VALID, b, offs, ok, s_vb, PADDED: tl.constexpr, HAS_VALID: tl.constexpr, ACC: tl.constexpr):
    """k_j: 0 on a real key, PADDED on a padded one, -inf beyond the sentence; and whether each is real."""
    real = ok
    if HAS_VALID:
        real = real & (tl.load(VALID + b * s_vb + offs, mask=ok, other=0) != 0)
    critic = tl.where(real, 0.0, PADDED).to(ACC)
    return tl.where(ok, critic, float("-inf")), real


@triton.jit
def _scores_kernel(Q, VALID, SCORES, LSE, s_qb, s_qh, s_qn, s_qc, s_vb, H, N,
                   CLUSTERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_VALID: tl.constexpr,
                   PADDED: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < N
    own_critic, row_real = _key_critic(VALID, b, offs_m, row_ok, s_vb, PADDED, HAS_VALID, ACC)
    base = Q + b * s_qb + h * s_qh
    q_rows = base + offs_m * s_qn
    top = tl.full((BLOCK_M,), float("-inf"), ACC)
    total = tl.zeros((BLOCK_M,), ACC)
    diagonal = tl.zeros((BLOCK_M,), ACC)
    for c in tl.static_range(CLUSTERS):
        q_c = tl.load(q_rows + c * s_qc, mask=row_real, other=0.0).to(ACC)
        diagonal += q_c * q_c
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        key_critic, col_real = _key_critic(VALID, b, offs_n, col_ok, s_vb, PADDED, HAS_VALID, ACC)
        # <Q_i, Q_j>: the attention's M = P^q (P^k)^T with both sides the query posteriors
        f = _semantic_mask(q_rows, base + offs_n * s_qn, s_qc, s_qc, row_real, col_real, BLOCK_M, BLOCK_N,
                           CLUSTERS, ACC)
        f = f + key_critic[None, :]
        new_top = tl.maximum(top, tl.max(f, 1))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(f - new_top[:, None]), 1)
        top = new_top
    lse = top + tl.log(total)
    tl.store(LSE + bh * N + offs_m, lse, mask=row_ok)
    tl.store(SCORES + bh * N + offs_m, diagonal + own_critic - lse, mask=row_ok)


@triton.jit
def _gradient_kernel(Q, VALID, LSE, G, DQ, s_qb, s_qh, s_qn, s_qc, s_vb, s_gb, s_gh, s_gn, H, N, scale,
                     CLUSTERS: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_VALID: tl.constexpr, PADDED: tl.constexpr, ACC: tl.constexpr):
    """dQ (B, H, N, C), contiguous; G: g per head and token, (B, H, N) with strides (s_gb, s_gh,
    s_gn) (0 along an axis g is constant on)."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_C)
    row_ok = offs_m < N
    own_critic, row_real = _key_critic(VALID, b, offs_m, row_ok, s_vb, PADDED, HAS_VALID, ACC)
    base = Q + b * s_qb + h * s_qh
    q_rows = base + offs_m * s_qn
    lse_rows = tl.load(LSE + bh * N + offs_m, mask=row_ok, other=float("inf"))
    g_base = G + b * s_gb + h * s_gh
    g_rows = tl.load(g_base + offs_m * s_gn, mask=row_ok, other=0.0).to(ACC)
    grad = tl.zeros((BLOCK_M, BLOCK_C), ACC)
    for start in range(0, N, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        col_ok = offs_n < N
        key_critic, col_real = _key_critic(VALID, b, offs_n, col_ok, s_vb, PADDED, HAS_VALID, ACC)
        inner = _semantic_mask(q_rows, base + offs_n * s_qn, s_qc, s_qc, row_real, col_real, BLOCK_M, BLOCK_N,
                               CLUSTERS, ACC)
        lse_cols = tl.load(LSE + bh * N + offs_n, mask=col_ok, other=float("inf"))
        g_cols = tl.load(g_base + offs_n * s_gn, mask=col_ok, other=0.0).to(ACC)
        forward = tl.exp(inner + key_critic[None, :] - lse_rows[:, None])  # W_ij
        backward = tl.exp(inner + own_critic[:, None] - lse_cols[None, :])  # W_ji, laid out as (i, j)
        weight = g_rows[:, None] * forward + g_cols[None, :] * backward
        weight = tl.where(row_ok[:, None] & col_ok[None, :], weight, 0.0)
        for c in tl.static_range(CLUSTERS):
            k_c = tl.load(base + offs_n * s_qn + c * s_qc, mask=col_real, other=0.0).to(ACC)
            grad += tl.where(offs_c[None, :] == c, tl.sum(weight * k_c[None, :], 1)[:, None], 0.0)
    own = tl.load(q_rows[:, None] + offs_c[None, :] * s_qc, mask=row_real[:, None] & (offs_c < CLUSTERS)[None, :],
                  other=0.0).to(ACC)
    grad = scale * (2.0 * g_rows[:, None] * own - grad)
    tl.store(DQ + (bh * N + offs_m[:, None]) * CLUSTERS + offs_c[None, :], grad,
             mask=row_ok[:, None] & (offs_c < CLUSTERS)[None, :])


def _traffic(post: Tensor, valid: Optional[Tensor], extra_per_token: int, stored_per_token: int) -> KernelTraffic:
    """A pass over the keys for every block of queries: a token's Q (and validity byte) read
    once as a query and once per query block as a key, with ``extra_per_token`` more values
    each time (backward: lse and g); ``stored_per_token`` values stored (forward: s and lse)."""
    bsz, heads, length, clusters = post.shape
    size = post.element_size()
    token = (clusters + extra_per_token) * size + (0 if valid is None else 1)
    reads = 1 + triton.cdiv(length, BLOCK)
    once = bsz * heads * length * token
    return KernelTraffic(once * reads, bsz * heads * length * stored_per_token * size, reread=once * (reads - 1))


def _common(post: Tensor, valid: Optional[Tensor]) -> Tuple[Tensor, int, dict]:
    from .mi_bounds import _PADDED_KEY_CRITIC

    flags = dict(CLUSTERS=post.size(-1), BLOCK_M=BLOCK, BLOCK_N=BLOCK, HAS_VALID=valid is not None,
                 PADDED=float(_PADDED_KEY_CRITIC), ACC=TL_DTYPES[post.dtype])
    if valid is None:
        return post, 0, flags
    real = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    return real, real.stride(0), flags


def scores(post: Tensor, valid: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(s, lse), each (B, H, N): every token's score s_hi = f_ii - lse_i (module docstring)."""
    bsz, heads, length, _ = post.shape
    real, valid_stride, flags = _common(post, valid)
    out = post.new_empty(bsz, heads, length)
    lse = post.new_empty(bsz, heads, length)
    with record_function(KERNEL_EVENT_PREFIX + "infonce_forward"):
        _scores_kernel[(triton.cdiv(length, BLOCK), bsz * heads)](
            post, real, out, lse, *post.stride(), valid_stride, heads, length, num_warps=WARPS["scores"], **flags)
    report_traffic("infonce_forward", lambda: _traffic(post, valid, 0, 2))
    return out, lse


def gradient(post: Tensor, valid: Optional[Tensor], lse: Tensor, grad: Tensor, scale: float) -> Tensor:
    """dL/dQ (module docstring) for g = ``grad``: a scalar tensor, (B, 1) per sentence, (B, N)
    per token or (B, H, N) per head and token."""
    bsz, heads, length, clusters = post.shape
    real, valid_stride, flags = _common(post, valid)
    if grad.dim() < 3:
        grad = grad.expand(bsz, length).unsqueeze(1)  # stride 0 across the heads
    grad = grad.expand(bsz, heads, length)
    out = torch.empty(bsz, heads, length, clusters, dtype=post.dtype, device=post.device)
    with record_function(KERNEL_EVENT_PREFIX + "infonce_backward"):
        _gradient_kernel[(triton.cdiv(length, BLOCK), bsz * heads)](
            post, real, lse, grad, out, *post.stride(), valid_stride, *grad.stride(), heads, length,
            float(scale), BLOCK_C=max(2, triton.next_power_of_2(clusters)), num_warps=WARPS["gradient"], **flags)
    report_traffic("infonce_backward", lambda: _traffic(post, valid, 2, clusters))
    return out
