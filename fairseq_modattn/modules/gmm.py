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
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from fairseq.modules import GradMultiply
from torch import Tensor

from .precision import at_least_fp32

#: "xavier" (the DMA authors' initialisation) or "spread" (N(0, 1) centres, unit variances)
GMM_INITS = ("xavier", "spread")


def log_softmax_over_clusters(log_joint: Tensor) -> Tensor:
    """log_softmax over the last (cluster) axis, computed with that axis moved off the end.

    The same values; on the CPU (torch 2.13) ``log_softmax`` over a short last axis (n_c = 4-12)
    runs one scalar reduction per row and is ~45x slower than over a leading axis (measured on
    (4, 4096, 8): 2.3 ms against 0.05 ms, forward + backward 4.5 against 0.6 ms with the copy).
    The result is a transposed view, which every consumer here reads as it is.
    """
    if log_joint.device.type != "cpu":
        return torch.log_softmax(log_joint, dim=-1)
    return torch.log_softmax(log_joint.transpose(-1, -2).contiguous(), dim=-2).transpose(-1, -2)


class GMMStatistics(NamedTuple):
    """Per-point results of one GMM evaluation, all fp32.

    log_joint: log pi_c + log N(z_i; mu_c, sigma_c^2), shape (..., G, N, C)
    log_post:  log p(c | z_i) (log-softmax of log_joint over c), shape (..., G, N, C)
    kl:        VaDE KL per point (None unless requested), shape (..., G, N)
    """

    log_joint: Tensor
    log_post: Tensor
    kl: Optional[Tensor]


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
    point_axes = sorted(range(1, moved.dim() - 1), key=lambda a: -moved.stride(a))
    order = [0] + point_axes + [moved.dim() - 1]
    ordered = moved.permute(order)
    flat = ordered.reshape(num_groups, -1, x.size(-1))
    inverse = [order.index(a) for a in range(len(order))]

    def restore(result: Tensor) -> Tensor:
        out = result.reshape(*ordered.shape[:-1], result.size(-1)).permute(inverse)
        return out.squeeze(0) if num_groups == 1 else out.movedim(0, -3)

    return flat, restore


class _MahalanobisDistances(torch.autograd.Function):
    """D_c(x + s eps) and D_c(x) for (G, M, d) points; backward saves only x and eps.

    Autograd through the matmul expansion would keep x*x and the noisy point (two more
    (M, d) tensors per GMM) for backward; here both are rebuilt there, from

        dD_c/dz = 2 (z - mu_c) / sigma_c^2,
        dD_c/d(1/sigma_c^2) = (z - mu_c)^2 = z^2 - 2 mu_c z + mu_c^2,
        dD_c/dmu_c = -2 (z - mu_c) / sigma_c^2,

    summed over points with matmuls (no (M, C, d) tensor).
    """

    @staticmethod
    def forward(ctx, x, noise, noise_scale, means, inv_var):
        # returns D(x + s * eps) and, when noise is given, also D(x)
        scaled_means = means * inv_var  # (G, C, d)
        const = (means * scaled_means).sum(-1).unsqueeze(-2)  # (G, 1, C)
        ctx.noise_scale = noise_scale
        ctx.save_for_backward(x, noise, means, inv_var)
        if noise is None:
            return _expanded_distance(x, inv_var, scaled_means, const)
        point = torch.add(x, noise, alpha=noise_scale)
        square = torch.empty_like(point)  # z * z of both points, one buffer (fresh ones page-fault)
        return (
            _expanded_distance(point, inv_var, scaled_means, const, square),
            _expanded_distance(x, inv_var, scaled_means, const, square),
        )

    @staticmethod
    def backward(ctx, *grads):
        # fp32 like the forward, also when backward is called inside an autocast region
        with torch.autocast(device_type=grads[0].device.type, enabled=False):
            return _MahalanobisDistances._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        x, noise, means, inv_var = ctx.saved_tensors
        grad_point = grads[0]
        grad_mean = grads[1] if len(grads) > 1 else None
        terms = [(grad_point, x if noise is None else torch.add(x, noise, alpha=ctx.noise_scale))]
        if grad_mean is not None:
            terms.append((grad_mean, x))
        scaled_means = means * inv_var
        grad_x = grad_means = grad_inv_var = None
        if ctx.needs_input_grad[0]:
            # sum over terms of 2 g (z - mu) / sigma^2; the two points differ only by s * eps,
            # so this reads x once and eps once.
            total = grad_point if grad_mean is None else grad_point + grad_mean
            grad_x = torch.bmm(total, 2.0 * inv_var).mul_(x)
            grad_x.baddbmm_(total, scaled_means, alpha=-2.0)
            if noise is not None:
                grad_x.add_(torch.bmm(grad_point, (2.0 * ctx.noise_scale) * inv_var).mul_(noise))
        if ctx.needs_input_grad[3] or ctx.needs_input_grad[4]:
            weight_sum = sum(g.sum(1) for g, _ in terms).unsqueeze(-1)  # (G, C, 1)
            first = sum(torch.bmm(g.transpose(1, 2), z) for g, z in terms)  # sum_i g_ic z_i
            centred = first - means * weight_sum  # sum_i g_ic (z_i - mu_c)
            if ctx.needs_input_grad[3]:
                grad_means = -2.0 * inv_var * centred
            if ctx.needs_input_grad[4]:
                square = torch.empty_like(x)
                # sum_i g_ic z_i^2
                second = sum(torch.bmm(g.transpose(1, 2), torch.mul(z, z, out=square)) for g, z in terms)
                grad_inv_var = second - 2.0 * means * first + means * means * weight_sum
        return grad_x, None, None, grad_means, grad_inv_var


