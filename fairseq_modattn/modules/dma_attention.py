"""Disentangled mask attention (DMA; Chien & Huang, "Disentangled Mask Attention in
Transformer", sections 3.1-3.3 and 4.3). docs/fidelity.md lists, step by step, where this
module follows the paper's text, the authors' code, or neither, and why.

Every attention module owns

    * a token GMM per head over the module's *inputs* split into heads, z_i^h (query side: the
      query input; key side: the key input; self-attention shares them), with posteriors
      P_ic^h = p(c | z~_i^h) (``gmm.DiagonalGMM``); in training z~ = z + s * eps is sampled
      from N(z, s^2 I) (paper, 4.3), at inference z~ = z;
    * a query GMM shared by the heads over the projected queries q_i^h, with posteriors
      Q_ic^h = p(c | q_i^h).

Where the training sample goes (``sample_inputs``):

    * "gmm" (the paper's text): only the token GMM sees z~; the attention projections read z,
      and the query GMM clusters the queries themselves (its KL still uses q(z | q) = N(q, s^2 I));
    * "attention" (the authors' code): z~ replaces the query input of the projections (and the
      key input of encoder-decoder attention; keys and values of self-attention, and values of
      encoder-decoder attention, read z), and the queries are sampled too, q~ = q + s * eps',
      which the query GMM clusters and the logits q~ k^T / sqrt(d) use. Eq. 4 takes the
      likelihood at the sample, so the attention sees the point the GMM clustered.

What the query GMM clusters (``query_gmm_input``):

    * "raw" (the paper's text): q = W_q x, sampled as q~ = q + s eps';
    * "scaled" (the authors' code): u = q / sqrt(d), the query as fairseq's attention holds it
      once scaled, sampled as u~ = u + s eps'; the logits are then u~ k^T, i.e. the queries
      carry the noise sqrt(d) s eps'. A GMM on u is a GMM on q with its centres and spreads
      rescaled, so the model class is the same; what changes is the scale the GMM, its
      initialisation and the noise s act at.

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
(``mi_bounds``, in the forms ``qq_form`` and ``div_form``), over real tokens only; batch means,
or with ``per_sentence_losses`` one value per sentence (B,), the KL and L_dv of both sides of
encoder-decoder attention then added (as the authors' code adds them) rather than averaged.
"""

import math
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import dma_compiled
from .attention_base import MultiheadAttentionBase
from .device_paths import path_device
from .future_mask import is_future_mask
from .gmm import DiagonalGMM
from .interpolated_attention import interpolated_masked_attention, log_mask
from .mi_bounds import (
    DIV_FORMS,
    QQ_FORMS,
    diversity_penalty,
    head_dependence_bound,
    infonce_bound,
    masked_token_mean,
    sample_negatives,
)
from .noise import ReplayableNoise, standard_normal, standard_normal_like
from .parameter_names import parameter_names
from .precision import at_least_fp32
from .triton_support import kernel_device_error

AUX_LOSS_NAMES = ("kl", "dqq", "dxq", "div")
#: "fused": ``interpolated_masked_attention``; "sdpa": two scaled_dot_product_attention calls;
#: "auto": sdpa on CUDA (its kernels differentiate the log M bias), fused elsewhere
ATTENTION_IMPLS = ("auto", "fused", "sdpa")
#: where the training sample z~ = z + s eps goes: the token GMM only, or also the attention
SAMPLE_INPUTS = ("gmm", "attention")
#: what the query GMM clusters: q ("raw", the paper) or q / sqrt(d) ("scaled", the authors' code)
QUERY_GMM_INPUTS = ("raw", "scaled")
#: how a training forward is computed (``--dma-backend``): "eager" (PyTorch operators and this
#: package's autograd functions), "compile" (``dma_compiled``: one torch.compile'd graph),
#: "triton" (``dma_compiled``'s graph with the interpolated attention and L_Dxq's critic as
#: Triton kernels, ``triton_ops``; where compiling fails, the eager forward with those and the
#: GMMs' passes as kernels; CUDA), "auto" (the default: eager, until a GPU's measurements choose
#: otherwise).
#: Evaluation, validation and generation run eagerly with every backend.
BACKENDS = ("auto", "eager", "compile", "triton")


def check_backend(backend: str, flag: str = "backend"):
    """ValueError for a backend outside ``BACKENDS``. Whether "triton" can run (the package, a
    CUDA device) is asked at the first training forward (``kernel_device_error``): a model
    trained with it evaluates and decodes anywhere, eagerly."""
    if backend not in BACKENDS:
        raise ValueError(f"{flag} must be one of {BACKENDS}, got {backend!r}")


