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
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from fairseq.modules import GradMultiply
from torch import Tensor


def at_least_fp32(*tensors: Tensor) -> torch.dtype:
    """The dtype "fp32" computations run in: fp32 for half/bf16/fp32 inputs, fp64 for fp64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class GMMStatistics(NamedTuple):
    """Per-point results of one GMM evaluation, all fp32.

    log_joint: log pi_c + log N(z_i; mu_c, sigma_c^2), shape (..., G, N, C)
    log_post:  log p(c | z_i) (log-softmax of log_joint over c), shape (..., G, N, C)
    kl:        VaDE KL per point (None unless requested), shape (..., G, N)
    """

    log_joint: Tensor
    log_post: Tensor
    kl: Optional[Tensor]


class DiagonalGMM(nn.Module):
    """``num_groups`` diagonal GMMs with ``num_components`` components in ``dim`` dimensions.

    Args:
        num_components: n_c, the number of clusters (>= 1).
        dim: dimension of each clustered vector.
        num_groups: number of independent mixtures (e.g. one per head).
        centroid_grad_mult: c_grad, multiplies the gradient reaching the means (the paper
            trains centroids with a larger step than the rest of the network).
    """

    def __init__(self, num_components: int, dim: int, num_groups: int = 1, centroid_grad_mult: float = 1.0):
        super().__init__()
        if num_components < 1:
            raise ValueError(f"a GMM needs at least one component, got {num_components}")
        self.num_components = num_components
        self.dim = dim
        self.num_groups = num_groups
        self.centroid_grad_mult = centroid_grad_mult
        self.logits = nn.Parameter(torch.zeros(num_groups, num_components))
        self.means = nn.Parameter(torch.empty(num_groups, num_components, dim))
        self.log_vars = nn.Parameter(torch.zeros(num_groups, num_components, dim))
        self.reset_parameters()

    def reset_parameters(self):
        # Inputs are layer-normed (or embedding-scaled) vectors with roughly unit variance per
        # coordinate, so unit-variance components with N(0, 1) centres start well spread.
        nn.init.normal_(self.means)
        nn.init.zeros_(self.log_vars)
        nn.init.zeros_(self.logits)

    def _effective_means(self) -> Tensor:
        if self.centroid_grad_mult != 1.0 and self.means.requires_grad:
            return GradMultiply.apply(self.means, self.centroid_grad_mult)
        return self.means

    def squared_mahalanobis(self, x: Tensor, means: Tensor, inv_var: Tensor) -> Tensor:
        """D_c(x) for every point and component via the matmul expansion. x: (..., G, N, d)."""
        quad = torch.matmul(x * x, inv_var.transpose(-1, -2))
        cross = torch.matmul(x, (means * inv_var).transpose(-1, -2))
        const = (means * means * inv_var).sum(-1).unsqueeze(-2)  # (G, 1, C)
        # The expansion can go a few ulps below zero where x sits on a centre.
        return (quad - 2.0 * cross + const).clamp_min(0.0)

    def forward(
        self, x: Tensor, noise_var: float = 0.1, sample: bool = False, need_kl: bool = False
    ) -> GMMStatistics:
        """Cluster the points ``x`` of shape (..., G, N, d).

        ``noise_var`` is s^2 of q(z | x) = N(x, s^2 I). With ``sample`` (training) the posterior
        is taken at z~ = x + s * eps and the KL at the mean x, as in VaDE; without it both use x.
        """
        device_type = x.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            dtype = at_least_fp32(x, self.means)
            x = x.to(dtype)
            means = self._effective_means().to(dtype)
            log_vars = self.log_vars.to(dtype)
            inv_var = torch.exp(-log_vars)
            log_pi = torch.log_softmax(self.logits.to(dtype), dim=-1).unsqueeze(-2)  # (G, 1, C)
            log_det = log_vars.sum(-1).unsqueeze(-2)  # (G, 1, C)
            log_norm = log_pi - 0.5 * (log_det + self.dim * math.log(2.0 * math.pi))

            if sample and noise_var > 0.0:
                point = x + math.sqrt(noise_var) * torch.randn_like(x)
            else:
                point = x
            dist = self.squared_mahalanobis(point, means, inv_var)
            log_joint = log_norm - 0.5 * dist
            log_post = torch.log_softmax(log_joint, dim=-1)

            kl = None
            if need_kl:
                if noise_var <= 0.0:
                    raise ValueError("the VaDE KL needs a positive variance s^2 for q(z | x)")
                mean_dist = dist if point is x else self.squared_mahalanobis(x, means, inv_var)
                trace = inv_var.sum(-1).unsqueeze(-2)  # (G, 1, C)
                post = log_post.exp()
                expected_nll = 0.5 * (log_det + noise_var * trace + mean_dist)
                kl = (post * (expected_nll - log_pi + log_post)).sum(-1)
                kl = kl - 0.5 * self.dim * (1.0 + math.log(noise_var))
        return GMMStatistics(log_joint, log_post, kl)

    def extra_repr(self) -> str:
        return (
            f"num_components={self.num_components}, dim={self.dim}, "
            f"num_groups={self.num_groups}, centroid_grad_mult={self.centroid_grad_mult}"
        )
