"""Transformer layers with competing independent mechanisms (TIM; Lamb et al. 2021,
"Transformers with Competitive Ensembles of Independent Mechanisms", section 3, Algorithm 1).

The hidden state h (width D) of a position is split into n_s mechanisms of width d_m = D / n_s,
mechanism j = h[..., j*d_m:(j+1)*d_m]. One TIM encoder layer (post-norm, as the paper) is

    Step 1, competition:          c = softmax_j(W^c_j h_j)                  (W^c = GroupLinear(d_m -> 1))
    Step 2, mechanism attention:  M_j = MHA_j(h_j, h_j, h_j)                (heads of mechanism j only)
                                  h_j = norm_j(h_j + c_j * M_j)
    Step 3, inter-mechanism att.: h~_i = sum_j softmax_j(q_i(h_i) k_j(h_j)^T / sqrt(d_K)) v_j(h_j)
                                  (per position, over the n_s mechanisms, H_c heads of d_K
                                  units; q_j/k_j/v_j: d_m -> H_c d_K and out_i: H_c d_K -> d_m
                                  are mechanism j's / i's own GroupLinear blocks),
                                  h_i = norm_i(h_i + out_i(h~_i))
    Step 4, mechanism-wise FFN:   h_j = norm_j(h_j + W2_j act(W1_j h_j))

where every "norm" normalises each mechanism's slice separately (``GroupLayerNorm``) and every
per-mechanism weight is block-diagonal (``GroupLinear``). Without competition (TIM-NoComp,
c = 1) and without step 3, mechanism j's output depends on nothing but mechanism j's input.
With n_s = 1, no competition and no step 3 the layer is fairseq's transformer layer.

Decoder layers (the paper defines only encoder layers; this is our extension): causal
mechanism self-attention, then mechanism-wise encoder-decoder attention (queries and outputs
grouped; keys/values a dense projection of the whole encoder output, so every mechanism reads
all of it with its own heads), then steps 3 and 4. The competition c is computed once per layer
from the layer input, as in step 1, and scales *both* attention updates: both are how a
mechanism reads its context, and the competition decides which mechanisms update their state
from context at a position. Everything else is per position, so incremental decoding is exact.

Pre-norm (``normalize_before``) places the norms exactly where fairseq does (before each
sub-layer, the residual taken from the un-normalised input); the competition is then computed
from the normalised input of the mechanism attention.

Step 3 against the paper and the TIM authors' fairseq fork (github.com/alexmlamb/fairseq, branch
``mha_grouped``, class ``Attention`` in ``fairseq/modules/transformer_layer.py`` with
``GroupLinearLayer`` from ``fairseq/modules/group_linear_layer.py``), choice by choice:

* Projections per mechanism: Algorithm 1 has W^Q_3 in R^{n_s x d_m x H_c d_K} applied with
  GroupLinear, likewise K, V; the fork's ``query_net``/``key_net``/``value_net`` are
  ``GroupLinearLayer(d_m, H_c d_K, n_s)``. One map shared by the mechanisms could not represent
  the paper's layer: mechanism j's query, key and value would not be its own.
* Head width (default H_c = 2, d_K = 32): the paper's "2 heads with 32 units each"; the fork
  hard-codes ``n_heads = 2``, ``head_dim = 32`` whatever the width. d_K is independent of d_m
  (W = H_c d_K = 64 < d_m = 256 at D = 512, n_s = 2); ``head_dim=None`` gives d_K = d_m / H_c.
* Output projection per mechanism, H_c d_K -> d_m: the fork's ``final =
  GroupLinearLayer(H_c d_K, d_m, n_s)`` (the paper's step 3 does not spell it out).
* Scores scaled by d_K^-1/2 and softmax over the key mechanisms, as the fork. We add the
  layer's attention dropout on the weights (the fork has none; 0 gives its layer).
* Residual and norm: post-norm h = norm(h + dropout(out)) with a per-mechanism layer norm (the
  fork's ``NormLayer``: layer norm of each mechanism's slice, affine over the full width, which
  is our ``GroupLayerNorm``). With pre-norm the fork takes the residual from the *normalised*
  input (``x = comm_norm(x); residual = x``), unlike every other sub-layer of fairseq and of the
  fork; we keep fairseq's pre-norm convention (residual from the un-normalised input). The
  paper's setting, post-norm, is the same in both.
* Initialisation: fairseq's attention initialisation per block (see ``InterMechanismAttention``),
  not the fork's U(+-1/sqrt(n_s out)).
* Decoder: the fork runs step 3 twice in a decoder layer (after the self-attention and after
  the encoder-decoder attention, two modules); our decoder layers run it once, before the FFN,
  as in the encoder (the paper defines encoder layers only).

``docs/fidelity.md`` compares every step with the paper's Algorithm 1 and the authors' fork,
with the reason for each difference.
"""

