"""DMA's interpolated masked attention as Triton kernels: one pass over the keys, no T x S
tensor in memory, forward or backward (Chien & Huang, section 3.1, Eq. 5-7; the eager forms
are in ``interpolated_attention.py``).

For queries q (B, H, T, d), keys k and values v (B, H, S, d) and posteriors P^q (B, H, T, C),
P^k (B, H, S, C),

    S   = q k^T / sqrt(d) + masks,     M = P^q (P^k)^T,     S~ = S + log max(M, tiny),
    A   = softmax_j(S),                A~ = softmax_j(S~) = normalise_j(M * A),
    out = drop(A^) V,                  A^ = (1 - gamma) A + gamma A~,

where drop keeps each entry of A^ with probability 1 - p and scales it by 1 / (1 - p), the
keep mask drawn by Philox in the kernel from (seed, entry) and drawn again in backward.
log M is clamped at log(tiny) of the accumulation dtype as ``interpolated_attention.log_mask``
does (the form the SDPA path computes).

**Forward** (``_forward_kernel``, one program per block of BLOCK_M queries of one head): for
each block of BLOCK_N keys it computes S once, M from the (BLOCK_M, C) and (BLOCK_N, C)
posterior columns (C multiply-adds an entry: a broadcast sum, since a GPU's ``tl.dot`` needs an
inner size of at least 16), and updates two online softmaxes (running max and sum each) with
two accumulators of the dropped weights times V. It writes

    out = (1 - gamma) o + gamma o~,      o = drop(A) V,   o~ = drop(A~) V,
    diff = o~ - o (fp32),                lse = (m + log l, m~ + log l~) per query,

so that backward can recompute A and A~ from S without keeping them; a query whose keys are
all masked gets out = 0 (its lse is +inf, so its weights recompute as 0).

**Backward.** With G = dL/dA^ = drop'(dO V^T) (the keep mask and 1 / (1 - p)),
r = rowsum(G * A) = dO . o and r~ = rowsum(G * A~) = dO . o~ (o = out - gamma diff,
o~ = out + (1 - gamma) diff, read once per query block),

    dS = (1 - gamma) A * (G - r) + gamma A~ * (G - r~),      dS~ = gamma A~ * (G - r~),
    dM = dS~ / M (0 where M was clamped),
    dq = dS k / sqrt(d),   dk = dS^T q / sqrt(d),   dv = drop(A^)^T dO,
    dP^q = dM P^k,         dP^k = dM^T P^q.

Two kernels, each accumulating its outputs in registers over one loop (no atomics):
``_backward_query_kernel`` (a program per query block, over the keys: dq, dP^q, and r, r~,
which it stores) and then ``_backward_key_kernel`` (a program per key block, over the queries:
dk, dv, dP^k). Each recomputes S, M, A and A~ of its tiles: two more logit products, as a
flash attention's backward does.

Masks: a key padding mask (B, S) (left or right padding alike), fairseq's causal future mask
as a flag (the key loop then stops at the diagonal), or any other additive 2-D (T, S) mask,
read tile by tile. Dots run in the inputs' dtype with fp32 accumulation (fp64 for fp64
inputs), softmaxes, M and every statistic in the accumulation dtype; fp32 dots use TF32
only where torch's own matmuls do (``triton_support.dot_precision``).
"""

import functools
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.profiler import record_function

from .scalar_tensors import scalar_tensor
from .triton_support import KERNEL_EVENT_PREFIX, KernelTraffic, dot_precision, draw_seed, interpreting, report_traffic


class BlockConfig(NamedTuple):
    """Tile sizes and launch shape of the three kernels for one head width."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


def head_block(head_dim: int) -> int:
    """The padded head width the kernels tile: a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


#: tile sizes by padded head width (``head_block``), for the forward and the two backward kernels:
#: the largest that compile without register spills for sm_80 and sm_90 at the bench's shapes
#: (d = 128, C = 8) and at d <= 64, C <= 8, in fp32 and fp16 (benchmarks/triton_compile.py,
#: tests/test_triton_compile.py); 64 x 64 tiles spilled up to 2 KB. Larger heads are refused
#: (``check_shapes``).
FORWARD_CONFIGS = {16: BlockConfig(32, 32, 4, 2), 32: BlockConfig(32, 32, 4, 2), 64: BlockConfig(32, 32, 4, 2),
                   128: BlockConfig(32, 16, 4, 2)}
BACKWARD_CONFIGS = {16: BlockConfig(32, 32, 4, 2), 32: BlockConfig(32, 32, 4, 2), 64: BlockConfig(32, 32, 4, 2),
                    128: BlockConfig(16, 32, 4, 2)}
