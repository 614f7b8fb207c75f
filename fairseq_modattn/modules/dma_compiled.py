"""DMA's training forward as one compiled graph per module (``--dma-backend compile``, and
around its Triton kernels ``--dma-backend triton``).

On a GPU a DMA training step is launch-bound: every ATen call is a kernel launch (about 10 µs),
more than the arithmetic of the small per-token tables of the GMMs and regularisers. Here the
whole training forward of a ``DisentangledMaskAttention`` (projections, both GMMs with their
VaDE KLs, L_Dqq, L_Dxq, L_dv, the semantic mask and the interpolated attention) is one function
of tensors, ``dma_math``, which ``torch.compile(fullgraph=True, dynamic=True)`` turns into one
graph whose backward AOTAutograd derives; inductor fuses its elementwise work and reductions
into a few kernels, and only the attention's products stay ATen matmuls.

``dma_math`` restates, without custom autograd functions, what the eager module computes (the
same equations, docstrings of ``gmm``, ``mi_bounds`` and ``interpolated_attention``):

    GMM (gmm._MixtureStatistics), z = x + s eps:
        J = log N_c + sum_d z_d (mu_cd sigma_cd^-2 - z_d sigma_cd^-2 / 2),   LP = log_softmax_c J,
        KL = sum_c P (T + d log(2 pi) / 2) - d (log(2 pi) + 1 + log s^2) / 2,
        T + d log(2 pi) / 2 = -log N_c + s^2 tr_c / 2 + sum_d x_d (x_d sigma^-2 / 2 - mu sigma^-2) + LP;
    attention (Eq. 5-7): A^ V with A^ = lerp(softmax(S), softmax(S + log M), gamma);
    regularisers: ``mi_bounds`` (Eq. 9-14) in the forms the module is configured with.

Every contraction over the n_c clusters or the d coordinates of a head is written as a
broadcast product summed over that axis, not as a matmul: inductor fuses it with the
elementwise work around it (reductions of at most 8 terms are unrolled), where a matmul would
be an extern call with copies of its operands. The T x S products of the attention stay
matmuls, in the shared-logits form of the fused CPU kernel (one logit product for both
softmaxes, one value product) on every device: ``attention_impl`` does not apply here, and
the launches counted on the CPU approximate a GPU's (inductor's C++ and Triton code generators
fuse alike, though not identically; not measured on a GPU).

The random draws are made in the eager module's order and shapes (the token GMM's sample of
each side, the query sample, CLUB's negatives), so that the compiled and the eager forward see
the same numbers from the same generator state. On the CPU path they stay eager, around the
graph: there they come from the native Philox stream (``noise``), which a graph cannot call. On
the GPU path, under "attention" sampling (the authors' objective), the graph draws its noise
itself (``MathConfig.draws_noise``): inductor generates each draw inside the kernel that adds it
to its input, so that eps is never written to memory nor read back, and the two or three
``randn`` launches of each module become one draw of seeds per graph. (With CLUB's negatives,
which the eager module draws after the noise, or the token GMM's own group-major draws of
"gmm" sampling, the draws stay eager.) Inductor's random numbers are its own Philox stream, not
torch's generator: a test that compares the graph's draws with eager ones sets inductor's
``fallback_random``. Attention dropout, if any, is drawn inside the graph (``torch.rand`` on
the mixed weights, as the fused CPU kernel does; the kernels' own Philox stream with
``kernels``).

With ``MathConfig.kernels`` (``--dma-backend triton``) the attention and L_Dxq's critic are
Triton kernels called as operators (``triton_ops``): one pass over the keys each way, nothing
T x S, no checkpointing needed; the GMMs' backward is one pass over the points by
``mixture_triton``'s kernel (nothing points x C x d); inductor fuses everything else around them. A forward asked
for its weights keeps the matmul attention (the kernels build none).

Which forwards take the compiled path (``applies``): training forwards without incremental
state, weights or beams, with a 2-D (fairseq's future mask) or no attention mask, whose module
computes a mask or its regularisers; evaluation, validation and incremental decoding run the
eager module. The graph never sees a Python value that changes between batches: gamma is a
0-d tensor, padding masks are always tensors (all False without padding), the attention mask
is a contiguous tensor of its own, and all sizes are symbolic and independent (no duck sizing),
so the only recompiles are one per module configuration (attention type and flags).
A batch of one sentence or one token is an exception: torch specialises sizes 0 and 1, so such
a batch compiles its own graph once.

Memory: the token-pair tables (the attention's logits, both softmaxes, M and the mixed weights,
and L_Dxq's N x N critic) are computed inside ``torch.utils.checkpoint`` regions, so that the
graph's backward computes them again from the per-token inputs instead of keeping them, as the
eager module's autograd functions do. Left to itself, inductor's partitioner kept about three
B x H x T x S fp32 tables a module (peak memory 1.55-2.28 x the transformer's on an H200, against
eager's 1.26-1.42 x). Attention dropout's mask is drawn again from the saved generator state
(AOTAutograd functionalises random ops in checkpointed regions). Only a forward that returns the
per-head weights keeps one table besides them. Each sample is computed once and read by both its
consumers: the projection and the token GMM (with "attention" sampling), and the attention and
the query GMM (the sampled query q~). Two separate sums of the same values made backward keep the
noise as well as the sample.

Where ``torch.compile`` fails (no C++ compiler, an unsupported torch), the first failure is
logged in one line and every DMA module runs eagerly from then on.
"""