from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq import utils
from fairseq.modules.fairseq_dropout import FairseqDropout
from torch import Tensor

from .attention_base import MultiheadAttentionBase
from .group_linear import GroupLayerNorm, GroupLinear
from .parameter_names import parameter_names
from .precision import at_least_fp32

#: initial gain of the competition scores: small, so that c starts close to uniform (1 / n_s)
#: and no mechanism is starved of updates before it has learnt anything
COMPETITION_INIT_GAIN = 0.1


def check_mechanisms(embed_dim: int, num_heads: int, num_mechanisms: int, names: Optional[Mapping[str, str]] = None):
    """ValueError unless ``num_mechanisms`` splits ``embed_dim`` and ``num_heads`` evenly: each
    mechanism owns d_m = D / n_s units and H / n_s heads. ``names``: what the caller calls each
    parameter (``parameter_names``)."""
    name = parameter_names(names)
    if num_mechanisms < 1:
        raise ValueError(f"{name['num_mechanisms']} must be >= 1, got {num_mechanisms}")
    if embed_dim % num_mechanisms != 0:
        raise ValueError(f"{name['num_mechanisms']} ({num_mechanisms}) must divide {name['embed_dim']} ({embed_dim})")
    if num_heads % num_mechanisms != 0:
        raise ValueError(
            f"{name['num_mechanisms']} ({num_mechanisms}) must divide {name['num_heads']} ({num_heads}): "
            "each mechanism owns the same number of heads"
        )


def check_ffn_width(ffn_embed_dim: int, num_mechanisms: int, names: Optional[Mapping[str, str]] = None):
    """ValueError unless the mechanism-wise FFN width is a positive multiple of n_s."""
    name = parameter_names(names)
    if ffn_embed_dim < num_mechanisms or ffn_embed_dim % num_mechanisms != 0:
        raise ValueError(
            f"{name['ffn_embed_dim']} ({ffn_embed_dim}) must be a positive multiple of "
            f"{name['num_mechanisms']} ({num_mechanisms}): each mechanism gets an equal share"
        )


def check_inter_mechanism_heads(mechanism_dim: int, num_heads: int, head_dim: Optional[int],
                                names: Optional[Mapping[str, str]] = None):
    """ValueError unless step 3 has H_c >= 1 heads of d_K >= 1 units; ``head_dim=None`` means
    d_K = d_m / H_c, which needs H_c to divide d_m."""
    name = parameter_names(names)
    if num_heads < 1:
        raise ValueError(f"{name['num_heads']} must be >= 1, got {num_heads}")
    if head_dim is None:
        if mechanism_dim % num_heads != 0:
            raise ValueError(
                f"{name['num_heads']} ({num_heads}) must divide the mechanism width d_m = "
                f"{name['mechanism_dim']} ({mechanism_dim}) for d_K = d_m / H_c; or give {name['head_dim']}"
            )
    elif head_dim < 1:
        raise ValueError(f"{name['head_dim']} must be >= 1, got {head_dim}")


def check_fairseq_options(quant_noise_pq: float = 0.0, cross_self_attention: bool = False,
                          names: Optional[Mapping[str, str]] = None):
    """TIM layers implement neither of these options of fairseq's layers: refuse them rather
    than ignore them. Default names: the fields of fairseq's ``TransformerConfig``."""
    name = parameter_names({"quant_noise_pq": "cfg.quant_noise.pq", "cross_self_attention": "cfg.cross_self_attention",
                            **(names or {})})
    if quant_noise_pq > 0:
        raise ValueError(f"{name['quant_noise_pq']} is not supported by TIM layers")
    if cross_self_attention:
        raise ValueError(f"{name['cross_self_attention']} is not supported by TIM decoder layers")


