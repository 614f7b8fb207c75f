"""RIM-LSTM: an encoder of recurrent independent mechanisms under fairseq's LSTM decoder
(Goyal et al. 2019/2021, "Recurrent Independent Mechanisms", sections 2-3 and Algorithm 1).

Registered as model ``rim_lstm``. The encoder (``RIMEncoder``) embeds the source and runs
``--rim-layers`` stacked ``RIMLayer``s (``modules/rim.py``). Per layer and time step t, each of
the n RIMs (hidden size d_r) attends over [null, x_t]; the k RIMs that attend least to the null
input are active, are updated by their own LSTM (or GRU) cell and read from all RIMs through
multi-head communication attention; the other n - k keep their state. The encoder's output at
position t is the concatenation of the n RIM states, n * d_r wide (twice that with
``--rim-bidirectional``). The decoder is fairseq's own ``LSTMDecoder`` (input feeding and
attention over the encoder outputs, Luong et al. 2015), unchanged.

The encoder returns exactly what fairseq's ``LSTMEncoder`` returns, so ``LSTMDecoder``,
``SequenceGenerator`` and beam search work as they do for ``--arch lstm``:

    (outputs         T x B x C   the top layer's RIM states (zeros at padded positions)
     final_hiddens   D x B x C   initial hidden state of each of the D decoder layers
     final_cells     D x B x C   initial cell state of each decoder layer
     padding_mask    T x B)      True at padding

with C = n * d_r * (2 if bidirectional else 1) (``encoder.output_units``; the decoder projects
the final states to its hidden size when C differs from it, as it does for an LSTM encoder).

Final states for the decoder. fairseq's ``LSTMModel`` requires as many encoder as decoder
layers and starts decoder layer i from encoder layer i. Here the counts may differ (RIM layers
are expensive; the decoder keeps its own ``--decoder-layers``): row i of ``final_hiddens`` /
``final_cells`` is RIM layer i when both counts are equal; with fewer decoder layers they take
the TOP RIM layers (the ones whose states the decoder attends to); with more, the extra decoder
layers repeat the top RIM layer's state (``final_state_layers``). A bidirectional layer's final
state is [last forward state; last backward state] (the backward direction ends at the first
token), as ``LSTMEncoder.combine_bidir`` arranges it.

GRU cells (``--rim-cell gru``) have no cell state; their ``final_cells`` are the final hidden
states, as the RIMs reference implementation sets c = h for its BlockGRU. The decoder's cell
projection then maps the same summary as its hidden projection (zeros would leave that
projection without gradient and start every decoder cell at its bias).

Padding. fairseq left-pads sources; a padded time step leaves every RIM state unchanged (in
both directions), so each sentence's outputs and final states are those it gets alone, whatever
the padding (checked in tests/test_rim_lstm.py). ``RIMLayer`` sets the outputs at padded
positions to zero (the decoder's attention masks them anyway).

Named architectures (RIM part from the paper's hyperparameter table: input attention keys 64,
values 400 (= 4 d_r, as in the reference code); communication keys 32, values 32, 4 heads;
input and communication dropout 0.1; n = 6 RIMs of which k = 4 are active, d_r = 100, i.e. 600
units, as in the reference code's copying-task script). One input-attention head, as the
reference code (anirudh9119/RIMs) and the copying task use, where the paper's table says 4:
``--rim-input-heads 4`` gives the table's value (docs/fidelity.md has the reasons):

    ======================= ====== ======= =================== ===================== ==========
    --arch                  embed  n/k/d_r encoder output C    decoder hidden / out  layers
    ======================= ====== ======= =================== ===================== ==========
    rim_lstm                512    6/4/100 600                 512 / 512             1 + 1
    rim_lstm_iwslt_de_en    256    6/4/100 600                 256 / 256             1 + 1
    ======================= ====== ======= =================== ===================== ==========

The decoder and embedding dimensions and dropouts are those of fairseq's ``lstm`` and
``lstm_wiseman_iwslt_de_en``; the LSTM baseline of equal hidden size is that architecture with
``--encoder-hidden-size 600`` (examples/rim_lstm/README.md has the commands).

``model.rim_activations()`` returns {layer index: (B, T, num_directions, n) bool}, which RIMs
were active at each real token in the last forward pass (none at padding).
"""

from typing import Dict, List, Optional, Tuple

