"""The rim_lstm model: named architectures, building through fairseq, padding invariance,
incremental decoding with beam reordering, the activation readout and clear errors.

The RIM cell's own equations are tested in the module's tests; here the model around it:
``RIMEncoder`` returns ``LSTMEncoder``'s tuple and fairseq's ``LSTMDecoder`` runs on it.
"""

import pytest
import torch
from fairseq.models.lstm import LSTMDecoder

import fairseq_modattn  # noqa: F401  (registers rim_lstm)
from fairseq_modattn.models.rim_lstm import RIMEncoder, final_state_layers
from fairseq_modattn.modules.rim import RIMLayer
from tiny_models import model_args

# tiny sizes: n = 6, k = 4 (the architectures' defaults), d_r = 8 -> 48 encoder units
TINY = [
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--decoder-hidden-size", "24",
    "--decoder-out-embed-dim", "16", "--rim-size", "8", "--rim-input-key-size", "8",
    "--rim-input-value-size", "16", "--rim-comm-key-size", "8", "--rim-comm-value-size", "8",
]


@pytest.fixture
def build(tiny_model):
    """build(*flags, arch=..., seed=0) -> (model in eval mode, dictionary of 30 words)."""
    def build(*extra, arch="rim_lstm_iwslt_de_en", seed=0):
        model, d, _, _ = tiny_model(arch, *TINY, *extra, dictionary=30, seed=seed)
        return model.eval(), d

    return build


def left_pad(rows, pad, width=None):
    """Token lists -> (B, T) left-padded to ``width`` (default: the longest), as fairseq collates."""
    width = width or max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, width - len(r):] = torch.tensor(r)
    return out


def sentences(d, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(d.nspecial, len(d), (n - 1,), generator=g).tolist() + [d.eos()] for n in lengths]


# ---------------------------------------------------------------------------- configuration
def test_named_architectures_defaults():
    iwslt = model_args("rim_lstm_iwslt_de_en")
    rim = {k: v for k, v in vars(iwslt).items() if k.startswith("rim_")}
    assert rim == {
        "rim_num": 6, "rim_top_k": 4, "rim_size": 100, "rim_layers": 1, "rim_bidirectional": False,
        "rim_cell": "lstm", "rim_input_key_size": 64, "rim_input_value_size": 400, "rim_input_heads": 1,
        "rim_comm_key_size": 32, "rim_comm_value_size": 32, "rim_comm_heads": 4,
        "rim_no_communication": False, "rim_learned_initial_state": False, "rim_attention_dropout": 0.1,
        "rim_recurrence": "auto", "rim_compile": False,
    }
    # decoder and embeddings as fairseq's lstm_wiseman_iwslt_de_en
    wiseman = model_args("lstm_wiseman_iwslt_de_en")
    for key in ("encoder_embed_dim", "decoder_embed_dim", "decoder_hidden_size", "decoder_out_embed_dim",
                "decoder_layers", "encoder_dropout_in", "encoder_dropout_out", "decoder_dropout_in",
                "decoder_dropout_out", "decoder_attention", "dropout"):
        assert getattr(iwslt, key) == getattr(wiseman, key), key
    assert iwslt.encoder_embed_dim == 256 and iwslt.decoder_hidden_size == 256
    # the LSTM-encoder flags a RIM encoder replaces stay unset
    assert iwslt.encoder_hidden_size is None and iwslt.encoder_layers is None
    base = model_args("rim_lstm")
    assert (base.rim_num, base.rim_top_k, base.rim_size) == (6, 4, 100)
    assert (base.encoder_embed_dim, base.decoder_hidden_size, base.decoder_out_embed_dim) == (512, 512, 512)


def test_command_line_overrides_architecture_defaults():
    args = model_args("rim_lstm_iwslt_de_en", "--rim-num", "8", "--rim-top-k", "3", "--rim-size", "32",
                 "--rim-layers", "2", "--rim-bidirectional", "--rim-cell", "gru", "--rim-input-heads", "2",
                 "--rim-no-communication", "--rim-learned-initial-state", "--rim-attention-dropout", "0.2",
                 "--decoder-hidden-size", "128")
    assert (args.rim_num, args.rim_top_k, args.rim_size, args.rim_layers) == (8, 3, 32, 2)
    assert args.rim_bidirectional and args.rim_no_communication and args.rim_learned_initial_state
    assert (args.rim_cell, args.rim_input_heads, args.rim_attention_dropout) == ("gru", 2, 0.2)
    assert args.decoder_hidden_size == 128


