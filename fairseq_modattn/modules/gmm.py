"""Diagonal Gaussian mixture models with VaDE-style variational posteriors.

DMA (Chien & Huang, "Disentangled Mask Attention in Transformer", sections 3.2 and 4.3)
clusters token representations z (and attention queries q) with a GMM

    p(z) = sum_c pi_c N(z; mu_c, diag(sigma_c^2)),   pi = softmax(logits).

The posterior ("responsibility") of cluster c for a point z is

    P_c(z) = p(c | z) = softmax_c( log pi_c + log N(z; mu_c, sigma_c^2) ),

always computed in fp32 and in log space. During training the paper samples the point
from q(z | x) = N(x, s^2 I) with s^2 = 0.1 (section 4.3) before clustering it, and regularises
the mixture with the VaDE closed-form KL (Jiang et al., 2017, eq. 12 in their notation):

    KL( q(z, c | x) || p(z, c) ) =
        0.5 * sum_c P_c [ sum_d log sigma_cd^2 + s^2 sum_d 1 / sigma_cd^2 + D_c(x) ]
        - sum_c P_c log pi_c + sum_c P_c log P_c - 0.5 * d * (1 + log s^2),

where D_c(x) = sum_d (x_d - mu_cd)^2 / sigma_cd^2 and P_c is the posterior of the *sampled*
point (the 2*pi terms cancel). Every squared distance is expanded into matmuls,

    D_c(x) = (x*x) @ (1/sigma_c^2) - 2 x @ (mu_c / sigma_c^2) + sum_d mu_cd^2 / sigma_cd^2,

so no (points x clusters x dim) tensor is ever built.

One module holds ``num_groups`` independent mixtures (one per attention head for the token
GMM, a single shared one for the query GMM); inputs are laid out ``(..., G, N, d)`` with the
group axis third from the end (G may broadcast against 1).
"""

import math
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from . import blocking, native_mixture
from .device_paths import path_device
from .noise import standard_normal
from .precision import at_least_fp32

#: "xavier" (the DMA authors' initialisation) or "spread" (N(0, 1) centres, unit variances)
GMM_INITS = ("xavier", "spread")
LOG_2PI = math.log(2.0 * math.pi)


def log_softmax_over_clusters(log_joint: Tensor) -> Tensor:
    """log_softmax over the last (cluster) axis, computed with that axis moved off the end.

    The same values; on the CPU (torch 2.13) ``log_softmax`` over a short last axis (n_c = 4-12)
    runs one scalar reduction per row and is ~45x slower than over a leading axis (measured on
    (4, 4096, 8): 2.3 ms against 0.05 ms, forward + backward 4.5 against 0.6 ms with the copy).
    The result is a transposed view, which every consumer here reads as it is.
    """
    if path_device(log_joint) != "cpu":
        return torch.log_softmax(log_joint, dim=-1)
    return torch.log_softmax(log_joint.transpose(-1, -2).contiguous(), dim=-2).transpose(-1, -2)


class GMMStatistics(NamedTuple):
    """Per-point results of one GMM evaluation, all fp32.

    log_joint: log pi_c + log N(z_i; mu_c, sigma_c^2), shape (..., G, N, C)
    log_post:  log p(c | z_i) (log-softmax of log_joint over c), shape (..., G, N, C)
    kl:        VaDE KL per point (None unless requested), shape (..., G, N)
    post:      p(c | z_i) = exp(log_post), shape (..., G, N, C)
    """

    log_joint: Tensor
    log_post: Tensor
    kl: Optional[Tensor]
    post: Optional[Tensor] = None


