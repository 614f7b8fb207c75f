"""The talking-heads transformer: fairseq's transformer with ``TalkingHeadsAttention``.

Registered as model ``talking_heads_transformer`` with named architectures that keep the
dimensions of fairseq's transformers:

    ====================================== ============================= ==========
    --arch                                 dimensions                    talking in
    ====================================== ============================= ==========
    talking_heads_transformer              transformer (512/2048, 8 h)   enc_self
    talking_heads_transformer_iwslt_de_en  transformer_iwslt_de_en (4 h) enc_self
    talking_heads_transformer_wmt_en_de    transformer_wmt_en_de (8 h)   enc_self
    ====================================== ============================= ==========

Encoder self-attention is the default place (the paper's most useful one; Shazeer et al.,
2020, section 5); ``--th-attention`` adds decoder self- and encoder-decoder attention. The head
counts h_k, h, h_v default to the side's ``--*-attention-heads``, so the default model has
the transformer's parameters plus h^2 + h^2 per talking attention module. The model has no
auxiliary loss: train it with ``label_smoothed_cross_entropy`` (or the ``_with_aux``
criterion, which then reduces to it). Where the module follows the paper's pseudo-code and
where it departs (the mask placement, the identity initialisation): docs/fidelity.md.
"""

from typing import List

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de,
)
from fairseq.utils import safe_getattr

from ..modules.attention_base import check_heads
from ..modules.talking_heads_attention import TalkingHeadsAttention, check_head_projections
from .attention_types import ATTENTION_TYPES, parse_attention_types, query_stack
from .transformer_variant import (
    AttentionSwapDecoderLayer,
    AttentionSwapEncoderLayer,
    TransformerVariantModel,
    VariantDecoder,
    VariantEncoder,
)


def talking_heads_attention_types(cfg) -> List[str]:
    """The attention types given by --th-attention (comma-separated), validated."""
    return parse_attention_types(safe_getattr(cfg, "th_attention", "enc_self"), "--th-attention")


def head_counts(cfg, side_heads: int):
    """(h_k, h, h_v): the --th-* flags, each unset one defaulting to the side's attention heads."""
    heads = _given(cfg, "th_heads", side_heads)
    return _given(cfg, "th_key_heads", heads), heads, _given(cfg, "th_value_heads", heads)


def _given(cfg, key: str, default: int) -> int:
    value = safe_getattr(cfg, key, None)
    return default if value is None else value


def build_talking_heads_attention(cfg, attention_type: str, embed_dim: int, side_heads: int,
                                  **kwargs) -> TalkingHeadsAttention:
    """The talking-heads module for one attention type (``AttentionSwap.build_attention``)."""
    if safe_getattr(cfg.quant_noise, "pq", 0) > 0:
        raise ValueError("--quant-noise-pq is not supported by talking-heads attention")
    key_heads, heads, value_heads = head_counts(cfg, side_heads)
    return TalkingHeadsAttention(
        embed_dim,
        heads,
        dropout=cfg.attention_dropout,
        key_heads=key_heads,
        value_heads=value_heads,
        project_logits=not cfg.th_no_logits_projection,
        project_weights=not cfg.th_no_weights_projection,
        **kwargs,
    )


def validate_talking_heads_args(args):
    """Clear errors naming the flag, before anything is built: the module's checks run on the
    flags of every side that holds a talking-heads module (its heads split that side's width)."""
    sides = {query_stack(t) for t in talking_heads_attention_types(args)}
    for side in ("encoder", "decoder"):
        if side not in sides:
            continue
        key_heads, heads, value_heads = head_counts(args, getattr(args, f"{side}_attention_heads"))
        heads_flag = "--th-heads" if args.th_heads is not None else f"--{side}-attention-heads"
        names = {
            "embed_dim": f"--{side}-embed-dim", "num_heads": heads_flag,
            "key_heads": "--th-key-heads" if args.th_key_heads is not None else heads_flag,
            "value_heads": "--th-value-heads" if args.th_value_heads is not None else heads_flag,
            "project_logits": "--th-no-logits-projection", "project_weights": "--th-no-weights-projection",
        }
        check_heads(getattr(args, f"{side}_embed_dim"), heads, key_heads, value_heads, names)
        check_head_projections(heads, key_heads, value_heads, not args.th_no_logits_projection,
                               not args.th_no_weights_projection, names)