class MechanismAttention(MultiheadAttentionBase):
    """Multi-head attention whose heads are partitioned among n_s mechanisms (Algorithm 1, step 2).

    Head i occupies the slice [i*d, (i+1)*d) of the projected width (``MultiheadAttentionBase``),
    so with H / n_s heads per mechanism mechanism j owns heads j*H/n_s .. (j+1)*H/n_s - 1, i.e.
    exactly the projected slice [j*d_m, (j+1)*d_m). The q and out projections are
    ``GroupLinear(n_s, d_m, d_m)`` (block-diagonal), and so are k and v in self-attention: a
    mechanism's heads see only that mechanism's features and write only its slice. In
    encoder-decoder attention the keys/values come from the un-split encoder output: k and v are
    then dense ``nn.Linear(kdim, D)`` (each mechanism's heads read the whole encoder output)
    while q and out stay grouped. Within its heads it is plain scaled dot-product attention,
    the base class's ``attend``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_mechanisms: int,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        dropout: float = 0.0,
        bias: bool = True,
        self_attention: bool = False,
        encoder_decoder_attention: bool = False,
    ):
        check_mechanisms(embed_dim, num_heads, num_mechanisms)
        # build_projection (called by the base constructor) needs it
        self.num_mechanisms = num_mechanisms
        super().__init__(
            embed_dim, num_heads, kdim, vdim, dropout, bias, self_attention, encoder_decoder_attention
        )

    def build_projection(self, in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        if role in ("k", "v") and self.encoder_decoder_attention:
            return nn.Linear(in_features, out_features, bias=bias)
        n = self.num_mechanisms
        return GroupLinear(n, in_features // n, out_features // n, bias=bias)

    def init_projection(self, proj: nn.Module, gain: float):
        if isinstance(proj, GroupLinear):
            proj.reset_parameters(gain)  # Xavier per mechanism: per block as fairseq's per matrix
        else:
            super().init_projection(proj, gain)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, mechanisms={self.num_mechanisms}"


class InterMechanismAttention(nn.Module):
    """Attention among the n_s mechanisms of each position (Algorithm 1, step 3).

    At every position independently the n_s mechanism vectors (width d_m) are n_s "tokens"
    attending to each other with ``num_heads`` (H_c) heads of ``head_dim`` (d_K) units; the
    attention width is W = H_c d_K and the output projection maps it back to d_m. Input and
    output (..., n_s * d_m). q, k, v are ``GroupLinear(n_s, d_m, W)`` and out is
    ``GroupLinear(n_s, W, d_m)``: mechanism j's query, key and value come from mechanism j's own
    weights (W^Q_3 in R^{n_s x d_m x H_c d_K}, Q = GroupLinear(h, W^Q_3, n_s), likewise K and V),
    and mechanism i's output projection is its own. The paper gives "2 heads with 32 units
    each" (H_c = 2, d_K = 32); ``head_dim=None`` means d_K = d_m / H_c. Weights
    ``q_proj.weight`` etc. have shape (n_s, d_m, W), ``out_proj.weight`` (n_s, W, d_m).

    Computation: q, k and v of all mechanisms come from one batched ``baddbmm`` over the n_s
    blocks (the three weights concatenated along the output dim), laid out (n_s, N, H_c, d_K)
    for the N positions. The n_s x n_s scores of all positions come from one broadcast product
    summed over d_K, (n_s, 1, N, H_c, d_K) * (1, n_s, N, H_c, d_K), and the outputs likewise
    (weights times values summed over the key mechanism). This is exact attention; with n_s
    "tokens" per position (2 by default) the temporary holds n_s^2 W numbers per position. A
    fused attention kernel is the wrong tool at sequence length n_s: measured on an H100 (fp32,
    4096 tokens, D = 512, n_s = 2), ``scaled_dot_product_attention`` over an (N, H_c, n_s, d)
    layout took ~2 ms forward + backward per TIM layer, a fifth of a whole transformer step.

    Initialisation as fairseq's ``MultiheadAttention`` per mechanism block (Xavier-uniform, gain
    2^-1/2 for q/k/v, 1 for out, out bias zero; the q/k/v biases start at zero as in
    ``MechanismAttention``). (The TIM authors' fairseq fork draws every weight and bias of its
    ``GroupLinearLayer`` from U(+-1/sqrt(n_s * out)); we keep fairseq's initialisation, as for
    every other projection of this package.)
    """

    def __init__(self, mechanism_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 num_mechanisms: int, head_dim: Optional[int] = None):
        super().__init__()
        check_inter_mechanism_heads(mechanism_dim, num_heads, head_dim)
        if num_mechanisms < 1:
            raise ValueError(f"num_mechanisms must be >= 1, got {num_mechanisms}")
        self.mechanism_dim = mechanism_dim
        self.num_heads = num_heads
        self.head_dim = mechanism_dim // num_heads if head_dim is None else head_dim
        self.attn_dim = width = num_heads * self.head_dim
        self.num_mechanisms = n = num_mechanisms
        self.dropout = dropout
        self.q_proj = GroupLinear(n, mechanism_dim, width, bias=bias)
        self.k_proj = GroupLinear(n, mechanism_dim, width, bias=bias)
        self.v_proj = GroupLinear(n, mechanism_dim, width, bias=bias)
        self.out_proj = GroupLinear(n, width, mechanism_dim, bias=bias)
        self.reset_parameters()

    def reset_parameters(self):
        # fairseq's MultiheadAttention initialisation, per mechanism block
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.reset_parameters(2 ** -0.5)
        self.out_proj.reset_parameters()

    def _qkv(self, tokens: Tensor) -> Tensor:
        """q, k, v of (N, n_s, d_m) tokens from one fused matmul: (n_s, N, 3 W)."""
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        groups = tokens.transpose(0, 1)  # (n_s, N, d_m) @ (n_s, d_m, 3W): mechanism j's own block
        weight = torch.cat([q.weight, k.weight, v.weight], dim=-1)
        if q.bias is None or k.bias is None or v.bias is None:  # built together: all or none
            return torch.bmm(groups, weight)
        return torch.baddbmm(torch.cat([q.bias, k.bias, v.bias], dim=-1).unsqueeze(1), groups, weight)

    def forward(self, x: Tensor) -> Tensor:
        lead, width = x.shape[:-1], x.size(-1)
        n = self.num_mechanisms
        if width != n * self.mechanism_dim:
            raise ValueError(f"expected {n} mechanisms of width {self.mechanism_dim}, got an input of width {width}")
        tokens = x.reshape(-1, n, self.mechanism_dim)  # (N, n_s, d_m)
        qkv = self._qkv(tokens).view(n, -1, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)  # each (n_s, N, H_c, d_K)
        # scores[i, j, :, h] = <q_i, k_j>_h / sqrt(d_K); softmax over the key mechanism j
        scores = (q.unsqueeze(1) * k.unsqueeze(0)).sum(-1) * self.head_dim ** -0.5  # (n_s, n_s, N, H_c)
        weights = torch.softmax(scores.to(at_least_fp32(scores)), dim=1)
        weights = F.dropout(weights, self.dropout, self.training).to(v.dtype)
        out = (weights.unsqueeze(-1) * v.unsqueeze(0)).sum(1)  # (n_s, N, H_c, d_K)
        out = out.reshape(n, -1, self.attn_dim)
        # mechanism i's own output block: (n_s, N, W) @ (n_s, W, d_m)
        o = self.out_proj
        out = torch.bmm(out, o.weight) if o.bias is None else torch.baddbmm(o.bias.unsqueeze(1), out, o.weight)
        return out.transpose(0, 1).reshape(*lead, width)

    def extra_repr(self) -> str:
        return (f"mechanisms={self.num_mechanisms}, mechanism_dim={self.mechanism_dim}, "
                f"num_heads={self.num_heads}, head_dim={self.head_dim}")


class TIMLayerBase(nn.Module):
    """What TIM encoder and decoder layers share: competition, steps 3 and 4, norms, dropout."""

    def _build_common(
        self,
        cfg,
        side_cfg,
        num_mechanisms: int,
        mechanism_attention_heads: int,
        competition: bool,
        mechanism_attention: bool,
        ffn_embed_dim: Optional[int],
        mechanism_attention_head_dim: Optional[int] = 32,
    ):
        side = f"cfg.{self.side}"  # what the layer reads its dimensions from
        check_fairseq_options(utils.safe_getattr(cfg.quant_noise, "pq", 0))
        self.embed_dim = side_cfg.embed_dim
        n = num_mechanisms
        check_mechanisms(self.embed_dim, side_cfg.attention_heads, n,
                         {"embed_dim": f"{side}.embed_dim", "num_heads": f"{side}.attention_heads"})
        self.num_mechanisms = n
        self.mechanism_dim = d = self.embed_dim // n
        ffn = side_cfg.ffn_embed_dim if ffn_embed_dim is None else ffn_embed_dim
        check_ffn_width(ffn, n, None if ffn_embed_dim is not None else {"ffn_embed_dim": f"{side}.ffn_embed_dim"})
        self.ffn_embed_dim = ffn
        self.normalize_before = side_cfg.normalize_before

        self.dropout_module = FairseqDropout(cfg.dropout, module_name=self.__class__.__name__)
        self.activation_fn = utils.get_activation_fn(activation=cfg.activation_fn)
        activation_dropout_p = cfg.activation_dropout
        if activation_dropout_p == 0:
            # as fairseq: backwards compatibility with models that use relu_dropout
            activation_dropout_p = cfg.relu_dropout or 0
        self.activation_dropout_module = FairseqDropout(
            float(activation_dropout_p), module_name=self.__class__.__name__
        )

        self.self_attn = MechanismAttention(
            self.embed_dim, side_cfg.attention_heads, n, dropout=cfg.attention_dropout, self_attention=True
        )
        self.self_attn_layer_norm = GroupLayerNorm(n, d)
        self.build_cross_attention(cfg)

        self.competition = GroupLinear(n, d, 1) if competition else None
        if self.competition is not None:
            self.competition.reset_parameters(COMPETITION_INIT_GAIN)
        #: competition of the last forward, detached, (B, T, n_s); None without competition
        self.last_competition: Optional[Tensor] = None

        self.mechanism_attn: Optional[InterMechanismAttention]
        self.mechanism_attn_layer_norm: Optional[GroupLayerNorm]
        if mechanism_attention:
            self.mechanism_attn = InterMechanismAttention(
                d, mechanism_attention_heads, cfg.attention_dropout, num_mechanisms=n,
                head_dim=mechanism_attention_head_dim,
            )
            self.mechanism_attn_layer_norm = GroupLayerNorm(n, d)
        else:
            self.mechanism_attn = None
            self.mechanism_attn_layer_norm = None
        self.fc1 = GroupLinear(n, d, ffn // n)
        self.fc2 = GroupLinear(n, ffn // n, d)
        # fairseq's FFN keeps nn.Linear's default initialisation; so does each mechanism's FFN
        self.fc1.reset_parameters_like_linear()
        self.fc2.reset_parameters_like_linear()
        self.final_layer_norm = GroupLayerNorm(n, d)

    def build_cross_attention(self, cfg):
        """Decoder layers add their encoder-decoder attention here (after the self-attention)."""

    # ------------------------------------------------------------------ steps
    def compete(self, x: Tensor) -> Optional[Tensor]:
        """Step 1: c = softmax over mechanisms of GroupLinear(d_m -> 1)(x); (T, B, n_s) or None."""
        if self.competition is None:
            self.last_competition = None
            return None
        scores = self.competition(x)
        c = torch.softmax(scores.to(at_least_fp32(scores)), dim=-1).to(x.dtype)
        self.last_competition = c.detach().transpose(0, 1)
        return c

    def scale_by_competition(self, update: Tensor, c: Optional[Tensor]) -> Tensor:
        """c_j * update_j for every mechanism slice j of an (T, B, D) update."""
        if c is None:
            return update
        length, bsz, _ = update.shape
        scaled = update.view(length, bsz, self.num_mechanisms, self.mechanism_dim) * c.unsqueeze(-1)
        return scaled.view(length, bsz, self.embed_dim)

    def attention_sublayer(
        self,
        x: Tensor,
        layer_norm: nn.Module,
        attend: Callable[[Tensor], Tuple[Tensor, Optional[Tensor]]],
        c: Optional[Tensor] = None,
        compete: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """One residual attention sub-layer, h = norm(h + dropout(c * attend(h))) (step 2; with
        c = None and the inter-mechanism attention, step 3), the norm placed where fairseq places
        it (pre-norm: before ``attend``, the residual from the un-normalised h).

        ``compete`` computes c (step 1) from the sub-layer's input, normalised under pre-norm,
        in place of the given one. Returns (h, the attention weights ``attend`` gave, c)."""
        residual = x
        if self.normalize_before:
            x = layer_norm(x)
        if compete:
            c = self.compete(x)
        update, weights = attend(x)
        x = residual + self.dropout_module(self.scale_by_competition(update, c))
        if not self.normalize_before:
            x = layer_norm(x)
        return x, weights, c

    def communicate(self, x: Tensor) -> Tensor:
        """Step 3: residual inter-mechanism attention (identity when switched off)."""
        attention, layer_norm = self.mechanism_attn, self.mechanism_attn_layer_norm
        if attention is None or layer_norm is None:  # built together: both or neither
            return x
        x, _, _ = self.attention_sublayer(x, layer_norm, lambda h: (attention(h), None))
        return x

    def feed_forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """Step 4: residual mechanism-wise FFN; returns (x, FFN output before dropout)."""
        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        fc_result = x
        x = self.dropout_module(x)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, fc_result

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq's encoder and decoder call this on every layer; TIM weights need no renaming."""

    def extra_repr(self) -> str:
        return (
            f"mechanisms={self.num_mechanisms}, competition={self.competition is not None}, "
            f"mechanism_attention={self.mechanism_attn is not None}, ffn_embed_dim={self.ffn_embed_dim}"
        )