def group_major_points(x: Tensor, num_groups: int) -> Tuple[Tensor, Callable[[Tensor], Tensor]]:
    """View points (..., G, N, d) as (num_groups, M, d), without a copy when strides allow.

    The M points of a group are flattened in the order they lie in memory, so a head-split
    view of a token-major activation (``x.view(N, B, H, d).permute(1, 2, 0, 3)``) needs no
    copy. With ``num_groups == 1`` the G axis is flattened into the points. Returns the view
    and ``restore``, mapping a (num_groups, M, k) result back to (..., G, N, k).
    """
    if num_groups == 1:
        moved = x.unsqueeze(0)
    else:
        if x.size(-3) != num_groups:
            raise ValueError(f"expected {num_groups} groups on axis -3, got shape {tuple(x.shape)}")
        moved = x.movedim(-3, 0)
    # Leading point axes (all but the group axis and d), largest stride first.
    strides = moved.stride()
    point_axes = sorted(range(1, moved.dim() - 1), key=lambda a: -strides[a])
    order = [0] + point_axes + [moved.dim() - 1]
    ordered = moved.permute(order)
    flat = ordered.reshape(num_groups, -1, x.size(-1))
    inverse = [order.index(a) for a in range(len(order))]

    point_shape = ordered.shape[:-1]  # a shape, not the view: ``restore`` must not keep x alive

    def restore(result: Tensor) -> Tensor:
        out = result.reshape(*point_shape, result.size(-1)).permute(inverse)
        return out.squeeze(0) if num_groups == 1 else out.movedim(0, -3)

    return flat, restore