import torch
from fairseq import utils
from fairseq.models import FairseqEncoder, register_model, register_model_architecture
from fairseq.models.lstm import (
    DEFAULT_MAX_SOURCE_POSITIONS,
    DEFAULT_MAX_TARGET_POSITIONS,
    Embedding,
    LSTMDecoder,
    LSTMModel,
    base_architecture,
    lstm_wiseman_iwslt_de_en,
)
from fairseq.modules import FairseqDropout
from fairseq.utils import safe_getattr
from torch import Tensor, nn

from ..modules.rim import CELL_TYPES, RECURRENCES, RIMLayer, check_rim_cell
from .dictionary_fingerprint import RecordsDictionaries
from .flag_types import finite_float
from .hub_interface import PretrainedWithTextPipeline

# fairseq's LSTM-encoder flags that LSTMModel.add_args defines but a RIM encoder replaces.
REPLACED_ENCODER_FLAGS = {
    "encoder_hidden_size": "--encoder-hidden-size (the width is --rim-num x --rim-size)",
    "encoder_layers": "--encoder-layers (use --rim-layers)",
    "encoder_bidirectional": "--encoder-bidirectional (use --rim-bidirectional)",
}


# ---------------------------------------------------------------------------- configuration
def validate_rim_args(args):
    """Clear errors naming the flag, before anything is built."""
    for dest, flag in REPLACED_ENCODER_FLAGS.items():
        if safe_getattr(args, dest, None) not in (None, False):
            raise ValueError(f"rim_lstm has no {flag}; got {safe_getattr(args, dest)!r}")
    if args.rim_layers < 1:
        raise ValueError(f"--rim-layers must be >= 1, got {args.rim_layers}")
    cell = rim_layer_kwargs(args)
    for unchecked in ("bidirectional", "learned_initial_state", "recurrence", "compile_recurrence"):
        del cell[unchecked]  # nothing to check (argparse checks --rim-recurrence's choices)
    check_rim_cell(args.encoder_embed_dim, **cell, names=RIM_CELL_FLAGS)
    if args.share_all_embeddings and args.encoder_embed_dim != args.decoder_embed_dim:
        raise ValueError(
            f"--share-all-embeddings requires --encoder-embed-dim ({args.encoder_embed_dim}) to match "
            f"--decoder-embed-dim ({args.decoder_embed_dim})"
        )
    if args.share_decoder_input_output_embed and args.decoder_embed_dim != args.decoder_out_embed_dim:
        raise ValueError(
            f"--share-decoder-input-output-embed requires --decoder-embed-dim ({args.decoder_embed_dim}) "
            f"to match --decoder-out-embed-dim ({args.decoder_out_embed_dim})"
        )


#: the flag each ``RIMCell`` parameter is read from (``rim_layer_kwargs``)
RIM_CELL_FLAGS = {
    "input_size": "--encoder-embed-dim", "num_rims": "--rim-num", "rim_size": "--rim-size",
    "top_k": "--rim-top-k", "cell": "--rim-cell", "input_key_size": "--rim-input-key-size",
    "input_value_size": "--rim-input-value-size", "input_heads": "--rim-input-heads",
    "comm_key_size": "--rim-comm-key-size", "comm_value_size": "--rim-comm-value-size",
    "comm_heads": "--rim-comm-heads", "input_dropout": "--rim-attention-dropout",
    "comm_dropout": "--rim-attention-dropout",
}


def rim_layer_kwargs(args) -> dict:
    """``RIMLayer`` keyword arguments from the ``--rim-*`` flags."""
    return dict(
        num_rims=args.rim_num,
        rim_size=args.rim_size,
        top_k=args.rim_top_k,
        bidirectional=args.rim_bidirectional,
        cell=args.rim_cell,
        input_key_size=args.rim_input_key_size,
        input_value_size=args.rim_input_value_size,
        input_heads=args.rim_input_heads,
        comm_key_size=args.rim_comm_key_size,
        comm_value_size=args.rim_comm_value_size,
        comm_heads=args.rim_comm_heads,
        communication=not args.rim_no_communication,
        input_dropout=args.rim_attention_dropout,
        comm_dropout=args.rim_attention_dropout,
        learned_initial_state=args.rim_learned_initial_state,
        recurrence=args.rim_recurrence,
        compile_recurrence=args.rim_compile,
    )


