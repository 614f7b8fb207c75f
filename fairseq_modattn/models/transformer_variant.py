"""What the plugin's transformer families share: fairseq's transformer with some attentions or
layers replaced, built through fairseq's own hooks.

* ``AttentionSwapEncoderLayer`` / ``AttentionSwapDecoderLayer``: fairseq's layers whose
  ``build_self_attention`` / ``build_encoder_attention`` return the family's module for the
  attention types (``attention_types.py``) a ``--<family>-attention`` flag selects and fairseq's
  ``MultiheadAttention`` otherwise;
* ``VariantEncoder`` / ``VariantDecoder``: fairseq's encoder and decoder building a given layer
  class, wrapped (activation checkpointing, FSDP) exactly as fairseq wraps its own layers;
* ``TransformerVariantModel``: ``TransformerModel`` that fills the family's defaults and
  validates its flags before building, then builds ``encoder_class`` / ``decoder_class``; it
  records a fingerprint of its dictionaries and refuses weights saved with others
  (``dictionary_fingerprint.py``).
"""

from typing import List

from fairseq.distributed import fsdp_wrap
from fairseq.models.transformer import (
    TransformerConfig,
    TransformerDecoderBase,
    TransformerEncoderBase,
    TransformerModel,
)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

from ..modules.attention_base import MultiheadAttentionBase
from .dictionary_fingerprint import RecordsDictionaries
from .hub_interface import PretrainedWithTextPipeline


def wrap_layer(layer, cfg):
    """Activation checkpointing and FSDP wrapping exactly as fairseq's layer builders do."""
    checkpoint = cfg.checkpoint_activations
    if checkpoint:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not checkpoint else 0)


class AttentionSwap:
    """The two hooks a family implements (as static methods on its layer classes)."""

    @staticmethod
    def attention_types(cfg) -> List[str]:
        """The attention types (``attention_types.ATTENTION_TYPES``) that use the family's module."""
        raise NotImplementedError

    @staticmethod
    def build_attention(cfg, attention_type: str, embed_dim: int, num_heads: int, **kwargs):
        """The family's attention module for ``attention_type``; ``kwargs`` as fairseq passes
        them to ``MultiheadAttention`` (self_attention / kdim, vdim, encoder_decoder_attention)."""
        raise NotImplementedError


class AttentionSwapEncoderLayer(AttentionSwap, TransformerEncoderLayerBase):
    def build_self_attention(self, embed_dim, cfg):
        if "enc_self" not in self.attention_types(cfg):
            return super().build_self_attention(embed_dim, cfg)
        return self.build_attention(cfg, "enc_self", embed_dim, cfg.encoder.attention_heads, self_attention=True)


class AttentionSwapDecoderLayer(AttentionSwap, TransformerDecoderLayerBase):
    def build_self_attention(self, embed_dim, cfg, add_bias_kv=False, add_zero_attn=False):
        if "dec_self" not in self.attention_types(cfg):
            return super().build_self_attention(embed_dim, cfg, add_bias_kv, add_zero_attn)
        if add_bias_kv or add_zero_attn or cfg.cross_self_attention:
            raise ValueError(f"{type(self).__name__}: decoder self-attention does not support --cross-self-attention")
        return self.build_attention(cfg, "dec_self", embed_dim, cfg.decoder.attention_heads, self_attention=True)

    def build_encoder_attention(self, embed_dim, cfg):
        if "enc_dec" not in self.attention_types(cfg):
            return super().build_encoder_attention(embed_dim, cfg)
        return self.build_attention(
            cfg, "enc_dec", embed_dim, cfg.decoder.attention_heads,
            kdim=cfg.encoder.embed_dim, vdim=cfg.encoder.embed_dim, encoder_decoder_attention=True,
        )


class VariantEncoder(TransformerEncoderBase):
    """fairseq's encoder whose layers are ``layer_class``."""

    layer_class = TransformerEncoderLayerBase

    def build_encoder_layer(self, cfg):
        return wrap_layer(self.layer_class(cfg, return_fc=self.return_fc), cfg)


class VariantDecoder(TransformerDecoderBase):
    """fairseq's decoder whose layers are ``layer_class``."""

    layer_class = TransformerDecoderLayerBase

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        return wrap_layer(self.layer_class(cfg, no_encoder_attn), cfg)


class TransformerVariantModel(PretrainedWithTextPipeline, RecordsDictionaries, TransformerModel):
    """``TransformerModel`` building ``encoder_class`` / ``decoder_class``, with
    ``from_pretrained`` applying the data-bin's text pipeline (``hub_interface.py``).

    ``prepare_args(args)`` runs before anything is built: it fills the family's defaults (the
    base architecture function; fairseq calls the named one before) and raises clear errors.
    """

    encoder_class = TransformerEncoderBase
    decoder_class = TransformerDecoderBase

    @classmethod
    def prepare_args(cls, args):
        raise NotImplementedError

    @classmethod
    def build_model(cls, args, task):
        cls.prepare_args(args)
        model = super().build_model(args, task)
        model.record_data_bin(args, task)
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return cls.encoder_class(TransformerConfig.from_namespace(args), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        cfg = TransformerConfig.from_namespace(args)
        return cls.decoder_class(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def set_beam_size(self, beam_size: int):
        """Called by fairseq's SequenceGenerator (``EnsembleModel.set_decoder_beam_size``) on a
        model that has it: this package's attention modules then keep one copy of each
        sentence's encoder keys for its beams (``MultiheadAttentionBase``). fairseq's own
        ``MultiheadAttention`` modules are left as fairseq 0.12 runs them in a
        ``TransformerModel``, which has no such method (beam size 1)."""
        for module in self.modules():
            if isinstance(module, MultiheadAttentionBase):
                module.set_beam_size(beam_size)