def _expanded_distance(
    z: Tensor, inv_var: Tensor, scaled_means: Tensor, const: Tensor, square: Optional[Tensor] = None
) -> Tensor:
    """sum_d (z_d - mu_cd)^2 / sigma_cd^2 = (z*z) @ (1/sigma^2) - 2 z @ (mu/sigma^2) + const;
    ``square``, optional, receives z*z."""
    square = z * z if square is None else torch.mul(z, z, out=square)
    dist = torch.bmm(square, inv_var.transpose(1, 2))
    dist.baddbmm_(z, scaled_means.transpose(1, 2), alpha=-2.0).add_(const)
    # The expansion can go a few ulps below zero where z sits on a centre.
    return dist.clamp_min_(0.0)


def mahalanobis_distances(
    x: Tensor, noise: Optional[Tensor], noise_scale: float, means: Tensor, inv_var: Tensor
) -> Tuple[Tensor, Tensor]:
    """(D(x + noise_scale * noise), D(x)) for points x (G, M, d), each (G, M, C).

    With ``noise`` None (no sampling) both are the same tensor D(x).
    """
    if noise is None:
        dist = _MahalanobisDistances.apply(x, None, noise_scale, means, inv_var)
        return dist, dist
    return _MahalanobisDistances.apply(x, noise, noise_scale, means, inv_var)


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
        if init not in GMM_INITS:
            raise ValueError(f"GMM initialisation must be one of {GMM_INITS}, got {init!r}")
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

    def _effective_means(self) -> Tensor:
        if self.centroid_grad_mult != 1.0 and self.means.requires_grad and torch.is_grad_enabled():
            return GradMultiply.apply(self.means, self.centroid_grad_mult)
        return self.means

    def forward(
        self,
        x: Tensor,
        noise_var: float = 0.1,
        sample: bool = False,
        need_kl: bool = False,
        noise: Optional[Tensor] = None,
    ) -> GMMStatistics:
        """Cluster the points ``x`` of shape (..., G, N, d).

        ``noise_var`` is s^2 of q(z | x) = N(x, s^2 I). With ``sample`` (training) the posterior
        is taken at z~ = x + s * eps and the KL at the mean x, as in VaDE; without it both use x.
        ``noise`` (shape of ``x``) is eps when the caller needs the same sample z~ elsewhere
        (DMA feeds it to the attention projections); by default it is drawn here.
        """
        if noise is not None and noise.shape != x.shape:
            raise ValueError(f"noise of shape {tuple(noise.shape)} for points of shape {tuple(x.shape)}")
        if need_kl and noise_var <= 0.0:
            raise ValueError("the VaDE KL needs a positive variance s^2 for q(z | x)")
        with torch.autocast(device_type=x.device.type, enabled=False):
            dtype = at_least_fp32(x, self.means)
            points, restore = group_major_points(x.to(dtype), self.num_groups)
            means = self._effective_means().to(dtype)
            log_vars = self.log_vars.to(dtype)
            inv_var = torch.exp(-log_vars)
            log_pi = torch.log_softmax(self.logits.to(dtype), dim=-1).unsqueeze(-2)  # (G, 1, C)
            log_det = log_vars.sum(-1).unsqueeze(-2)  # (G, 1, C)
            log_norm = log_pi - 0.5 * (log_det + self.dim * math.log(2.0 * math.pi))

            if not sample:
                noise = None
            elif noise is not None:
                # laid out like x, so that group_major_points orders both points the same way
                if noise.stride() != x.stride() or noise.dtype != dtype:
                    noise = torch.empty_like(x, dtype=dtype).copy_(noise)
                noise = group_major_points(noise, self.num_groups)[0]
            elif noise_var > 0.0:
                noise = torch.randn(points.shape, dtype=dtype, device=points.device)
            if noise is not None and not need_kl:  # the distance at the mean is not needed
                points, noise = torch.add(points, noise, alpha=math.sqrt(noise_var)), None
            dist, mean_dist = mahalanobis_distances(points, noise, math.sqrt(noise_var), means, inv_var)
            log_joint = log_norm - 0.5 * dist
            log_post = log_softmax_over_clusters(log_joint)

            kl = None
            if need_kl:
                trace = inv_var.sum(-1).unsqueeze(-2)  # (G, 1, C)
                expected_nll = 0.5 * (log_det + noise_var * trace + mean_dist)
                kl = (log_post.exp() * (expected_nll - log_pi + log_post)).sum(-1)
                kl = restore(kl.unsqueeze(-1)).squeeze(-1) - 0.5 * self.dim * (1.0 + math.log(noise_var))
        # (B, H, N, C) in one block: the posteriors are small (C values per point), and every
        # consumer multiplies them by matrices, which needs them laid out batch by batch (torch's
        # bmm copies each matrix separately otherwise)
        return GMMStatistics(restore(log_joint).contiguous(), restore(log_post).contiguous(), kl)

    def extra_repr(self) -> str:
        return (
            f"num_components={self.num_components}, dim={self.dim}, "
            f"num_groups={self.num_groups}, centroid_grad_mult={self.centroid_grad_mult}, init={self.init}"
        )