class TIMEncoderLayer(TIMLayerBase):
    """A TIM encoder layer (Algorithm 1) with fairseq's ``TransformerEncoderLayerBase`` contract.

    ``forward(x (T, B, D), encoder_padding_mask (B, T), attn_mask=None)`` returns x, or
    ``(x, fc_result)`` when built with ``return_fc`` (fc_result: the FFN output before dropout).
    """

    side = "encoder"

    def __init__(
        self,
        cfg,
        num_mechanisms: int = 2,
        mechanism_attention_heads: int = 2,
        competition: bool = True,
        mechanism_attention: bool = True,
        ffn_embed_dim: Optional[int] = None,
        return_fc: bool = False,
        mechanism_attention_head_dim: Optional[int] = 32,
    ):
        super().__init__()
        self.cfg = cfg
        self.return_fc = return_fc
        self._build_common(
            cfg, cfg.encoder, num_mechanisms, mechanism_attention_heads, competition, mechanism_attention,
            ffn_embed_dim, mechanism_attention_head_dim,
        )

    def forward(self, x: Tensor, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        if attn_mask is not None:
            # as fairseq: a large finite value rather than -inf (no NaN for fully masked rows)
            attn_mask = attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4)

        x, _, _ = self.attention_sublayer(
            x,
            self.self_attn_layer_norm,
            lambda h: self.self_attn(
                query=h, key=h, value=h, key_padding_mask=encoder_padding_mask, need_weights=False, attn_mask=attn_mask
            ),
            compete=True,
        )
        x = self.communicate(x)
        x, fc_result = self.feed_forward(x)

        if self.return_fc and not torch.jit.is_scripting():
            return x, fc_result
        return x


