"""Disentangled mask attention (DMA; Chien & Huang, "Disentangled Mask Attention in
Transformer", sections 3.1-3.3 and 4.3).

Every attention module owns

    * a token GMM per head over the module's *inputs* split into heads, z_i^h (query side: the
      query input; key side: the key input; self-attention shares them), with posteriors
      P_ic^h = p(c | z~_i^h) (``gmm.DiagonalGMM``); in training z~ = z + s * eps is sampled
      from N(z, s^2 I) (paper, 4.3), at inference z~ = z;
    * a query GMM shared by the heads over the projected queries q_i^h, with posteriors
      Q_ic^h = p(c | q_i^h) at the queries themselves (the MI bounds below are statements about
      the model's queries, so they are not perturbed; only the KL uses q(z | q) = N(q, s^2 I)).

The semantic mask of head h is M_ij = sum_c P^q_ic P^k_jc and the masked attention

    A~ = normalise_j(M * A) = softmax_j(q k^T / sqrt(d) + masks + log M)           (exact)
    A^ = (1 - gamma) A + gamma A~,   gamma(t) = 1 - max(1 - alpha, exp(-r t)),

with t the number of updates (``set_num_updates``; r = 5e-4 in the paper), so gamma rises
from 0 to alpha. A^ V is computed without a B x H x T x S x C tensor in one of two exact ways
(``attention_impl``):

    * "fused": ``interpolated_attention.interpolated_masked_attention``, one logit product
      shared by both softmaxes and one value product (the fast form on CPU);
    * "sdpa": (1 - gamma) SDPA(q, k, v, masks) + gamma SDPA(q, k, v, masks + log M), with
      log M from a matmul of the posteriors in fp32 (the fast form on CUDA, whose memory-efficient
      kernel differentiates the bias); attention dropout then acts on A and A~ separately,
      which has the expectation of dropping A^.

"auto" (default) takes sdpa on CUDA and fused elsewhere. The weights themselves are
materialised only when a caller asks for them.

At inference the decoder self-attention drops the mask (paper, 4.3: gamma = 0 there) unless
``mask_at_inference`` is set; encoder self- and encoder-decoder attention keep it. The key-side
log posteriors are cached with the keys, so incremental decoding reproduces the full forward.

While ``collect_aux`` is on (the model sets it for its own forward) the module also computes
its regularisers into ``aux_losses``: the VaDE KL of both GMMs, L_Dqq, L_Dxq and L_dv
(``mi_bounds``), over real tokens only.
"""

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention_base import MultiheadAttentionBase
from .gmm import DiagonalGMM, at_least_fp32
from .interpolated_attention import interpolated_masked_attention, log_semantic_mask
from .mi_bounds import (
    diversity_penalty,
    head_dependence_bound,
    infonce_bound,
    masked_token_mean,
    sample_negatives,
)

AUX_LOSS_NAMES = ("kl", "dqq", "dxq", "div")
#: "fused": ``interpolated_masked_attention``; "sdpa": two scaled_dot_product_attention calls;
#: "auto": sdpa on CUDA (its kernels differentiate the log M bias), fused elsewhere
ATTENTION_IMPLS = ("auto", "fused", "sdpa")


def annealing_rate(num_updates: int, alpha: float, rate: float) -> float:
    """gamma(t) = 1 - max(1 - alpha, exp(-rate * t)): 0 at t = 0, tends to alpha."""
    return 1.0 - max(1.0 - alpha, math.exp(-rate * num_updates))