class TalkingHeadsEncoderLayer(AttentionSwapEncoderLayer):
    attention_types = staticmethod(talking_heads_attention_types)
    build_attention = staticmethod(build_talking_heads_attention)


class TalkingHeadsDecoderLayer(AttentionSwapDecoderLayer):
    attention_types = staticmethod(talking_heads_attention_types)
    build_attention = staticmethod(build_talking_heads_attention)


class TalkingHeadsEncoder(VariantEncoder):
    layer_class = TalkingHeadsEncoderLayer


class TalkingHeadsDecoder(VariantDecoder):
    layer_class = TalkingHeadsDecoderLayer


@register_model("talking_heads_transformer")
class TalkingHeadsTransformerModel(TransformerVariantModel):
    """Transformer whose chosen attentions are ``TalkingHeadsAttention`` (see module docstring)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        group = parser.add_argument_group("talking-heads attention")
        # No default= here: fairseq suppresses argparse defaults; the architecture functions fill them.
        group.add_argument("--th-attention", type=str, metavar="TYPES",
                           help="comma-separated attention types that use talking heads: "
                                f"{', '.join(ATTENTION_TYPES)}, or 'none' (default: enc_self, the paper's best place)")
        group.add_argument("--th-heads", type=int, metavar="H",
                           help="h, the softmax heads (default: the side's --*-attention-heads)")
        group.add_argument("--th-key-heads", type=int, metavar="HK",
                           help="h_k, query/key heads of width embed_dim / h_k (default: h)")
        group.add_argument("--th-value-heads", type=int, metavar="HV",
                           help="h_v, value heads of width embed_dim / h_v (default: h)")
        group.add_argument("--th-no-logits-projection", action="store_true",
                           help="drop the h_k x h projection of the logits before the softmax "
                                "(the paper's 'project weights only'; needs h_k = h)")
        group.add_argument("--th-no-weights-projection", action="store_true",
                           help="drop the h x h_v projection of the weights after the softmax "
                                "(the paper's 'project logits only'; needs h_v = h)")

    encoder_class = TalkingHeadsEncoder
    decoder_class = TalkingHeadsDecoder

    @classmethod
    def prepare_args(cls, args):
        talking_heads_base_architecture(args)
        validate_talking_heads_args(args)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        if strict:
            missing = sorted(k for k in self.state_dict() if k.endswith(("logits_proj", "weights_proj"))
                             and k not in state_dict)
            if missing:
                raise RuntimeError(
                    f"the checkpoint has no talking-heads parameters for this model ({len(missing)} "
                    f"missing, e.g. '{missing[0]}'): it was trained with another --arch or another "
                    "--th-attention / --th-no-*-projection setting"
                )
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)


# ---------------------------------------------------------------------------- architectures
@register_model_architecture("talking_heads_transformer", "talking_heads_transformer")
def talking_heads_base_architecture(args):
    args.th_attention = safe_getattr(args, "th_attention", "enc_self")
    args.th_heads = safe_getattr(args, "th_heads", None)
    args.th_key_heads = safe_getattr(args, "th_key_heads", None)
    args.th_value_heads = safe_getattr(args, "th_value_heads", None)
    args.th_no_logits_projection = safe_getattr(args, "th_no_logits_projection", False)
    args.th_no_weights_projection = safe_getattr(args, "th_no_weights_projection", False)
    base_architecture(args)


@register_model_architecture("talking_heads_transformer", "talking_heads_transformer_iwslt_de_en")
def talking_heads_transformer_iwslt_de_en(args):
    transformer_iwslt_de_en(args)
    talking_heads_base_architecture(args)


@register_model_architecture("talking_heads_transformer", "talking_heads_transformer_wmt_en_de")
def talking_heads_transformer_wmt_en_de(args):
    transformer_wmt_en_de(args)
    talking_heads_base_architecture(args)
