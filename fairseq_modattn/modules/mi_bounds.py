"""Mutual-information bounds and the diversity penalty of DMA (paper section 3.3, Eq. 9-14).

All functions take cluster statistics laid out ``(B, H, N, C)`` (batch, heads, tokens,
clusters) in fp32 and a boolean ``valid`` of shape ``(B, N)`` that is True on real tokens;
padded tokens never enter a sum, a normaliser or a count.

Every term has two reductions (``per_sentence``):
    * batch means (default): ``head_dependence_bound`` (L_Dqq) and ``infonce_bound`` (L_Dxq) are
      means over the real tokens of the batch (and over head pairs / heads);
      ``diversity_penalty`` (L_dv) is a mean over sentences and heads;
    * per sentence: a (B,) vector, each entry the same mean taken over one sentence's real
      tokens (zero for a sentence without any). The DMA authors' objective sums these over the
      batch's sentences and divides by the number of target tokens together with the
      cross-entropy (``models/dma_transformer.py`` does that reduction).

Two forms of L_Dqq (``form``) and of L_dv (``form``), the authors' code and the paper's text:

    L_Dqq "bounded" (the authors' code): for every head pair h != h' and real token i,
        p_i^{hh'} = min(1, p(q_i^h | q_i^h')),  L_Dqq = (1/H^2) sum_{h != h'} mean_i -log(1 + eps - p_i^{hh'})
    with eps = 1e-6: bounded below by 0, always pushing the probability that head h' predicts
    head h's query down (the paper, section 4.3, drops CLUB's negative term; the authors then
    penalise -log(1 - p) instead of log p, which is bounded). The 1/H^2 (not 1/(H(H-1))) is theirs.

    L_Dqq "club": the CLUB estimate with its negative term, clamped at 0 per head pair (below).

    L_dv "paper" (Eq. 14): (1/n) ||C C^T - I||_F^2 per sentence and head; it is O(n / n_c) for a
    sentence of n tokens spread over n_c clusters, so longer sentences weigh more.

    L_dv "entrywise" (the authors' code): the weighted mean over the n^2 entries,
        (1/n^2) sum_ij w_ij ((C C^T)_ij - delta_ij)^2,  w = 1.25 on the diagonal, 0.75 off it,
        = (1/n^2) [ 0.75 ||C C^T - I||_F^2 + 0.5 sum_i (||C_i||^2 - 1)^2 ],
    about n times smaller than Eq. 14 for an n-token sentence.

L_Dqq "club" (CLUB upper bound of I(q^h; q^h'), Eq. 9, 12, 13). For heads h != h' and tokens i, j
of a sentence of n real tokens,

    p(q_j^h | c)      = p(q_j^h, c) / sum_j' p(q_j'^h, c)            (tokens of the sentence)
    S_ij             = p(q_j^h | q_i^h') = sum_c p(q_j^h | c) Q_ic^h'
    I_hh'            = mean_i [ log S_ii - (1/n) sum_j log S_ij ]      (real tokens of the batch)
    L_Dqq            = mean_{h != h'} max(0, I_hh'),

where p(q, c) = pi_c N(q; mu_c, sigma_c^2) is the query GMM's joint and Q^h' its posterior for
head h'. Three deliberate departures from a literal reading of the paper (docs/design.md, "DMA"):
    * the normaliser of p(. | c) uses head h's own joint, so that it is a distribution over the
      sentence's tokens (with h' there it is not normalised);
    * the negative-pair term (1/n) sum_j log S_ij of CLUB is kept. Without it (the paper drops
      it) the term is an unbounded log-likelihood: with c_qq = 100 a tiny model on Multi30k
      drove it from -5 to -5e5 in 150 updates, the KL exploded with it and cross-entropy
      stopped improving. With it, L_Dqq is 0 when head h' tells nothing about which token
      head h saw, which is what minimising the bound asks for.
    * each head pair's estimate I_hh' is clamped at 0. A mutual information is never negative;
      CLUB's estimate is, where its conditional model S (same-cluster, from one shared GMM)
      cannot describe the heads, and minimising it then rewards making S_ii improbable with
      no limit. Unclamped, the tiny DMA model on Multi30k (c_qq = 50) drove L_Dqq from -0.2
      to -14 in 300 updates in fp32, its per-token gradient norm from 80 to 1e5 (fp16 overflows
      at any loss scale) and the total loss to -990, while nll_loss stalled at 7.7 (transformer
      6.5); clamped, L_Dqq goes to 0, the gradient norm stays below 60 and nll_loss reaches
      7.4. A pair below 0 therefore adds neither value nor gradient; the estimate is a mean
      over the batch's tokens first, so single tokens may still be below 0.
The exact mean over j needs S of shape (B, H, H, n, n) (H attention maps per head); training
replaces it by one sampled j per query (``negatives``), so that no n x n table is built.

L_Dxq (InfoNCE lower bound of I(x; q), Eq. 10), per head and sentence of n tokens,

    f_ij = sum_c Q_ic Q_jc,     L_Dxq = mean_i [ f_ii - log( (1/n) sum_j exp f_ij ) ].

L_dv with C the (n x n_c) posterior matrix of a sentence and head uses

    ||C C^T - I||_F^2 = ||C^T C||_F^2 - 2 ||C||_F^2 + n,

which needs only the n_c x n_c Gram matrix (no n x n table), in both forms.

On a GPU each operator call is at least one kernel launch (about 10 µs), more than the
arithmetic of these small tensors, so L_dv, L_Dxq and the bounded L_Dqq are each one
``torch.autograd.Function`` with an analytic backward, written in few operator calls: sums
scaled by constants are accumulated by ``baddbmm`` (its alpha and beta carry the constants),
masks come from ``torch.where`` on the bool mask (no float copy of it), and the token counts are
computed once, from ``valid``, as weights that the backward reuses.
"""