def test_builds_through_fairseq_with_fairseqs_lstm_decoder(build):
    model, _ = build("--rim-layers", "2", "--rim-bidirectional")
    encoder, decoder = model.encoder, model.decoder
    assert isinstance(encoder, RIMEncoder) and type(decoder) is LSTMDecoder
    assert len(encoder.layers) == 2 and all(isinstance(layer, RIMLayer) for layer in encoder.layers)
    assert encoder.output_units == 2 * 6 * 8 == decoder.encoder_output_units
    assert encoder.layers[1].input_size == encoder.layers[0].output_size  # layer 1 reads layer 0
    assert decoder.attention.input_proj.out_features == 96  # attention over the RIM states
    assert decoder.encoder_hidden_proj.in_features == 96  # final states projected to 24


def test_encoder_returns_lstm_encoders_tuple(build):
    model, d = build("--rim-layers", "2", "--decoder-layers", "3")
    src = left_pad(sentences(d, [5, 3]), d.pad())
    out, hiddens, cells, pad = model.encoder(src, torch.tensor([5, 3]))
    assert out.shape == (5, 2, 48) and pad.shape == (5, 2) and pad.dtype == torch.bool
    assert hiddens.shape == cells.shape == (3, 2, 48)  # one row per decoder layer
    assert pad[:, 1].tolist() == [True, True, False, False, False]
    assert out[:2, 1].abs().sum() == 0  # zero at padding
    assert not torch.equal(hiddens[0], hiddens[1]) and torch.equal(hiddens[1], hiddens[2])


@pytest.mark.parametrize("rim_layers, decoder_layers, expected",
                         [(1, 1, [0]), (2, 2, [0, 1]), (3, 1, [2]), (3, 2, [1, 2]), (1, 3, [0, 0, 0]),
                          (2, 4, [0, 1, 1, 1])])
def test_final_state_layers(rim_layers, decoder_layers, expected):
    assert final_state_layers(rim_layers, decoder_layers) == expected


def test_gru_final_cells_are_the_final_hidden_states(build):
    model, d = build("--rim-cell", "gru")
    src = left_pad(sentences(d, [6, 4]), d.pad())
    _, hiddens, cells, _ = model.encoder(src, torch.tensor([6, 4]))
    assert torch.equal(hiddens, cells)
    prev = left_pad(sentences(d, [4, 4], seed=2), d.pad())
    logits, _ = model(src, torch.tensor([6, 4]), prev)
    assert logits.shape == (2, 4, len(d)) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------- padding
@pytest.mark.parametrize("flags", [(), ("--rim-bidirectional", "--rim-layers", "2"), ("--rim-cell", "gru"),
                                   ("--rim-learned-initial-state",)])