import contextlib
import inspect
import logging
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .device_paths import path_device
from .future_mask import is_future_mask
from .gmm import LOG_2PI, group_major_points
from .mi_bounds import _DIV_COEFFICIENTS, _PADDED_KEY_CRITIC, BOUNDED_QQ_EPS, sample_negatives
from .noise import standard_normal, standard_normal_like
from .precision import at_least_fp32
from .scalar_tensors import scalar_tensor
from .triton_support import draw_seed, kernel_device_error

logger = logging.getLogger(__name__)

#: ``torch.compile``'s backend: a test may choose "aot_eager" (the same graphs and derived
#: backward, run by ATen without generated kernels), or None: ``dma_math`` runs uncompiled
BACKEND = "inductor"


class MathConfig(NamedTuple):
    """What ``dma_math`` takes as constants of its graph (dynamo guards on their values, so
    modules of the same configuration share one graph)."""

    num_heads: int
    head_dim: int
    self_attention: bool
    noise_scale: float  # s, sqrt(noise_var)
    centroid_grad_mult: float
    query_gmm_scale: float
    sample_attention: bool  # sample_inputs == "attention"
    qq_form: str
    div_form: str
    per_sentence: bool
    need_aux: bool
    dropout: float
    weights: str  # what the caller asked for: "none", "mean" (over heads) or "heads"
    kernels: bool = False  # the T x S passes as Triton kernels (``triton_ops``; the "triton" backend)
    causal: bool = False  # the attention mask is fairseq's future mask (the kernels apply it as a rule)
    draws_noise: bool = False  # the graph draws the noise of "attention" sampling (``draws_noise_in_graph``)


# ----------------------------------------------------------------------------- the math
def _split(x: Tensor, heads: int, dim: int) -> Tensor:
    """(N, B, H d) -> (N, B, H, d): a view."""
    return x.view(x.size(0), x.size(1), heads, dim)


def _grouped(t: Tensor, groups: int, head_axis: int) -> Tensor:
    """Points (..., d) with the H heads on ``head_axis`` as the (G, M, d) points of G = H
    mixtures (head-major) or of one: a view where the layout allows."""
    if groups == 1:
        return t.reshape(1, -1, t.size(-1))
    return t.movedim(head_axis, 0).reshape(groups, -1, t.size(-1))


def _ungrouped(r: Tensor, points_shape: torch.Size, groups: int, head_axis: int) -> Tensor:
    """The (G, M, *) results of ``_grouped`` points back in the points' (..., *) order (a view)."""
    lead, tail = list(points_shape[:-1]), list(r.shape[2:])
    if groups == 1:
        return r.view(*lead, *tail)
    moved = [lead[head_axis]] + lead[:head_axis] + lead[head_axis + 1:]
    return r.view(*moved, *tail).movedim(0, head_axis)