class DisentangledMaskAttention(MultiheadAttentionBase):
    """Multi-head attention with a GMM semantic mask (see the module docstring).

    Args (beyond ``MultiheadAttentionBase``):
        num_clusters: n_c, components of both GMMs.
        alpha: final value of the interpolation weight gamma.
        anneal_rate: r in gamma(t) = 1 - max(1 - alpha, exp(-r t)).
        noise_var: s^2 of q(z | x) = N(x, s^2 I) (training samples, KL).
        centroid_grad_mult: c_grad, gradient multiplier of the GMM means.
        mask_at_inference: keep the mask in eval mode (False for decoder self-attention by
            default, as in the paper).
    """

    cached_state_names = ("log_p",)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
        num_clusters: int = 4,
        alpha: float = 0.5,
        anneal_rate: float = 5e-4,
        noise_var: float = 0.1,
        centroid_grad_mult: float = 1.0,
        mask_at_inference: bool = True,
        attention_impl: str = "auto",
    ):
        super().__init__(
            embed_dim, num_heads, kdim, vdim, dropout, bias, self_attention, encoder_decoder_attention
        )
        if num_clusters < 1:
            raise ValueError(f"--dma-clusters must be >= 1, got {num_clusters}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"--dma-alpha must lie in [0, 1], got {alpha}")
        if anneal_rate < 0.0:
            raise ValueError(f"--dma-anneal-rate must be >= 0, got {anneal_rate}")
        if noise_var <= 0.0:
            raise ValueError(f"--dma-noise-var must be > 0, got {noise_var}")
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"--dma-attention-impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
        if self.kdim != embed_dim:
            # P^q and P^k come from the same token GMM, so both inputs need the same width.
            raise ValueError(
                f"DMA attention needs key inputs as wide as queries ({self.kdim} != {embed_dim}):"
                " use --encoder-embed-dim equal to --decoder-embed-dim"
            )
        self.num_clusters = num_clusters
        self.alpha = alpha
        self.anneal_rate = anneal_rate
        self.noise_var = noise_var
        self.mask_at_inference = mask_at_inference
        self.attention_impl = attention_impl
        self.token_gmm = DiagonalGMM(num_clusters, embed_dim // num_heads, num_heads, centroid_grad_mult)
        self.query_gmm = DiagonalGMM(num_clusters, self.head_dim, 1, centroid_grad_mult)

        self.num_updates = 0
        #: set by the model around its own forward: compute ``aux_losses``
        self.collect_aux = False
        #: (B, T) True on padded queries, set by the model for encoder-decoder attention
        self.query_padding_mask: Optional[Tensor] = None
        self.aux_losses: Optional[Dict[str, Tensor]] = None

    def set_num_updates(self, num_updates: int):
        self.num_updates = num_updates

    @property
    def gamma(self) -> float:
        """The interpolation weight in force for the next forward."""
        if not self.training and not self.mask_at_inference:
            return 0.0
        return annealing_rate(self.num_updates, self.alpha, self.anneal_rate)

    def token_state(self, x: Tensor) -> Dict[str, Tensor]:
        if not self.collect_aux and self.gamma == 0.0:
            return {}
        length, bsz, _ = x.shape
        z = x.view(length, bsz, self.num_heads, -1).permute(1, 2, 0, 3)  # (B, H, N, E / H)
        stats = self.token_gmm(z, self.noise_var, sample=self.training, need_kl=self.collect_aux)
        state = {"log_p": stats.log_post}
        if stats.kl is not None:
            state["kl"] = stats.kl
        return state

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_state: Dict[str, Tensor],
        k_state: Dict[str, Tensor],
        mask: Optional[Tensor],
        key_padding_mask: Optional[Tensor],
        need_weights: bool,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        gamma = self.gamma
        if self.collect_aux:
            self.aux_losses = self.regularisers(q, q_state, k_state, key_padding_mask)
        if need_weights:
            log_m = None
            if gamma > 0.0:
                log_m = log_semantic_mask(q_state["log_p"], k_state["log_p"])
            scale = self.head_dim ** -0.5
            dtype = at_least_fp32(q)
            logits = torch.matmul(q.to(dtype) * scale, k.to(dtype).transpose(-1, -2))
            if mask is not None:
                logits = logits + mask.to(dtype)
            weights = self.explicit_softmax(logits)
            if log_m is not None:
                weights = (1.0 - gamma) * weights + gamma * self.explicit_softmax(logits + log_m)
            out = torch.matmul(self.apply_dropout(weights).to(v.dtype), v)
            return out, weights

        p = self.dropout if self.training else 0.0
        if gamma == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p), None
        if self.uses_fused_kernel(q):
            out = interpolated_masked_attention(q, k, v, q_state["log_p"], k_state["log_p"], mask, gamma, p)
            return out, None
        bias = log_semantic_mask(q_state["log_p"], k_state["log_p"]).to(q.dtype)
        if mask is not None:
            bias = bias + mask
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
        if gamma == 1.0:
            return masked, None
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return torch.lerp(plain, masked, gamma), None

    def uses_fused_kernel(self, q: Tensor) -> bool:
        """Whether ``attend`` takes ``interpolated_masked_attention`` or two SDPA calls.

        "auto": the two SDPA calls on CUDA, whose kernels differentiate the log M bias; the
        fused form elsewhere. On CPU it is the faster one in training (torch's CPU kernels
        differentiate no bias) and also without autograd (measured at beam-search shapes, one
        query against 30 keys: 2.1 ms against 4.5 ms for the pair).
        """
        if self.attention_impl == "auto":
            return q.device.type != "cuda"
        return self.attention_impl == "fused"

    def regularisers(
        self,
        q: Tensor,
        q_state: Dict[str, Tensor],
        k_state: Dict[str, Tensor],
        key_padding_mask: Optional[Tensor],
    ) -> Dict[str, Tensor]:
        """KL (both GMMs), L_Dqq, L_Dxq and L_dv of this module, each a mean (see mi_bounds)."""
        key_valid = None if key_padding_mask is None else ~key_padding_mask.bool()
        if self.self_attention:
            query_valid = key_valid
        else:
            query_valid = None if self.query_padding_mask is None else ~self.query_padding_mask.bool()

        queries = self.query_gmm(q, self.noise_var, sample=False, need_kl=True)
        query_post = queries.log_post.exp()
        token_post = q_state["log_p"].exp()
        # training: one sampled negative per query (unbiased, no (B, H, H, T, T) table);
        # evaluation: the exact mean over all tokens, so validation is deterministic
        negatives = None
        if self.training:
            negatives = sample_negatives(query_valid, q.size(0), q.size(2), q.device)
        kl = masked_token_mean(q_state["kl"], query_valid)
        div = diversity_penalty(token_post, query_valid)
        if not self.self_attention:  # the key side is a second set of tokens for the token GMM
            kl = 0.5 * (kl + masked_token_mean(k_state["kl"], key_valid))
            div = 0.5 * (div + diversity_penalty(k_state["log_p"].exp(), key_valid))
        return {
            "kl": kl + masked_token_mean(queries.kl, query_valid),
            "dqq": head_dependence_bound(queries.log_joint, queries.log_post, query_valid, negatives),
            "dxq": infonce_bound(query_post, query_valid),
            "div": div + diversity_penalty(query_post, query_valid),
        }

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, clusters={self.num_clusters}, "
            f"alpha={self.alpha}, anneal_rate={self.anneal_rate}, mask_at_inference={self.mask_at_inference}"
        )