def mixture_constants(logits: Tensor, means: Tensor, log_vars: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The per-cluster tensors of ``mixture_statistics``, from the parameters (G, C[, d]):
    sigma^-2 and mu sigma^-2 (G, C, d), and log N_c (G, 1, C) (``_MixtureStatistics``)."""
    inv_var = torch.exp(torch.neg(log_vars))
    scaled_means = means * inv_var
    log_pi = torch.log_softmax(logits, dim=-1).unsqueeze(-2)
    spread = torch.add(log_vars.sum(-1), (means * scaled_means).sum(-1)).add_(means.size(-1) * LOG_2PI)
    return inv_var, scaled_means, torch.add(log_pi, spread.unsqueeze(-2), alpha=-0.5)


def mixture_statistics(
    x: Tensor,
    point: Tensor,
    scale: float,
    noise_var: float,
    need_kl: bool,
    inv_var: Tensor,
    scaled_means: Tensor,
    log_norm: Tensor,
    triton: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """J, LP, P, KL and T + d log(2 pi) / 2 of ``_MixtureStatistics`` (whose docstring gives the
    equations) for (G, M, d) points, from ``mixture_constants``; no autograd of its own. With
    ``triton`` (``--dma-backend triton``) the Triton kernel (``mixture_triton``); fp32 on the CPU
    takes the C kernels (``native_mixture``); otherwise matmuls, whose passes over the points run
    block by block on the CPU (``blocking.point_blocks``)."""
    groups, num_points, dim = point.shape
    offset = None
    if need_kl:
        # T + d log(2 pi) / 2 = -(log N_c - s^2 tr_c / 2) + D'(a x) / 2 + LP, D' = D - sum_d mu^2 / sigma^2;
        # the constant leaves the KL once, as sum_c P = 1
        trace = inv_var.sum(-1).unsqueeze(-2)
        offset = torch.add(log_norm, trace, alpha=-0.5 * noise_var)
    kl_const = 0.5 * dim * (LOG_2PI + 1.0 + math.log(noise_var)) if need_kl else 0.0
    if triton and _triton_kernels().available(point, inv_var.size(1)) and x.stride(-1) == 1:
        return _triton_kernels().forward(x, point, scale, kl_const, need_kl, inv_var, scaled_means, log_norm, offset)
    if native_mixture.available(point, inv_var.size(1)) and x.stride(-1) == 1:
        return native_mixture.forward(x, point, scale, kl_const, need_kl, inv_var, scaled_means, log_norm, offset)
    # each block's (G, m, C) results are new tensors, joined after the loop: written into a slice
    # of the whole, torch's CPU baddbmm would run group by group
    joints, all_terms = [], []
    for block in blocking.point_blocks(num_points, groups * dim, path_device(point)):
        sampled = point[:, block]
        joint = torch.baddbmm(log_norm, sampled * sampled, inv_var.transpose(1, 2), alpha=-0.5 * scale * scale)
        joints.append(joint.baddbmm_(sampled, scaled_means.transpose(1, 2), alpha=scale))
        if offset is not None:
            mean = x[:, block]
            term = torch.baddbmm(offset, mean * mean, inv_var.transpose(1, 2), beta=-1.0, alpha=0.5 * scale * scale)
            all_terms.append(term.baddbmm_(mean, scaled_means.transpose(1, 2), alpha=-scale))
    log_joint = _joined(joints)
    terms = _joined(all_terms) if offset is not None else None
    log_post = log_softmax_over_clusters(log_joint)
    post = log_post.exp()
    kl = None
    if terms is not None:
        terms.add_(log_post)
        kl = (post * terms).sum(-1).sub_(kl_const)
    return log_joint, log_post, post, kl, terms


def _triton_kernels():
    """``mixture_triton``, imported on first use: triton is needed only by ``--dma-backend triton``."""
    from . import mixture_triton

    return mixture_triton


def _joined(blocks: List[Tensor]) -> Tensor:
    """The (G, m, k) results of the point blocks as one (G, M, k) tensor (no copy for one block)."""
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)


class _MixtureStatistics(torch.autograd.Function):
    """log p(z, c), log p(c | z), p(c | z) and the VaDE KL of (G, M, d) points in one call.

    The mixture clusters u = a x: a point x of the caller, scaled by a constant a (1 but for
    DMA's query GMM on q / sqrt(d), ``scale``). The caller gives the mean x and the sampled
    point z (z = x + s eps in training, z = x otherwise); no noise is kept here, so a sample the
    caller keeps anyway (DMA's attention inputs) costs no memory twice. With
    sigma^-2 = exp(-log sigma^2) and
    log N_c = log pi_c - (sum_d log sigma_cd^2 + d log 2 pi) / 2 - sum_d mu_cd^2 / (2 sigma_cd^2):

        J_ic  = log p(a z_i, c) = log N_c - a^2 (z_i*z_i) @ sigma_c^-2 / 2 + a z_i @ (mu_c sigma_c^-2)
        LP_ic = J_ic - logsumexp_c J_ic,       P = exp(LP),
        KL_i  = sum_c P_ic T_ic - d (1 + log s^2) / 2,
        T_ic  = (sum_d log sigma_cd^2 + s^2 sum_d sigma_cd^-2 + D_c(a x_i)) / 2 - log pi_c + LP_ic,

    D_c(u) = sum_d (u_d - mu_cd)^2 / sigma_cd^2 at the mean (VaDE). Every distance is a
    matmul of the points with the (C, d) parameters, so no (M, C, d) tensor exists.

    Backward (``_backward``), with G^J, G^LP, G^P, G^KL the incoming gradients:

        G^LP' = G^LP + G^P P + G^KL P (T + 1)             (P = exp(LP); T enters KL with P)
        G^J'  = G^J + G^LP' - P rowsum_c(G^LP')            (log-softmax)
        dD(a z) = -G^J' / 2,   dD(a x) = G^KL P / 2,
        dz    = 2 a (dD sigma^-2) * a z - 2 a dD (mu sigma^-2), and so dx at the mean,
        dmu_c = -2 sigma_c^-2 sum_i dD_ic (u_i - mu_c),    d sigma_c^-2 = sum_i dD_ic (u_i - mu_c)^2
        d log sigma^2 = -sigma^-2 (d sigma^-2) + column sums for the log-determinant and trace,
        d logits = softmax backward of d log pi,

    summed over both points by matmuls. The backward keeps x, z and T (C values a point) and
    rebuilds z*z and x*x; the mean's gradient is multiplied by c_grad here (fairseq's
    ``GradMultiply``, folded in to save its two calls). fp32 on the CPU, forward and backward
    are one pass over the points each by the C kernels (``native_mixture``); the matmul path
    passes over them block by block on the CPU (``blocking.point_blocks``), so that all but a
    block's first pass read the cache. The point gradients are laid out like the points.

    The caller's z is x + c eps with eps constant (``DiagonalGMM.forward``'s contract), so
    d z / d x = I and the loss's gradient reaches x as dx + dz whichever input carries dz: where
    both need one they are returned summed on x (and None for z), one (M, d) result instead of
    two and no sum for autograd to take where z's other consumers meet x:

        dx + dz = a (G^J' - G^KL P) (mu sigma^-2) - a^2 (G^J' sigma^-2) * z + a^2 (G^KL P sigma^-2) * x.
    """

    @staticmethod
    def forward(ctx, x, point, logits, means, log_vars, scale, noise_var, need_kl, grad_mult, mean_of, triton=False):
        # unused outputs give None gradients instead of zero tensors (each one a launch)
        ctx.set_materialize_grads(False)
        inv_var, scaled_means, log_norm = mixture_constants(logits, means, log_vars)
        log_joint, log_post, post, kl, terms = mixture_statistics(
            x, point, scale, noise_var, need_kl, inv_var, scaled_means, log_norm, triton
        )
        ctx.scale, ctx.noise_var, ctx.grad_mult, ctx.device_type = scale, noise_var, grad_mult, x.device.type
        ctx.triton = triton
        # ``mean_of(point)`` rebuilds x in backward (from the replayed noise), so x is not kept
        ctx.mean_of = mean_of
        kept_mean = x if need_kl and mean_of is None else None
        ctx.save_for_backward(kept_mean, point, logits, means, inv_var, scaled_means, post, terms)
        return log_joint, log_post, post, kl

    @staticmethod
    def backward(ctx, grad_joint, grad_log_post, grad_post, grad_kl):
        # fp32 like the forward, also when backward is called inside an autocast region
        with torch.autocast(device_type=ctx.device_type, enabled=False):
            return _MixtureStatistics._backward(ctx, grad_joint, grad_log_post, grad_post, grad_kl)

    @staticmethod
    def _backward(ctx, grad_joint, grad_log_post, grad_post, grad_kl):
        x, point, logits, means, inv_var, scaled_means, post, terms = ctx.saved_tensors
        if terms is not None and x is None:
            x = ctx.mean_of(point)
        needs = ctx.needs_input_grad
        kernels = None
        if x is None or x.stride(-1) == 1:
            if ctx.triton and _triton_kernels().available(point, post.size(-1)):
                kernels = _triton_kernels()
            elif native_mixture.available(point, post.size(-1)):
                kernels = native_mixture
        if kernels is not None:
            grad_x, grad_point, weight, kl_weight, first, second = kernels.backward(
                x, point, ctx.scale, 1.0 - 0.5 * point.size(-1) * LOG_2PI, inv_var, scaled_means, post, terms,
                grad_joint, grad_log_post, grad_post, grad_kl, needs[0], needs[1], needs[3] or needs[4], needs[4])
        else:
            grad_x, grad_point, weight, kl_weight, first, second = _point_gradients_and_sums(
                ctx.scale, x, point, inv_var, scaled_means, post, terms, grad_joint, grad_log_post, grad_post,
                grad_kl, needs)
        grad_logits = grad_means = grad_log_vars = None
        if needs[2]:
            log_pi = torch.log_softmax(logits, dim=-1)
            grad_logits = torch.ops.aten._log_softmax_backward_data(weight, log_pi, -1, weight.dtype).neg_()
        if first is not None:
            weight3 = weight.unsqueeze(-1)
            if needs[3]:
                # dmu = -2 sigma^-2 sum_i dD (u_i - mu) = sigma^-2 (mu weight - first), times c_grad
                grad_means = torch.addcmul(first, means, weight3, value=-1.0).mul_(inv_var).mul_(-ctx.grad_mult)
            if second is not None:
                # 2 d sigma^-2 = sum_i 2 dD (u_i - mu)^2 = second - 2 mu first + mu^2 weight, plus the
                # trace's s^2 sum_i G^KL P; d log sigma^2 = weight / 2 - sigma^-2 (d sigma^-2)
                if kl_weight is not None:
                    second.add_(kl_weight.unsqueeze(-1), alpha=ctx.noise_var)
                second.addcmul_(means, first, value=-2.0).addcmul_(means * means, weight3)
                grad_log_vars = torch.addcmul(0.5 * weight3, second, inv_var, value=-0.5)
        return grad_x, grad_point, grad_logits, grad_means, grad_log_vars, None, None, None, None, None, None


def _point_gradients_and_sums(a, x, point, inv_var, scaled_means, post, terms, grad_joint, grad_log_post, grad_post,
                              grad_kl, needs):
    """``_MixtureStatistics._backward``'s passes over the points, by matmuls (the native kernel's
    counterpart): (grad_x, grad_point, weight, kl_weight, first, second) as
    ``native_mixture.backward`` returns them."""
    dim = point.size(-1)
    # G^LP' = G^LP + P (G^P + G^KL (T + 1)); ``terms`` is T + d log(2 pi) / 2. Any incoming
    # gradient may be None (an output that reached no loss).
    weighted_kl = None  # G^KL P = 2 dD(a x), (G, M, C)
    grad_lp = None
    if grad_kl is not None and terms is not None:
        grad_kl = grad_kl.unsqueeze(-1)
        weighted_kl = post * grad_kl
        shifted = grad_kl * (1.0 - 0.5 * dim * LOG_2PI) if grad_post is None else torch.add(
            grad_post, grad_kl, alpha=1.0 - 0.5 * dim * LOG_2PI
        )
        grad_lp = torch.addcmul(shifted, grad_kl, terms).mul_(post)
    elif grad_post is not None:
        grad_lp = post * grad_post
    if grad_log_post is not None:
        grad_lp = grad_log_post if grad_lp is None else grad_lp.add_(grad_log_post)
    # G^J' = -2 dD(a z) (log-softmax backward)
    if grad_lp is None:
        grad_j = grad_joint if grad_joint is not None else torch.zeros_like(post)
    else:
        grad_j = torch.addcmul(grad_lp, post, grad_lp.sum(-1, keepdim=True), value=-1.0)
        if grad_joint is not None:
            grad_j.add_(grad_joint)
    grad_x = grad_point = None
    # the column sums of 2 dD over both points: -d log pi and 2 d(sum_d log sigma^2)
    weight = grad_j.sum(1).neg_() if weighted_kl is None else (weighted_kl - grad_j).sum(1)  # (G, C)
    kl_weight = weighted_kl.sum(1) if weighted_kl is not None and needs[4] else None  # for the trace's term
    # Each point gradient (``_point_gradient``) is a target (result, T, alpha, terms): the
    # sampled points' term weighs G^J' with sign -1, the means' G^KL P with +1. dx + dz is one
    # result where both are needed (class docstring). Results are laid out like the points, so
    # that they reach the caller's activation as a view.
    sampled_terms = [(grad_j, point, -1.0)]
    mean_terms = [] if weighted_kl is None else [(weighted_kl, x, 1.0)]
    targets = []
    if needs[0] and needs[1]:
        grad_x = torch.empty_like(point)
        targets.append((grad_x, grad_j if weighted_kl is None else grad_j - weighted_kl, a,
                        sampled_terms + mean_terms))
    else:
        if needs[1]:
            grad_point = torch.empty_like(point)
            targets.append((grad_point, grad_j, a, sampled_terms))
        if needs[0] and weighted_kl is not None:
            grad_x = torch.empty_like(point)
            targets.append((grad_x, weighted_kl, -a, mean_terms))
    # first = sum_i 2 dD_ic u_i and second = sum_i 2 dD_ic u_i^2 over both points (u = a z, a x)
    moments = sampled_terms + mean_terms if needs[3] or needs[4] else []
    first = second = None
    groups, num_points, _ = point.shape
    for block in blocking.point_blocks(num_points, groups * dim, path_device(point)):
        for result, towards_means, alpha, terms in targets:
            _point_gradient(towards_means[:, block], alpha, [(g[:, block], p[:, block], v) for g, p, v in terms],
                            a, inv_var, scaled_means, result[:, block])
        for grad, points, sign in moments:
            g_t, u = grad[:, block].transpose(1, 2), points[:, block]
            first = _accumulate_product(first, g_t, u, sign * a)
            if needs[4]:
                second = _accumulate_product(second, g_t, u * u, sign * a * a)
    return grad_x, grad_point, weight, kl_weight, first, second


def _point_gradient(towards_means: Tensor, alpha: float, terms: List[Tuple[Tensor, Tensor, float]], a: float,
                    inv_var: Tensor, scaled_means: Tensor, out: Tensor):
    """alpha T (mu sigma^-2) + sum_k sign_k a^2 (G_k sigma^-2) * u_k of one block of points into
    ``out``, ``terms`` the (G_k, u_k, sign_k) (at least one): ``_MixtureStatistics``'s dz, dx or
    their sum. The last term writes ``out``, so that a block's intermediates are new tensors
    (torch's CPU baddbmm into a slice of a larger tensor runs group by group)."""
    grad = torch.baddbmm(towards_means.new_empty(()), towards_means, scaled_means, beta=0.0, alpha=alpha)
    for index, (gradient, points, sign) in enumerate(terms):
        torch.addcmul(grad, torch.bmm(gradient, inv_var), points, value=sign * a * a,
                      out=out if index == len(terms) - 1 else grad)


def _accumulate_product(total: Optional[Tensor], a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """total + alpha a @ b, the product alone when ``total`` is None (the first block)."""
    if total is None:
        return torch.baddbmm(a.new_empty(()), a, b, beta=0.0, alpha=alpha)
    return total.baddbmm_(a, b, alpha=alpha)


def _mean_rebuilder(
    noise_replay: Callable[[], Tensor], step: float, restore: Callable[[Tensor], Tensor], num_groups: int
) -> Callable[[Tensor], Tensor]:
    """The mean x = z~ - step * eps of group-major sampled points z~, with eps from
    ``noise_replay`` (in the points' logical layout), in the same group-major order."""

    def mean_of(sampled: Tensor) -> Tensor:
        logical = restore(sampled)
        mean = torch.empty_like(logical)  # z~'s layout, so that both take one group-major order
        torch.sub(logical, noise_replay().to(logical.dtype), alpha=step, out=mean)
        return group_major_points(mean, num_groups)[0]

    return mean_of


def check_gmm_init(init: str, name: str = "init"):
    """ValueError unless ``init`` is one of ``GMM_INITS``; ``name``: what the caller calls it."""
    if init not in GMM_INITS:
        raise ValueError(f"{name} must be one of {GMM_INITS}, got {init!r}")


class DiagonalGMM(nn.Module):
    """``num_groups`` diagonal GMMs with ``num_components`` components in ``dim`` dimensions.

    Args:
        num_components: n_c, the number of clusters (>= 1).
        dim: dimension of each clustered vector.
        num_groups: number of independent mixtures (e.g. one per head).
        centroid_grad_mult: c_grad, multiplies the gradient reaching the means (the paper
            trains centroids with a larger step than the rest of the network).
        init: "xavier" or "spread" (see ``reset_parameters``).
    """

    def __init__(
        self,
        num_components: int,
        dim: int,
        num_groups: int = 1,
        centroid_grad_mult: float = 1.0,
        init: str = "xavier",
    ):
        super().__init__()
        if num_components < 1:
            raise ValueError(f"a GMM needs at least one component, got {num_components}")
        check_gmm_init(init)
        self.init = init
        self.num_components = num_components
        self.dim = dim
        self.num_groups = num_groups
        self.centroid_grad_mult = centroid_grad_mult
        self.logits = nn.Parameter(torch.zeros(num_groups, num_components))
        self.means = nn.Parameter(torch.empty(num_groups, num_components, dim))
        self.log_vars = nn.Parameter(torch.zeros(num_groups, num_components, dim))
        self.reset_parameters()

    def reset_parameters(self):
        if self.init == "xavier":
            # The DMA authors' initialisation: Xavier-normal logits, means and log-variances,
            # i.e. N(0, 2 / (n_c + G)) logits and N(0, 2 / ((n_c + G) d)) means and log-variances
            # (torch's fans of a (G, n_c, d) tensor). The centres start close together
            # (std 0.09 for n_c = G = 4, d = 32) against inputs of unit scale, so the posteriors
            # start soft and the mask close to uniform, and clusters separate as they train.
            for p in (self.logits, self.means, self.log_vars):
                nn.init.xavier_normal_(p)
        else:
            # "spread": unit-variance components with N(0, 1) centres, well apart for inputs of
            # unit scale per coordinate, so the posteriors start peaked (and random)
            nn.init.normal_(self.means)
            nn.init.zeros_(self.log_vars)
            nn.init.zeros_(self.logits)

    def forward(
        self,
        x: Tensor,
        noise_var: float = 0.1,
        sample: bool = False,
        need_kl: bool = False,
        noise: Optional[Tensor] = None,
        point: Optional[Tensor] = None,
        scale: float = 1.0,
        noise_replay: Optional[Callable[[], Tensor]] = None,
        triton: bool = False,
    ) -> GMMStatistics:
        """Cluster the points ``scale * x``, x of shape (..., G, N, d).

        ``noise_var`` is s^2 of q(z | x) = N(x, s^2 I). With ``sample`` (training) the posterior
        is taken at a sample z~ = x + s * eps and the KL at the mean x, as in VaDE; without it
        both use x. The caller that needs the sample elsewhere too (DMA feeds it to the
        attention) gives either ``noise`` (eps, shape of ``x``) or the sampled ``point`` z~
        itself, which is then kept for backward without a copy (the points are in the
        mixture's space divided by ``scale``: z~ = x + (s / scale) eps); by default eps is drawn
        here. With ``point``, ``noise_replay`` (optional) returns eps again in backward, which
        then rebuilds the mean x = z~ - (s / scale) eps instead of keeping it. A ``point`` must
        be that sample of x, with eps constant: the GMM's gradient for z~ is returned through x
        (d z~ / d x = I), so z~ itself receives none from here. ``triton``: the passes over the
        points as Triton kernels (``mixture_triton``; ``--dma-backend triton``).
        """
        for name, t in (("noise", noise), ("point", point)):
            if t is not None and t.shape != x.shape:
                raise ValueError(f"{name} of shape {tuple(t.shape)} for points of shape {tuple(x.shape)}")
        if need_kl and noise_var <= 0.0:
            raise ValueError("the VaDE KL needs a positive variance s^2 for q(z | x)")
        with torch.autocast(device_type=x.device.type, enabled=False):
            dtype = at_least_fp32(x, self.means)
            points, restore = group_major_points(x.to(dtype), self.num_groups)
            sampled = points
            if sample:
                if point is None and noise is not None:
                    point = torch.add(x, noise, alpha=math.sqrt(noise_var) / scale)
                if point is not None:
                    # laid out like x, so that group_major_points orders both points the same way
                    if point.stride() != x.stride() or point.dtype != dtype:
                        point = torch.empty_like(x, dtype=dtype).copy_(point)
                    sampled = group_major_points(point, self.num_groups)[0]
                elif noise_var > 0.0:
                    drawn = standard_normal(points.shape, dtype, points.device)
                    sampled = torch.add(points, drawn, alpha=math.sqrt(noise_var) / scale)
            params = (self.logits.to(dtype), self.means.to(dtype), self.log_vars.to(dtype))
            grad_needed = points.requires_grad or sampled.requires_grad or any(p.requires_grad for p in params)
            if torch.is_grad_enabled() and grad_needed:
                mean_of = None
                if noise_replay is not None and point is not None and sampled is not points:
                    mean_of = _mean_rebuilder(noise_replay, math.sqrt(noise_var) / scale, restore, self.num_groups)
                log_joint, log_post, post, kl = _MixtureStatistics.apply(
                    points, sampled, *params, scale, noise_var, need_kl, self.centroid_grad_mult, mean_of, triton
                )
            else:
                inv_var, scaled_means, log_norm = self._frozen_constants(params)
                log_joint, log_post, post, kl, _ = mixture_statistics(
                    points, sampled, scale, noise_var, need_kl, inv_var, scaled_means, log_norm, triton
                )
            if kl is not None:
                kl = restore(kl.unsqueeze(-1)).squeeze(-1)
        # P as (B, H, N, C) in one block: every consumer multiplies it by matrices, which needs it
        # laid out batch by batch (torch's bmm copies each matrix separately otherwise). The log
        # posterior and the joint stay views (one copy each saved) of the group-major results.
        return GMMStatistics(restore(log_joint), restore(log_post), kl, restore(post).contiguous())

    def _frozen_constants(self, params: Tuple[Tensor, Tensor, Tensor]) -> Tuple[Tensor, ...]:
        """``mixture_constants`` without autograd, kept while the parameters are unchanged:
        a decoding step then clusters its query with the few launches of the points alone.
        Keyed on the parameters' storage and version counters (an optimizer step, a checkpoint
        load or a ``.to()`` changes one of them)."""
        own = (self.logits, self.means, self.log_vars)  # not ``params``: a dtype copy is new each call
        key = tuple((p.data_ptr(), p._version, p.device) for p in own) + (params[0].dtype,)
        if getattr(self, "_constants_key", None) != key:
            with torch.no_grad():
                self._constants = mixture_constants(*params)
            self._constants_key = key
        return self._constants

    def extra_repr(self) -> str:
        return (
            f"num_components={self.num_components}, dim={self.dim}, "
            f"num_groups={self.num_groups}, centroid_grad_mult={self.centroid_grad_mult}, init={self.init}"
        )