def mixture_statistics(
    x: Tensor, z: Optional[Tensor], logits: Tensor, means: Tensor, log_vars: Tensor, cfg: MathConfig,
    need_kl: bool, head_axis: int,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """J, LP, P (..., C) and the VaDE KL (...) of points x (..., d), the H heads on ``head_axis``,
    sampled at z = x + s eps (None: at x), under the mixtures (G, C[, d]) with G = H or 1 (module
    docstring; the same equations as ``gmm._MixtureStatistics``, whose backward autograd derives
    here). The caller computes the sample: where the attention reads it too, one tensor serves
    both, so that backward needs it and x, and not the noise as well. With ``cfg.kernels`` the
    backward's pass over the points is ``mixture_triton``'s kernel (``_MixtureKernelBackward``)."""
    s, dim = cfg.noise_scale, cfg.head_dim
    dtype = x.dtype
    logits, means, log_vars = logits.to(dtype), means.to(dtype), log_vars.to(dtype)
    if cfg.centroid_grad_mult != 1.0:
        # the value of the means, their gradient times c_grad (fairseq's GradMultiply)
        means = means + (cfg.centroid_grad_mult - 1.0) * (means - means.detach())
    inv_var = torch.exp(-log_vars)  # (G, C, d)
    scaled_means = means * inv_var
    log_norm = torch.log_softmax(logits, -1) - 0.5 * (
        log_vars.sum(-1) + (means * scaled_means).sum(-1) + dim * LOG_2PI
    )  # log N_c, (G, C)
    kl_const = 0.5 * dim * (LOG_2PI + 1.0 + math.log(s * s))
    # T's constant: T = -offset + sum_d x_d (x_d sigma^-2 / 2 - mu sigma^-2) + LP (gmm.mixture_statistics)
    offset = log_norm - 0.5 * s * s * inv_var.sum(-1)
    if cfg.kernels and _gmm_kernels_take(x, logits.size(-1)):
        # (z None: x itself; dynamo takes no tensor twice as a Function's input)
        return _MixtureKernelBackward.apply(x, z, inv_var, scaled_means, log_norm, offset, kl_const, need_kl, head_axis)
    return _mixture_forward(x, x if z is None else z, inv_var, scaled_means, log_norm, offset, kl_const, need_kl)[:4]


def _mixture_forward(x: Tensor, point: Tensor, inv_var: Tensor, scaled_means: Tensor, log_norm: Tensor,
                     offset: Tensor, kl_const: float, need_kl: bool):
    """J, LP, P, KL and T (the KL's terms; both None without ``need_kl``) of ``mixture_statistics``
    as broadcast products summed over d, which inductor fuses with their neighbours."""
    zc = point.unsqueeze(-2)  # (..., 1, d) against the (G, C, d) constants
    log_joint = (zc * (scaled_means - 0.5 * zc * inv_var)).sum(-1) + log_norm
    log_post = torch.log_softmax(log_joint, -1)
    post = log_post.exp()
    if not need_kl:
        return log_joint, log_post, post, None, None
    xc = x.unsqueeze(-2)
    terms = (xc * (0.5 * xc * inv_var - scaled_means)).sum(-1) - offset + log_post
    return log_joint, log_post, post, (post * terms).sum(-1) - kl_const, terms


class _MixtureKernelBackward(torch.autograd.Function):
    """``mixture_statistics`` with the ``triton`` backend: the forward's broadcast products as
    ``_mixture_forward`` (inductor fuses them with their neighbours, as for ``compile``), the
    backward one pass over the points by ``mixture_triton``'s kernel
    (``triton_ops.mixture_statistics_backward``). Autograd's own backward of the broadcast
    products has inductor write points x C x d tensors for the constants' gradients (sums over
    the points of their products with z, x, z^2, x^2), several times a layer's input.

    With G^J' the gradient at J after the log-softmax and W = G^KL P (``mixture_triton``'s
    docstring), the kernel's per-block sums give: d log N_c = sum_i G^J', d offset = -sum_i W,
    d(mu sigma^-2) = sum_i (G^J' z - W x) = -first, d sigma^-2 = sum_i (W x^2 - G^J' z^2) / 2 =
    second / 2; and one gradient for x and z together (z = x + a constant)."""

    @staticmethod
    def forward(ctx, x, point, inv_var, scaled_means, log_norm, offset, kl_const, need_kl, head_axis):
        log_joint, log_post, post, kl, terms = _mixture_forward(
            x, x if point is None else point, inv_var, scaled_means, log_norm, offset, kl_const, need_kl)
        ctx.save_for_backward(x, point, inv_var, scaled_means, post, terms)
        ctx.head_axis = head_axis
        return log_joint, log_post, post, kl

    @staticmethod
    def backward(ctx, grad_joint, grad_log_post, grad_post, grad_kl):
        x, point, inv_var, scaled_means, post, terms = ctx.saved_tensors
        point = x if point is None else point
        groups, axis, shape = inv_var.size(0), ctx.head_axis, x.shape

        def grouped(t):  # the points: the kernel takes them strided
            return None if t is None else _grouped(t, groups, axis)

        def grouped_table(t):
            # the (..., C) tables laid out as the kernel reads them: a copy traced here is fused
            # into the kernel that makes t; one inside the operator would be a launch of its own
            return None if t is None else _grouped(t, groups, axis).contiguous()

        if terms is None:
            terms = post.new_empty(0)
            grad_kl = None
        else:
            terms = grouped_table(terms)
            grad_kl = None if grad_kl is None else grouped_table(grad_kl.unsqueeze(-1)).squeeze(-1)
        grad_x, weight, kl_weight, first, second = torch.ops.fairseq_modattn_ops.mixture_statistics_backward(
            grouped(x), grouped(point), inv_var, scaled_means, grouped_table(post), terms, grouped_table(grad_joint),
            grouped_table(grad_log_post), grouped_table(grad_post), grad_kl, 1.0 - 0.5 * x.size(-1) * LOG_2PI)
        weight, first, second = weight.sum(0), first.sum(0), second.sum(0)  # weight = sum_i (W - G^J')
        grad_offset = None
        if kl_weight.numel():
            kl_weight = kl_weight.sum(0)
            grad_log_norm, grad_offset = kl_weight - weight, -kl_weight
        else:
            grad_log_norm = -weight
        return (_ungrouped(grad_x, shape, groups, axis), None, 0.5 * second, -first, grad_log_norm, grad_offset,
                None, None, None)


def _gmm_kernels_take(x: Tensor, clusters: int) -> bool:
    """Whether ``mixture_triton``'s kernels take points like x (fp32 or fp64, C <= 16)."""
    from . import mixture_triton

    return x.dtype in (torch.float32, torch.float64) and clusters <= mixture_triton.MAX_CLUSTERS


def _token_mean(values: Tensor, valid: Tensor, per_sentence: bool) -> Tensor:
    """``mi_bounds.masked_token_mean`` of (B, H, N) values over the real tokens valid (B, N)."""
    keep = valid.unsqueeze(1).expand_as(values)
    kept = torch.where(keep, values, 0.0)
    if per_sentence:
        return kept.sum((1, 2)) / keep.sum((1, 2)).clamp_min(1)
    return kept.sum() / keep.sum().clamp_min(1)


def _token_weights(valid: Tensor, per_sentence: bool, dtype: torch.dtype) -> Tensor:
    """``mi_bounds._token_weights``: 1/n on real tokens (of the sentence or the batch), 0 elsewhere."""
    count = valid.sum(1, keepdim=True, dtype=dtype) if per_sentence else valid.sum(dtype=dtype)
    return valid / count.clamp_min(1.0)


def _weighted_token_sum(values: Tensor, weights: Tensor, per_sentence: bool) -> Tensor:
    """sum_i w_i v_i over the tokens of (B, N) values: per sentence (B,) or over the batch."""
    total = values * weights
    return total.sum(1) if per_sentence else total.sum()


def diversity_penalty(post: Tensor, valid: Tensor, form: str, per_sentence: bool) -> Tensor:
    """L_dv (``mi_bounds._DiversityPenalty``) of one (B, H, N, C) posterior: per sentence and head
    (alpha ||G||^2 + beta sum_i r_i^2 + tau sum_i r_i + gamma n) / n^k, G = C^T C, r_i = ||C_i||^2,
    averaged over heads, then per sentence or over the sentences with a real token."""
    alpha, beta, tau, gamma, power = _DIV_COEFFICIENTS[form]
    c = torch.where(valid[:, None, :, None], post, 0.0)
    gram = (c.unsqueeze(-1) * c.unsqueeze(-2)).sum(2)  # (B, H, C, C)
    rows = (c * c).sum(-1)  # r_i, (B, H, N)
    per_head = alpha * (gram * gram).sum((-1, -2)) + tau * rows.sum(-1)
    if beta:
        per_head = per_head + beta * (rows * rows).sum(-1)
    count = valid.sum(1, dtype=post.dtype)  # n, (B,)
    total = per_head.mean(1) + gamma * count
    denominator = count * count if power == 2 else count
    if not per_sentence:
        # the mean over the sentences that have a real token; a sentence without any gives 0 / 1
        denominator = denominator * (count > 0).sum(dtype=post.dtype)
        return (total / denominator.clamp_min(1.0)).sum()
    return total / denominator.clamp_min(1.0)


def infonce_bound(post: Tensor, valid: Tensor, per_sentence: bool, kernels: bool = False) -> Tensor:
    """L_Dxq (``mi_bounds._InfoNCEBound``): mean_i [f_ii - log mean_j exp f_ij] over the real
    tokens, f = Q Q^T over the real keys (a padded key's critic is -1e4); with ``kernels`` the
    scores f_ii - log sum_j exp f_ij by ``triton_ops.infonce_scores`` (no N x N table)."""
    if kernels:
        scores = torch.ops.fairseq_modattn_ops.infonce_scores(post, valid)[0].mean(1)
    else:
        c = torch.where(valid[:, None, :, None], post, 0.0)
        key_critic = torch.where(valid, 0.0, _PADDED_KEY_CRITIC)[:, None, None, :]  # (B, 1, 1, N)
        critic = (c.unsqueeze(-2) * c.unsqueeze(-3)).sum(-1) + key_critic  # (B, H, N, N)
        diagonal = (c * c).sum(-1) + key_critic[:, :, 0]  # f_ii, (B, H, N)
        scores = (diagonal - torch.logsumexp(critic, -1)).mean(1)  # (B, N)
    if per_sentence:
        count = valid.sum(1, dtype=post.dtype).clamp_min(1.0)
        return count.log() + (scores * valid).sum(1) / count
    weights = _token_weights(valid, False, post.dtype)
    log_count = torch.xlogy(valid, valid.sum(1, keepdim=True, dtype=post.dtype))
    return ((scores + log_count) * weights).sum()


def _log_pair_likelihood(log_a: Tensor, log_b: Tensor) -> Tensor:
    """log sum_c exp(a[b, h, i, c] + b[b, h', i, c]) -> (B, H, H', N), with the shifts and the
    clamp at log(tiny) of ``logspace.log_matmul_exp``."""
    shift_a = log_a.amax(-1, keepdim=True)
    shift_b = log_b.amax(-1, keepdim=True)
    inner = ((log_a - shift_a).exp().unsqueeze(2) * (log_b - shift_b).exp().unsqueeze(1)).sum(-1)
    return inner.clamp_min(torch.finfo(inner.dtype).tiny).log() + shift_a.unsqueeze(2).squeeze(-1) + (
        shift_b.unsqueeze(1).squeeze(-1)
    )


def head_dependence_bound(
    log_joint: Tensor, log_post: Tensor, post: Tensor, valid: Tensor, negatives: Optional[Tensor], cfg: MathConfig
) -> Tensor:
    """L_Dqq (``mi_bounds.head_dependence_bound``) of the query GMM's (B, H, N, C) statistics."""
    bsz, heads, length, _ = log_joint.shape
    per_sentence = cfg.per_sentence
    if heads < 2:
        return log_joint.new_zeros((bsz,) if per_sentence else ())
    off_diagonal = ~torch.eye(heads, dtype=torch.bool, device=log_joint.device)
    if cfg.qq_form == "bounded":
        logits = torch.where(valid[:, None, :, None], log_joint, torch.finfo(log_joint.dtype).min)
        token_given_c = torch.softmax(logits, 2)
        pair = (token_given_c.unsqueeze(2) * post.unsqueeze(1)).sum(-1)  # P[h, h'], (B, H, H', N)
        penalty = torch.where(off_diagonal[:, :, None], torch.log1p(BOUNDED_QQ_EPS - pair.clamp_max(1.0)), 0.0)
        per_token = penalty.sum((1, 2))  # (B, N)
        return _weighted_token_sum(per_token, _token_weights(valid, per_sentence, per_token.dtype), per_sentence) * (
            -1.0 / heads**2
        )
    # CLUB with one sampled negative per query (mi_bounds.head_dependence_estimates)
    masked = torch.where(valid[:, None, :, None], log_joint, float("-inf"))
    log_token_given_c = log_joint - torch.logsumexp(masked, 2, keepdim=True)
    positive = _log_pair_likelihood(log_token_given_c, log_post)
    index = negatives.view(bsz, 1, length, 1).expand(-1, heads, -1, log_joint.size(-1))
    negative = _log_pair_likelihood(log_token_given_c.gather(2, index), log_post)
    keep = valid[:, None, None, :]
    total = torch.where(keep, positive - negative, 0.0).sum(3 if per_sentence else (0, 3))
    count = valid.sum(1).view(-1, 1, 1) if per_sentence else valid.sum()
    estimates = total / count.clamp_min(1).to(total.dtype)  # (B|, H, H')
    clamped = torch.where(off_diagonal, estimates.clamp_min(0.0), 0.0)
    return clamped.sum((-1, -2)) / (heads * (heads - 1))


def interpolated_attention(
    q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, post_k: Tensor, attn_mask: Optional[Tensor],
    key_padding: Tensor, gamma: Tensor, dropout: float,
) -> Tuple[Tensor, Tensor]:
    """A^ V (``interpolated_attention``) and A^ (before dropout) for q (B, H, T, d), k, v
    (B, H, S, d) and posteriors (B, H, T|S, C); masks: fairseq's additive (T, S) attn_mask and
    the (B, S) key padding."""
    dtype = post_q.dtype
    logits = torch.matmul(q, k.transpose(-1, -2)).to(dtype) * q.size(-1) ** -0.5
    if attn_mask is not None:
        logits = logits + attn_mask.to(dtype)
    logits = logits.masked_fill(key_padding[:, None, None, :], float("-inf"))
    inner = (post_q.unsqueeze(-2) * post_k.unsqueeze(-3)).sum(-1)  # M, (B, H, T, S)
    log_m = inner.clamp_min(torch.finfo(dtype).tiny).log()
    weights = torch.lerp(torch.softmax(logits, -1), torch.softmax(logits + log_m, -1), gamma.to(dtype))
    mixed = weights
    if dropout > 0.0:
        keep = torch.rand(mixed.shape, device=mixed.device) >= dropout
        mixed = mixed * keep * (1.0 / (1.0 - dropout))
    return torch.matmul(mixed.to(v.dtype), v), weights


def dma_math(
    query: Tensor,
    key: Optional[Tensor],
    value: Optional[Tensor],
    attn_mask: Optional[Tensor],
    key_padding: Tensor,
    query_padding: Tensor,
    token_noise: Optional[Tensor],
    key_token_noise: Optional[Tensor],
    query_noise: Optional[Tensor],
    negatives: Optional[Tensor],
    gamma: Tensor,
    seed: Tensor,
    projections: Tuple[Optional[Tensor], ...],
    token_gmm: Tuple[Tensor, Tensor, Tensor],
    query_gmm: Tuple[Tensor, Tensor, Tensor],
    cfg: MathConfig,
) -> Tuple[Tensor, ...]:
    """One DMA module's training forward: (out (T, B, E),) and, with ``cfg.need_aux``, the
    regularisers KL, L_Dqq, L_Dxq, L_dv as ``DisentangledMaskAttention.regularisers`` gives them,
    then the weights that ``cfg.weights`` asks for.

    query (T, B, E); key, value (S, B, E) (None for self-attention: the query's input);
    key_padding (B, S) and query_padding (B, T): True on padding (all False without);
    token_noise: eps of the token GMM's sample of the queries' input, (T, B, E) with "attention"
    sampling (the projections read the sample too), else (T, B, H, d); key_token_noise: the
    same for the keys' input of encoder-decoder attention; query_noise (B, H, T, d): eps' of the
    query sample ("attention" sampling) or None; all three None with ``cfg.draws_noise``, where
    the graph draws them in that order; negatives (B, T): CLUB's sampled tokens (or
    None); gamma: 0-d; seed: the kernels' dropout key (``cfg.kernels``), 0-d int64 on the CPU;
    projections: (W, b) of q, k, v, out; token_gmm, query_gmm: (logits, means, log_vars)."""
    heads, dim, s = cfg.num_heads, cfg.head_dim, cfg.noise_scale
    wq, bq, wk, bk, wv, bv, wo, bo = projections
    dtype = at_least_fp32(query)
    tgt_len, bsz, embed = query.shape
    if key is None:
        key = value = query
    if cfg.draws_noise:  # drawn where inductor fuses each draw into the sum that reads it (module docstring)
        token_noise = torch.randn(query.shape, dtype=query.dtype, device=query.device)
        if not cfg.self_attention:
            key_token_noise = torch.randn(key.shape, dtype=key.dtype, device=key.device)
    sides = [(query, token_noise)] if cfg.self_attention else [(query, token_noise), (key, key_token_noise)]

    # projections; "attention" sampling: the queries' (encoder-decoder: also the keys') input is the sample
    def sample(x: Tensor, noise: Tensor) -> Tensor:
        return x + s * noise if cfg.sample_attention else x

    q_input = sample(query, token_noise)
    q = nn.functional.linear(q_input, wq, bq)
    k_input = key if cfg.self_attention else sample(key, key_token_noise)
    k = nn.functional.linear(k_input, wk, bk)
    v = nn.functional.linear(value, wv, bv)

    # the token GMM of each side's input (its clean input, sampled at x + s eps); with "attention"
    # sampling the projection's input is that sample (the eager GMM is given it as its point)
    stats = []
    for (x, noise), projected in zip(sides, (q_input, k_input)):
        x_heads = _split(x, heads, dim).to(dtype)
        z = _split(projected, heads, dim).to(dtype) if cfg.sample_attention else x_heads + s * noise.to(dtype)
        stats.append(mixture_statistics(x_heads, z, *token_gmm, cfg, cfg.need_aux, head_axis=2))
    q_stats, k_stats = stats[0], stats[-1]

    def heads_first(t: Tensor) -> Tensor:  # (N, B, H, *) -> (B, H, N, *)
        return t.permute(1, 2, 0, *range(3, t.dim()))

    q = heads_first(_split(q, heads, dim))
    k = heads_first(_split(k, heads, dim))
    v = heads_first(_split(v, heads, dim))

    if cfg.draws_noise:
        query_noise = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    # the query sample q~ = (u + s eps') / scale, read by the attention and (scaled) by the query GMM
    sampled_q = q if query_noise is None else q + query_noise * (s / cfg.query_gmm_scale)

    def query_gmm_space(t: Tensor) -> Tensor:
        return (t if cfg.query_gmm_scale == 1.0 else t * cfg.query_gmm_scale).to(dtype)

    aux: Tuple[Tensor, ...] = ()
    if cfg.need_aux:
        key_valid = ~key_padding
        query_valid = key_valid if cfg.self_attention else ~query_padding
        u = query_gmm_space(q)
        z_q = None if query_noise is None else query_gmm_space(sampled_q)
        log_joint, log_post, query_post, query_kl = mixture_statistics(u, z_q, *query_gmm, cfg, True, head_axis=1)
        token_post = heads_first(q_stats[2])
        kl = _token_mean(heads_first(q_stats[3]), query_valid, cfg.per_sentence)
        div = diversity_penalty(token_post, query_valid, cfg.div_form, cfg.per_sentence)
        if not cfg.self_attention:
            key_kl = _token_mean(heads_first(k_stats[3]), key_valid, cfg.per_sentence)
            key_div = diversity_penalty(heads_first(k_stats[2]), key_valid, cfg.div_form, cfg.per_sentence)
            both = 1.0 if cfg.per_sentence else 0.5
            kl, div = both * (kl + key_kl), both * (div + key_div)
        dqq = head_dependence_bound(log_joint, log_post, query_post, query_valid, negatives, cfg)
        aux = (
            kl + _token_mean(query_kl, query_valid, cfg.per_sentence),
            dqq,
            # its N x N critic is recomputed in backward (module docstring, "Memory"); the kernels build none
            infonce_bound(query_post, query_valid, cfg.per_sentence, True) if cfg.kernels else
            checkpoint(infonce_bound, query_post, query_valid, cfg.per_sentence, use_reentrant=False),
            div + diversity_penalty(query_post, query_valid, cfg.div_form, cfg.per_sentence),
        )

    if cfg.kernels:  # one pass over the keys forward and backward, nothing T x S in memory
        out = torch.ops.fairseq_modattn_ops.interpolated_attention(
            sampled_q, k, v, heads_first(q_stats[2]), heads_first(k_stats[2]), key_padding,
            None if cfg.causal else attn_mask, cfg.causal, gamma, cfg.dropout, seed,
        )[0]
        return (nn.functional.linear(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed), wo, bo), *aux)
    # recomputed in backward (module docstring, "Memory"), as the eager module's attention is
    out, weights = checkpoint(
        interpolated_attention, sampled_q, k, v, heads_first(q_stats[2]), heads_first(k_stats[2]), attn_mask,
        key_padding, gamma, cfg.dropout, use_reentrant=False,
    )
    out = nn.functional.linear(out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, embed), wo, bo)
    if cfg.weights == "none":
        return (out, *aux)
    # what MultiheadAttentionBase.forward returns: per head (H, B, T, S) or their mean (B, T, S)
    weights = weights.to(out.dtype)
    return (out, *aux, weights.transpose(0, 1) if cfg.weights == "heads" else weights.mean(1))


