"""DMA's interpolated masked attention in one pass (Chien & Huang, section 3.1, Eq. 5-7).

With logits S = q k^T / sqrt(d) + masks and the semantic mask M = P^q (P^k)^T,

    A  = softmax_j(S),    A~ = normalise_j(M * A) = softmax_j(S + log M),
    out = A^ V,           A^ = (1 - gamma) A + gamma A~.

Two calls of ``scaled_dot_product_attention`` (the second with the bias log M) compute the
same thing, and on CUDA that is the fast form: its memory-efficient kernel also returns the
gradient of the bias. On CPU, torch has no fused kernel that differentiates a bias, so the
biased call falls back to the unfused math path and the pair costs three logit products,
two softmaxes and two value products, and keeps every intermediate for backward. This
function shares one logit product between both softmaxes, mixes the weights before the
single value product, and keeps no T x S table for backward (like a flash kernel, it
recomputes the logits there, one more product, and from them A, A~ and M), from which

    dS      = (1 - gamma) A  * (G - rowsum(G * A))  +  gamma A~ * (G - rowsum(G * A~)),
    d log M = gamma A~ * (G - rowsum(G * A~)),          G = dL/dA^ = dL/dout V^T,

and log M's gradient reaches the posteriors through dM = d log M / M and two matmuls with the
(T x C) and (S x C) posteriors (no T x S x C tensor). Softmax and mask math are fp32 whatever
the input dtype; attention dropout drops entries of A^ (the paper's final weights). Both
passes run over blocks of sentences (``blocking.py``) with the softmaxes in place, so that
a call holds two or three T x S tables of one block at a time.
"""

from typing import Optional

import torch
from torch import Tensor

from . import blocking
from .precision import at_least_fp32


def _batch_slice(t: Optional[Tensor], block: slice) -> Optional[Tensor]:
    """The block's rows of a tensor whose batch axis may broadcast (size 1)."""
    return t if t is None or t.size(0) == 1 else t[block]


class _InterpolatedMaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_post_q, log_post_k, mask, gamma, dropout_p):
        with torch.autocast(device_type=q.device.type, enabled=False):
            dtype = at_least_fp32(q)
            scale = q.size(-1) ** -0.5
            post_q, post_k = log_post_q.to(dtype).exp(), log_post_k.to(dtype).exp()
            bsz, heads, tgt_len, _ = q.shape
            blocks = blocking.sentence_blocks(bsz, heads * tgt_len * k.size(-2))
            out = v.new_empty(bsz, heads, tgt_len, v.size(-1))
            keep = None
            if dropout_p > 0.0:
                keep = torch.empty(bsz, heads, tgt_len, k.size(-2), dtype=torch.bool, device=q.device)
            for block in blocks:
                out[block] = _forward_block(
                    q[block], k[block], v[block], post_q[block], post_k[block], _batch_slice(mask, block),
                    gamma, dropout_p, scale, dtype, None if keep is None else keep[block],
                )
            ctx.gamma, ctx.dropout_p, ctx.scale, ctx.blocks = gamma, dropout_p, scale, blocks
            ctx.save_for_backward(q, k, v, post_q, post_k, mask, keep)
            return out

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            q, k, v, post_q, post_k, mask, keep = ctx.saved_tensors
            needs = ctx.needs_input_grad
            grads = [torch.empty_like(t) if needs[i] else None for i, t in enumerate((q, k, v, post_q, post_k))]
            for block in ctx.blocks:
                block_grads = _backward_block(
                    q[block], k[block], v[block], post_q[block], post_k[block], _batch_slice(mask, block),
                    None if keep is None else keep[block], grad_out[block], ctx.gamma, ctx.dropout_p, ctx.scale,
                    needs[:5],
                )
                for full, part in zip(grads, block_grads):
                    if full is not None:
                        full[block] = part
            return (*grads, None, None, None)


def _forward_block(q, k, v, post_q, post_k, mask, gamma, dropout_p, scale, dtype, keep):
    """A^ V for one block of sentences; fills ``keep`` (the dropout mask) when given."""
    logits = _logits(q, k, mask, scale, dtype)
    # two T x S tables in all: A~ is built in M's buffer, A and then A^ in the logits'
    masked = _softmax_(log_mask(post_q, post_k).add_(logits))
    mixed = _softmax_(logits).lerp_(masked, gamma)
    del masked
    if keep is not None:
        torch.ge(torch.rand(mixed.shape, device=mixed.device), dropout_p, out=keep)
        mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
    return torch.matmul(mixed.to(v.dtype), v)