class TIMDecoderLayer(TIMLayerBase):
    """A TIM decoder layer with fairseq's ``TransformerDecoderLayerBase`` contract.

    ``forward(x, encoder_out, encoder_padding_mask, incremental_state, prev_self_attn_state,
    prev_attn_state, self_attn_mask, self_attn_padding_mask, need_attn, need_head_weights)``
    returns (x, encoder-decoder attention weights or None, None); weights averaged over heads
    (B, T, S) or per head (H, B, T, S) with ``need_head_weights``, as fairseq.
    """

    side = "decoder"

    def __init__(
        self,
        cfg,
        no_encoder_attn: bool = False,
        num_mechanisms: int = 2,
        mechanism_attention_heads: int = 2,
        competition: bool = True,
        mechanism_attention: bool = True,
        ffn_embed_dim: Optional[int] = None,
        mechanism_attention_head_dim: Optional[int] = 32,
    ):
        super().__init__()
        check_fairseq_options(cross_self_attention=cfg.cross_self_attention)
        self.no_encoder_attn = no_encoder_attn
        self.cross_self_attention = False
        self._build_common(
            cfg, cfg.decoder, num_mechanisms, mechanism_attention_heads, competition, mechanism_attention,
            ffn_embed_dim, mechanism_attention_head_dim,
        )
        self.need_attn = True
        self.onnx_trace = False

    def build_cross_attention(self, cfg):
        self.encoder_attn: Optional[MechanismAttention]
        self.encoder_attn_layer_norm: Optional[GroupLayerNorm]
        if self.no_encoder_attn:
            self.encoder_attn = None
            self.encoder_attn_layer_norm = None
            return
        self.encoder_attn = MechanismAttention(
            self.embed_dim,
            cfg.decoder.attention_heads,
            self.num_mechanisms,
            kdim=cfg.encoder.embed_dim,
            vdim=cfg.encoder.embed_dim,
            dropout=cfg.attention_dropout,
            encoder_decoder_attention=True,
        )
        self.encoder_attn_layer_norm = GroupLayerNorm(self.num_mechanisms, self.mechanism_dim)

    def prepare_for_onnx_export_(self):
        self.onnx_trace = True

    def make_generation_fast_(self, need_attn: bool = False, **kwargs):
        self.need_attn = need_attn

    @staticmethod
    def _restore_state(attn: MultiheadAttentionBase, incremental_state, state: List[Tensor]):
        """fairseq's prev_*_state: a [key, value(, key padding mask)] list to preload the cache."""
        saved: Dict[str, Optional[Tensor]] = {"prev_key": state[0], "prev_value": state[1]}
        if len(state) >= 3:
            saved["prev_key_padding_mask"] = state[2]
        assert incremental_state is not None
        attn._set_input_buffer(incremental_state, saved)

    def forward(
        self,
        x: Tensor,
        encoder_out: Optional[Tensor] = None,
        encoder_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        prev_self_attn_state: Optional[List[Tensor]] = None,
        prev_attn_state: Optional[List[Tensor]] = None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
        need_attn: bool = False,
        need_head_weights: bool = False,
    ):
        if need_head_weights:
            need_attn = True

        if prev_self_attn_state is not None:
            self._restore_state(self.self_attn, incremental_state, prev_self_attn_state)
        # one competition per layer and position, from the layer input (Algorithm 1, step 1);
        # it scales both attention updates (see the module docstring)
        x, _, c = self.attention_sublayer(
            x,
            self.self_attn_layer_norm,
            lambda h: self.self_attn(
                query=h, key=h, value=h, key_padding_mask=self_attn_padding_mask,
                incremental_state=incremental_state, need_weights=False, attn_mask=self_attn_mask,
            ),
            compete=True,
        )

        attn: Optional[Tensor] = None
        encoder_attn, encoder_attn_layer_norm = self.encoder_attn, self.encoder_attn_layer_norm
        if encoder_attn is not None and encoder_attn_layer_norm is not None and encoder_out is not None:
            if prev_attn_state is not None:
                self._restore_state(encoder_attn, incremental_state, prev_attn_state)
            x, attn, _ = self.attention_sublayer(
                x,
                encoder_attn_layer_norm,
                lambda h: encoder_attn(
                    query=h, key=encoder_out, value=encoder_out, key_padding_mask=encoder_padding_mask,
                    incremental_state=incremental_state, static_kv=True,
                    need_weights=need_attn or (not self.training and self.need_attn),
                    need_head_weights=need_head_weights,
                ),
                c,
            )

        x = self.communicate(x)
        x, _ = self.feed_forward(x)

        if self.onnx_trace and incremental_state is not None:
            saved = self.self_attn._get_input_buffer(incremental_state)
            self_attn_state = [saved["prev_key"], saved["prev_value"]]
            if self_attn_padding_mask is not None:
                self_attn_state.append(saved["prev_key_padding_mask"])
            return x, attn, self_attn_state
        return x, attn, None
