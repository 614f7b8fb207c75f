"""The TIM transformer: fairseq's transformer with some layers replaced by TIM layers
(Lamb et al. 2021, "Transformers with Competitive Ensembles of Independent Mechanisms").

Registered as model ``tim_transformer``. The layers named by ``--tim-encoder-layers`` /
``--tim-decoder-layers`` (0-based indices, 'auto', 'all' or 'none') are ``TIMEncoderLayer`` /
``TIMDecoderLayer`` (``modules/tim_layer.py``: n_s competing mechanisms, mechanism-wise attention
and FFN, inter-mechanism attention); all others are fairseq's standard layers, unchanged.
'auto' is the paper's finding: every layer but the first two and the last (6 layers: 2, 3, 4).

Named architectures:

    ======================================= ============ ===== ============================
    --arch                                  emb/FFN      heads TIM layers' FFN width
    ======================================= ============ ===== ============================
    tim_transformer                         512/2048     8     2048 (the side's FFN width)
    tim_transformer_iwslt_de_en             512/1024     4     1024
    tim_transformer_iwslt_de_en_matched     512/1024     4     2808 (--tim-match-params)
    tim_transformer_wmt_en_de               512/2048     8     2048
    tim_transformer_wmt_en_de_matched       512/2048     8     4854 (--tim-match-params)
    ======================================= ============ ===== ============================

(all with n_s = 2, competition on, inter-mechanism attention on with per-mechanism q/k/v/out and
H_c = 2 heads of d_K = 32 units as the paper, TIM in encoder layers 2-4, none in the decoder.)

Parameter matching (``--tim-match-params``). Block-diagonal projections have 1/n_s of the
weights of dense ones, so a TIM layer is smaller than the layer it replaces. The paper
"increases the hidden size to match parameters"; widening D would change every standard layer,
the embeddings and the output projection too, so we widen only the TIM layers' FFN instead:
with d_m = D / n_s, a TIM layer with FFN width F_t has

    P_TIM(F_t) = P_TIM(0) + F_t (2 d_m + 1)

parameters (fc1: d_m F_t weights + F_t biases, fc2: F_t d_m weights; the fc2 bias is in
P_TIM(0)), and F_t = n_s * round((P_std - P_TIM(0)) / ((2 d_m + 1) n_s)), the multiple of n_s
that brings P_TIM closest to the standard layer's P_std (see ``standard_layer_params`` and
``tim_layer_params``, checked against the built modules in the tests); the count is then
within (2 d_m + 1) n_s / 2 = 513 of P_std at D = 512, n_s = 2. With the default per-mechanism
inter-mechanism attention (W = H_c d_K = 64: 4 n_s d_m W + 3 n_s W + D = 131,968 parameters
and its norm 1,024), for IWSLT dims
(512/1024, n_s = 2) a TIM encoder layer has 2,102,906 parameters against 2,102,784
(F_t = 2808); for WMT dims (512/2048) 3,152,504 against 3,152,384 (F_t = 4854). Whole models
(vocabulary 104): tim_transformer_iwslt_de_en_matched 31,703,406 against
transformer_iwslt_de_en's 31,703,040 (unmatched: 28,957,830);
tim_transformer_wmt_en_de_matched 44,298,600 against 44,298,240 (unmatched: 39,980,166). TIM
decoder layers (--tim-decoder-layers) are matched the same way: F_t = 3318 (IWSLT, 3,154,040
against 3,154,432) and 5364 (WMT, 4,203,638 against 4,204,032).

``model.competition()`` returns {layer name: its last competition (B, T, n_s)} for analysis.
"""

from typing import Dict, List, Optional

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoderBase,
    TransformerEncoderBase,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_wmt_en_de,
)
from fairseq.utils import safe_getattr
from torch import Tensor