def final_state_layers(rim_layers: int, decoder_layers: int) -> List[int]:
    """The RIM layer whose final state starts each decoder layer (see the module docstring):
    layer i for equal counts, the top RIM layers for fewer decoder layers, the top one repeated
    for more."""
    if decoder_layers <= rim_layers:
        return list(range(rim_layers - decoder_layers, rim_layers))
    return [min(i, rim_layers - 1) for i in range(decoder_layers)]


# ---------------------------------------------------------------------------- encoder
class RIMEncoder(FairseqEncoder):
    """Embedding, dropout, stacked ``RIMLayer``s; returns ``LSTMEncoder``'s tuple.

    Dropout as in fairseq's ``LSTMEncoder``: ``dropout_in`` on the embeddings, ``dropout_out``
    between layers (``nn.LSTM``'s inter-layer dropout) and on the top layer's outputs.
    """

    def __init__(
        self,
        dictionary,
        embed_tokens: nn.Embedding,
        num_layers: int,
        rim_kwargs: dict,
        dropout_in: float = 0.0,
        dropout_out: float = 0.0,
        decoder_layers: int = 1,
        max_source_positions: float = DEFAULT_MAX_SOURCE_POSITIONS,
    ):
        super().__init__(dictionary)
        self.embed_tokens = embed_tokens
        self.padding_idx = embed_tokens.padding_idx
        self.max_source_positions = max_source_positions
        self.dropout_in_module = FairseqDropout(dropout_in, module_name=self.__class__.__name__)
        self.dropout_out_module = FairseqDropout(dropout_out, module_name=self.__class__.__name__)
        layers = []
        input_size = embed_tokens.embedding_dim
        for _ in range(num_layers):
            layers.append(RIMLayer(input_size, **rim_kwargs))
            input_size = layers[-1].output_size  # layer l > 0 reads the states of layer l - 1
        self.layers = nn.ModuleList(layers)
        self.num_layers = num_layers
        self.output_units = input_size
        self.final_state_layers = final_state_layers(num_layers, decoder_layers)
        # last forward's activation pattern, per layer (T, B, directions, n), False at padding
        self._last_active: List[Optional[Tensor]] = [None] * num_layers

    def forward(self, src_tokens: Tensor, src_lengths: Optional[Tensor] = None, **unused):
        """src_tokens (B, T), left- or right-padded; returns ``LSTMEncoder``'s 4-tuple."""
        padding_mask = src_tokens.eq(self.padding_idx)  # (B, T)
        x = self.dropout_in_module(self.embed_tokens(src_tokens)).transpose(0, 1)  # T x B x E
        hiddens, cells = [], []
        for index, layer in enumerate(self.layers):
            if index > 0:
                x = self.dropout_out_module(x)
            x, final_h, final_c, active = layer(x, padding_mask)
            hiddens.append(final_h)
            cells.append(final_h if final_c is None else final_c)  # GRU: c = h (module docstring)
            self._last_active[index] = active.detach()
        encoder_padding_mask = padding_mask.t()  # T x B
        x = self.dropout_out_module(x)  # RIMLayer's outputs are already zero at padded positions
        final_hiddens = torch.stack([hiddens[i] for i in self.final_state_layers])
        final_cells = torch.stack([cells[i] for i in self.final_state_layers])
        return tuple((x, final_hiddens, final_cells, encoder_padding_mask))

    def reorder_encoder_out(self, encoder_out: Tuple[Tensor, Tensor, Tensor, Tensor], new_order):
        """Batch dimension 1 of every element, as ``LSTMEncoder`` (beam search)."""
        return tuple(t.index_select(1, new_order) for t in encoder_out)

    def max_positions(self):
        return self.max_source_positions

    def rim_activations(self) -> Dict[int, Tensor]:
        """{layer index: (B, T, num_directions, n) bool} of the last forward; False at padding."""
        if self._last_active[0] is None:
            return {}
        return {i: active.transpose(0, 1) for i, active in enumerate(self._last_active)}


