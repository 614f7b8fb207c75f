"""The T x S passes' Triton kernels as torch operators (``torch.library``), so that the
``triton`` backend's compiled graph (``dma_compiled`` with ``MathConfig.kernels``) calls them.

``torch.compile`` does not trace into a custom operator: it sees one opaque call with a fake
implementation for shapes, and differentiates it by the backward registered here, which is
another such call. So inductor fuses the GMMs' forwards, the regularisers and the glue around
the kernels, while the interpolated attention and L_Dxq's critic keep their one-pass kernels
and hand-written backwards (``interpolated_attention_triton``, ``infonce_triton``): nothing
T x S is built, forward or backward. The GMMs' backward is one pass over the points by
``mixture_triton``'s kernel (``dma_compiled._MixtureKernelBackward`` calls it).

Operators (all tensors; every value that changes between steps is a tensor, so that a graph
never recompiles for it):

    fairseq_modattn_ops::interpolated_attention(q, k, v, post_q, post_k, key_padding, attn_mask,
        causal, gamma, dropout_p, seed) -> (out, diff, lse)
    fairseq_modattn_ops::interpolated_attention_backward(..., out, diff, lse, grad_out, ...)
        -> (dq, dk, dv, dP^q, dP^k)
    fairseq_modattn_ops::infonce_scores(post, valid) -> (s, lse)
    fairseq_modattn_ops::infonce_gradient(post, valid, lse, grad) -> dQ
    fairseq_modattn_ops::mixture_statistics_backward(x, z, sigma^-2, mu sigma^-2, P, T, G^J, G^LP,
        G^P, G^KL, kl_shift) -> (d(x, z), then per block of points: weight, kl_weight, first, second)

``key_padding`` and ``valid`` are (B, S) bool tensors; ``gamma`` a 0-d fp32 tensor on the
inputs' device; ``seed`` a 0-d int64 tensor on the CPU (the dropout's Philox key, read on the
host without a device synchronisation). ``diff`` and ``lse`` are what backward reads; they
take no gradient.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import infonce_triton, mixture_triton
from . import interpolated_attention_triton as attention

#: their namespace: not the kernels' profiler prefix ``fairseq_modattn::``, so that a launch counter
#: counts the kernels an operator launches, not the operator
LIBRARY = "fairseq_modattn_ops"


def _launch(q, k, v, post_q, key_padding, attn_mask, causal, gamma, dropout_p, seed):
    return attention._prepare(q, k, v, post_q, key_padding.view(torch.uint8), attn_mask, causal, gamma, dropout_p,
                              int(seed))


@torch.library.custom_op(f"{LIBRARY}::interpolated_attention", mutates_args=())
def interpolated_attention(
    q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, post_k: Tensor, key_padding: Tensor, attn_mask: Optional[Tensor],
    causal: bool, gamma: Tensor, dropout_p: float, seed: Tensor,
) -> Tuple[Tensor, Tensor, Tensor]:
    """out (B, H, T, d), laid out (T, B, H, d), and backward's diff and lse
    (``interpolated_attention_triton.forward``)."""
    attention.check_shapes(q, k, v, post_q, post_k)
    launch = _launch(q, k, v, post_q, key_padding, attn_mask, causal, gamma, dropout_p, seed)
    return attention.forward(q, k, v, post_q, post_k, launch)


@interpolated_attention.register_fake
def _(q, k, v, post_q, post_k, key_padding, attn_mask, causal, gamma, dropout_p, seed):
    bsz, heads, tgt_len, head_dim = q.shape
    acc = torch.promote_types(torch.float32, q.dtype)
    out = v.new_empty(tgt_len, bsz, heads, head_dim).permute(1, 2, 0, 3)
    return out, q.new_empty(bsz, heads, tgt_len, head_dim, dtype=acc), q.new_empty(bsz * heads, 2, tgt_len, dtype=acc)


@torch.library.custom_op(f"{LIBRARY}::interpolated_attention_backward", mutates_args=())
def interpolated_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, post_q: Tensor, post_k: Tensor, key_padding: Tensor, attn_mask: Optional[Tensor],
    out: Tensor, diff: Tensor, lse: Tensor, grad_out: Tensor, causal: bool, gamma: Tensor, dropout_p: float,
    seed: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dP^q, dP^k, contiguous (``interpolated_attention_triton.backward``)."""
    launch = _launch(q, k, v, post_q, key_padding, attn_mask, causal, gamma, dropout_p, seed)
    return attention.backward(q, k, v, post_q, post_k, out, diff, lse, grad_out.contiguous(), launch)