MAX_HEAD_DIM = max(FORWARD_CONFIGS)
#: the cluster counts the kernels unroll for (each a compiled variant)
MAX_CLUSTERS = 16


def check_shapes(q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, post_k: Tensor):
    """ValueError where the kernels cannot take these operands."""
    if q.size(-1) > MAX_HEAD_DIM or v.size(-1) != q.size(-1):
        raise ValueError(f"the Triton attention takes heads of at most {MAX_HEAD_DIM} units with values as wide "
                         f"as keys; got q {tuple(q.shape)}, v {tuple(v.shape)}")
    if post_q.size(-1) > MAX_CLUSTERS or post_q.size(-1) != post_k.size(-1):
        raise ValueError(f"the Triton attention takes at most {MAX_CLUSTERS} clusters, the same on both sides; "
                         f"got {post_q.size(-1)} and {post_k.size(-1)}")
    if q.size(-2) * k.size(-2) >= 2**31:
        raise ValueError(f"the Triton attention takes fewer than 2^31 query-key pairs a head, got "
                         f"{q.size(-2)} x {k.size(-2)}")
    if not all(t.stride(-1) == 1 for t in (q, k, v)):
        raise ValueError("the Triton attention needs q, k and v contiguous in their last axis")


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _dropout_keep(seed, pid_bh, offs_m, offs_n, S, dropout_p):
    """Which entries (offs_m, offs_n) of head ``pid_bh``'s A^ dropout keeps: Philox-4x32 keyed
    by ``seed`` on the counter (i S + j, head): 32-bit counters, so that a tile's randoms cost
    no 64-bit arithmetic (T S < 2^31, ``check_shapes``)."""
    entry = offs_m[:, None] * S + offs_n[None, :]
    zero = entry * 0
    bits, _, _, _ = tl.random.philox(seed, entry, zero + pid_bh, zero, zero)
    return tl.random.uint_to_uniform_float(bits) >= dropout_p