# ---------------------------------------------------------------------------- model
@register_model("rim_lstm")
class RIMLSTMModel(PretrainedWithTextPipeline, RecordsDictionaries, LSTMModel):
    """``RIMEncoder`` + fairseq's ``LSTMDecoder`` (see the module docstring), with a fingerprint
    of its dictionaries checked on load (``dictionary_fingerprint.py``) and ``from_pretrained``
    with the data-bin's text pipeline (``hub_interface.py``)."""

    @classmethod
    def add_args(cls, parser):
        # fairseq's LSTM flags: embeddings, decoder, dropouts, sharing, adaptive softmax. Its
        # --encoder-hidden-size / --encoder-layers / --encoder-bidirectional are rejected with
        # the RIM flag to use instead (validate_rim_args).
        LSTMModel.add_args(parser)
        group = parser.add_argument_group("recurrent independent mechanisms (RIMs)")
        # No default= here: fairseq suppresses argparse defaults; the architecture functions
        # below fill them.
        group.add_argument("--rim-num", type=int, metavar="N", help="number of RIMs n per layer and direction")
        group.add_argument("--rim-top-k", type=int, metavar="K",
                           help="k, RIMs active (updated) per time step: those attending least to the null input")
        group.add_argument("--rim-size", type=int, metavar="D", help="hidden size d_r of each RIM")
        group.add_argument("--rim-layers", type=int, metavar="L",
                           help="stacked RIM layers; layer l > 0 reads the states of layer l - 1")
        group.add_argument("--rim-bidirectional", action="store_true",
                           help="a second set of n RIMs reads each layer's input right to left")
        group.add_argument("--rim-cell", type=str, metavar="CELL",
                           help=f"recurrent cell of each RIM: {' or '.join(CELL_TYPES)}")
        group.add_argument("--rim-input-key-size", type=int, metavar="N",
                           help="query/key width of the input attention (all heads together)")
        group.add_argument("--rim-input-value-size", type=int, metavar="N",
                           help="value width of the input attention, i.e. each RIM cell's input size")
        group.add_argument("--rim-input-heads", type=int, metavar="H", help="heads of the input attention")
        group.add_argument("--rim-comm-key-size", type=int, metavar="N",
                           help="query/key width of the communication attention (all heads together)")
        group.add_argument("--rim-comm-value-size", type=int, metavar="N",
                           help="value width of the communication attention (all heads together)")
        group.add_argument("--rim-comm-heads", type=int, metavar="H", help="heads of the communication attention")
        group.add_argument("--rim-no-communication", action="store_true",
                           help="drop the communication attention between RIMs (ablation)")
        group.add_argument("--rim-learned-initial-state", action="store_true",
                           help="learn each RIM's initial state instead of starting from zeros")
        group.add_argument("--rim-attention-dropout", type=finite_float, metavar="D",
                           help="dropout of the input and communication attention weights")
        group.add_argument("--rim-recurrence", choices=RECURRENCES,
                           help="how the time loop runs (LSTM cells): 'fused' is one autograd function with a "
                                "hand-written backward loop, few kernels per step (modules/rim_recurrence.py); "
                                "'stepwise' is a RIMCell step per time step under autograd; 'auto' (default) "
                                "takes 'fused' on a GPU and 'stepwise' on the CPU, where each is faster")
        group.add_argument("--rim-compile", action="store_true",
                           help="torch.compile the fused recurrence's forward and backward step (a few fused "
                                "kernels per step; the first batches compile for minutes); falls back to eager "
                                "with one log line where torch.compile fails")

    @classmethod
    def build_model(cls, args, task):
        rim_base_architecture(args)
        validate_rim_args(args)
        encoder_embed = cls._embedding(args.encoder_embed_path, task.source_dictionary, args.encoder_embed_dim)
        if args.share_all_embeddings:
            if task.source_dictionary != task.target_dictionary:
                raise ValueError("--share-all-embeddings requires a joined dictionary")
            if args.decoder_embed_path and args.decoder_embed_path != args.encoder_embed_path:
                raise ValueError("--share-all-embeddings is not compatible with --decoder-embed-path")
            decoder_embed = encoder_embed
            args.share_decoder_input_output_embed = True
        elif args.decoder_embed_path:
            decoder_embed = cls._embedding(args.decoder_embed_path, task.target_dictionary, args.decoder_embed_dim)
        else:
            decoder_embed = None  # LSTMDecoder builds its own
        if args.encoder_freeze_embed:
            encoder_embed.weight.requires_grad = False
        if args.decoder_freeze_embed and decoder_embed is not None:
            decoder_embed.weight.requires_grad = False

        encoder = RIMEncoder(
            task.source_dictionary,
            encoder_embed,
            num_layers=args.rim_layers,
            rim_kwargs=rim_layer_kwargs(args),
            dropout_in=args.encoder_dropout_in,
            dropout_out=args.encoder_dropout_out,
            decoder_layers=args.decoder_layers,
            max_source_positions=safe_getattr(args, "max_source_positions", DEFAULT_MAX_SOURCE_POSITIONS),
        )
        decoder = LSTMDecoder(
            dictionary=task.target_dictionary,
            embed_dim=args.decoder_embed_dim,
            hidden_size=args.decoder_hidden_size,
            out_embed_dim=args.decoder_out_embed_dim,
            num_layers=args.decoder_layers,
            dropout_in=args.decoder_dropout_in,
            dropout_out=args.decoder_dropout_out,
            attention=utils.eval_bool(args.decoder_attention),
            encoder_output_units=encoder.output_units,
            pretrained_embed=decoder_embed,
            share_input_output_embed=args.share_decoder_input_output_embed,
            adaptive_softmax_cutoff=(
                utils.eval_str_list(args.adaptive_softmax_cutoff, type=int)
                if safe_getattr(args, "criterion", None) == "adaptive_loss"
                else None
            ),
            max_target_positions=safe_getattr(args, "max_target_positions", DEFAULT_MAX_TARGET_POSITIONS),
            residuals=False,
        )
        model = cls(encoder, decoder)
        model.record_data_bin(args, task)
        return model

    @staticmethod
    def _embedding(path, dictionary, dim) -> nn.Embedding:
        """fairseq's LSTM embedding (uniform in [-0.1, 0.1]), optionally loaded from ``path``."""
        embed = Embedding(len(dictionary), dim, dictionary.pad())
        if path:
            embed_dict = utils.parse_embedding(path)
            utils.print_embed_overlap(embed_dict, dictionary)
            embed = utils.load_embedding(embed_dict, dictionary, embed)
        return embed

    def rim_activations(self) -> Dict[int, Tensor]:
        """{encoder layer index: (B, T, num_directions, n) bool}: which RIMs were active at each
        real token in the last forward pass (exactly k per token and direction; none at padding)."""
        return self.encoder.rim_activations()