@interpolated_attention_backward.register_fake
def _(q, k, v, post_q, post_k, key_padding, attn_mask, out, diff, lse, grad_out, causal, gamma, dropout_p, seed):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, post_q, post_k))


def _attention_context(ctx, inputs, output):
    q, k, v, post_q, post_k, key_padding, attn_mask, causal, gamma, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, post_q, post_k, key_padding, attn_mask, *output, gamma, seed)
    ctx.causal, ctx.dropout_p = causal, dropout_p
    # backward's own inputs: no gradient to make (autograd would fill zeros for each, a launch)
    ctx.mark_non_differentiable(*output[1:])


def _attention_gradient(ctx, grad_out, _grad_diff, _grad_lse):
    q, k, v, post_q, post_k, key_padding, attn_mask, out, diff, lse, gamma, seed = ctx.saved_tensors
    grads = interpolated_attention_backward(q, k, v, post_q, post_k, key_padding, attn_mask, out, diff, lse,
                                            grad_out, ctx.causal, gamma, ctx.dropout_p, seed)
    return (*grads, None, None, None, None, None, None)


interpolated_attention.register_autograd(_attention_gradient, setup_context=_attention_context)


@torch.library.custom_op(f"{LIBRARY}::infonce_scores", mutates_args=())
def infonce_scores(post: Tensor, valid: Tensor) -> Tuple[Tensor, Tensor]:
    """s = f_ii - lse_i and lse (B, H, N) of L_Dxq's critic (``infonce_triton.scores``)."""
    return infonce_triton.scores(post, valid)


@infonce_scores.register_fake
def _(post, valid):
    shape = post.shape[:-1]
    return post.new_empty(shape), post.new_empty(shape)


@torch.library.custom_op(f"{LIBRARY}::infonce_gradient", mutates_args=())
def infonce_gradient(post: Tensor, valid: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """dL/dQ for dL/ds = ``grad`` (B, H, N) (``infonce_triton.gradient``)."""
    return infonce_triton.gradient(post, valid, lse, grad, 1.0)


@infonce_gradient.register_fake
def _(post, valid, lse, grad):
    return torch.empty_like(post, memory_format=torch.contiguous_format)


def _infonce_context(ctx, inputs, output):
    post, valid = inputs
    ctx.save_for_backward(post, valid, output[1])
    ctx.mark_non_differentiable(output[1])


def _infonce_backward(ctx, grad_scores, _grad_lse):
    post, valid, lse = ctx.saved_tensors
    return infonce_gradient(post, valid, lse, grad_scores), None


infonce_scores.register_autograd(_infonce_backward, setup_context=_infonce_context)


# ----------------------------------------------------------------------------- the GMMs' passes
@torch.library.custom_op(f"{LIBRARY}::mixture_statistics_backward", mutates_args=())
def mixture_statistics_backward(
    x: Tensor, point: Tensor, inv_var: Tensor, scaled_means: Tensor, post: Tensor, terms: Tensor,
    grad_joint: Optional[Tensor], grad_log_post: Optional[Tensor], grad_post: Optional[Tensor],
    grad_kl: Optional[Tensor], kl_shift: float,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """d(x and z together) (G, M, d) (z = x + a constant, so one gradient serves both), and per
    block of points (``mixture_triton.backward``, ``sum_blocks=False``): weight, kl_weight
    (blocks, G, C), first, second (blocks, G, C, d); kl_weight is empty without the KL."""
    with_kl = grad_kl is not None and terms.numel() > 0
    x, point = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, point))
    grad_x, _, weight, kl_weight, first, second = mixture_triton.backward(
        x, point, 1.0, kl_shift, inv_var, scaled_means, post, terms if with_kl else None, grad_joint, grad_log_post,
        grad_post, grad_kl if with_kl else None, True, True, True, True, sum_blocks=False)
    if kl_weight is None:
        kl_weight = point.new_empty(0)
    return grad_x, weight, kl_weight, first, second


@mixture_statistics_backward.register_fake
def _(x, point, inv_var, scaled_means, post, terms, grad_joint, grad_log_post, grad_post, grad_kl, kl_shift):
    groups, num_points, dim = point.shape
    clusters = inv_var.size(1)
    blocks = (num_points + mixture_triton.block_shape(dim)[0] - 1) // mixture_triton.block_shape(dim)[0]
    with_kl = grad_kl is not None and terms.numel() > 0
    sums = point.new_empty(blocks, groups, clusters)
    return (torch.empty_like(point), sums, torch.empty_like(sums) if with_kl
            else point.new_empty(0), point.new_empty(blocks, groups, clusters, dim),
            point.new_empty(blocks, groups, clusters, dim))