import functools
import math
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import blocking
from .device_paths import path_device
from .logspace import log_matmul_exp
from .precision import at_least_fp32


def in_fp32(bound):
    """Run ``bound`` with autocast off and its floating-point inputs (also those in a list or tuple
    argument) in at least fp32: under ``--amp`` or bf16 autocast the critic and Gram matmuls
    would otherwise run in half precision (a 4e-3 relative error on L_Dxq in bf16), although the
    result is fp32."""

    @functools.wraps(bound)
    def fp32_bound(*args, **kwargs):
        def widen(t):
            if isinstance(t, (list, tuple)):
                return type(t)(map(widen, t))
            return t.to(at_least_fp32(t)) if torch.is_tensor(t) and t.is_floating_point() else t

        device = next(t.device.type for t in _tensors(args))
        with torch.autocast(device_type=device, enabled=False):
            return bound(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()})

    return fp32_bound


def _tensors(args):
    """The tensors among ``args``, also those inside lists and tuples."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            yield from _tensors(arg)
        elif torch.is_tensor(arg):
            yield arg


QQ_FORMS = ("bounded", "club")
DIV_FORMS = ("entrywise", "paper")
#: eps of the bounded L_Dqq, -log(1 + eps - p): keeps it finite where p reaches 1
BOUNDED_QQ_EPS = 1e-6


def masked_token_mean(values: Tensor, valid: Optional[Tensor], per_sentence: bool = False) -> Tensor:
    """Mean of ``values`` (B, H, N) over heads and the real tokens given by ``valid`` (B, N);
    with ``per_sentence`` one mean per sentence, shape (B,) (0 for a sentence without any)."""
    if valid is None:
        return values.mean((1, 2)) if per_sentence else values.mean()
    keep = valid.unsqueeze(1).expand_as(values)
    # where(), not a product: a padded entry may be +-inf and 0 * inf is NaN.
    kept = torch.where(keep, values, 0.0)
    # the count, H n, is the expanded mask's sum: one reduction, no product with H
    if per_sentence:
        return kept.sum((1, 2)) / keep.sum((1, 2)).clamp_min(1)
    return kept.sum() / keep.sum().clamp_min(1)


def _token_weights(valid: Tensor, per_sentence: bool, dtype: torch.dtype) -> Tensor:
    """(B, N) weights of a mean over the real tokens: 1/n_b on sentence b's real tokens with
    ``per_sentence`` (1/N_real of the batch without), 0 on padding and in a sentence without real
    tokens (its count is clamped to 1, so no 0/0)."""
    count = valid.sum(1, keepdim=True, dtype=dtype) if per_sentence else valid.sum(dtype=dtype)
    return valid / count.clamp_min(1.0)


def _neg_inf_padding(log_values: Tensor, valid: Optional[Tensor], token_dim: int) -> Tensor:
    """Set padded tokens of a log-space tensor to -inf along ``token_dim`` (for logsumexp)."""
    if valid is None:
        return log_values
    shape = [1] * log_values.dim()
    shape[0] = valid.size(0)
    shape[token_dim] = valid.size(1)
    return log_values.masked_fill(~valid.view(shape), float("-inf"))


def sample_negatives(valid: Optional[Tensor], batch: int, length: int, device=None) -> Tensor:
    """One token index j per (sentence, position), uniform over the sentence's real tokens.

    Returns a (B, N) LongTensor. Uses torch's global generator (fairseq seeds it per update, so
    a resumed run draws the same indices). Positions of an all-padding sentence get index 0.
    """
    if valid is None:
        return torch.randint(length, (batch, length), device=device)
    counts = valid.sum(1, keepdim=True)  # (B, 1)
    ranks = (torch.rand(batch, length, device=valid.device) * counts).long().clamp_max_(length - 1)
    # the r-th real token: the first position whose running count of real tokens exceeds r
    running = valid.long().cumsum(1)
    return torch.searchsorted(running, ranks + 1).clamp_max_(length - 1)


def _log_pair_likelihood(log_token_given_c: Tensor, log_post: Tensor) -> Tensor:
    """log sum_c p(q_j^h | c) Q_ic^h' for aligned (B, H, N, C) inputs -> (B, H, H', N).

    An (H x C) @ (C x H') product per token in log space (no (B, H, H', N, C) tensor).
    """
    per_token = log_matmul_exp(log_token_given_c.transpose(1, 2), log_post.transpose(1, 2))  # (B, N, H, H')
    return per_token.permute(0, 2, 3, 1)


@in_fp32
def head_dependence_bound(
    log_joint: Tensor,
    log_post: Tensor,
    valid: Optional[Tensor],
    negatives: Optional[Tensor] = None,
    form: str = "club",
    per_sentence: bool = False,
) -> Tensor:
    """L_Dqq in ``form`` "club" (the CLUB estimates of I(q^h; q^h'), each clamped at 0,
    averaged over the head pairs h != h') or "bounded" (the authors' -log(1 - p), see the module
    doc; ``negatives`` is not used); arguments as in ``head_dependence_estimates``."""
    num_heads = log_joint.size(1)
    if form not in QQ_FORMS:
        raise ValueError(f"L_Dqq form must be one of {QQ_FORMS}, got {form!r}")
    if num_heads < 2:
        return log_joint.new_zeros((log_joint.size(0),) if per_sentence else ())
    if form == "bounded":
        return _BoundedHeadDependence.apply(log_joint, log_post, valid, per_sentence)
    off_diagonal = ~torch.eye(num_heads, dtype=torch.bool, device=log_joint.device)
    estimates = head_dependence_estimates(log_joint, log_post, valid, negatives, per_sentence)
    return estimates.clamp_min(0.0)[..., off_diagonal].mean(-1)


class _BoundedHeadDependence(torch.autograd.Function):
    """The bounded L_Dqq (module doc) of ``(log_joint, log_post, valid, per_sentence)``:

        T_hic = p(q_i^h | c) = softmax_i(log p(q_i^h, c)) over the sentence's real tokens,
        P_i[h, h'] = sum_c T_hic Q_ic^h',    L = -(1/H^2) sum_i w_i sum_{h != h'} log1p(eps - min(P, 1)),

    with w the weights of the mean over real tokens (``_token_weights``). Backward, with
    F_i[h, h'] = w_i [P <= 1] / (H^2 (1 + eps - min(P, 1))) off the diagonal (0 on it):

        dL/dT_i = F_i Q_i,    dL/dQ_i = F_i^T T_i,
        dL/dlog p(q, c) = softmax backward of dL/dT,    dL/dlog Q = Q * dL/dQ.

    Padded tokens enter the softmax as the dtype's minimum, not -inf: their T is exactly 0 next
    to a real token, and a sentence without real tokens gets a finite (uniform) T instead of NaN
    (its weights are 0, so it adds neither value nor gradient). ``log_post`` is a log-probability
    on padded tokens too (Q <= 1), so their P = sum_c 0 * Q is exactly 0 whatever they hold.
    """

    @staticmethod
    def forward(ctx, log_joint, log_post, valid, per_sentence):
        bsz, heads, length, _ = log_joint.shape
        logits = log_joint
        if valid is not None:
            logits = torch.where(valid.view(bsz, 1, length, 1), log_joint, torch.finfo(log_joint.dtype).min)
        token_given_c = torch.softmax(logits, 2)
        post = log_post.exp()
        # in linear space: both factors lie in [0, 1], and a product that underflows to 0 gives
        # the penalty's minimum, -log(1 + eps)
        pair = torch.matmul(token_given_c.transpose(1, 2), post.transpose(1, 2).transpose(-1, -2))  # (B, N, H, H')
        gap = torch.rsub(pair.clamp_max(1.0), BOUNDED_QQ_EPS)  # eps - min(p, 1)
        log_gap = torch.log1p(gap)  # the penalty, negated
        log_gap.diagonal(dim1=-2, dim2=-1).zero_()
        per_token = log_gap.sum((-1, -2))  # (B, N)
        norm, weights = 1.0 / heads**2, None
        if valid is None:
            out = (per_token.mean(-1) if per_sentence else per_token.mean()) * -norm
            norm /= max(length, 1) * (1 if per_sentence else bsz)  # the token mean's, for backward
        else:
            weights = _token_weights(valid, per_sentence, per_token.dtype)
            rows = bsz if per_sentence else 1
            # beta = 0: baddbmm ignores its (uninitialised) input
            out = torch.baddbmm(
                per_token.new_empty(()), per_token.view(rows, 1, -1), weights.view(rows, -1, 1), beta=0.0, alpha=-norm
            ).view(_out_shape(bsz, per_sentence))
        ctx.norm, ctx.per_sentence = norm, per_sentence
        ctx.save_for_backward(token_given_c, post, pair, gap, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            token_given_c, post, pair, gap, weights = ctx.saved_tensors
            bsz = pair.size(0)
            grad = grad * ctx.norm
            if ctx.per_sentence:
                grad = grad.view(bsz, 1)
            if weights is not None:
                grad = grad * weights
            factor = torch.div(grad.view(*grad.shape, 1, 1), gap.add(1.0))  # dL/dP
            factor.masked_fill_(pair > 1.0, 0.0)  # clamp_max passes no gradient above 1
            factor.diagonal(dim1=-2, dim2=-1).zero_()
            grad_t = torch.matmul(factor, post.transpose(1, 2))  # (B, N, H, C)
            grad_q = torch.matmul(factor.transpose(-1, -2), token_given_c.transpose(1, 2))  # (B, N, H', C)
            # T * (dL/dT - sum_j T_j dL/dT_j) over the tokens, in one operator call
            grad_log_joint = torch._softmax_backward_data(grad_t.transpose(1, 2), token_given_c, 2, token_given_c.dtype)
            # post first: the product takes its (contiguous) layout, not grad_q's transposed one
            return grad_log_joint, post * grad_q.transpose(1, 2), None, None


def _out_shape(bsz: int, per_sentence: bool):
    return (bsz,) if per_sentence else ()


def _log_token_given_cluster(log_joint: Tensor, valid: Optional[Tensor]) -> Tensor:
    """log p(q_j^h | c): the joint normalised over the sentence's real tokens j."""
    masked_joint = _neg_inf_padding(log_joint, valid, token_dim=2)
    return log_joint - torch.logsumexp(masked_joint, dim=2, keepdim=True)


def head_dependence_estimates(
    log_joint: Tensor,
    log_post: Tensor,
    valid: Optional[Tensor],
    negatives: Optional[Tensor] = None,
    per_sentence: bool = False,
) -> Tensor:
    """(H, H') CLUB estimates I_hh' of I(q^h; q^h'), unclamped (the diagonal is not used);
    with ``per_sentence`` one set per sentence, (B, H, H').

    ``log_joint`` and ``log_post`` (B, H, N, C): the query GMM's log p(q_i^h, c) and log Q_ic^h.

    ``negatives`` (B, N), optional: the token j used for the negative term of query i (from
    ``sample_negatives``), which replaces the mean over all j by one uniform sample, the
    sampled CLUB of Cheng et al. (2020, section 3.2): the same value in expectation, with an
    unbiased gradient, in O(H^2 N C) memory instead of the (B, H, H, N, N) table of all pairs.
    Training uses it; without it (evaluation, tests) the mean over j is exact.
    """
    num_heads = log_joint.size(1)
    log_token_given_c = _log_token_given_cluster(log_joint, valid)
    positive = _log_pair_likelihood(log_token_given_c, log_post)  # log S_ii, (B, H, H', N)
    if negatives is not None:
        index = negatives.view(negatives.size(0), 1, -1, 1).expand(-1, num_heads, -1, log_joint.size(-1))
        negative = _log_pair_likelihood(log_token_given_c.gather(2, index), log_post)  # log S_{i j_i}
    else:
        # log S[b, h, h', i, j] = log sum_c p(q_j^h | c) Q_ic^h'  -> (B, H, H', N, N)
        log_s = log_matmul_exp(log_post.unsqueeze(1), log_token_given_c.unsqueeze(2))
        if valid is None:
            negative = log_s.mean(-1)
        else:
            keep = valid.view(valid.size(0), 1, 1, 1, valid.size(1))
            negative = torch.where(keep, log_s, log_s.new_zeros(())).sum(-1)
            negative = negative / valid.sum(1).clamp_min(1).to(log_s.dtype).view(-1, 1, 1, 1)
    return _pair_token_mean(positive - negative, valid, per_sentence)


def _pair_token_mean(values: Tensor, valid: Optional[Tensor], per_sentence: bool = False) -> Tensor:
    """(B, H, H', N) -> (H, H'): the mean over the batch's real tokens for each head pair;
    with ``per_sentence`` (B, H, H'), the mean over each sentence's real tokens."""
    token_axes = (3,) if per_sentence else (0, 3)
    if valid is None:
        return values.mean(token_axes)
    keep = valid.view(valid.size(0), 1, 1, valid.size(1))
    total = torch.where(keep, values, values.new_zeros(())).sum(token_axes)
    count = valid.sum(1).view(-1, 1, 1) if per_sentence else valid.sum()
    return total / count.clamp_min(1).to(values.dtype)


#: the critic of a padded key (its posterior is masked to 0, so f_ij = 0): next to a real key its
#: exp underflows to exactly 0 in fp32 and fp64 (the row's maximum is at least f_ii = ||Q_i||^2
#: >= 0), and unlike -inf it leaves a sentence without real keys a finite, uniform softmax, so
#: that no NaN reaches the gradient
_PADDED_KEY_CRITIC = -1e4


class _InfoNCEBound(torch.autograd.Function):
    """L_Dxq (``infonce_bound``) of ``(post, valid, per_sentence)``. With the score of token i
    and head h

        s_hi = f_ii - log sum_j exp f_ij = log_softmax_j(f)_ii,    f = Q Q^T over the real keys j,

    and w the weights of the mean over real tokens (``_token_weights``),

        L = sum_i w_i [ (1/H) sum_h s_hi + log n ],

    n the sentence's number of real tokens (its own in each term, also for the batch mean).
    Keeps only Q for backward (autograd would keep the (B, H, N, N) critic); the critic and its
    softmax W are rebuilt there, one block of sentences at a time on the CPU (``blocking.py``):

        dL/dQ_i = (1/H) [ 2 g_i Q_i - sum_j (g_i W_ij + g_j W_ji) Q_j ],    g = w * dL.

    With ``triton`` the scores and dL/dQ come from ``infonce_triton``'s kernels (one pass over
    the keys each, no N x N table), which keep the log-sum-exps for backward.
    """

    @staticmethod
    def forward(ctx, post, valid, per_sentence, triton=False):
        bsz, heads, length, _ = post.shape
        blocks = blocking.sentence_blocks(bsz, heads * length**2, path_device(post))
        ctx.kernels = _infonce_kernels() if triton and _infonce_kernels().available(post) else None
        key_critic = lse = None
        if ctx.kernels is not None:
            per_head, lse = ctx.kernels.scores(post, valid)
            scores = per_head.mean(1)  # (1/H) sum_h s_hi
        else:
            if valid is None:
                post = post.contiguous()
            else:
                # padded tokens are zeroed, so whatever they hold (even inf) reaches no sum
                post = torch.where(valid.view(bsz, 1, length, 1), post, 0.0)
                key_critic = torch.where(valid, 0.0, _PADDED_KEY_CRITIC).view(bsz, 1, 1, length)
            scores = post.new_empty(bsz, length)  # (1/H) sum_h s_hi
            for block in blocks:
                critic = _critic(post[block], key_critic, block)
                torch.mean(torch.log_softmax(critic, -1).diagonal(dim1=-2, dim2=-1), 1, out=scores[block])
        weights = None
        if valid is None:
            out = scores.mean(-1) if per_sentence else scores.mean()
            out = out + math.log(max(length, 1))
        elif per_sentence:
            count = valid.sum(1, dtype=post.dtype).clamp_min(1.0)  # log 1 = 0 without real tokens
            weights = valid / count.unsqueeze(1)
            out = torch.baddbmm(count.log().view(bsz, 1, 1), scores.view(bsz, 1, length), weights.view(bsz, length, 1))
            out = out.view(bsz)
        else:
            weights = _token_weights(valid, per_sentence, post.dtype)
            # valid * log n: xlogy is 0 wherever valid is, also where n = 0
            log_count = torch.xlogy(valid, valid.sum(1, keepdim=True, dtype=post.dtype))
            out = torch.baddbmm(
                post.new_empty(()), scores.add_(log_count).view(1, 1, -1), weights.view(1, -1, 1), beta=0.0
            ).view(())
        ctx.blocks, ctx.per_sentence = blocks, per_sentence
        # dL/ds_hi = g_i / H, and without padding g_i is dL times the token mean's 1/N
        ctx.scale = 1.0 / heads if valid is not None else 1.0 / (heads * max(length, 1) * (1 if per_sentence else bsz))
        if ctx.kernels is not None:
            ctx.save_for_backward(post, valid, weights, lse)
        else:
            ctx.save_for_backward(post, key_critic, weights)
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            if ctx.kernels is not None:
                post, valid, weights, lse = ctx.saved_tensors
                grad = grad.view(post.size(0), 1) if ctx.per_sentence else grad
                if weights is not None:
                    grad = grad * weights
                return ctx.kernels.gradient(post, valid, lse, grad.to(post.dtype), ctx.scale), None, None, None
            post, key_critic, weights = ctx.saved_tensors
            bsz, _, length, clusters = post.shape
            if ctx.per_sentence:
                grad = grad.view(bsz, 1)
            if weights is not None:
                grad = grad * weights
            grad = grad.view(*grad.shape[:1], 1, -1, 1) if grad.dim() else grad  # g_i, scaling row i
            scale, grad_post = ctx.scale, torch.empty_like(post)
            for block in ctx.blocks:
                part, g = post[block], grad[block] if grad.dim() else grad
                weighted = torch.softmax(_critic(part, key_critic, block), -1).mul_(g)  # g_i W_ij
                total = torch.matmul(weighted, part).view(-1, length, clusters)
                total = torch.baddbmm(
                    total, weighted.view(-1, length, length).transpose(1, 2), part.view(-1, length, clusters),
                    beta=-scale, alpha=-scale,
                )
                torch.addcmul(total.view(part.shape), part, g, value=2.0 * scale, out=grad_post[block])
            return grad_post, None, None, None


def _critic(post: Tensor, key_critic: Optional[Tensor], block: slice) -> Tensor:
    critic = torch.matmul(post, post.transpose(-1, -2))  # (b, H, N, N)
    return critic if key_critic is None else critic.add_(key_critic[block])


def _infonce_kernels():
    """``infonce_triton``, imported on first use: triton is needed only by ``--dma-backend triton``."""
    from . import infonce_triton

    return infonce_triton


@in_fp32
def infonce_bound(post: Tensor, valid: Optional[Tensor], per_sentence: bool = False, triton: bool = False) -> Tensor:
    """L_Dxq: InfoNCE with critic f_ij = <Q_i, Q_j>, over the real tokens of each sentence;
    ``triton``: by ``infonce_triton``'s kernels (``--dma-backend triton``)."""
    return _InfoNCEBound.apply(post, valid, per_sentence, triton)


#: L_dv of one sentence and head, with G = C^T C (n_c x n_c) and r_i = ||C_i||^2 (module doc), is
#:     (alpha ||G||_F^2 + beta sum_i r_i^2 + tau sum_i r_i + gamma n) / n^k;
#: "paper" is ||G||^2 - 2 sum_i r_i + n over n, "entrywise" 0.75 of that plus
#: 0.5 sum_i (r_i - 1)^2, over n^2. Form: (alpha, beta, tau, gamma, k).
_DIV_COEFFICIENTS = {"paper": (1.0, 0.0, -2.0, 1.0, 1), "entrywise": (0.75, 0.5, -2.5, 1.25, 2)}


class _DiversityPenalty(torch.autograd.Function):
    """L_dv (``diversity_penalty``) of ``(valid, form, per_sentence, *posts)``, summed over the
    posteriors ``posts`` (same shape), each averaged over its H heads. With C masked to 0 on
    padded tokens and the coefficients of ``_DIV_COEFFICIENTS``, sentence b's value

        L_b = (1/(H n^k)) [ sum_h (alpha ||G_h||^2 + beta sum_i r_hi^2 + tau sum_i r_hi) + K H gamma n ]

    (K posteriors, sum_h over all K H heads) is 0 without real tokens (C = 0, n = 0); the batch
    mean is sum_b L_b / (number of sentences with a real token). The sums over heads and tokens
    are (1 x m) @ (m x 1) products accumulated by ``baddbmm``, which also applies the constants.
    The gradient of one head's term, scaled as the term is:

        dL/dC = 4 alpha C G + (4 beta r + 2 tau) * C,

    zero on padded rows (C is 0 there); paper: 4 C (C^T C) - 4 C; entrywise: 3 C (C^T C) +
    (2 r - 5) * C, where 2 (r - 1) C is the gradient of the diagonal term 0.5 (r - 1)^2.
    """

    @staticmethod
    def forward(ctx, valid, form, per_sentence, *posts):
        alpha, beta, tau, gamma, power = _DIV_COEFFICIENTS[form]
        post = posts[0] if len(posts) == 1 else torch.cat(posts, 1)
        bsz, heads, length, _ = post.shape
        per_post = heads // len(posts)  # each posterior is averaged over its own heads
        if valid is None:
            # n = N in every sentence: the normalisers are constants, which alpha and beta carry
            post = post.contiguous()
            norm = 1.0 / (max(length, 1) ** power * per_post * (1 if per_sentence else bsz))
            rows, total, start = (bsz if per_sentence else 1), post.new_empty(()), 0.0
        else:
            post = torch.where(valid.view(bsz, 1, length, 1), post, 0.0)
            norm, rows = 1.0 / per_post, bsz
            count = valid.sum(1, dtype=post.dtype)  # n
            total, start = count, gamma * len(posts)
        gram = torch.matmul(post.transpose(-1, -2), post)  # (B, KH, C, C)
        total = _accumulate(total, gram, rows, alpha * norm, start)
        row_norms = None
        if beta:
            row_norms = torch.matmul(post.unsqueeze(-2), post.unsqueeze(-1))  # r_i, (B, KH, N, 1, 1)
            total = _accumulate(total, row_norms, rows, beta * norm)
        total = _accumulate(total, post, rows, tau * norm).view(-1)  # sum_i r_i = ||C||_F^2
        denominator = None
        if valid is None:
            out = total.view(_out_shape(bsz, per_sentence)) + gamma * len(posts) * length / max(length, 1) ** power
        else:
            # n^k, and for the batch mean times the number of sentences with a real token; a
            # sentence without any has total 0 (C = 0, n = 0), divided by 1
            denominator = count.square() if power == 2 else count
            if not per_sentence:
                denominator = denominator * torch.linalg.vector_norm(count, 0)
            denominator = denominator.clamp_min(1.0)
            out = total / denominator
            if not per_sentence:
                out = out.sum()
        ctx.norm, ctx.per_post, ctx.form = norm, per_post, form
        ctx.save_for_backward(post, gram, row_norms, denominator)
        return out

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            post, gram, row_norms, denominator = ctx.saved_tensors
            alpha, beta, tau, _, _ = _DIV_COEFFICIENTS[ctx.form]
            bsz, heads, length, clusters = post.shape
            if denominator is not None:
                grad = grad / denominator
            scaled = post * (grad.view(-1, 1, 1, 1) if grad.dim() else grad)
            # (4 beta r + 2 tau) C = 2 tau (C + (2 beta / tau) r C), the first part of baddbmm's sum
            linear = scaled
            if beta:
                linear = torch.addcmul(scaled, scaled, row_norms.view(bsz, heads, length, 1), value=2.0 * beta / tau)
            grad_post = torch.baddbmm(
                linear.view(-1, length, clusters), scaled.view(-1, length, clusters), gram.view(-1, clusters, clusters),
                beta=2.0 * tau * ctx.norm, alpha=4.0 * alpha * ctx.norm,
            ).view(post.shape)
            return (None, None, None, *grad_post.split(ctx.per_post, 1))


def _accumulate(total: Tensor, t: Tensor, rows: int, alpha: float, beta: float = 1.0) -> Tensor:
    """beta * total + alpha * (the sum of t's squares over each of ``rows`` rows), one product."""
    flat = t.reshape(rows, 1, -1)
    return torch.baddbmm(total.view(-1, 1, 1), flat, flat.transpose(1, 2), beta=beta, alpha=alpha)


@in_fp32
def diversity_penalty(
    post: Union[Tensor, Sequence[Tensor]], valid: Optional[Tensor], form: str = "paper", per_sentence: bool = False
) -> Tensor:
    """L_dv in ``form`` "paper" ((1/n) ||C C^T - I||_F^2) or "entrywise" (the authors' weighted
    mean over the n^2 entries), averaged over heads and sentences (or per sentence), O(n n_c^2).

    ``post``: a (B, H, N, C) posterior, or several of the same shape (with the same ``valid``),
    whose penalties are summed: one set of kernels for all, where separate calls launch a set
    each."""
    if form not in DIV_FORMS:
        raise ValueError(f"L_dv form must be one of {DIV_FORMS}, got {form!r}")
    posts = (post,) if torch.is_tensor(post) else tuple(post)
    if len({p.shape for p in posts}) != 1:
        raise ValueError(f"L_dv of several posteriors needs one shape, got {[tuple(p.shape) for p in posts]}")
    return _DiversityPenalty.apply(valid, form, per_sentence, *posts)
