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
"""

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from . import blocking
from .logspace import log_matmul_exp
from .precision import at_least_fp32


def in_fp32(bound):
    """Run ``bound`` with autocast off and its floating-point inputs in at least fp32: under
    ``--amp`` or bf16 autocast the critic and Gram matmuls would otherwise run in half
    precision (a 4e-3 relative error on L_Dxq in bf16), although the result is fp32."""

    @functools.wraps(bound)
    def fp32_bound(*args, **kwargs):
        def widen(t):
            return t.to(at_least_fp32(t)) if torch.is_tensor(t) and t.is_floating_point() else t

        device = next(t.device.type for t in args if torch.is_tensor(t))
        with torch.autocast(device_type=device, enabled=False):
            return bound(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()})

    return fp32_bound


QQ_FORMS = ("bounded", "club")
DIV_FORMS = ("entrywise", "paper")
#: eps of the bounded L_Dqq, -log(1 + eps - p): keeps it finite where p reaches 1
BOUNDED_QQ_EPS = 1e-6


def masked_token_mean(values: Tensor, valid: Optional[Tensor], per_sentence: bool = False) -> Tensor:
    """Mean of ``values`` (B, H, N) over heads and the real tokens given by ``valid`` (B, N);
    with ``per_sentence`` one mean per sentence, shape (B,)."""
    if per_sentence:
        if valid is None:
            return values.mean((1, 2))
        keep = valid.unsqueeze(1)
        total = torch.where(keep, values, values.new_zeros(())).sum((1, 2))
        return total / (valid.sum(1) * values.size(1)).clamp_min(1).to(values.dtype)
    if valid is None:
        return values.mean()
    keep = valid.unsqueeze(1)  # (B, 1, N)
    # where(), not a product: a padded entry may be +-inf and 0 * inf is NaN.
    total = torch.where(keep, values, values.new_zeros(())).sum()
    count = keep.sum() * values.size(1)
    return total / count.clamp_min(1).to(values.dtype)


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
    off_diagonal = ~torch.eye(num_heads, dtype=torch.bool, device=log_joint.device)
    if form == "bounded":
        # p(q_i^h | q_i^h') = sum_c p(q_i^h | c) Q_ic^h' in linear space: both factors lie in
        # [0, 1], and a product that underflows to 0 gives the penalty's minimum, -log(1 + eps)
        token_given_c = _log_token_given_cluster(log_joint, valid).exp().transpose(1, 2)  # (B, N, H, C)
        pair = torch.matmul(token_given_c, log_post.exp().transpose(1, 2).transpose(-1, -2))  # (B, N, H, H')
        penalty = -torch.log1p(BOUNDED_QQ_EPS - pair.clamp_max(1.0))
        penalty = torch.where(off_diagonal, penalty, penalty.new_zeros(()))
        per_token = penalty.sum((-1, -2)).unsqueeze(1) / num_heads**2  # (B, 1, N)
        return masked_token_mean(per_token, valid, per_sentence)
    estimates = head_dependence_estimates(log_joint, log_post, valid, negatives, per_sentence)
    return estimates.clamp_min(0.0)[..., off_diagonal].mean(-1)


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


class _InfoNCEScores(torch.autograd.Function):
    """f_ii - log sum_j exp f_ij with f = Q Q^T over the real keys j, shape (B, H, N).

    Keeps only Q and the log-partition for backward (autograd would keep the (B, H, N, N)
    critic); the critic and its softmax are rebuilt there, block by block of sentences
    (``blocking.py``):
        d/dQ_i = 2 g_i Q_i - sum_j (g_i w_ij + g_j w_ji) Q_j,   w = softmax_j(f).
    """

    @staticmethod
    def forward(ctx, post, key_valid):
        log_partition = post.new_empty(post.shape[:-1])
        blocks = blocking.sentence_blocks(post.size(0), post.size(1) * post.size(2) ** 2)
        for block in blocks:
            critic = _masked_critic(post[block], None if key_valid is None else key_valid[block])
            # logsumexp in place (torch.logsumexp allocates two more N x N tables)
            shift = critic.amax(-1, keepdim=True)
            shift.masked_fill_(torch.isinf(shift), 0.0)  # a sentence without real keys: -inf
            log_partition[block] = critic.sub_(shift).exp_().sum(-1).log_().add_(shift.squeeze(-1))
        ctx.blocks = blocks
        ctx.save_for_backward(post, key_valid, log_partition)
        return post.pow(2).sum(-1) - log_partition

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(device_type=grad.device.type, enabled=False):
            return _InfoNCEScores._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        post, key_valid, log_partition = ctx.saved_tensors
        # a sentence without real keys has log_partition = -inf and no gradient
        shift = log_partition.masked_fill(torch.isinf(log_partition), 0.0).unsqueeze(-1)
        grad_post = torch.empty_like(post)
        for block in ctx.blocks:
            part, g = post[block], grad[block].unsqueeze(-1)
            critic = _masked_critic(part, None if key_valid is None else key_valid[block])
            weighted = critic.sub_(shift[block]).exp_().mul_(g)
            total = torch.matmul(weighted, part).add_(torch.matmul(weighted.transpose(-1, -2), part))
            grad_post[block] = (2.0 * g) * part - total
        return grad_post, None


def _masked_critic(post: Tensor, key_valid: Optional[Tensor]) -> Tensor:
    critic = torch.matmul(post, post.transpose(-1, -2))  # (B, H, N, N)
    if key_valid is not None:
        critic.masked_fill_(~key_valid.view(key_valid.size(0), 1, 1, -1), float("-inf"))
    return critic


@in_fp32
def infonce_bound(post: Tensor, valid: Optional[Tensor], per_sentence: bool = False) -> Tensor:
    """L_Dxq: InfoNCE with critic f_ij = <Q_i, Q_j>, over the real tokens of each sentence."""
    if valid is None:
        log_n = math.log(post.size(2))
    else:
        log_n = valid.sum(1).clamp_min(1).to(post.dtype).log().view(-1, 1, 1)
    return masked_token_mean(_InfoNCEScores.apply(post, valid) + log_n, valid, per_sentence)


@in_fp32
def diversity_penalty(
    post: Tensor, valid: Optional[Tensor], form: str = "paper", per_sentence: bool = False
) -> Tensor:
    """L_dv in ``form`` "paper" ((1/n) ||C C^T - I||_F^2) or "entrywise" (the authors' weighted
    mean over the n^2 entries), averaged over heads and sentences (or per sentence), O(n n_c^2)."""
    if form not in DIV_FORMS:
        raise ValueError(f"L_dv form must be one of {DIV_FORMS}, got {form!r}")
    if valid is not None:
        post = post * valid.to(post.dtype).view(valid.size(0), 1, valid.size(1), 1)
        n = valid.sum(1).to(post.dtype).view(-1, 1)  # (B, 1)
    else:
        n = post.new_full((post.size(0), 1), float(post.size(2)))
    gram = torch.matmul(post.transpose(-1, -2), post)  # (B, H, C, C)
    row_norms = post.pow(2).sum(-1)  # ||C_i||^2 = (C C^T)_ii, (B, H, N)
    frob = gram.pow(2).sum((-1, -2)) - 2.0 * row_norms.sum(-1) + n  # ||C C^T - I||_F^2, (B, H)
    if form == "paper":
        values = frob / n.clamp_min(1.0)
    else:
        diagonal = (row_norms - 1.0).pow(2)
        if valid is not None:
            diagonal = diagonal * valid.to(post.dtype).unsqueeze(1)
        values = (0.75 * frob + 0.5 * diagonal.sum(-1)) / n.pow(2).clamp_min(1.0)
    has_tokens = (n > 0).to(post.dtype)  # (B, 1)
    if per_sentence:
        return values.mean(1) * has_tokens.squeeze(1)
    if valid is None:
        return values.mean()
    return (values * has_tokens).sum() / (has_tokens.sum() * post.size(1)).clamp_min(1.0)
