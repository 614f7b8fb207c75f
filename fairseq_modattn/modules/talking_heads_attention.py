"""Talking-heads attention (Shazeer, Lan, Cheng, Ding & Hou, "Talking-Heads Attention", 2020,
section 4 and the pseudo-code of its appendix A).

Multi-head attention computes each head's weights from its own logits only. Talking-heads
attention lets the heads exchange information with two learned linear maps across the head
dimension, one before and one after the softmax. With h_k query/key heads, h softmax heads
and h_v value heads (three independent numbers):

    J^a  = q^a (k^a)^T / sqrt(d_k)                a = 1..h_k   (per query/key head)
    L^b  = sum_a J^a P_l[a, b]  + masks           b = 1..h     (logits projection)
    W^b  = softmax_j(L^b)
    U^c  = sum_b W^b P_w[b, c]                    c = 1..h_v   (weights projection)
    out  = concat_c( dropout(U^c) v^c ) W_o

Padding and causal masks are added AFTER the logits projection. The paper's pseudo-code has
no mask step at all, so this placement is our reasoning, not the paper's: masking J before
P_l would mix an -inf into other heads, masking keys that those heads are allowed to see, or
produce NaN (x-transformers also masks after its head mixing). Dropout acts on U, the weights
that multiply the values (the pseudo-code has none). Either projection can be switched off (the
paper's "project logits only" / "project weights only" ablations); without P_l the logits
need h_k = h, without P_w the weights need h = h_v. With both projections the identity and
h_k = h = h_v, this is exactly multi-head attention (a test checks it against fairseq's
``MultiheadAttention``).

Widths: queries and keys are split into h_k heads of d_k = E / h_k and values into h_v heads
of d_v = E / h_v, so the input and output projections stay E x E and the module is a drop-in
for fairseq's attention with any (h_k, h, h_v).

Initialisation: P_l and P_w start as the (rectangular) identity, ``nn.init.eye_``. With equal
head counts the module then starts as exactly the multi-head attention it replaces and learns
how much the heads should talk; no symmetry has to be broken by noise, because the heads'
query/key/value projections already differ (their random init), so the gradients of the
off-diagonal entries differ too. With unequal counts the extra heads start at zero: an extra
softmax head starts uniform, an extra value head starts silent, and both receive gradients
from the first step. (The paper's code initialises the projections randomly; starting from
the baseline instead makes "talking heads" a strict extension of the model it is compared
against, which is what an ablation on a fixed budget needs.)

docs/fidelity.md compares every step with the paper's pseudo-code and x-transformers.

The h x T x S weights are materialised (the mixing across heads sits between the two matrix
products, so no fused attention kernel applies); the mixing itself is one batched matmul over
a (B, h_in, T * S) view per projection, no loop over heads.
"""

from typing import Dict, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .attention_base import MultiheadAttentionBase
from .parameter_names import parameter_names


def mix_heads(scores: Tensor, projection: Tensor) -> Tensor:
    """sum_a scores[:, a] * projection[a, b] for scores (B, h_in, T, S), projection (h_in, h_out)."""
    bsz, heads, tgt_len, src_len = scores.shape
    mixed = torch.matmul(projection.t().to(scores.dtype), scores.reshape(bsz, heads, tgt_len * src_len))
    return mixed.view(bsz, -1, tgt_len, src_len)


def check_head_projections(num_heads: int, key_heads: int, value_heads: int, project_logits: bool,
                           project_weights: bool, names: Optional[Mapping[str, str]] = None):
    """ValueError where a head projection that is switched off would have to change the head
    count: without P_l the logits keep h_k heads, so h_k must equal h; without P_w the weights
    keep h heads, so h_v must equal h. ``names``: what the caller calls each parameter
    (``parameter_names``; ``project_logits`` / ``project_weights`` name the switch being off).
    The counts themselves are ``attention_base.check_heads``'s."""
    name = parameter_names({"project_logits": "project_logits=False", "project_weights": "project_weights=False",
                            **(names or {})})
    if not project_logits and key_heads != num_heads:
        raise ValueError(
            f"without the logits projection ({name['project_logits']}) the key heads "
            f"({name['key_heads']} {key_heads}) must equal the softmax heads ({name['num_heads']} {num_heads})"
        )
    if not project_weights and value_heads != num_heads:
        raise ValueError(
            f"without the weights projection ({name['project_weights']}) the value heads "
            f"({name['value_heads']} {value_heads}) must equal the softmax heads ({name['num_heads']} {num_heads})"
        )


class TalkingHeadsAttention(MultiheadAttentionBase):
    """Multi-head attention whose heads talk through two learned head projections.

    Args (beyond ``MultiheadAttentionBase``):
        num_heads: h, the softmax heads.
        key_heads: h_k, query/key heads (default h).
        value_heads: h_v, value heads (default h).
        project_logits: learn P_l (h_k x h) before the softmax; otherwise h_k must equal h.
        project_weights: learn P_w (h x h_v) after the softmax; otherwise h_v must equal h.
    """

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
        project_logits: bool = True,
        project_weights: bool = True,
    ):
        key_heads = num_heads if key_heads is None else key_heads
        value_heads = num_heads if value_heads is None else value_heads
        check_head_projections(num_heads, key_heads, value_heads, project_logits, project_weights)
        super().__init__(
            embed_dim, num_heads, kdim, vdim, dropout, bias, self_attention, encoder_decoder_attention,
            key_heads=key_heads, value_heads=value_heads,
        )
        self.logits_proj = nn.Parameter(torch.empty(key_heads, num_heads)) if project_logits else None
        self.weights_proj = nn.Parameter(torch.empty(num_heads, value_heads)) if project_weights else None
        self.reset_head_projections()

    def reset_head_projections(self):
        for projection in (self.logits_proj, self.weights_proj):
            if projection is not None:
                nn.init.eye_(projection)

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
        logits = torch.matmul(q * self.head_dim ** -0.5, k.transpose(-1, -2))  # J, (B, h_k, T, S)
        if self.logits_proj is not None:
            logits = mix_heads(logits, self.logits_proj)  # L, (B, h, T, S)
        if mask is not None:
            logits = logits + mask.to(logits.dtype)
        weights = self.explicit_softmax(logits)  # W, fp32 (fp64 for fp64 inputs)
        mixed = weights if self.weights_proj is None else mix_heads(weights, self.weights_proj)  # U
        out = torch.matmul(self.apply_dropout(mixed).to(v.dtype), v)  # (B, h_v, T, d_v)
        return out, (weights if need_weights else None)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, key_heads={self.key_heads}, heads={self.num_heads}, "
            f"value_heads={self.value_heads}, project_logits={self.logits_proj is not None}, "
            f"project_weights={self.weights_proj is not None}"
        )
