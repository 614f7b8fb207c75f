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
the input dtype; attention dropout drops entries of A^ (the paper's final weights).
"""

from typing import Optional

import torch
from torch import Tensor


class _InterpolatedMaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, log_post_q, log_post_k, mask, gamma, dropout_p):
        with torch.autocast(device_type=q.device.type, enabled=False):
            return _InterpolatedMaskedAttention._forward(ctx, q, k, v, log_post_q, log_post_k, mask, gamma, dropout_p)

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            return _InterpolatedMaskedAttention._backward(ctx, grad_out)

    @staticmethod
    def _forward(ctx, q, k, v, log_post_q, log_post_k, mask, gamma, dropout_p):
        dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        scale = q.size(-1) ** -0.5
        logits = _logits(q, k, mask, scale, dtype)
        post_q, post_k = log_post_q.to(dtype).exp(), log_post_k.to(dtype).exp()
        weights, masked, _ = _both_softmaxes(logits, post_q, post_k)
        del logits
        mixed = torch.lerp(weights, masked, gamma)
        del weights, masked
        keep = None
        if dropout_p > 0.0:
            keep = torch.rand(mixed.shape, device=mixed.device) >= dropout_p
            mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
        out = torch.matmul(mixed.to(v.dtype), v)
        ctx.gamma, ctx.dropout_p, ctx.scale = gamma, dropout_p, scale
        ctx.save_for_backward(q, k, v, post_q, post_k, mask, keep)
        return out

    @staticmethod
    def _backward(ctx, grad_out):
        q, k, v, post_q, post_k, mask, keep = ctx.saved_tensors
        dtype = post_q.dtype
        weights, masked, inner = _both_softmaxes(_logits(q, k, mask, ctx.scale, dtype), post_q, post_k)
        gamma, dropout_p = ctx.gamma, ctx.dropout_p
        grad_q = grad_k = grad_v = grad_log_q = grad_log_k = None

        if ctx.needs_input_grad[2]:
            mixed = torch.lerp(weights, masked, gamma)
            if keep is not None:
                mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
            grad_v = torch.matmul(mixed.to(v.dtype).transpose(-1, -2), grad_out)
            del mixed
        grad_mixed = torch.matmul(grad_out, v.transpose(-1, -2)).to(dtype)
        if keep is not None:
            grad_mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
        grad_biased = torch._softmax_backward_data(grad_mixed, masked, -1, dtype).mul_(gamma)
        grad_logits = torch._softmax_backward_data(grad_mixed, weights, -1, dtype)
        del grad_mixed
        grad_logits.mul_(1.0 - gamma).add_(grad_biased).mul_(ctx.scale)

        if ctx.needs_input_grad[0]:
            grad_q = torch.matmul(grad_logits.to(k.dtype), k)
        if ctx.needs_input_grad[1]:
            grad_k = torch.matmul(grad_logits.to(q.dtype).transpose(-1, -2), q)
        del grad_logits

        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            # d log M / dM = 1 / M; zero where the forward clamped M
            grad_inner = grad_biased.div_(inner).masked_fill_(inner < torch.finfo(dtype).tiny, 0.0)
            del inner
            if ctx.needs_input_grad[3]:
                grad_log_q = torch.matmul(grad_inner, post_k).mul_(post_q)
            if ctx.needs_input_grad[4]:
                grad_log_k = torch.matmul(grad_inner.transpose(-1, -2), post_q).mul_(post_k)
        return grad_q, grad_k, grad_v, grad_log_q, grad_log_k, None, None, None




def log_semantic_mask(log_pq: Tensor, log_pk: Tensor) -> Tensor:
    """log M_ij = log sum_c P^q_ic P^k_jc for (..., T, C) and (..., S, C) log posteriors.

    At least fp32, no (..., T, S, C) tensor. Posteriors lie in [0, 1] and each row holds one
    >= 1/C, so M_ij >= max_c(P^q_ic P^k_jc) underflows only where the two disagree beyond the
    dtype's range (both log posteriors below about -87 in fp32); there log M is clamped at
    log(tiny), finite, so softmax(S + log M) stays defined.
    """
    with torch.autocast(device_type=log_pq.device.type, enabled=False):
        dtype = torch.promote_types(torch.promote_types(log_pq.dtype, log_pk.dtype), torch.float32)
        inner = torch.matmul(log_pq.to(dtype).exp(), log_pk.to(dtype).exp().transpose(-1, -2))
        return inner.clamp_min(torch.finfo(dtype).tiny).log()


def _logits(q: Tensor, k: Tensor, mask: Optional[Tensor], scale: float, dtype: torch.dtype) -> Tensor:
    """S = q k^T / sqrt(d) + mask, in ``dtype`` (the product itself in the inputs' dtype)."""
    logits = torch.matmul(q, k.transpose(-1, -2)).to(dtype).mul_(scale)
    return logits if mask is None else logits.add_(mask)


def _both_softmaxes(logits: Tensor, post_q: Tensor, post_k: Tensor):
    """A = softmax(S), A~ = softmax(S + log M) and M = P^q (P^k)^T (unclamped; see
    ``log_semantic_mask`` for the clamp)."""
    inner = torch.matmul(post_q, post_k.transpose(-1, -2))
    biased = inner.clamp_min(torch.finfo(inner.dtype).tiny).log_().add_(logits)
    masked = torch.softmax(biased, dim=-1)
    del biased
    return torch.softmax(logits, dim=-1), masked, inner


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