# ----------------------------------------------------------------------------- the module's side
#: the names of ``dma_math``'s regularisers, in its order (``DisentangledMaskAttention.regularisers``')
AUX_NAMES = ("kl", "dqq", "dxq", "div")


#: recompiles allowed per module configuration: its own graph, and one more for each size that
#: torch specialises (a batch of one sentence, sentences of one token)
RECOMPILE_LIMIT = 16


class _State:
    """The compiled ``dma_math`` of each module configuration (built at first use) and whether
    compiling failed."""

    compiled: Dict[MathConfig, object] = {}
    failed = False
    eager = False  # ``eager_forwards``


@contextlib.contextmanager
def eager_forwards():
    """Inside the block every DMA module runs its eager forward, as where compiling failed (the
    "triton" backend: its kernels with eager operators around them), for comparing that
    fallback with the graph (the tests' launch counts)."""
    previous, _State.eager = _State.eager, True
    try:
        yield
    finally:
        _State.eager = previous


def reset():
    """Forget the compiled functions and a failure (a test that changes ``BACKEND``)."""
    _State.compiled, _State.failed = {}, False


def compile_failed() -> bool:
    """Whether compiling failed in this process, so that DMA modules run eagerly (a benchmark
    asks: it may have silenced the log line)."""
    return _State.failed


