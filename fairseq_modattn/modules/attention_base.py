"""The attention skeleton shared by this package's attention variants.

``MultiheadAttentionBase`` is a drop-in replacement for ``fairseq.modules.MultiheadAttention``
(same constructor arguments that the transformer layers use, same ``forward`` signature and
return values, same parameter names ``q_proj``/``k_proj``/``v_proj``/``out_proj`` and
initialisation) that owns everything a variant should not have to re-implement:

    * input/output projections and the split into heads, (T, B, E) <-> (B, H, T, d);
    * the incremental-decoding cache ("prev_key", "prev_value", "prev_key_padding_mask", plus
      any per-token state a variant declares in ``cached_state_names``), concatenated along
      time for self-attention and computed once for encoder-decoder attention (``static_kv``);
    * beam-search reordering of that cache;
    * padding and causal masks turned into one additive -inf mask of shape (B|1, 1, T, S);
    * encoder states with a smaller batch than the queries (``kv_bsz != bsz``), and in beam
      search (fairseq's ``set_beam_size``) one copy of a sentence's encoder keys shared by its
      beams, as fairseq's own attention keeps them;
    * head-averaged / per-head weights for fairseq callers (``need_weights``,
      ``need_head_weights``; the analysis reads them through these flags, see
      ``analysis/capture.py``).

A variant overrides two hooks:

    token_state(x)  -> dict of per-token tensors (B, H, N, *) computed from a *module input*
                       (queries' input, and keys' input for cross-attention; self-attention
                       computes it once and uses it on both sides); an entry "input" (N, B, E)
                       replaces x as what the query (cross-attention: key) projection reads,
                       e.g. DMA's training sample; values always read the given input;
                       none by default (``token_states`` calls it for both sides, and may be
                       overridden to compute them together);
    attend(q, k, v, q_state, k_state, mask, key_padding_mask, need_weights)
                    -> (out (B, H, T, d), weights (B, H, T, S) or None); by default
                       scaled dot-product attention (Vaswani et al. 2017, section 3.2.1),

                           out = dropout(softmax(q k^T / sqrt(d) + mask)) v,

                       fused (``scaled_dot_product_attention``) unless the weights are asked
                       for, else explicit with the softmax in at least fp32 (``precision``).

``mask`` is the additive mask described above and ``key_padding_mask`` the (B, S) padding of
the (possibly cached) keys, for variants that need to know which keys are real. Variants that
compute the weights themselves build on ``attention_logits``, ``explicit_softmax`` and
``weighted_values``, the steps of the explicit path.

Two more knobs for variants whose projections are not one dense matrix per head:

    * ``key_heads`` / ``value_heads`` (constructor): queries and keys are split into
      ``key_heads`` heads and values into ``value_heads`` heads (talking-heads attention has
      h_k, h and h_v heads); both default to ``num_heads``;
    * ``build_projection(in_features, out_features, bias)``: the module that maps a
      (N, B, in) input to (N, B, out), ``nn.Linear`` by default (TIM uses a block-diagonal
      ``GroupLinear``); ``reset_parameters`` calls ``init_projection`` on each.
"""

from typing import Callable, Dict, Mapping, Optional, Tuple, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor

from .parameter_names import parameter_names
from .precision import at_least_fp32


def _cached(saved: Dict[str, Optional[Tensor]], name: str) -> Tensor:
    """Entry NAME of an incremental cache, which holds it since the step that cached the keys."""
    t = saved[name]
    assert t is not None, f"incremental cache entry {name} is None"
    return t


def combine_padding_masks(
    prev: Optional[Tensor], new: Optional[Tensor], bsz: int, prev_len: int, new_len: int
) -> Optional[Tensor]:
    """Concatenate the cached and the new key padding masks along time (None = no padding)."""
    if new is None:
        if prev is None:
            return None
        new = prev.new_zeros(bsz, new_len)
    elif prev is None:
        prev = new.new_zeros(bsz, prev_len)
    return torch.cat([prev.bool(), new.bool()], dim=1)