def posteriors(state: Dict[str, Tensor]) -> Tensor:
    """P = p(c | z) of a token state: the GMM's own output, or exp(log P) where the state holds
    only log P (the fused path's; ``token_state``)."""
    post = state.get("post")
    return post if post is not None else state["log_p"].exp()


def annealing_rate(num_updates: int, alpha: float, rate: float) -> float:
    """gamma(t) = 1 - max(1 - alpha, exp(-rate * t)): 0 at t = 0, tends to alpha."""
    return 1.0 - max(1.0 - alpha, math.exp(-rate * num_updates))


def check_dma_parameters(num_clusters: int, alpha: float, anneal_rate: float, noise_var: float,
                         centroid_grad_mult: float, attention_impl: str, sample_inputs: str, query_gmm_input: str,
                         qq_form: str, div_form: str, names: Optional[Mapping[str, str]] = None):
    """ValueError for a setting of ``DisentangledMaskAttention`` outside its domain (n_c >= 1,
    alpha in [0, 1], r >= 0, s^2 > 0, c_grad >= 0, each real number finite; each form one of its
    choices). ``names``: what the caller calls each parameter (``parameter_names``)."""
    name = parameter_names(names)
    if num_clusters < 1:
        raise ValueError(f"{name['num_clusters']} must be >= 1, got {num_clusters}")
    if not 0.0 <= alpha <= 1.0:  # False for NaN as well
        raise ValueError(f"{name['alpha']} must lie in [0, 1], got {alpha}")
    for parameter, value, positive in (("anneal_rate", anneal_rate, False), ("noise_var", noise_var, True),
                                       ("centroid_grad_mult", centroid_grad_mult, False)):
        if not math.isfinite(value) or value < 0.0 or (positive and value == 0.0):
            raise ValueError(f"{name[parameter]} must be a finite number {'>' if positive else '>='} 0, got {value}")
    for parameter, choice, choices in (
        ("attention_impl", attention_impl, ATTENTION_IMPLS),
        ("sample_inputs", sample_inputs, SAMPLE_INPUTS),
        ("query_gmm_input", query_gmm_input, QUERY_GMM_INPUTS),
        ("qq_form", qq_form, QQ_FORMS),
        ("div_form", div_form, DIV_FORMS),
    ):
        if choice not in choices:
            raise ValueError(f"{name[parameter]} must be one of {choices}, got {choice!r}")


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
        sample_inputs: "gmm" or "attention" (see the module docstring).
        query_gmm_input: "raw" or "scaled" (see the module docstring).
        qq_form, div_form: the forms of L_Dqq ("club", "bounded") and L_dv ("paper",
            "entrywise"), see ``mi_bounds``.
        per_sentence_losses: report each regulariser per sentence (B,) instead of a batch mean.
        gmm_init: "xavier" (the authors') or "spread", see ``gmm.DiagonalGMM.reset_parameters``.
        backend: how training forwards are computed, one of ``BACKENDS``.
        compile_math: True is backend="compile" (the older spelling).
    """

    cached_state_names = ("log_p", "post")

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
        sample_inputs: str = "gmm",
        query_gmm_input: str = "raw",
        qq_form: str = "club",
        div_form: str = "paper",
        per_sentence_losses: bool = False,
        gmm_init: str = "xavier",
        compile_math: bool = False,
        backend: str = "auto",
    ):
        super().__init__(
            embed_dim, num_heads, kdim, vdim, dropout, bias, self_attention, encoder_decoder_attention
        )
        check_dma_parameters(num_clusters, alpha, anneal_rate, noise_var, centroid_grad_mult, attention_impl,
                             sample_inputs, query_gmm_input, qq_form, div_form)
        if self.kdim != embed_dim:
            # P^q and P^k come from the same token GMM, so both inputs need the same width.
            raise ValueError(
                f"DMA attention needs key inputs as wide as queries: kdim ({self.kdim}) != embed_dim ({embed_dim})")
        self.num_clusters = num_clusters
        self.alpha = alpha
        self.anneal_rate = anneal_rate
        self.noise_var = noise_var
        self.mask_at_inference = mask_at_inference
        self.attention_impl = attention_impl
        self.sample_inputs = sample_inputs
        self.query_gmm_input = query_gmm_input
        #: u = query_gmm_scale * q is what the query GMM clusters
        self.query_gmm_scale = self.head_dim**-0.5 if query_gmm_input == "scaled" else 1.0
        self.qq_form = qq_form
        self.div_form = div_form
        self.per_sentence_losses = per_sentence_losses
        self.token_gmm = DiagonalGMM(num_clusters, embed_dim // num_heads, num_heads, centroid_grad_mult, gmm_init)
        self.query_gmm = DiagonalGMM(num_clusters, self.head_dim, 1, centroid_grad_mult, gmm_init)

        self.num_updates = 0
        #: set by the model around its own forward: compute ``aux_losses``
        self.collect_aux = False
        #: (B, T) True on padded queries, set by the model for encoder-decoder attention
        self.query_padding_mask: Optional[Tensor] = None
        self.aux_losses: Optional[Dict[str, Tensor]] = None
        check_backend(backend)
        if compile_math and backend not in ("auto", "compile"):
            raise ValueError(f"compile_math=True is backend='compile', which contradicts backend={backend!r}")
        self.backend = "compile" if compile_math else backend
        #: (attn_mask,) while a forward takes the Triton kernels (``attention_mask`` keeps it)
        self._kernel_masks: Optional[Tuple[Optional[Tensor]]] = None
        self._triton_forward = False

    @property
    def compile_math(self) -> bool:
        """Whether training forwards run through ``dma_compiled`` (backend "compile")."""
        return self.backend == "compile"

    @compile_math.setter
    def compile_math(self, value: bool):
        self.backend = "compile" if value else "eager"

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None, need_weights=True,
                static_kv=False, attn_mask=None, before_softmax=False, need_head_weights=False):
        if self.backend in ("compile", "triton") and dma_compiled.applies(
                self, query, key, incremental_state, attn_mask, before_softmax):
            result = dma_compiled.forward(
                self, query, key, value, key_padding_mask, attn_mask, need_weights, need_head_weights
            )
            if result is not None:  # None: compiling failed, run eagerly
                return result
        self._triton_forward = self._takes_triton_path(query, incremental_state, attn_mask,
                                                       need_weights or need_head_weights or before_softmax)
        try:
            return super().forward(query, key, value, key_padding_mask, incremental_state, need_weights, static_kv,
                                   attn_mask, before_softmax, need_head_weights)
        finally:
            self._triton_forward, self._kernel_masks = False, None

    def _takes_triton_path(self, query: Tensor, incremental_state, attn_mask: Optional[Tensor],
                           need_weights: bool) -> bool:
        """Whether this forward's attention runs as Triton kernels: backend "triton", a training
        forward without incremental state or weights, with no attention mask or a 2-D one. The
        kernels' device must be able to run them (``kernel_device_error``: a one-line error)."""
        if self.backend != "triton" or not self.training or incremental_state is not None or need_weights:
            return False
        if attn_mask is not None and attn_mask.dim() != 2:
            return False
        error = kernel_device_error(query)
        if error is not None:
            raise RuntimeError(error)
        return True

    def attention_mask(self, key_padding_mask, attn_mask, bsz, tgt_len, src_len, dtype):
        if self._triton_forward and self.gamma != 0.0:
            # the kernels read the padding (B, S) and the attention mask apart: no (B, 1, T, S) table
            self._kernel_masks = (attn_mask,)
            return None
        return super().attention_mask(key_padding_mask, attn_mask, bsz, tgt_len, src_len, dtype)

    def set_num_updates(self, num_updates: int):
        self.num_updates = num_updates

    @property
    def gamma(self) -> float:
        """The interpolation weight in force for the next forward."""
        if not self.training and not self.mask_at_inference:
            return 0.0
        return annealing_rate(self.num_updates, self.alpha, self.anneal_rate)

    @property
    def samples_attention(self) -> bool:
        """Whether this forward feeds the training sample to the attention (``sample_inputs``)."""
        return self.training and self.sample_inputs == "attention"

    def token_state(self, x: Tensor) -> Dict[str, Tensor]:
        return self._token_state(x, standard_normal_like(x) if self.samples_attention else None)

    def token_states(self, query: Tensor, key: Optional[Tensor]) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """Encoder-decoder attention clusters its queries' and keys' inputs (one token GMM) in
        one pass over both, concatenated along time: one GMM call instead of two, with the
        same random draws in the same order as two ``token_state`` calls."""
        if key is None or query.size(1) != key.size(1) or (not self.collect_aux and self.gamma == 0.0):
            return super().token_states(query, key)
        noise = gmm_noise = noise_replay = None
        if self.samples_attention:
            # drawn again in backward, where the GMM rebuilds the concatenated means from the
            # samples the projections keep (the concatenation itself is not kept)
            replay = ReplayableNoise()
            noise = torch.cat(replay.draw(query, key))
            noise_replay = lambda: torch.cat(replay.replay())  # noqa: E731
        elif self.training:
            # the draws the token GMM makes for each side, (H, N * B, d) in its group-major
            # order, laid out as the concatenated points
            draws = [standard_normal((self.num_heads, t.size(0) * t.size(1), self.head_dim), at_least_fp32(t),
                                     t.device) for t in (query, key)]
            both = torch.cat(draws, 1).view(self.num_heads, -1, query.size(1), self.head_dim)
            gmm_noise = both.permute(2, 0, 1, 3)
        state = self._token_state(torch.cat([query, key]), noise, gmm_noise, noise_replay)
        split = query.size(0)
        return (
            {name: t[:split] if name == "input" else t[:, :, :split] for name, t in state.items()},
            {name: t[split:] if name == "input" else t[:, :, split:] for name, t in state.items()},
        )

    def _token_state(
        self,
        x: Tensor,
        noise: Optional[Tensor],
        gmm_noise: Optional[Tensor] = None,
        noise_replay: Optional[Callable[[], Tensor]] = None,
    ) -> Dict[str, Tensor]:
        """The state of the inputs x (N, B, E): their training sample x + s noise as "input"
        (``noise`` given, "attention" sampling), and the token GMM's statistics of x (sampled
        with ``noise``, else ``gmm_noise`` (B, H, N, d), else the GMM's own draw).
        ``noise_replay``: ``noise`` drawn again, for a GMM that should not keep x itself."""
        state: Dict[str, Tensor] = {}
        if noise is not None:
            state["input"] = torch.add(x, noise, alpha=math.sqrt(self.noise_var))
        if not self.collect_aux and self.gamma == 0.0:
            return state
        length, bsz, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(length, bsz, self.num_heads, -1).permute(1, 2, 0, 3)  # (B, H, N, E / H)

        stats = self.token_gmm(
            heads(x),
            self.noise_var,
            sample=self.training,
            need_kl=self.collect_aux,
            noise=gmm_noise,
            # the sample the projections read is the GMM's point too: kept once for both
            point=heads(state["input"]) if noise is not None else None,
            noise_replay=None if noise_replay is None else (lambda: heads(noise_replay())),
            triton=self._triton_forward,
        )
        # What ``attend`` reads: log P on the fused path, P on the SDPA path and in the
        # regularisers. Each entry left out is a copy saved where the beams of a decoding step are
        # folded into one sentence's rows, and the incremental cache keeps exactly these entries.
        if self.uses_fused_kernel(x):
            state["log_p"] = stats.log_post
        if self.collect_aux or not self.uses_fused_kernel(x):
            state["post"] = stats.post
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
        sampled_q = replay = None
        if self.samples_attention:
            # q~ = (u + s eps') / scale with u = scale q, laid out like q (the first operand), so
            # that the query GMM keeps for backward the very tensor the attention keeps, and
            # rebuilds q there from eps' drawn again (``noise``)
            replay = ReplayableNoise()
            (query_noise,) = replay.draw((q.shape, q.dtype, q.device))
            sampled_q = torch.add(q, query_noise, alpha=math.sqrt(self.noise_var) / self.query_gmm_scale)
            del query_noise
        if self.collect_aux:
            noise_replay = None if replay is None else (lambda: replay.replay()[0])
            self.aux_losses = self.regularisers(q, q_state, k_state, key_padding_mask, sampled_q, noise_replay)
        if sampled_q is not None:
            q = sampled_q
        if gamma == 0.0:  # A^ = A: plain attention
            return super().attend(q, k, v, q_state, k_state, mask, key_padding_mask, need_weights)
        if need_weights:
            log_m = log_mask(posteriors(q_state), posteriors(k_state))
            logits = self.attention_logits(q, k, mask)
            weights = torch.lerp(self.explicit_softmax(logits), self.explicit_softmax(logits + log_m), gamma)
            return self.weighted_values(weights, v), weights

        p = self.dropout if self.training else 0.0
        if self._kernel_masks is not None:
            return self._triton_attention(q, k, v, q_state, k_state, key_padding_mask, gamma, p), None
        if self.uses_fused_kernel(q):
            out = interpolated_masked_attention(q, k, v, q_state["log_p"], k_state["log_p"], mask, gamma, p)
            return out, None
        bias = log_mask(posteriors(q_state), posteriors(k_state)).to(q.dtype)
        if mask is not None:
            bias = bias.add_(mask)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p)
        if gamma == 1.0:
            return masked, None
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return torch.lerp(plain, masked, gamma), None

    def _triton_attention(self, q: Tensor, k: Tensor, v: Tensor, q_state: Dict[str, Tensor],
                          k_state: Dict[str, Tensor], key_padding_mask: Optional[Tensor], gamma: float,
                          dropout_p: float) -> Tensor:
        """A^ V by ``interpolated_attention_triton`` with the masks ``attention_mask`` kept."""
        from .interpolated_attention_triton import triton_interpolated_attention

        assert self._kernel_masks is not None
        (attn_mask,) = self._kernel_masks
        causal = attn_mask is not None and q.size(2) == k.size(2) and is_future_mask(attn_mask)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, device=q.device).masked_fill_(attn_mask, float("-inf"))
        if key_padding_mask is not None and key_padding_mask.dtype == torch.bool:
            key_padding_mask = key_padding_mask.view(torch.uint8)  # the same bytes: no copy
        return triton_interpolated_attention(
            q, k, v, posteriors(q_state), posteriors(k_state), key_padding_mask, None if causal else attn_mask,
            causal, gamma, dropout_p,
        )

    def uses_fused_kernel(self, q: Tensor) -> bool:
        """Whether ``attend`` takes ``interpolated_masked_attention`` or two SDPA calls.

        "auto": the two SDPA calls on CUDA, whose kernels differentiate the log M bias; the
        fused form elsewhere. On CPU it is the faster one in training (torch's CPU kernels
        differentiate no bias) and also without autograd (measured at beam-search shapes, one
        query against 30 keys: 2.1 ms against 4.5 ms for the pair).
        """
        if self._triton_forward:
            return False  # the Triton kernels read the posteriors themselves
        if self.attention_impl == "auto":
            return path_device(q) != "cuda"
        return self.attention_impl == "fused"

    def regularisers(
        self,
        q: Tensor,
        q_state: Dict[str, Tensor],
        k_state: Dict[str, Tensor],
        key_padding_mask: Optional[Tensor],
        sampled_q: Optional[Tensor] = None,
        noise_replay: Optional[Callable[[], Tensor]] = None,
    ) -> Dict[str, Tensor]:
        """KL (both GMMs), L_Dqq, L_Dxq and L_dv of this module, each a batch mean or, with
        ``per_sentence_losses``, a (B,) vector (see mi_bounds). ``q``: the queries, which the
        query GMM clusters scaled by ``query_gmm_scale``; ``sampled_q``: their training sample
        q~ ("attention" sampling), the point whose posterior the GMM takes; ``noise_replay``:
        its noise drawn again (``gmm.DiagonalGMM.forward``)."""
        key_valid = None if key_padding_mask is None else ~key_padding_mask.bool()
        if self.self_attention:
            query_valid = key_valid
        else:
            query_valid = None if self.query_padding_mask is None else ~self.query_padding_mask.bool()

        queries = self.query_gmm(
            q, self.noise_var, sample=sampled_q is not None, need_kl=True, point=sampled_q,
            scale=self.query_gmm_scale, noise_replay=noise_replay, triton=self._triton_forward,
        )
        query_post = queries.post
        token_post = posteriors(q_state)
        # training: one sampled negative per query (unbiased, no (B, H, H, T, T) table);
        # evaluation: the exact mean over all tokens, so validation is deterministic
        negatives = None
        if self.training and self.qq_form == "club":
            negatives = sample_negatives(query_valid, q.size(0), q.size(2), q.device)
        per_sentence = self.per_sentence_losses
        kl = masked_token_mean(q_state["kl"], query_valid, per_sentence)
        div = diversity_penalty(token_post, query_valid, self.div_form, per_sentence)
        if not self.self_attention:  # the key side is a second set of tokens for the token GMM
            key_kl = masked_token_mean(k_state["kl"], key_valid, per_sentence)
            key_div = diversity_penalty(posteriors(k_state), key_valid, self.div_form, per_sentence)
            # per sentence: the authors' sum of both sides; batch means: their average
            both = 1.0 if per_sentence else 0.5
            kl, div = both * (kl + key_kl), both * (div + key_div)
        dqq = head_dependence_bound(
            queries.log_joint, queries.log_post, query_valid, negatives, self.qq_form, per_sentence
        )
        return {
            "kl": kl + masked_token_mean(queries.kl, query_valid, per_sentence),
            "dqq": dqq,
            "dxq": infonce_bound(query_post, query_valid, per_sentence, self._triton_forward),
            "div": div + diversity_penalty(query_post, query_valid, self.div_form, per_sentence),
        }

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, clusters={self.num_clusters}, "
            f"alpha={self.alpha}, anneal_rate={self.anneal_rate}, mask_at_inference={self.mask_at_inference}, "
            f"sample_inputs={self.sample_inputs}, query_gmm_input={self.query_gmm_input}, "
            f"qq_form={self.qq_form}, div_form={self.div_form}, backend={self.backend}"
        )