@triton.jit
def _load_rows(base, offs, stride, offs_d, ok, d_ok, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """A (rows, BLOCK_D) tile of a (rows, d) matrix with unit column stride, 0 outside it; in
    the accumulation dtype where the interpreter needs it (``UPCAST``)."""
    tile = tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(ACC)
    return tile


@triton.jit
def _masked_logits(q, k, offs_m, offs_n, row_ok, col_ok, pad_row, MASK, s_mt, s_ms, scale,
                   HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, ACC: tl.constexpr,
                   PRECISION: tl.constexpr):
    """S = q k^T / sqrt(d) + masks of one (BLOCK_M, BLOCK_N) tile, -inf where a key is padding
    (``pad_row``: the sentence's padding mask), after the query (causal), or out of range."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
    valid = row_ok[:, None] & col_ok[None, :]
    if HAS_PAD:
        pad = tl.load(pad_row + offs_n, mask=col_ok, other=1)
        valid = valid & (pad == 0)[None, :]
    if IS_CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if HAS_MASK:
        s += tl.load(MASK + offs_m[:, None] * s_mt + offs_n[None, :] * s_ms,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(ACC)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _semantic_mask(pq_rows, pk_rows, s_pqc, s_pkc, row_ok, col_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CLUSTERS: tl.constexpr, ACC: tl.constexpr):
    """M = P^q (P^k)^T of one tile from the posteriors' rows (``pq_rows``, ``pk_rows``: pointers
    to each row's first cluster), as C broadcast multiply-adds (a GPU's dot needs K >= 16)."""
    inner = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for c in tl.static_range(CLUSTERS):
        pq_c = tl.load(pq_rows + c * s_pqc, mask=row_ok, other=0.0).to(ACC)
        pk_c = tl.load(pk_rows + c * s_pkc, mask=col_ok, other=0.0).to(ACC)
        inner += pq_c[:, None] * pk_c[None, :]
    return inner


@triton.jit
def _forward_kernel(
    Q, K, V, PQ, PK, PAD, MASK, OUT, DIFF, LSE,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
    s_pqb, s_pqh, s_pqt, s_pqc, s_pkb, s_pkh, s_pkt, s_pkc,
    s_pad, s_mt, s_ms, s_ob, s_oh, s_ot, s_db, s_dh, s_dt,
    H, T, S, GAMMA, scale, dropout_p, keep_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CLUSTERS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr, TINY: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    gamma = tl.load(GAMMA).to(ACC)  # a 0-d tensor: a changing gamma recompiles no caller's graph
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    q = _load_rows(Q + b * s_qb + h * s_qh, offs_m, s_qt, offs_d, row_ok, d_ok, UPCAST, ACC)
    pq_base = PQ + b * s_pqb + h * s_pqh + offs_m * s_pqt
    pk_base = PK + b * s_pkb + h * s_pkh
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh

    m1 = tl.full((BLOCK_M,), float("-inf"), ACC)
    m2 = tl.full((BLOCK_M,), float("-inf"), ACC)
    l1 = tl.zeros((BLOCK_M,), ACC)
    l2 = tl.zeros((BLOCK_M,), ACC)
    acc1 = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    acc2 = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    hi = S
    if IS_CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = _load_rows(k_base, offs_n, s_kt, offs_d, col_ok, d_ok, UPCAST, ACC)
        v = _load_rows(v_base, offs_n, s_vt, offs_d, col_ok, d_ok, UPCAST, ACC)
        s = _masked_logits(q, k, offs_m, offs_n, row_ok, col_ok, PAD + b * s_pad, MASK, s_mt, s_ms, scale,
                           HAS_PAD, HAS_MASK, IS_CAUSAL, ACC, PRECISION)
        # two online softmaxes, one after the other so that one's tiles are dead before the
        # other's are made; a row with no unmasked key so far keeps max -inf, and its shift is
        # taken as 0 so that exp(-inf - shift) = 0 rather than NaN
        new1 = tl.maximum(m1, tl.max(s, 1))
        shift1 = tl.where(new1 == float("-inf"), 0.0, new1)
        p1 = tl.exp(s - shift1[:, None])
        rescale1 = tl.exp(m1 - shift1)
        l1 = l1 * rescale1 + tl.sum(p1, 1)
        m1 = new1
        if DROPOUT:
            keep = _dropout_keep(seed, pid_bh, offs_m, offs_n, S, dropout_p)
            p1 = tl.where(keep, p1, 0.0)
        acc1 = acc1 * rescale1[:, None] + tl.dot(p1.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)

        inner = _semantic_mask(pq_base, pk_base + offs_n * s_pkt, s_pqc, s_pkc, row_ok, col_ok, BLOCK_M, BLOCK_N,
                               CLUSTERS, ACC)
        s = s + tl.log(tl.maximum(inner, TINY))
        new2 = tl.maximum(m2, tl.max(s, 1))
        shift2 = tl.where(new2 == float("-inf"), 0.0, new2)
        p2 = tl.exp(s - shift2[:, None])
        rescale2 = tl.exp(m2 - shift2)
        l2 = l2 * rescale2 + tl.sum(p2, 1)
        m2 = new2
        if DROPOUT:
            p2 = tl.where(keep, p2, 0.0)
        acc2 = acc2 * rescale2[:, None] + tl.dot(p2.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)

    empty = l1 == 0.0
    # keep_scale: 1 / (1 - p) with dropout, else 1
    o1 = acc1 * tl.where(empty, 0.0, keep_scale / tl.where(empty, 1.0, l1))[:, None]
    o2 = acc2 * tl.where(empty, 0.0, keep_scale / tl.where(empty, 1.0, l2))[:, None]
    out = (1.0 - gamma) * o1 + gamma * o2
    out_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(OUT + b * s_ob + h * s_oh + offs_m[:, None] * s_ot + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=out_mask)
    tl.store(DIFF + b * s_db + h * s_dh + offs_m[:, None] * s_dt + offs_d[None, :], o2 - o1, mask=out_mask)
    lse1 = tl.where(empty, float("inf"), m1 + tl.log(tl.where(empty, 1.0, l1)))
    lse2 = tl.where(empty, float("inf"), m2 + tl.log(tl.where(empty, 1.0, l2)))
    tl.store(LSE + pid_bh * 2 * T + offs_m, lse1, mask=row_ok)
    tl.store(LSE + pid_bh * 2 * T + T + offs_m, lse2, mask=row_ok)


@triton.jit
def _backward_query_kernel(
    Q, K, V, PQ, PK, PAD, MASK, OUT, DIFF, LSE, DO, DQ, DPQ, R,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
    s_pqb, s_pqh, s_pqt, s_pqc, s_pkb, s_pkh, s_pkt, s_pkc,
    s_pad, s_mt, s_ms, s_ob, s_oh, s_ot, s_db, s_dh, s_dt, s_gb, s_gh, s_gt,
    H, T, S, GAMMA, scale, dropout_p, keep_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CLUSTERS: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr, TINY: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dq, dP^q and (r, r~) of one block of queries (module docstring); DQ and DPQ are
    contiguous (B, H, T, d) and (B, H, T, C), R is (B H, 2, T)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    gamma = tl.load(GAMMA).to(ACC)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    row_ok = offs_m < T
    d_ok = offs_d < HEAD_DIM
    md_mask = row_ok[:, None] & d_ok[None, :]
    q = _load_rows(Q + b * s_qb + h * s_qh, offs_m, s_qt, offs_d, row_ok, d_ok, UPCAST, ACC)
    do = _load_rows(DO + b * s_gb + h * s_gh, offs_m, s_gt, offs_d, row_ok, d_ok, UPCAST, ACC)
    out = _load_rows(OUT + b * s_ob + h * s_oh, offs_m, s_ot, offs_d, row_ok, d_ok, True, ACC)
    diff = _load_rows(DIFF + b * s_db + h * s_dh, offs_m, s_dt, offs_d, row_ok, d_ok, False, ACC)
    do_acc = do.to(ACC)
    r1 = tl.sum(do_acc * (out - gamma * diff), 1)
    r2 = tl.sum(do_acc * (out + (1.0 - gamma) * diff), 1)
    tl.store(R + pid_bh * 2 * T + offs_m, r1, mask=row_ok)
    tl.store(R + pid_bh * 2 * T + T + offs_m, r2, mask=row_ok)
    lse1 = tl.load(LSE + pid_bh * 2 * T + offs_m, mask=row_ok, other=float("inf"))
    lse2 = tl.load(LSE + pid_bh * 2 * T + T + offs_m, mask=row_ok, other=float("inf"))
    pq_base = PQ + b * s_pqb + h * s_pqh + offs_m * s_pqt
    pk_base = PK + b * s_pkb + h * s_pkh
    k_base = K + b * s_kb + h * s_kh
    v_base = V + b * s_vb + h * s_vh

    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    dpq = tl.zeros((BLOCK_M, BLOCK_C), ACC)
    hi = S
    if IS_CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < S
        k = _load_rows(k_base, offs_n, s_kt, offs_d, col_ok, d_ok, UPCAST, ACC)
        v = _load_rows(v_base, offs_n, s_vt, offs_d, col_ok, d_ok, UPCAST, ACC)
        s = _masked_logits(q, k, offs_m, offs_n, row_ok, col_ok, PAD + b * s_pad, MASK, s_mt, s_ms, scale,
                           HAS_PAD, HAS_MASK, IS_CAUSAL, ACC, PRECISION)
        inner = _semantic_mask(pq_base, pk_base + offs_n * s_pkt, s_pqc, s_pkc, row_ok, col_ok, BLOCK_M, BLOCK_N,
                               CLUSTERS, ACC)
        clamped = inner < TINY
        p1 = tl.exp(s - lse1[:, None])
        p2 = tl.exp(s + tl.log(tl.maximum(inner, TINY)) - lse2[:, None])
        g = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        if DROPOUT:
            keep = _dropout_keep(seed, pid_bh, offs_m, offs_n, S, dropout_p)
            g = tl.where(keep, g * keep_scale, 0.0)
        ds2 = gamma * p2 * (g - r2[:, None])
        ds = (1.0 - gamma) * p1 * (g - r1[:, None]) + ds2
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
        dm = tl.where(clamped, 0.0, ds2 / tl.where(clamped, 1.0, inner))
        for c in tl.static_range(CLUSTERS):
            pk_c = tl.load(pk_base + offs_n * s_pkt + c * s_pkc, mask=col_ok, other=0.0).to(ACC)
            dpq += tl.where(offs_c[None, :] == c, tl.sum(dm * pk_c[None, :], 1)[:, None], 0.0)

    tl.store(DQ + pid_bh * T * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=md_mask)
    tl.store(DPQ + pid_bh * T * CLUSTERS + offs_m[:, None] * CLUSTERS + offs_c[None, :],
             dpq.to(DPQ.dtype.element_ty), mask=row_ok[:, None] & (offs_c < CLUSTERS)[None, :])


@triton.jit
def _backward_key_kernel(
    Q, K, V, PQ, PK, PAD, MASK, LSE, DO, R, DK, DV, DPK,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt,
    s_pqb, s_pqh, s_pqt, s_pqc, s_pkb, s_pkh, s_pkt, s_pkc,
    s_pad, s_mt, s_ms, s_gb, s_gh, s_gt,
    H, T, S, GAMMA, scale, dropout_p, keep_scale, seed,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CLUSTERS: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr, TINY: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """dk, dv and dP^k of one block of keys (module docstring), reading the (r, r~) that
    ``_backward_query_kernel`` stored; DK, DV, DPK are contiguous (B, H, S, d|C)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    gamma = tl.load(GAMMA).to(ACC)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    col_ok = offs_n < S
    d_ok = offs_d < HEAD_DIM
    nd_mask = col_ok[:, None] & d_ok[None, :]
    k = _load_rows(K + b * s_kb + h * s_kh, offs_n, s_kt, offs_d, col_ok, d_ok, UPCAST, ACC)
    v = _load_rows(V + b * s_vb + h * s_vh, offs_n, s_vt, offs_d, col_ok, d_ok, UPCAST, ACC)
    pq_base = PQ + b * s_pqb + h * s_pqh
    pk_base = PK + b * s_pkb + h * s_pkh + offs_n * s_pkt

    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dpk = tl.zeros((BLOCK_N, BLOCK_C), ACC)
    lo = 0
    if IS_CAUSAL:
        lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M
    for start_m in range(lo, T, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        q = _load_rows(Q + b * s_qb + h * s_qh, offs_m, s_qt, offs_d, row_ok, d_ok, UPCAST, ACC)
        do = _load_rows(DO + b * s_gb + h * s_gh, offs_m, s_gt, offs_d, row_ok, d_ok, UPCAST, ACC)
        lse1 = tl.load(LSE + pid_bh * 2 * T + offs_m, mask=row_ok, other=float("inf"))
        lse2 = tl.load(LSE + pid_bh * 2 * T + T + offs_m, mask=row_ok, other=float("inf"))
        r1 = tl.load(R + pid_bh * 2 * T + offs_m, mask=row_ok, other=0.0)
        r2 = tl.load(R + pid_bh * 2 * T + T + offs_m, mask=row_ok, other=0.0)
        s = _masked_logits(q, k, offs_m, offs_n, row_ok, col_ok, PAD + b * s_pad, MASK, s_mt, s_ms, scale,
                           HAS_PAD, HAS_MASK, IS_CAUSAL, ACC, PRECISION)
        inner = _semantic_mask(pq_base + offs_m * s_pqt, pk_base, s_pqc, s_pkc, row_ok, col_ok, BLOCK_M, BLOCK_N,
                               CLUSTERS, ACC)
        clamped = inner < TINY
        p1 = tl.exp(s - lse1[:, None])
        p2 = tl.exp(s + tl.log(tl.maximum(inner, TINY)) - lse2[:, None])
        mixed = (1.0 - gamma) * p1 + gamma * p2
        g = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        if DROPOUT:
            keep = _dropout_keep(seed, pid_bh, offs_m, offs_n, S, dropout_p)
            g = tl.where(keep, g * keep_scale, 0.0)
            mixed = tl.where(keep, mixed * keep_scale, 0.0)
        dv += tl.dot(tl.trans(mixed.to(do.dtype)), do, input_precision=PRECISION, out_dtype=ACC)
        ds2 = gamma * p2 * (g - r2[:, None])
        ds = (1.0 - gamma) * p1 * (g - r1[:, None]) + ds2
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION, out_dtype=ACC)
        dm = tl.where(clamped, 0.0, ds2 / tl.where(clamped, 1.0, inner))
        for c in tl.static_range(CLUSTERS):
            pq_c = tl.load(pq_base + offs_m * s_pqt + c * s_pqc, mask=row_ok, other=0.0).to(ACC)
            dpk += tl.where(offs_c[None, :] == c, tl.sum(dm * pq_c[:, None], 0)[:, None], 0.0)

    base = pid_bh * S
    tl.store(DK + (base + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=nd_mask)
    tl.store(DV + (base + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=nd_mask)
    tl.store(DPK + (base + offs_n[:, None]) * CLUSTERS + offs_c[None, :], dpk.to(DPK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_c < CLUSTERS)[None, :])


# ----------------------------------------------------------------------------- launching
#: the accumulation dtypes the kernels take, as Triton names them (also the other kernel modules')
TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


class _Launch(NamedTuple):
    """What every kernel of one call shares: shapes, masks, scalars and compile-time flags."""

    heads: int
    tgt_len: int
    src_len: int
    pad: Tensor  # (B, S) uint8, or a 1-element placeholder
    pad_stride: int
    mask: Tensor  # (T, S) additive, or a 1-element placeholder
    mask_strides: tuple
    gamma: Tensor  # 0-d fp32 on the inputs' device (``scalar_tensors``)
    scale: float
    dropout_p: float
    seed: int
    flags: dict


def _strides(t: Tensor, axes: int = 3) -> tuple:
    return tuple(t.stride()[:axes])


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A one-element tensor to pass where a mask is absent: a pointer the kernels never read,
    made once per device and dtype rather than at every launch (each allocation a launch)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _prepare(q, k, v, post_q, key_padding_mask, attn_mask, causal, gamma, dropout_p, seed) -> _Launch:
    bsz, heads, tgt_len, head_dim = q.shape
    src_len = k.size(2)
    acc = torch.promote_types(torch.float32, q.dtype)
    pad, pad_stride = _placeholder(q.device, torch.uint8), 0
    if key_padding_mask is not None:
        pad = key_padding_mask.to(torch.uint8) if key_padding_mask.dtype == torch.bool else key_padding_mask
        pad_stride = pad.stride(0)
    mask, mask_strides = _placeholder(q.device, acc), (0, 0)
    if attn_mask is not None:
        mask, mask_strides = attn_mask, tuple(attn_mask.stride())
    flags = dict(
        HEAD_DIM=head_dim, BLOCK_D=head_block(head_dim), CLUSTERS=post_q.size(-1),
        HAS_PAD=key_padding_mask is not None, HAS_MASK=attn_mask is not None, IS_CAUSAL=causal,
        DROPOUT=dropout_p > 0.0, ACC=TL_DTYPES[acc], TINY=torch.finfo(acc).tiny,
        # the interpreter computes half-precision dots wrongly (Triton 3.7): it gets fp32 operands
        UPCAST=interpreting() and q.dtype not in (torch.float32, torch.float64),
        PRECISION=dot_precision(q.dtype),
    )
    if not torch.is_tensor(gamma):
        gamma = scalar_tensor(gamma, q.device)
    return _Launch(heads, tgt_len, src_len, pad, pad_stride, mask, mask_strides, gamma,
                   head_dim**-0.5, float(dropout_p), int(seed), flags)


def _common_strides(q, k, v, post_q, post_k, launch: _Launch) -> tuple:
    return (*_strides(q), *_strides(k), *_strides(v), *post_q.stride(), *post_k.stride(), launch.pad_stride,
            *launch.mask_strides)


def _scalars(launch: _Launch) -> tuple:
    keep_scale = 1.0 / (1.0 - launch.dropout_p)
    return (launch.heads, launch.tgt_len, launch.src_len, launch.gamma, launch.scale, launch.dropout_p, keep_scale,
            launch.seed)


def _query_block_keys(tgt_len: int, src_len: int, block_m: int, causal: bool) -> List[Tuple[int, int]]:
    """(queries, keys read) of each block of queries in a pass over the keys: all keys, or
    under the causal mask those up to the block's last query (the loop's bound ``hi``)."""
    blocks = []
    for start in range(0, tgt_len, block_m):
        rows = min(block_m, tgt_len - start)
        blocks.append((rows, min(src_len, start + block_m) if causal else src_len))
    return blocks


def _key_block_queries(tgt_len: int, src_len: int, block_m: int, block_n: int, causal: bool) -> List[Tuple[int, int]]:
    """(keys, queries read) of each block of keys in the pass over the queries (``lo``)."""
    blocks = []
    for start in range(0, src_len, block_n):
        lo = start // block_m * block_m if causal else 0
        blocks.append((min(block_n, src_len - start), tgt_len - lo))
    return blocks


def _loaded_again(blocks: List[Tuple[int, int]]) -> int:
    """Of the other side's rows that the blocks read (the second of each pair), those loaded
    after another block loaded them: each block reads a prefix (keys) or a suffix (queries) of
    them, so the block that reads most reads every row once."""
    counts = [n for _, n in blocks]
    return sum(counts) - max(counts)


def _traffic(kernel: str, q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, launch: _Launch) -> KernelTraffic:
    """The loads, stores and dot FLOPs of one launch of ``kernel`` ("forward", "queries" or
    "keys"), from the tiles its programs visit: a program's own rows once, the other side's rows
    once per program that reads them (``reread``: those loads beyond the first of each row)."""
    bsz, heads, tgt_len, dim = q.shape
    src_len = k.size(2)
    acc = 8 if q.dtype == torch.float64 else 4
    qe, ve, clusters = q.element_size(), v.element_size(), post_q.size(-1)
    pad = 1 if launch.flags["HAS_PAD"] else 0
    mask = launch.mask.element_size() if launch.flags["HAS_MASK"] else 0
    causal = launch.flags["IS_CAUSAL"]
    key_row = dim * (k.element_size() + ve) + clusters * acc + pad  # k, v, P^k and the padding of a key
    read = written = flops = reread = 0
    if kernel in ("forward", "queries"):
        config = (FORWARD_CONFIGS if kernel == "forward" else BACKWARD_CONFIGS)[launch.flags["BLOCK_D"]]
        own = dim * qe + clusters * acc  # q, P^q
        if kernel == "queries":
            own += dim * (ve + acc + qe) + 2 * acc  # out, diff, dO, lse
        blocks = _query_block_keys(tgt_len, src_len, config.block_m, causal)
        for rows, keys in blocks:
            read += rows * own + keys * key_row + rows * keys * mask
            flops += 2 * rows * keys * dim * 3  # q k^T, and two value products (forward) or dO v^T, dS k
        reread = _loaded_again(blocks) * key_row
        stored = dim * (ve + acc) + 2 * acc if kernel == "forward" else dim * qe + clusters * acc + 2 * acc
        written = tgt_len * stored
    else:
        config = BACKWARD_CONFIGS[launch.flags["BLOCK_D"]]
        query_row = dim * 2 * qe + clusters * acc + 4 * acc  # q, dO, P^q, lse and (r, r~)
        blocks = _key_block_queries(tgt_len, src_len, config.block_m, config.block_n, causal)
        for keys, queries in blocks:
            read += keys * key_row + queries * query_row + keys * queries * mask
            flops += 2 * keys * queries * dim * 4  # q k^T, dO v^T, dv, dk
        reread = _loaded_again(blocks) * query_row
        written = src_len * (dim * (k.element_size() + ve) + clusters * acc)
    heads_total = bsz * heads
    return KernelTraffic(read * heads_total, written * heads_total, flops * heads_total, reread * heads_total)


def forward(q, k, v, post_q, post_k, launch: _Launch):
    """out (B, H, T, d) in v's dtype, laid out as (T, B, H, d) so that fairseq's (T, B, E) view
    of it needs no copy; diff (B, H, T, d) fp32|fp64; lse (B H, 2, T)."""
    bsz, heads, tgt_len, head_dim = q.shape
    acc = torch.promote_types(torch.float32, q.dtype)
    out = v.new_empty(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
    diff = torch.empty(bsz, heads, tgt_len, head_dim, dtype=acc, device=q.device)
    lse = torch.empty(bsz * heads, 2, tgt_len, dtype=acc, device=q.device)
    config = FORWARD_CONFIGS[launch.flags["BLOCK_D"]]
    grid = (triton.cdiv(tgt_len, config.block_m), bsz * heads)
    with record_function(KERNEL_EVENT_PREFIX + "interpolated_attention_forward"):
        _forward_kernel[grid](
            q, k, v, post_q, post_k, launch.pad, launch.mask, out, diff, lse,
            *_common_strides(q, k, v, post_q, post_k, launch), *_strides(out), *_strides(diff), *_scalars(launch),
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
            **launch.flags,
        )
    report_traffic("interpolated_attention_forward", lambda: _traffic("forward", q, k, v, post_q, launch))
    return out, diff, lse


def backward(q, k, v, post_q, post_k, out, diff, lse, grad_out, launch: _Launch):
    """dq, dk, dv, dP^q, dP^k (contiguous, in the inputs' dtypes)."""
    bsz, heads, tgt_len, head_dim = q.shape
    src_len = k.size(2)
    clusters = post_q.size(-1)
    acc = lse.dtype
    grad_q = torch.empty(bsz, heads, tgt_len, head_dim, dtype=q.dtype, device=q.device)
    grad_k = torch.empty(bsz, heads, src_len, head_dim, dtype=k.dtype, device=q.device)
    grad_v = torch.empty(bsz, heads, src_len, head_dim, dtype=v.dtype, device=q.device)
    grad_pq = torch.empty(bsz, heads, tgt_len, clusters, dtype=post_q.dtype, device=q.device)
    grad_pk = torch.empty(bsz, heads, src_len, clusters, dtype=post_k.dtype, device=q.device)
    rows = torch.empty(bsz * heads, 2, tgt_len, dtype=acc, device=q.device)
    config = BACKWARD_CONFIGS[launch.flags["BLOCK_D"]]
    common = _common_strides(q, k, v, post_q, post_k, launch)
    shape = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
                 num_stages=config.num_stages, BLOCK_C=max(2, triton.next_power_of_2(clusters)), **launch.flags)
    with record_function(KERNEL_EVENT_PREFIX + "interpolated_attention_backward_queries"):
        _backward_query_kernel[(triton.cdiv(tgt_len, config.block_m), bsz * heads)](
            q, k, v, post_q, post_k, launch.pad, launch.mask, out, diff, lse, grad_out, grad_q, grad_pq, rows,
            *common, *_strides(out), *_strides(diff), *_strides(grad_out), *_scalars(launch), **shape,
        )
    with record_function(KERNEL_EVENT_PREFIX + "interpolated_attention_backward_keys"):
        _backward_key_kernel[(triton.cdiv(src_len, config.block_n), bsz * heads)](
            q, k, v, post_q, post_k, launch.pad, launch.mask, lse, grad_out, rows, grad_k, grad_v, grad_pk,
            *common, *_strides(grad_out), *_scalars(launch), **shape,
        )
    report_traffic("interpolated_attention_backward_queries", lambda: _traffic("queries", q, k, v, post_q, launch))
    report_traffic("interpolated_attention_backward_keys", lambda: _traffic("keys", q, k, v, post_q, launch))
    return grad_q, grad_k, grad_v, grad_pq, grad_pk


class TritonInterpolatedAttention(torch.autograd.Function):
    """out = drop(A^) V (module docstring) with the Triton kernels, forward and backward.

    Inputs: q (B, H, T, d), k and v (B, H, S, d), any strides with a contiguous last axis;
    posteriors P^q (B, H, T, C) and P^k (B, H, S, C) (fp32 or fp64); ``key_padding_mask``
    (B, S) True on padding or None; ``attn_mask`` an additive (T, S) mask or None; ``causal``:
    the mask j <= i (square, T = S); ``seed``: the dropout's Philox key. Gradients for q, k,
    v and both posteriors; ``out`` in v's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, post_q, post_k, key_padding_mask, attn_mask, causal, gamma, dropout_p, seed):
        launch = _prepare(q, k, v, post_q, key_padding_mask, attn_mask, causal, gamma, dropout_p, seed)
        out, diff, lse = forward(q, k, v, post_q, post_k, launch)
        ctx.launch = launch
        ctx.save_for_backward(q, k, v, post_q, post_k, out, diff, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, post_q, post_k, out, diff, lse = ctx.saved_tensors
        grads = backward(q, k, v, post_q, post_k, out, diff, lse, grad_out.contiguous(), ctx.launch)
        return (*grads, None, None, None, None, None, None)


def triton_interpolated_attention(
    q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, post_k: Tensor, key_padding_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None, causal: bool = False, gamma: Union[float, Tensor] = 0.5,
    dropout_p: float = 0.0, seed: Optional[int] = None,
) -> Tensor:
    """``TritonInterpolatedAttention`` (its docstring); ``gamma`` a float or a 0-d fp32 tensor
    on the inputs' device; ``seed`` None draws one from torch's CPU generator (so
    ``torch.manual_seed`` makes the dropout reproducible)."""
    check_shapes(q, k, v, post_q, post_k)
    if causal and q.size(2) != k.size(2):
        raise ValueError(f"the causal mask needs as many queries as keys, got {q.size(2)} and {k.size(2)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if seed is None:
        seed = draw_seed() if dropout_p > 0.0 else 0
    return TritonInterpolatedAttention.apply(q, k, v, post_q, post_k, key_padding_mask, attn_mask, causal,
                                             gamma, float(dropout_p), seed)


def dropout_keep_mask(bsz: int, heads: int, tgt_len: int, src_len: int, dropout_p: float, seed: int,
                      device: torch.device) -> Tensor:
    """The (B, H, T, S) keep mask the kernels draw for (dropout_p, seed): for tests, which
    build the eager reference from it."""
    keep = torch.empty(bsz * heads, tgt_len, src_len, dtype=torch.uint8, device=device)
    block = 64
    _keep_mask_kernel[(triton.cdiv(tgt_len, block), bsz * heads)](
        keep, tgt_len, src_len, dropout_p, seed, BLOCK_M=block, BLOCK_N=triton.next_power_of_2(max(src_len, 16)))
    return keep.view(bsz, heads, tgt_len, src_len).bool()


@triton.jit
def _keep_mask_kernel(KEEP, T, S, dropout_p, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, pid_bh, offs_m, offs_n, S, dropout_p)
    entry = (pid_bh.to(tl.int64) * T + offs_m[:, None]) * S + offs_n[None, :]
    tl.store(KEEP + entry, keep.to(tl.uint8), mask=(offs_m < T)[:, None] & (offs_n < S)[None, :])
