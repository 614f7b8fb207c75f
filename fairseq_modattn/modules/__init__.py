"""Plain nn.Modules (no fairseq registration): the math of each method."""

from .attention_base import MultiheadAttentionBase
from .dma_attention import DisentangledMaskAttention, annealing_rate
from .gmm import DiagonalGMM, GMMStatistics
from .group_linear import GroupLayerNorm, GroupLinear
from .group_recurrent_cells import GroupGRUCell, GroupLSTMCell
from .interpolated_attention import interpolated_masked_attention, log_semantic_mask
from .rim import RIMCell, RIMLayer, RIMState
from .talking_heads_attention import TalkingHeadsAttention, mix_heads
from .tim_layer import TIMDecoderLayer, TIMEncoderLayer

__all__ = [
    "DiagonalGMM",
    "DisentangledMaskAttention",
    "GMMStatistics",
    "GroupLayerNorm",
    "GroupGRUCell",
    "GroupLSTMCell",
    "GroupLinear",
    "MultiheadAttentionBase",
    "RIMCell",
    "RIMLayer",
    "RIMState",
    "TIMDecoderLayer",
    "TIMEncoderLayer",
    "TalkingHeadsAttention",
    "annealing_rate",
    "interpolated_masked_attention",
    "log_semantic_mask",
    "mix_heads",
]