def test_extra_left_padding_changes_nothing(flags, build):
    model, d = build(*flags)
    rows = sentences(d, [7, 4, 2])
    prev = left_pad(sentences(d, [5, 5, 5], seed=3), d.pad())
    with torch.no_grad():
        tight = left_pad(rows, d.pad())
        wide = left_pad(rows, d.pad(), width=11)  # 4 more pad columns on the left
        out_t, h_t, c_t, _ = model.encoder(tight, torch.tensor([7, 4, 2]))
        out_w, h_w, c_w, _ = model.encoder(wide, torch.tensor([7, 4, 2]))
        torch.testing.assert_close(out_w[4:], out_t, rtol=1e-5, atol=1e-6)
        assert out_w[:4].abs().sum() == 0
        torch.testing.assert_close(h_w, h_t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c_w, c_t, rtol=1e-5, atol=1e-6)
        logits_t, _ = model(tight, torch.tensor([7, 4, 2]), prev)
        logits_w, _ = model(wide, torch.tensor([7, 4, 2]), prev)
        torch.testing.assert_close(logits_w, logits_t, rtol=1e-5, atol=1e-5)
        # and each sentence alone, without any padding, gives the same
        for i, row in enumerate(rows):
            alone, h_a, _, _ = model.encoder(torch.tensor([row]), torch.tensor([len(row)]))
            torch.testing.assert_close(out_t[-len(row):, i], alone[:, 0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(h_t[:, i], h_a[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags", [("--rim-bidirectional", "--rim-layers", "2"), ("--rim-cell", "gru")])
def test_fused_and_stepwise_recurrences_train_the_same(flags, build):
    """The whole model's loss and every gradient, on a left-padded batch, with either loop."""
    models = {}
    for recurrence in ("fused", "stepwise"):
        model, d = build(*flags, "--rim-recurrence", recurrence)
        models[recurrence] = model.double()
    src = left_pad(sentences(d, [7, 4, 2]), d.pad())
    prev = left_pad(sentences(d, [5, 5, 5], seed=3), d.pad())
    results = {}
    for recurrence, model in models.items():
        assert all(layer.recurrence == recurrence for layer in model.encoder.layers)
        logits, _ = model(src, torch.tensor([7, 4, 2]), prev)
        loss = torch.log_softmax(logits, -1)[..., 4].sum()
        loss.backward()
        results[recurrence] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss_f, grads_f), (loss_s, grads_s) = results["fused"], results["stepwise"]
    torch.testing.assert_close(loss_f, loss_s, rtol=0, atol=1e-12)
    assert grads_f.keys() == grads_s.keys()
    for name in grads_s:
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------- decoding
def test_incremental_decoding_with_reordering_matches_full_forward(build):
    model, d = build("--decoder-layers", "2", "--rim-layers", "2")
    src = left_pad(sentences(d, [6, 3, 5, 4]), d.pad())
    prev = torch.cat([torch.full((4, 1), d.eos()), torch.randint(d.nspecial, len(d), (4, 5))], dim=1)
    new_order = torch.tensor([2, 0, 3, 1])
    with torch.no_grad():
        encoder_out = model.encoder(src, torch.tensor([6, 3, 5, 4]))
        # full forward on the reordered batch
        reordered = model.encoder.reorder_encoder_out(encoder_out, new_order)
        full, _ = model.decoder(prev[new_order], encoder_out=reordered)
        # incremental: two steps in the original order, then reorder state and encoder out
        state = {}
        steps = []
        for t in range(6):
            if t == 2:
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
                steps = [s[new_order] for s in steps]
            tokens = prev if t < 2 else prev[new_order]
            logits, _ = model.decoder(tokens[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            steps.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_beam_search_through_fairseqs_sequence_generator(build):
    from fairseq.sequence_generator import SequenceGenerator

    model, d = build("--rim-bidirectional")
    src = left_pad(sentences(d, [6, 3, 5]), d.pad())
    generator = SequenceGenerator([model], d, beam_size=4, max_len_a=0, max_len_b=6, min_len=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([6, 3, 5])}}
    with torch.no_grad():
        hypos = generator.forward(sample)
    assert len(hypos) == 3 and all(len(h) == 4 for h in hypos)
    for beams in hypos:
        best = beams[0]
        assert best["tokens"].numel() == 7 and best["tokens"][-1] == d.eos()
        assert torch.isfinite(best["positional_scores"]).all()


# ---------------------------------------------------------------------------- activations
@pytest.mark.parametrize("flags, k, directions", [((), 4, 1), (("--rim-top-k", "2", "--rim-bidirectional",
                                                               "--rim-layers", "2"), 2, 2)])
def test_activation_readout_k_per_real_token_none_at_pads(flags, k, directions, build):
    model, d = build(*flags)
    src = left_pad(sentences(d, [6, 2, 4]), d.pad())
    with torch.no_grad():
        model(src, torch.tensor([6, 2, 4]), left_pad(sentences(d, [3, 3, 3], seed=4), d.pad()))
    activations = model.rim_activations()
    assert sorted(activations) == list(range(len(model.encoder.layers)))
    real = src.ne(d.pad())
    for active in activations.values():
        assert active.shape == (3, 6, directions, 6) and active.dtype == torch.bool
        assert not active.requires_grad
        counts = active.sum(-1)  # (B, T, directions)
        assert (counts[real] == k).all()
        assert (counts[~real] == 0).all()


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "flags, message",
    [
        (("--rim-top-k", "7"), r"--rim-top-k \(7\) must be >= 1 and <= --rim-num \(6\)"),
        (("--rim-top-k", "0"), "--rim-top-k"),
        (("--rim-num", "0"), "--rim-num"),
        (("--rim-size", "0"), "--rim-size"),
        (("--rim-layers", "0"), "--rim-layers"),
        (("--rim-cell", "rnn"), "--rim-cell"),
        (("--rim-input-heads", "3"), r"--rim-input-key-size \(8\) must be divisible by --rim-input-heads"),
        (("--rim-input-heads", "2", "--rim-input-value-size", "15"), "--rim-input-value-size"),
        (("--rim-comm-heads", "3"), r"--rim-comm-key-size \(8\) must be divisible by --rim-comm-heads"),
        (("--rim-comm-value-size", "6"), "--rim-comm-value-size"),
        (("--rim-attention-dropout", "1.0"), "--rim-attention-dropout"),
        (("--encoder-hidden-size", "48"), "--encoder-hidden-size"),
        (("--encoder-layers", "2"), "--rim-layers"),
        (("--encoder-bidirectional",), "--rim-bidirectional"),
        (("--share-all-embeddings", "--decoder-embed-dim", "32"), "--share-all-embeddings"),
    ],
)
def test_bad_configuration_names_the_flag(flags, message, build):
    with pytest.raises(ValueError, match=message):
        build(*flags)


def test_no_communication_skips_the_size_checks_it_does_not_need(build):
    model, _ = build("--rim-no-communication", "--rim-comm-heads", "3")
    assert not any(hasattr(cell, "comm_qkv") for layer in model.encoder.layers for cell in layer.cells)