# ---------------------------------------------------------------------------- architectures
# Each function only fills defaults (safe_getattr keeps what the command line set) and then
# calls the fairseq LSTM architecture with the same decoder and embedding dimensions.


def _fill_rim_defaults(args):
    args.rim_num = safe_getattr(args, "rim_num", 6)
    args.rim_top_k = safe_getattr(args, "rim_top_k", 4)
    args.rim_size = safe_getattr(args, "rim_size", 100)
    args.rim_layers = safe_getattr(args, "rim_layers", 1)
    args.rim_bidirectional = safe_getattr(args, "rim_bidirectional", False)
    args.rim_cell = safe_getattr(args, "rim_cell", "lstm")
    args.rim_input_key_size = safe_getattr(args, "rim_input_key_size", 64)
    args.rim_input_value_size = safe_getattr(args, "rim_input_value_size", 400)
    args.rim_input_heads = safe_getattr(args, "rim_input_heads", 1)
    args.rim_comm_key_size = safe_getattr(args, "rim_comm_key_size", 32)
    args.rim_comm_value_size = safe_getattr(args, "rim_comm_value_size", 32)
    args.rim_comm_heads = safe_getattr(args, "rim_comm_heads", 4)
    args.rim_no_communication = safe_getattr(args, "rim_no_communication", False)
    args.rim_learned_initial_state = safe_getattr(args, "rim_learned_initial_state", False)
    args.rim_attention_dropout = safe_getattr(args, "rim_attention_dropout", 0.1)
    args.rim_recurrence = safe_getattr(args, "rim_recurrence", "auto")
    args.rim_compile = safe_getattr(args, "rim_compile", False)
    # The LSTM-encoder flags a RIM encoder replaces stay None (fairseq's architecture functions
    # keep an attribute that exists), so validate_rim_args can tell that a user set one.
    for dest in REPLACED_ENCODER_FLAGS:
        setattr(args, dest, safe_getattr(args, dest, None))


@register_model_architecture("rim_lstm", "rim_lstm")
def rim_base_architecture(args):
    _fill_rim_defaults(args)
    base_architecture(args)


@register_model_architecture("rim_lstm", "rim_lstm_iwslt_de_en")
def rim_lstm_iwslt_de_en(args):
    _fill_rim_defaults(args)
    lstm_wiseman_iwslt_de_en(args)