def additive_attention_mask(
    key_padding_mask: Optional[Tensor],
    attn_mask: Optional[Tensor],
    bsz: int,
    num_heads: int,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
) -> Optional[Tensor]:
    """fairseq's two masks as one additive mask broadcastable to (B, H, T, S).

    ``key_padding_mask`` is (B, S) with True on padding; ``attn_mask`` is fairseq's (T, S)
    float mask with -inf on forbidden positions (or a bool mask with True there), or a
    (B * H, T, S) one.
    """
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
                attn_mask, float("-inf")
            )
        attn_mask = attn_mask.to(dtype)
        if attn_mask.dim() == 2:
            mask = attn_mask.view(1, 1, tgt_len, src_len)
        elif attn_mask.dim() == 3:
            mask = attn_mask.view(bsz, num_heads, tgt_len, src_len)
        else:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got shape {tuple(attn_mask.shape)}")
    if key_padding_mask is not None:
        padding = torch.zeros((bsz, 1, 1, src_len), dtype=dtype, device=key_padding_mask.device)
        padding = padding.masked_fill(key_padding_mask.view(bsz, 1, 1, src_len).bool(), float("-inf"))
        mask = padding if mask is None else mask + padding
    return mask


def check_heads(embed_dim: int, num_heads: int, key_heads: Optional[int] = None, value_heads: Optional[int] = None,
                names: Optional[Mapping[str, str]] = None):
    """ValueError unless every head count (h, and h_k, h_v where given) is >= 1 and divides
    ``embed_dim``: each head owns embed_dim / count units. ``names``: what the caller calls each
    parameter (``parameter_names``); h is checked first, as h_k and h_v default to it."""
    name = parameter_names(names)
    for parameter, heads in (("num_heads", num_heads), ("key_heads", key_heads), ("value_heads", value_heads)):
        if heads is None:
            continue
        if heads < 1:
            raise ValueError(f"{name[parameter]} must be >= 1, got {heads}")
        if embed_dim % heads != 0:
            raise ValueError(f"{name[parameter]} ({heads}) must divide {name['embed_dim']} ({embed_dim})")