def _compiled_math(cfg: MathConfig):
    """``dma_math`` compiled for ``cfg``'s modules. Where torch.compile can (torch >= 2.13), each
    configuration has a cache of its own: dynamo's recompile limit (8 graphs per function by
    default, and a hard error with fullgraph=True) then counts one configuration's graphs, not
    those of all the model's attention types together."""
    if cfg not in _State.compiled:
        if BACKEND is None:
            _State.compiled[cfg] = dma_math
        else:
            isolate: Dict[str, Any] = {}  # torch.compile keywords of newer torch releases
            if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
                isolate = dict(isolate_recompiles=True, recompile_limit=RECOMPILE_LIMIT)
            _State.compiled[cfg] = torch.compile(dma_math, fullgraph=True, dynamic=True, backend=BACKEND, **isolate)
    return _State.compiled[cfg]


def applies(module, query: Tensor, key: Optional[Tensor], incremental_state, attn_mask: Optional[Tensor],
            before_softmax: bool) -> bool:
    """Whether this forward of ``module`` (a DisentangledMaskAttention with backend "compile" or
    "triton") takes the compiled path (module docstring): training, no incremental state,
    fairseq's masks, and a mask or regularisers to compute."""
    if _State.failed or _State.eager or not module.training or incremental_state is not None or before_softmax:
        return False
    if not (module.collect_aux or module.gamma != 0.0):
        return False  # plain attention: nothing to compile
    if attn_mask is not None and (attn_mask.dim() != 2 or not attn_mask.is_floating_point()):
        return False
    if not module.self_attention and (key is None or key.size(1) != query.size(1)):
        return False
    return all(type(p) is nn.Linear for p in (module.q_proj, module.k_proj, module.v_proj, module.out_proj))