from ..modules.tim_layer import (
    TIMDecoderLayer,
    TIMEncoderLayer,
    TIMLayerBase,
    check_fairseq_options,
    check_ffn_width,
    check_inter_mechanism_heads,
    check_mechanisms,
)
from .transformer_variant import TransformerVariantModel, wrap_layer

SIDES = ("encoder", "decoder")


# ---------------------------------------------------------------------------- configuration
def parse_layer_indices(value, num_layers: int, flag: str) -> List[int]:
    """The sorted 0-based layer indices given on ``flag``: 'i,j,...', 'auto', 'all' or 'none'.

    'auto' = every layer but the first two and the last (the paper's finding); empty for fewer
    than 4 layers.
    """
    text = str(value).strip().lower()
    if text in ("", "none"):
        return []
    if text == "auto":
        return list(range(2, num_layers - 1))
    if text == "all":
        return list(range(num_layers))
    try:
        indices = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"{flag}: expected comma-separated 0-based layer indices, 'auto', 'all' or 'none', got {value!r}"
        ) from None
    bad = [i for i in indices if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{flag}: layer index {bad} out of range for a stack of {num_layers} layers (0-based)")
    return sorted(set(indices))


def tim_layer_indices(cfg, side: str) -> List[int]:
    num_layers = safe_getattr(cfg, f"{side}_layers", None)
    if num_layers is None:  # a TransformerConfig
        num_layers = getattr(cfg, side).layers
    return parse_layer_indices(safe_getattr(cfg, f"tim_{side}_layers", "none"), num_layers, f"--tim-{side}-layers")


def standard_layer_params(embed_dim: int, ffn_dim: int, decoder: bool = False,
                          encoder_dim: Optional[int] = None, cross_attention: bool = True) -> int:
    """Parameters of fairseq's transformer layer (all biases on, no quant-noise extras)."""
    D = embed_dim
    total = 4 * (D * D + D) + 2 * D  # self-attention q/k/v/out, its layer norm
    total += D * ffn_dim + ffn_dim + ffn_dim * D + D + 2 * D  # fc1, fc2, final layer norm
    if decoder and cross_attention:
        k = D if encoder_dim is None else encoder_dim
        total += 2 * (D * D + D) + 2 * (k * D + D) + 2 * D  # q/out, k/v from the encoder, norm
    return total


def tim_layer_params(embed_dim: int, ffn_dim: int, num_mechanisms: int, competition: bool = True,
                     mechanism_attention: bool = True, decoder: bool = False,
                     encoder_dim: Optional[int] = None, cross_attention: bool = True,
                     mechanism_attention_heads: int = 2, mechanism_attention_head_dim: Optional[int] = 32) -> int:
    """Parameters of a TIM layer: block-diagonal maps hold n_s blocks of d_m x d_m = D d_m weights.

    The inter-mechanism attention has width W = H_c d_K (d_K = ``mechanism_attention_head_dim``,
    None or 0: d_m / H_c): q/k/v GroupLinear(n_s, d_m, W), out GroupLinear(n_s, W, d_m), i.e.
    4 n_s d_m W weights and 3 n_s W + D biases.
    """
    D, n = embed_dim, num_mechanisms
    d = D // n
    total = 4 * (D * d + D) + 2 * D  # grouped q/k/v/out, group norm
    if competition:
        total += D + n  # GroupLinear(n_s, d_m, 1)
    if mechanism_attention:
        W = mechanism_attention_heads * (mechanism_attention_head_dim or d // mechanism_attention_heads)
        total += n * (4 * d * W + 3 * W + d) + 2 * D  # q/k/v/out, group norm
    total += 2 * d * ffn_dim + ffn_dim + D + 2 * D  # grouped fc1, fc2, final group norm
    if decoder and cross_attention:
        k = D if encoder_dim is None else encoder_dim
        total += 2 * (D * d + D) + 2 * (k * D + D) + 2 * D  # grouped q/out, dense k/v, norm
    return total


def matched_ffn_dim(embed_dim: int, ffn_dim: int, num_mechanisms: int, competition: bool = True,
                    mechanism_attention: bool = True, decoder: bool = False,
                    encoder_dim: Optional[int] = None, cross_attention: bool = True,
                    mechanism_attention_heads: int = 2, mechanism_attention_head_dim: Optional[int] = 32) -> int:
    """The multiple of n_s that makes a TIM layer's count closest to the standard layer's."""
    kwargs = dict(decoder=decoder, encoder_dim=encoder_dim, cross_attention=cross_attention)
    target = standard_layer_params(embed_dim, ffn_dim, **kwargs)
    fixed = tim_layer_params(embed_dim, 0, num_mechanisms, competition, mechanism_attention, **kwargs,
                             mechanism_attention_heads=mechanism_attention_heads,
                             mechanism_attention_head_dim=mechanism_attention_head_dim)
    per_unit = 2 * (embed_dim // num_mechanisms) + 1  # parameters per unit of FFN width
    blocks = round((target - fixed) / (per_unit * num_mechanisms))
    return num_mechanisms * max(1, blocks)


def tim_ffn_dim(cfg, side: str) -> int:
    """FFN width of ``side``'s TIM layers: --tim-ffn-embed-dim, matched, or the side's FFN width."""
    side_ffn = safe_getattr(cfg, f"{side}_ffn_embed_dim", None)
    if side_ffn is None:
        side_ffn = getattr(cfg, side).ffn_embed_dim
    if safe_getattr(cfg, "tim_match_params", False):
        embed = _side_dim(cfg, side)
        return matched_ffn_dim(
            embed,
            side_ffn,
            cfg.tim_mechanisms,
            competition=not cfg.tim_no_competition,
            mechanism_attention=not cfg.tim_no_mechanism_attention,
            decoder=side == "decoder",
            encoder_dim=_side_dim(cfg, "encoder"),
            cross_attention=not safe_getattr(cfg, "no_cross_attention", False),
            **inter_mechanism_kwargs(cfg),
        )
    explicit = safe_getattr(cfg, "tim_ffn_embed_dim", None)
    return side_ffn if explicit is None else explicit


def inter_mechanism_kwargs(cfg) -> dict:
    """Heads and head width (None: d_m / H_c) of the inter-mechanism attention."""
    return dict(
        mechanism_attention_heads=cfg.tim_mechanism_attention_heads,
        mechanism_attention_head_dim=cfg.tim_mechanism_attention_head_dim or None,
    )


def _side_dim(cfg, side: str) -> int:
    dim = safe_getattr(cfg, f"{side}_embed_dim", None)
    return getattr(cfg, side).embed_dim if dim is None else dim


def validate_tim_args(args):
    """Clear errors naming the flag, before anything is built: the layers' own checks
    (``modules/tim_layer.py``) run on the flags, plus those of the flags' own conventions."""
    if args.tim_mechanism_attention_head_dim is None or args.tim_mechanism_attention_head_dim < 0:
        raise ValueError(
            "--tim-mechanism-attention-head-dim must be >= 0 (0: d_m / H_c), "
            f"got {args.tim_mechanism_attention_head_dim}"
        )
    if args.tim_match_params and args.tim_ffn_embed_dim is not None:
        raise ValueError("--tim-ffn-embed-dim and --tim-match-params exclude each other (the latter computes it)")
    sides = [side for side in SIDES if tim_layer_indices(args, side)]
    if sides:
        check_fairseq_options(safe_getattr(args, "quant_noise_pq", 0),
                              "decoder" in sides and safe_getattr(args, "cross_self_attention", False),
                              {"quant_noise_pq": "--quant-noise-pq", "cross_self_attention": "--cross-self-attention"})
    n = args.tim_mechanisms
    for side in sides:
        dim = getattr(args, f"{side}_embed_dim")
        check_mechanisms(dim, getattr(args, f"{side}_attention_heads"), n, {
            "num_mechanisms": "--tim-mechanisms", "embed_dim": f"--{side}-embed-dim",
            "num_heads": f"--{side}-attention-heads",
        })
        if not args.tim_no_mechanism_attention:
            check_inter_mechanism_heads(dim // n, args.tim_mechanism_attention_heads,
                                        args.tim_mechanism_attention_head_dim or None, {
                "num_heads": "--tim-mechanism-attention-heads", "head_dim": "--tim-mechanism-attention-head-dim",
                "mechanism_dim": f"--{side}-embed-dim / --tim-mechanisms",
            })
        ffn_flag = "--tim-ffn-embed-dim" if args.tim_ffn_embed_dim is not None else f"--{side}-ffn-embed-dim"
        check_ffn_width(tim_ffn_dim(args, side), n, {"ffn_embed_dim": ffn_flag, "num_mechanisms": "--tim-mechanisms"})


def tim_layer_kwargs(cfg, side: str) -> dict:
    return dict(
        num_mechanisms=cfg.tim_mechanisms,
        competition=not cfg.tim_no_competition,
        mechanism_attention=not cfg.tim_no_mechanism_attention,
        ffn_embed_dim=tim_ffn_dim(cfg, side),
        **inter_mechanism_kwargs(cfg),
    )


# ---------------------------------------------------------------------------- encoder / decoder
class TIMTransformerEncoder(TransformerEncoderBase):
    """fairseq's encoder with TIM layers at ``cfg.tim_encoder_layers``."""

    def __init__(self, cfg, dictionary, embed_tokens, return_fc=False):
        # build_encoder_layer runs inside super().__init__ without an index: count the calls
        self.tim_layers = tim_layer_indices(cfg, "encoder")
        self._layers_built = 0
        super().__init__(cfg, dictionary, embed_tokens, return_fc=return_fc)

    def build_encoder_layer(self, cfg):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        if index not in self.tim_layers:
            return super().build_encoder_layer(cfg)
        layer = TIMEncoderLayer(cfg, return_fc=self.return_fc, **tim_layer_kwargs(cfg, "encoder"))
        return wrap_layer(layer, cfg)


class TIMTransformerDecoder(TransformerDecoderBase):
    """fairseq's decoder with TIM layers at ``cfg.tim_decoder_layers``."""

    def __init__(self, cfg, dictionary, embed_tokens, no_encoder_attn=False, output_projection=None):
        self.tim_layers = tim_layer_indices(cfg, "decoder")
        self._layers_built = 0
        super().__init__(cfg, dictionary, embed_tokens, no_encoder_attn=no_encoder_attn,
                         output_projection=output_projection)

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        if index not in self.tim_layers:
            return super().build_decoder_layer(cfg, no_encoder_attn)
        layer = TIMDecoderLayer(cfg, no_encoder_attn, **tim_layer_kwargs(cfg, "decoder"))
        return wrap_layer(layer, cfg)


@register_model("tim_transformer")
class TIMTransformerModel(TransformerVariantModel):
    """Transformer with TIM layers at the chosen indices (see the module docstring)."""

    encoder_class = TIMTransformerEncoder
    decoder_class = TIMTransformerDecoder

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        group = parser.add_argument_group("transformer with independent mechanisms (TIM)")
        # No default= here: fairseq suppresses argparse defaults; the architecture functions
        # below fill them.
        group.add_argument("--tim-mechanisms", type=int, metavar="N",
                           help="number of mechanisms n_s each TIM layer splits the hidden state into "
                                "(must divide the embedding dim, the attention heads and the TIM FFN width)")
        group.add_argument("--tim-encoder-layers", type=str, metavar="LIST",
                           help="0-based comma-separated encoder layers that are TIM layers, 'auto' "
                                "(all but the first two and the last, the paper's finding), 'all' or 'none'")
        group.add_argument("--tim-decoder-layers", type=str, metavar="LIST",
                           help="decoder layers that are TIM layers, same syntax as --tim-encoder-layers "
                                "(the paper defines TIM encoder layers only)")
        group.add_argument("--tim-no-competition", action="store_true",
                           help="switch the competition between mechanisms off (TIM-NoComp: c = 1)")
        group.add_argument("--tim-mechanism-attention-heads", type=int, metavar="H",
                           help="heads H_c of the inter-mechanism attention (must divide embed dim / n_s)")
        group.add_argument("--tim-mechanism-attention-head-dim", type=int, metavar="K",
                           help="units d_K per head of the inter-mechanism attention (the paper: 32); "
                                "0: d_m / H_c (embed dim / n_s / heads)")
        group.add_argument("--tim-no-mechanism-attention", action="store_true",
                           help="drop the inter-mechanism attention step of TIM layers")
        group.add_argument("--tim-ffn-embed-dim", type=int, metavar="F",
                           help="FFN width of TIM layers (split among the mechanisms); unset: the "
                                "side's --encoder/--decoder-ffn-embed-dim")
        group.add_argument("--tim-match-params", action="store_true",
                           help="widen the TIM layers' FFN so that each TIM layer has as many parameters "
                                "as the standard layer it replaces (closest multiple of n_s)")

    @classmethod
    def prepare_args(cls, args):
        tim_base_architecture(args)
        validate_tim_args(args)

    def tim_layers(self) -> Dict[str, TIMLayerBase]:
        return {name: m for name, m in self.named_modules() if isinstance(m, TIMLayerBase)}

    def competition(self) -> Dict[str, Optional[Tensor]]:
        """{layer name: competition of its last forward, (B, T, n_s), detached} (None: off)."""
        return {name: layer.last_competition for name, layer in self.tim_layers().items()}


# ---------------------------------------------------------------------------- architectures
# Each function only fills defaults (safe_getattr keeps what the command line set) and then
# calls the fairseq architecture with the same dimensions.

@register_model_architecture("tim_transformer", "tim_transformer")
def tim_base_architecture(args):
    args.tim_mechanisms = safe_getattr(args, "tim_mechanisms", 2)
    args.tim_encoder_layers = safe_getattr(args, "tim_encoder_layers", "auto")
    args.tim_decoder_layers = safe_getattr(args, "tim_decoder_layers", "none")
    args.tim_no_competition = safe_getattr(args, "tim_no_competition", False)
    # Step 3 as the paper: "2 heads with 32 units each"
    args.tim_mechanism_attention_heads = safe_getattr(args, "tim_mechanism_attention_heads", 2)
    args.tim_mechanism_attention_head_dim = safe_getattr(args, "tim_mechanism_attention_head_dim", 32)
    args.tim_no_mechanism_attention = safe_getattr(args, "tim_no_mechanism_attention", False)
    args.tim_ffn_embed_dim = safe_getattr(args, "tim_ffn_embed_dim", None)
    args.tim_match_params = safe_getattr(args, "tim_match_params", False)
    base_architecture(args)


@register_model_architecture("tim_transformer", "tim_transformer_iwslt_de_en")
def tim_transformer_iwslt_de_en(args):
    transformer_iwslt_de_en(args)
    tim_base_architecture(args)


@register_model_architecture("tim_transformer", "tim_transformer_wmt_en_de")
def tim_transformer_wmt_en_de(args):
    transformer_wmt_en_de(args)
    tim_base_architecture(args)


@register_model_architecture("tim_transformer", "tim_transformer_iwslt_de_en_matched")
def tim_transformer_iwslt_de_en_matched(args):
    args.tim_match_params = safe_getattr(args, "tim_match_params", True)
    tim_transformer_iwslt_de_en(args)


@register_model_architecture("tim_transformer", "tim_transformer_wmt_en_de_matched")
def tim_transformer_wmt_en_de_matched(args):
    args.tim_match_params = safe_getattr(args, "tim_match_params", True)
    tim_transformer_wmt_en_de(args)