@with_incremental_state
class MultiheadAttentionBase(nn.Module):
    """Projections, caching and masking around a variant's ``attend`` step (see module doc)."""

    #: names of ``token_state`` entries that the incremental cache keeps for the key side
    cached_state_names: Tuple[str, ...] = ()
    # added by @with_incremental_state (fairseq's FairseqIncrementalState); declared here because
    # fairseq has no type information, so the checker cannot see the decorator's base class
    get_incremental_state: Callable[..., Optional[Dict[str, Optional[Tensor]]]]
    set_incremental_state: Callable[..., Optional[Dict[str, Dict[str, Optional[Tensor]]]]]

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
        key_heads: Optional[int] = None,
        value_heads: Optional[int] = None,
    ):
        super().__init__()
        key_heads = num_heads if key_heads is None else key_heads
        value_heads = num_heads if value_heads is None else value_heads
        check_heads(embed_dim, num_heads, key_heads, value_heads)
        if self_attention and encoder_decoder_attention:
            raise ValueError("an attention module is either self- or encoder-decoder attention")
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.qkv_same_dim = self.kdim == embed_dim and self.vdim == embed_dim
        if self_attention and not self.qkv_same_dim:
            raise ValueError("self-attention requires query, key and value of the same width")
        self.num_heads = num_heads
        self.key_heads = key_heads
        self.value_heads = value_heads
        #: width of a query/key head (embed_dim / key_heads)
        self.head_dim = embed_dim // key_heads
        self.dropout = dropout
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention

        self.q_proj = self.build_projection(embed_dim, embed_dim, bias, "q")
        self.k_proj = self.build_projection(self.kdim, embed_dim, bias, "k")
        self.v_proj = self.build_projection(self.vdim, embed_dim, bias, "v")
        self.out_proj = self.build_projection(embed_dim, embed_dim, bias, "out")

        #: fairseq's beam size (``set_beam_size``); > 1 shares encoder keys among the beams
        self.beam_size = 1
        self.reset_parameters()

    def build_projection(self, in_features: int, out_features: int, bias: bool, role: str) -> nn.Module:
        """The (N, B, in) -> (N, B, out) map for ``role`` in q, k, v, out (``nn.Linear`` here)."""
        return nn.Linear(in_features, out_features, bias=bias)

    def init_projection(self, proj: nn.Module, gain: float):
        """Xavier-uniform weights with ``gain`` (fairseq's choice); ``proj`` from build_projection."""
        nn.init.xavier_uniform_(cast(Tensor, proj.weight), gain=gain)

    def reset_parameters(self):
        # Same initialisation as fairseq.modules.MultiheadAttention so that swapping the
        # attention class changes nothing else about a model.
        gain = 2 ** -0.5 if self.qkv_same_dim else 1.0
        for proj in (self.k_proj, self.v_proj, self.q_proj):
            self.init_projection(proj, gain)
        self.init_projection(self.out_proj, 1.0)
        out_bias = cast(Optional[Tensor], self.out_proj.bias)  # a projection's bias, if any
        if out_bias is not None:
            nn.init.constant_(out_bias, 0.0)

    # ----------------------------------------------------------------- variant hooks
    def token_state(self, x: Tensor) -> Dict[str, Tensor]:
        """Per-token state (B, H, N, *) of a module input x (N, B, E). None by default."""
        return {}

    def token_states(self, query: Tensor, key: Optional[Tensor]) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """``token_state`` of the queries' input and, when ``key`` is given (the keys' input of
        encoder-decoder attention, not yet cached), of the keys' input, in that order. A variant
        may override it to compute both in one pass."""
        return self.token_state(query), ({} if key is None else self.token_state(key))

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
        """Scaled dot-product attention (module docstring); the weights only if ``need_weights``."""
        if not need_weights:
            p = self.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p), None
        weights = self.explicit_softmax(self.attention_logits(q, k, mask))
        return self.weighted_values(weights, v), weights

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _split_heads(x: Tensor, heads: int) -> Tensor:
        """(N, B, heads * d) -> (B, heads, N, d)."""
        length, bsz, _ = x.shape
        return x.view(length, bsz, heads, -1).permute(1, 2, 0, 3)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        need_weights: bool = True,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
        before_softmax: bool = False,
        need_head_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """fairseq's MultiheadAttention contract: inputs (T, B, E), returns ((T, B, E), weights).

        weights are None unless ``need_weights``; averaged over heads (B, T, S) unless
        ``need_head_weights`` (H, B, T, S).
        """
        if before_softmax:
            raise NotImplementedError(f"{type(self).__name__} does not return pre-softmax scores")
        need_weights = need_weights or need_head_weights
        tgt_len, bsz, _ = query.shape
        beams = self._beams_sharing_keys(incremental_state, bsz)

        saved: Dict[str, Optional[Tensor]] = {}
        if incremental_state is not None:
            saved = self._get_input_buffer(incremental_state)
            if static_kv and saved.get("prev_key") is not None:
                key = value = None  # encoder keys were projected at the first step

        if key is not None and not self.self_attention and beams > 1 and key.size(1) == bsz:
            # SequenceGenerator repeats each sentence's encoder states for its beams: one copy
            # per sentence is projected, cached and attended to
            assert value is not None  # fairseq passes keys and values together
            key, value = key[:, ::beams], value[:, ::beams]
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask[::beams]
        q_state, k_state = self.token_states(query, None if self.self_attention else key)
        q = self._split_heads(self.q_proj(q_state.pop("input", query)), self.key_heads)

        if key is not None:
            if self.self_attention:
                key = value = query
                k_state = q_state  # its "input" went to the queries: keys read the given input
            k = self._split_heads(self.k_proj(k_state.pop("input", key)), self.key_heads)
            v = self._split_heads(self.v_proj(value), self.value_heads)
            # Expand before caching (to one copy per sentence when the beams share it), so that
            # beam search's reordering applies to the cache (``reorder_incremental_state``).
            k, v, k_state, key_padding_mask = self._expand_to_batch(
                bsz // beams, k, v, k_state, key_padding_mask
            )

        if incremental_state is not None:
            k_state = {name: k_state[name] for name in self.cached_state_names if name in k_state}
            if key is None:  # static_kv, reuse the cache as is
                k, v = _cached(saved, "prev_key"), _cached(saved, "prev_value")
                k_state = {
                    name: _cached(saved, "prev_" + name) for name in self.cached_state_names if "prev_" + name in saved
                }
                if saved.get("prev_key_padding_mask") is not None:
                    key_padding_mask = saved["prev_key_padding_mask"]
            else:
                if saved.get("prev_key") is not None and not static_kv:
                    prev_len = _cached(saved, "prev_key").size(2)
                    key_padding_mask = combine_padding_masks(
                        saved.get("prev_key_padding_mask"), key_padding_mask, bsz, prev_len, k.size(2)
                    )
                    k = torch.cat([_cached(saved, "prev_key"), k], dim=2)
                    v = torch.cat([_cached(saved, "prev_value"), v], dim=2)
                    k_state = {
                        name: torch.cat([_cached(saved, "prev_" + name), t], dim=2) for name, t in k_state.items()
                    }
                saved["prev_key"], saved["prev_value"] = k, v
                saved["prev_key_padding_mask"] = key_padding_mask
                for name, t in k_state.items():
                    saved["prev_" + name] = t
                self._set_input_buffer(incremental_state, saved)

        k, v, k_state, key_padding_mask = self._expand_to_batch(bsz // beams, k, v, k_state, key_padding_mask)

        src_len = k.size(2)
        if beams > 1:
            # the beams' queries become extra query rows of their sentence: exact, as every
            # query row attends on its own, and each sentence's keys are read once
            q = _fold_beams(q, beams)
            q_state = {name: _fold_beams(t, beams) for name, t in q_state.items()}
            if attn_mask is not None:
                if attn_mask.dim() != 2:
                    raise ValueError("a per-hypothesis attn_mask cannot be combined with beam-shared encoder keys")
                attn_mask = attn_mask.repeat(beams, 1)
        mask = self.attention_mask(key_padding_mask, attn_mask, bsz // beams, beams * tgt_len, src_len, q.dtype)
        out, weights = self.attend(q, k, v, q_state, k_state, mask, key_padding_mask, need_weights)
        if beams > 1:
            out = _unfold_beams(out, beams)
            weights = None if weights is None else _unfold_beams(weights, beams)

        out = out.permute(2, 0, 1, 3).reshape(tgt_len, bsz, -1)
        out = self.out_proj(out)

        if not need_weights or weights is None:
            return out, None
        weights = weights.to(out.dtype)
        if need_head_weights:
            return out, weights.transpose(0, 1)
        return out, weights.mean(dim=1)

    def attention_mask(self, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], bsz: int,
                       tgt_len: int, src_len: int, dtype: torch.dtype) -> Optional[Tensor]:
        """The ``mask`` that ``attend`` gets: fairseq's padding and attention masks as one additive
        mask (``additive_attention_mask``). A variant whose kernel reads the padding and the
        attention mask apart may return None and keep ``attn_mask`` for its ``attend``."""
        return additive_attention_mask(key_padding_mask, attn_mask, bsz, self.num_heads, tgt_len, src_len, dtype)

    def _beams_sharing_keys(self, incremental_state, bsz: int) -> int:
        """How many consecutive queries share one sentence's encoder keys: fairseq's beam size in
        the incremental decoding of encoder-decoder attention, else 1."""
        if not (self.encoder_decoder_attention and incremental_state is not None and self.beam_size > 1):
            return 1
        if bsz % self.beam_size != 0:
            raise ValueError(f"a batch of {bsz} hypotheses is not a whole number of beams of {self.beam_size}")
        return self.beam_size

    @staticmethod
    def _expand_to_batch(
        bsz: int, k: Tensor, v: Tensor, k_state: Dict[str, Tensor], key_padding_mask: Optional[Tensor]
    ) -> Tuple[Tensor, Tensor, Dict[str, Tensor], Optional[Tensor]]:
        """Repeat encoder states shared by the beams of a sentence (kv_bsz = bsz / beam) to bsz."""

        def expand(t: Tensor) -> Tensor:
            if t.dim() == 0 or t.size(0) == bsz:
                return t
            if bsz % t.size(0) != 0:
                raise ValueError(f"query batch {bsz} is not a multiple of key batch {t.size(0)}")
            return t.repeat_interleave(bsz // t.size(0), 0)

        mask = None if key_padding_mask is None else expand(key_padding_mask)
        return expand(k), expand(v), {name: expand(t) for name, t in k_state.items()}, mask

    # ----------------------------------------------------------------- the explicit path
    def attention_logits(self, q: Tensor, k: Tensor, mask: Optional[Tensor]) -> Tensor:
        """q k^T / sqrt(d) + mask (B, H, T, S), in at least fp32: the weights-returning path
        keeps its logits out of half precision, as fairseq's does."""
        dtype = at_least_fp32(q)
        logits = torch.matmul(q.to(dtype) * self.head_dim ** -0.5, k.to(dtype).transpose(-1, -2))
        return logits if mask is None else logits + mask.to(dtype)

    def explicit_softmax(self, logits: Tensor) -> Tensor:
        """Softmax in (at least) fp32 (fairseq does the same) for the weights-returning path."""
        return torch.softmax(logits.to(at_least_fp32(logits)), dim=-1)

    def apply_dropout(self, weights: Tensor) -> Tensor:
        return F.dropout(weights, p=self.dropout, training=self.training)

    def weighted_values(self, weights: Tensor, v: Tensor) -> Tensor:
        """dropout(weights) v in the values' dtype, (B, H, T, d_v)."""
        return torch.matmul(self.apply_dropout(weights).to(v.dtype), v)

    # ----------------------------------------------------------------- incremental state
    def _get_input_buffer(
        self, incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]]
    ) -> Dict[str, Optional[Tensor]]:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(
        self,
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]],
        buffer: Dict[str, Optional[Tensor]],
    ):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def reorder_incremental_state(
        self, incremental_state: Dict[str, Dict[str, Optional[Tensor]]], new_order: Tensor
    ):
        """Follow beam search's reordering of hypotheses (batch dim 0 of every cached tensor)."""
        buffer = self._get_input_buffer(incremental_state)
        if not buffer:
            return incremental_state
        rows = new_order
        if self.encoder_decoder_attention and self.beam_size > 1:  # one cached copy per sentence
            rows = new_order.view(-1, self.beam_size)[:, 0] // self.beam_size
        for name, cached in buffer.items():
            if cached is None:
                continue
            if self.encoder_decoder_attention and cached.size(0) * self.beam_size == new_order.size(0):
                # The beams of a sentence share identical encoder keys, so a reordering among
                # the same sentences is a no-op here (fairseq's MultiheadAttention skips it too);
                # a shrinking batch (finished sentences) still selects.
                continue
            buffer[name] = cached.index_select(0, rows)
        return self._set_input_buffer(incremental_state, buffer)

    def set_beam_size(self, beam_size: int):
        """fairseq's hook (``SequenceGenerator`` calls it through the decoder): with a beam size
        above 1, encoder-decoder attention keeps one copy of each sentence's keys for its beams."""
        self.beam_size = beam_size


def _fold_beams(t: Tensor, beams: int) -> Tensor:
    """(n * beams, h, T, *) -> (n, h, beams * T, *): each sentence's beams as consecutive rows."""
    folded = t.view(t.size(0) // beams, beams, *t.shape[1:]).transpose(1, 2)
    return folded.reshape(folded.size(0), folded.size(1), -1, *t.shape[3:])


def _unfold_beams(t: Tensor, beams: int) -> Tensor:
    """The inverse of ``_fold_beams``: (n, h, beams * T, *) -> (n * beams, h, T, *)."""
    unfolded = t.view(t.size(0), t.size(1), beams, -1, *t.shape[3:]).transpose(1, 2)
    return unfolded.reshape(-1, *unfolded.shape[2:])