def _backward_block(q, k, v, post_q, post_k, mask, keep, grad_out, gamma, dropout_p, scale, needs):
    """Gradients of one block's A^ V with respect to q, k, v and the log posteriors (module doc)."""
    dtype = post_q.dtype
    logits = _logits(q, k, mask, scale, dtype)
    inner = torch.matmul(post_q, post_k.transpose(-1, -2))  # M, kept for d log M / dM
    masked = _softmax_(inner.clamp_min(torch.finfo(dtype).tiny).log_().add_(logits))
    weights = _softmax_(logits)
    del logits
    grad_q = grad_k = grad_v = grad_log_q = grad_log_k = None

    if needs[2]:
        mixed = torch.lerp(weights, masked, gamma)
        if keep is not None:
            mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
        grad_v = torch.matmul(mixed.to(v.dtype).transpose(-1, -2), grad_out)
        del mixed
    grad_mixed = torch.matmul(grad_out, v.transpose(-1, -2)).to(dtype)
    if keep is not None:
        grad_mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
    # softmax backward, A * (G - rowsum(G * A)), for both softmaxes in place on A and A~
    # with one shared temporary (torch's kernel allocates a fresh T x S table each time)
    centred = grad_mixed - _row_dot(grad_mixed, masked)
    grad_biased = masked.mul_(centred).mul_(gamma)
    torch.sub(grad_mixed, _row_dot(grad_mixed, weights), out=centred)
    del grad_mixed
    grad_logits = weights.mul_(centred)
    del centred
    grad_logits.mul_(1.0 - gamma).add_(grad_biased).mul_(scale)

    if needs[0]:
        grad_q = torch.matmul(grad_logits.to(k.dtype), k)
    if needs[1]:
        grad_k = torch.matmul(grad_logits.to(q.dtype).transpose(-1, -2), q)
    del grad_logits

    if needs[3] or needs[4]:
        # d log M / dM = 1 / M; zero where the forward clamped M
        grad_inner = grad_biased.div_(inner).masked_fill_(inner < torch.finfo(dtype).tiny, 0.0)
        del inner
        if needs[3]:
            grad_log_q = torch.matmul(grad_inner, post_k).mul_(post_q)
        if needs[4]:
            grad_log_k = torch.matmul(grad_inner.transpose(-1, -2), post_q).mul_(post_k)
    return grad_q, grad_k, grad_v, grad_log_q, grad_log_k


def log_semantic_mask(log_pq: Tensor, log_pk: Tensor) -> Tensor:
    """log M_ij = log sum_c P^q_ic P^k_jc for (..., T, C) and (..., S, C) log posteriors.

    At least fp32, no (..., T, S, C) tensor. Posteriors lie in [0, 1] and each row holds one
    >= 1/C, so M_ij >= max_c(P^q_ic P^k_jc) underflows only where the two disagree beyond the
    dtype's range (both log posteriors below about -87 in fp32); there log M is clamped at
    log(tiny), finite, so softmax(S + log M) stays defined.
    """
    with torch.autocast(device_type=log_pq.device.type, enabled=False):
        dtype = at_least_fp32(log_pq, log_pk)
        return log_mask(log_pq.to(dtype).exp(), log_pk.to(dtype).exp())


def _logits(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float, dtype: torch.dtype) -> Tensor:
    """S = q k^T / sqrt(d) + mask, in ``dtype`` (the product itself in the inputs' dtype)."""
    logits = torch.matmul(q, k.transpose(-1, -2)).to(dtype).mul_(scale)
    return logits if mask is None else logits.add_(mask)


def log_mask(post_q: Tensor, post_k: Tensor) -> Tensor:
    """log M = log P^q (P^k)^T from the posteriors themselves (at least fp32 inputs), clamped
    at log(tiny) as in ``log_semantic_mask``."""
    with torch.autocast(device_type=post_q.device.type, enabled=False):
        inner = torch.matmul(post_q, post_k.transpose(-1, -2))
        return inner.clamp_min_(torch.finfo(inner.dtype).tiny).log_()


def _softmax_(x: Tensor) -> Tensor:
    """softmax over the last axis, in place. The T x S tables here are large, and on the CPU a
    fresh one costs its page faults: in place, two softmaxes of (8, 4, 512, 512) took 42 ms
    against 91 ms for torch.softmax's (measured, one thread). Rows of -inf give NaN, as
    torch.softmax's do."""
    x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """sum_j a_ij b_ij as (..., T, 1), without an elementwise product table."""
    return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1)).squeeze(-1)


def interpolated_masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_post_q: Tensor,
    log_post_k: Tensor,
    mask: Optional[Tensor],
    gamma: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """A^ V for q (B, H, T, d), k and v (B, H, S, d) and log posteriors (B, H, T|S, C).

    ``mask``: additive, broadcastable to (B, H, T, S) (padding and causal masks, -inf where
    masked); it gets no gradient. Returns (B, H, T, d) in v's dtype.
    """
    if mask is not None and mask.requires_grad:
        raise ValueError("the additive attention mask must not require a gradient")
    return _InterpolatedMaskedAttention.apply(q, k, v, log_post_q, log_post_k, mask, float(gamma), float(dropout_p))