#: the kernels' dropout key where there is no dropout (a graph input all the same)
_NO_SEED = torch.zeros((), dtype=torch.int64)


def _projection_dtype(x: Tensor) -> torch.dtype:
    """The dtype of a projection of x: autocast's where it is on."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _gmm_draws(module, x: Tensor, concatenated: bool) -> Tensor:
    """The token GMM's own draws for the input x (N, B, E) as (N, B, H, d): eps of the point
    x[n, b, h], drawn as ``DiagonalGMM`` draws it (in the order its points lie in memory), or, for
    ``concatenated`` (encoder-decoder attention's sides), as ``token_states`` draws each side."""
    heads, dim = module.num_heads, module.head_dim
    dtype = at_least_fp32(x)
    if concatenated:
        draw = standard_normal((heads, x.size(0) * x.size(1), dim), dtype, x.device)
        return draw.view(heads, x.size(0), x.size(1), dim).permute(1, 2, 0, 3)
    points, restore = group_major_points(x.view(x.size(0), x.size(1), heads, dim).permute(1, 2, 0, 3).to(dtype), heads)
    drawn = restore(standard_normal(points.shape, dtype, x.device)).permute(2, 0, 1, 3)
    if not drawn.permute(2, 0, 1, 3).is_contiguous():
        # drawn for a batch-major input (the first layer's): laid out as for a token-major one,
        # the only layout the graph is compiled for (a view of an (H, N B, d) block, as dynamo
        # guards on a view's base too)
        points = torch.empty(heads, x.size(0) * x.size(1), dim, dtype=dtype, device=x.device)
        drawn = points.view(heads, x.size(0), x.size(1), dim).permute(1, 2, 0, 3).copy_(drawn)
    return drawn


def draws_noise_in_graph(cfg: MathConfig, query: Tensor) -> bool:
    """Whether ``dma_math`` draws its noise itself for ``query`` (module docstring): "attention"
    sampling on the GPU path (the CPU's noise is the native generator's), with no CLUB
    negatives to draw after the noise."""
    return cfg.sample_attention and path_device(query) != "cpu" and not (cfg.need_aux and cfg.qq_form == "club")


def config_of(module, weights: str, causal: bool = False) -> MathConfig:
    """The graph constants of ``module``'s forward; the "triton" backend's kernels serve a forward
    that returns no weights (the kernels keep none)."""
    return MathConfig(
        num_heads=module.num_heads,
        head_dim=module.head_dim,
        self_attention=module.self_attention,
        noise_scale=math.sqrt(module.noise_var),
        centroid_grad_mult=float(module.token_gmm.centroid_grad_mult),
        query_gmm_scale=float(module.query_gmm_scale),
        sample_attention=module.sample_inputs == "attention",
        qq_form=module.qq_form,
        div_form=module.div_form,
        per_sentence=module.per_sentence_losses,
        need_aux=module.collect_aux,
        dropout=float(module.dropout),
        weights=weights,
        kernels=module.backend == "triton" and weights == "none",
        causal=causal,
    )


def forward(module, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
            key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], need_weights: bool,
            need_head_weights: bool) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``module``'s training forward through the compiled ``dma_math`` (where ``applies``), with
    ``MultiheadAttentionBase.forward``'s arguments and result; sets ``module.aux_losses`` while
    ``collect_aux`` is on. None where compiling failed: the caller then runs the eager module."""
    weights = "heads" if need_head_weights else "mean" if need_weights else "none"
    tgt_len, bsz, _ = query.shape
    cfg = config_of(module, weights)
    if cfg.kernels:
        error = kernel_device_error(query)
        if error is not None:
            raise RuntimeError(error)
        from . import triton_ops  # noqa: F401 - registers the kernels' operators

        if attn_mask is not None and attn_mask.size(0) == attn_mask.size(1) and is_future_mask(attn_mask):
            # applied by the kernels as a rule: the graph reads no T x T table
            cfg, attn_mask = cfg._replace(causal=True), None
    self_attention = module.self_attention
    if self_attention:
        key = value = None
    cfg = cfg._replace(draws_noise=draws_noise_in_graph(cfg, query))

    # the random draws of the eager forward, in its order: the token GMM's sample of each side
    # (token_states), the query sample (attend), CLUB's negatives (regularisers); with
    # ``draws_noise`` the graph draws the noise (module docstring)
    token_noise = key_token_noise = query_noise = None
    if cfg.sample_attention and not cfg.draws_noise:
        token_noise = standard_normal_like(query)
        if not self_attention:
            key_token_noise = standard_normal_like(key)
    elif not cfg.sample_attention:
        token_noise = _gmm_draws(module, query, concatenated=not self_attention)
        if not self_attention:
            key_token_noise = _gmm_draws(module, key, concatenated=True)
    # One layout per input: the first layers of fairseq's encoder and decoder read a batch-major
    # view (T, B, E) of a (B, T, E) tensor, the others token-major tensors, and dynamo guards on
    # strides: a copy here (a launch, in those two layers) instead of a second graph.
    query = query.contiguous()
    if attn_mask is not None:
        # fairseq's decoder passes its future mask as the top-left T x T slice of a buffer as large
        # as the longest batch so far: a view, contiguous only while the batches grow, and dynamo
        # guards on a view's base. Contiguous and not a view (detach shares the storage), the
        # mask is one layout for every batch.
        attn_mask = attn_mask.contiguous().detach()
    if not self_attention:
        same = value is key
        key = key.contiguous()
        value = key if same else value.contiguous()
    if cfg.sample_attention and not cfg.draws_noise:
        shape = (bsz, module.num_heads, tgt_len, module.head_dim)
        query_noise = standard_normal(shape, _projection_dtype(query), query.device)
    src_len = tgt_len if self_attention else key.size(0)
    key_padding = (
        query.new_zeros((bsz, src_len), dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool()
    )
    query_padding_mask = key_padding_mask if self_attention else module.query_padding_mask
    if self_attention:  # the same tensor (as ``bool()`` of a bool mask is): no second all-False one
        query_padding = key_padding
    elif query_padding_mask is None:
        query_padding = query.new_zeros((bsz, tgt_len), dtype=torch.bool)
    else:
        query_padding = query_padding_mask.bool()
    negatives = None
    if cfg.need_aux and cfg.qq_form == "club":
        query_valid = None if query_padding_mask is None else ~query_padding
        negatives = sample_negatives(query_valid, bsz, tgt_len, query.device)

    projections = tuple(t for p in (module.q_proj, module.k_proj, module.v_proj, module.out_proj)
                        for t in (p.weight, p.bias))
    gmms = tuple((g.logits, g.means, g.log_vars) for g in (module.token_gmm, module.query_gmm))
    seed = _NO_SEED
    if cfg.kernels and cfg.dropout > 0.0:
        seed = torch.tensor(draw_seed())  # on the CPU: the kernels read it on the host
    args = (query, key, value, attn_mask, key_padding, query_padding, token_noise, key_token_noise, query_noise,
            negatives, scalar_tensor(module.gamma, query.device), seed, projections, *gmms, cfg)
    try:
        # The configuration's floats are constants of the graph: as symbolic floats (dynamic=True's
        # default) dynamo would specialise them one by one, restarting its analysis. Duck sizing
        # (on by default) would give sizes that are equal at the first call one symbol and guard
        # on their equality, so that the next batch recompiles: the bench's L = 128 equals its
        # head dimension, L = 512 its model dimension, a batch of 32 sentences a length of 32.
        # (a private module of torch, hence imported where a failure falls back to eager; it gets
        # ``patch`` at import, as dynamo's config does, but declares no type for it)
        from torch.fx.experimental import _config as fx_config

        no_duck_sizing = fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]
        with torch._dynamo.config.patch(specialize_float=True), no_duck_sizing:
            results = _compiled_math(cfg)(*args)
    except Exception as error:  # noqa: BLE001 - any failure of the compiler: run eagerly
        _State.failed = True
        summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
        logger.warning("--dma-compile: torch.compile failed (%s: %s); DMA attention runs eagerly",
                       type(error).__name__, summary[:300])
        return None
    if cfg.need_aux:
        module.aux_losses = dict(zip(AUX_NAMES, results[1:5]))
    return results[0], (results[-1] if weights != "none" else None)
