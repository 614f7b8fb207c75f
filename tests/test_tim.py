"""TIM layers (Lamb et al. 2021, Algorithm 1): a naive reference, the degenerate case that is
fairseq's transformer layer, mechanism separation, competition, padding, incremental decoding,
gradients, parameter counts and configuration errors."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from fairseq import utils
from fairseq.models.transformer import TransformerConfig
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase, TransformerEncoderLayerBase

import fairseq_modattn  # noqa: F401  (registers the architectures)
from attention_helpers import check_incremental_decoding, decode_incrementally
from beam_search_checks import check_beam_shared_keys_are_exact
from fairseq_modattn.models.tim_transformer import (
    TIMTransformerModel,
    matched_ffn_dim,
    standard_layer_params,
    tim_layer_params,
)
from fairseq_modattn.modules import TIMDecoderLayer, TIMEncoderLayer
from fairseq_modattn.modules.tim_layer import InterMechanismAttention
from tiny_models import model_args


def make_cfg(embed=16, heads=4, ffn=32, normalize_before=False):
    cfg = TransformerConfig()
    for side in (cfg.encoder, cfg.decoder):
        side.embed_dim, side.attention_heads, side.ffn_embed_dim = embed, heads, ffn
        side.normalize_before = normalize_before
    cfg.dropout = cfg.attention_dropout = cfg.activation_dropout = 0.0
    cfg.activation_fn = "relu"
    return cfg


def randomise(module, std=0.3, seed=0):
    """Non-trivial values for every parameter (biases and norm affines included)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module.eval()


def padded_batch(length=6, bsz=3, dim=16, seed=1):
    torch.manual_seed(seed)
    x = torch.randn(length, bsz, dim)
    padding = torch.zeros(bsz, length, dtype=torch.bool)
    padding[1, -2:] = True
    padding[2, -1:] = True
    return x, padding


# ----------------------------------------------------------------------------- naive reference
# Algorithm 1 written out with loops over mechanisms, heads and mechanism pairs.
def part(t, j, width):
    return t[..., j * width:(j + 1) * width]


def group_linear(lin, inp, j):
    """Mechanism j's own block of a GroupLinear applied to mechanism j's slice ``inp``."""
    return inp @ lin.weight[j] + lin.bias[j]


def group_norm(norm, t, n, d):
    return torch.cat([F.layer_norm(part(t, j, d), (d,), norm.weight[j], norm.bias[j]) for j in range(n)], -1)


def naive_competition(layer, x, n, d):
    if layer.competition is None:
        return torch.ones(*x.shape[:2], n)
    return torch.softmax(torch.cat([group_linear(layer.competition, part(x, j, d), j) for j in range(n)], -1), -1)


def naive_position_attention(attn, x, n, keys=None, key_padding=None, causal=False):
    """Step 2 for every mechanism: mechanism j's heads read x's slice j (self-attention) or the
    whole ``keys`` through the dense k/v projection rows of its heads (encoder-decoder)."""
    T, B, D = x.shape
    d = D // n
    heads_per_mech = attn.num_heads // n
    dh = d // heads_per_mech
    outs = []
    for j in range(n):
        q = group_linear(attn.q_proj, part(x, j, d), j)
        if keys is None:
            k = group_linear(attn.k_proj, part(x, j, d), j)
            v = group_linear(attn.v_proj, part(x, j, d), j)
        else:  # rows j*d..(j+1)*d of the dense projections produce mechanism j's heads
            k = keys @ part(attn.k_proj.weight.t(), j, d) + part(attn.k_proj.bias, j, d)
            v = keys @ part(attn.v_proj.weight.t(), j, d) + part(attn.v_proj.bias, j, d)
        head_outs = []
        for h in range(heads_per_mech):
            qh, kh, vh = (part(t, h, dh).transpose(0, 1) for t in (q, k, v))  # (B, T|S, dh)
            logits = qh @ kh.transpose(1, 2) / math.sqrt(dh)
            if key_padding is not None:
                logits = logits.masked_fill(key_padding[:, None, :], float("-inf"))
            if causal:
                logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            head_outs.append((torch.softmax(logits, -1) @ vh).transpose(0, 1))
        outs.append(group_linear(attn.out_proj, torch.cat(head_outs, -1), j))
    return outs


def naive_inter_mechanism_attention(ima, h, n, d):
    """Step 3 without residual and norm: Q = GroupLinear(h, W^Q_3, n_s) etc. (mechanism j's own
    block of each weight), H_c heads of d_K units, softmax over the key mechanisms at every
    position, then mechanism i's output projection."""
    hc, dc = ima.num_heads, ima.head_dim
    proj = group_linear

    keys = [proj(ima.k_proj, part(h, j, d), j) for j in range(n)]
    values = [proj(ima.v_proj, part(h, j, d), j) for j in range(n)]
    new = []
    for i in range(n):
        qi = proj(ima.q_proj, part(h, i, d), i)
        head_outs = []
        for a in range(hc):
            scores = torch.stack([(part(qi, a, dc) * part(keys[j], a, dc)).sum(-1) for j in range(n)], -1)
            w = torch.softmax(scores / math.sqrt(dc), dim=-1)
            head_outs.append(sum(w[..., j:j + 1] * part(values[j], a, dc) for j in range(n)))
        new.append(proj(ima.out_proj, torch.cat(head_outs, -1), i))
    return torch.cat(new, -1)


def naive_communication_and_ffn(layer, h, n, d):
    """Steps 3 and 4."""
    if layer.mechanism_attn is not None:
        new = naive_inter_mechanism_attention(layer.mechanism_attn, h, n, d)
        h = group_norm(layer.mechanism_attn_layer_norm, h + new, n, d)
    ffn = [group_linear(layer.fc2, torch.relu(group_linear(layer.fc1, part(h, j, d), j)), j) for j in range(n)]
    return group_norm(layer.final_layer_norm, h + torch.cat(ffn, -1), n, d)


def naive_tim_encoder(layer, x, padding_mask=None):
    """Post-norm TIM encoder layer: h = norm(h + c * M); inter-mechanism attention; FFN."""
    n = layer.num_mechanisms
    d = x.size(-1) // n
    c = naive_competition(layer, x, n, d)
    updates = naive_position_attention(layer.self_attn, x, n, key_padding=padding_mask)
    h = group_norm(layer.self_attn_layer_norm, x + torch.cat([c[..., j:j + 1] * u for j, u in enumerate(updates)], -1),
                   n, d)
    return naive_communication_and_ffn(layer, h, n, d)


def naive_tim_decoder(layer, x, enc, enc_padding, target_padding):
    """Post-norm TIM decoder layer: the layer input's competition scales both attention updates."""
    n = layer.num_mechanisms
    d = x.size(-1) // n
    c = naive_competition(layer, x, n, d)
    updates = naive_position_attention(layer.self_attn, x, n, key_padding=target_padding, causal=True)
    h = group_norm(layer.self_attn_layer_norm, x + torch.cat([c[..., j:j + 1] * u for j, u in enumerate(updates)], -1),
                   n, d)
    updates = naive_position_attention(layer.encoder_attn, h, n, keys=enc, key_padding=enc_padding)
    h = group_norm(layer.encoder_attn_layer_norm,
                   h + torch.cat([c[..., j:j + 1] * u for j, u in enumerate(updates)], -1), n, d)
    return naive_communication_and_ffn(layer, h, n, d)


@pytest.mark.parametrize("competition", [True, False])
@pytest.mark.parametrize("mechanism_attention", [True, False])
@pytest.mark.parametrize("mechanisms, mech_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [32, 3, None])
def test_encoder_layer_equals_naive_algorithm_1(competition, mechanism_attention, mechanisms, mech_heads, head_dim):
    layer = randomise(TIMEncoderLayer(make_cfg(), num_mechanisms=mechanisms, mechanism_attention_heads=mech_heads,
                                      competition=competition, mechanism_attention=mechanism_attention,
                                      ffn_embed_dim=24, mechanism_attention_head_dim=head_dim))
    x, padding = padded_batch()
    with torch.no_grad():
        out = layer(x, padding)
        ref = naive_tim_encoder(layer, x, padding)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("competition, mechanism_attention", [(True, True), (False, False)])
def test_decoder_layer_equals_naive_reference(competition, mechanism_attention):
    layer = randomise(TIMDecoderLayer(make_cfg(), num_mechanisms=2, competition=competition,
                                      mechanism_attention=mechanism_attention))
    y, target_padding = padded_batch(length=5, seed=2)
    enc, source_padding = padded_batch(length=7, seed=3)
    causal = torch.triu(utils.fill_with_neg_inf(torch.zeros(5, 5)), 1)
    with torch.no_grad():
        out, attn, _ = layer(y, enc, source_padding, self_attn_mask=causal, self_attn_padding_mask=target_padding,
                             need_attn=True)
        ref = naive_tim_decoder(layer, y, enc, source_padding, target_padding)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert attn.shape == (3, 5, 7)
    torch.testing.assert_close(attn.sum(-1), torch.ones(3, 5))


# ----------------------------------------------------------------------------- degenerate case
def copy_standard_into_tim(standard, tim):
    """Copy a fairseq layer's weights into a 1-mechanism TIM layer (same parameter names)."""
    source = dict(standard.named_parameters())
    with torch.no_grad():
        for name, p in tim.named_parameters():
            w = source[name]
            if p.shape == w.shape:  # dense k/v of encoder-decoder attention
                p.copy_(w)
            elif w.dim() == 2:  # nn.Linear (out, in) -> GroupLinear (1, in, out)
                p.copy_(w.t().unsqueeze(0))
            else:  # biases and norm affines (D,) -> (1, D)
                p.copy_(w.unsqueeze(0))
    assert set(source) == {name for name, _ in tim.named_parameters()}


@pytest.mark.parametrize("normalize_before", [False, True])
def test_one_mechanism_encoder_layer_is_fairseq_encoder_layer(normalize_before):
    cfg = make_cfg(normalize_before=normalize_before)
    standard = randomise(TransformerEncoderLayerBase(cfg))
    tim = TIMEncoderLayer(cfg, num_mechanisms=1, competition=False, mechanism_attention=False).eval()
    copy_standard_into_tim(standard, tim)
    x, padding = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(tim(x, padding), standard(x, padding), rtol=1e-5, atol=1e-5)
    # return_fc: (x, FFN output before dropout), as fairseq
    standard.return_fc = tim.return_fc = True
    with torch.no_grad():
        for a, b in zip(tim(x, padding), standard(x, padding)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize_before", [False, True])
def test_one_mechanism_decoder_layer_is_fairseq_decoder_layer(normalize_before):
    cfg = make_cfg(normalize_before=normalize_before)
    standard = randomise(TransformerDecoderLayerBase(cfg))
    tim = TIMDecoderLayer(cfg, num_mechanisms=1, competition=False, mechanism_attention=False).eval()
    copy_standard_into_tim(standard, tim)
    y, target_padding = padded_batch(length=5, seed=2)
    enc, source_padding = padded_batch(length=7, seed=3)
    causal = torch.triu(utils.fill_with_neg_inf(torch.zeros(5, 5)), 1)
    kwargs = dict(encoder_padding_mask=source_padding, self_attn_mask=causal, self_attn_padding_mask=target_padding)
    with torch.no_grad():
        for need in (dict(need_attn=True), dict(need_head_weights=True), dict()):
            out, attn, _ = tim(y, enc, **kwargs, **need)
            ref, ref_attn, _ = standard(y, enc, **kwargs, **need)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            # in eval mode both return the weights unless make_generation_fast_ turned them off
            assert ref_attn is not None and attn.shape == ref_attn.shape
            torch.testing.assert_close(attn, ref_attn, rtol=1e-5, atol=1e-5)
    tim.make_generation_fast_()
    standard.make_generation_fast_()
    with torch.no_grad():
        assert tim(y, enc, **kwargs)[1] is None and standard(y, enc, **kwargs)[1] is None


# ----------------------------------------------------------------------------- step 3 per mechanism
def make_inter(n=3, d=8, heads=2, head_dim=5, seed=0):
    ima = InterMechanismAttention(d, heads, num_mechanisms=n, head_dim=head_dim)
    return randomise(ima, seed=seed)


def test_inter_mechanism_projections_are_per_mechanism_group_linear_blocks():
    n, d, heads, head_dim = 3, 8, 2, 5
    ima = make_inter(n, d, heads, head_dim)
    W = heads * head_dim
    shapes = {name: tuple(p.shape) for name, p in ima.named_parameters()}
    assert shapes == {
        "q_proj.weight": (n, d, W), "q_proj.bias": (n, W),
        "k_proj.weight": (n, d, W), "k_proj.bias": (n, W),
        "v_proj.weight": (n, d, W), "v_proj.bias": (n, W),
        "out_proj.weight": (n, W, d), "out_proj.bias": (n, d),
    }
    # the paper's default width: 2 heads of 32 units whatever d_m
    layer = TIMEncoderLayer(make_cfg(), num_mechanisms=2)
    assert (layer.mechanism_attn.num_heads, layer.mechanism_attn.head_dim) == (2, 32)
    assert layer.mechanism_attn.q_proj.weight.shape == (2, 8, 64)
    assert layer.mechanism_attn.out_proj.weight.shape == (2, 64, 8)


def test_changing_mechanism_1s_query_weights_changes_only_mechanism_1s_query():
    """Mechanism i's output reads q_i and out_i (its own blocks) and every mechanism's k_j, v_j:
    changing mechanism 1's query or output weights leaves mechanism 0's output exactly unchanged,
    while changing mechanism 1's key or value weights reaches mechanism 0 through the attention."""
    n, d = 3, 8
    ima = make_inter(n, d)
    torch.manual_seed(3)
    x = torch.randn(4, 2, n * d)
    with torch.no_grad():
        base = ima(x)
        for proj, reaches_0 in (("q_proj", False), ("out_proj", False), ("k_proj", True), ("v_proj", True)):
            changed = make_inter(n, d)
            getattr(changed, proj).weight[1].add_(torch.randn_like(getattr(changed, proj).weight[1]))
            out = changed(x)
            assert not torch.allclose(part(out, 1, d), part(base, 1, d), atol=1e-3), proj
            delta0 = (part(out, 0, d) - part(base, 0, d)).abs().max().item()
            delta2 = (part(out, 2, d) - part(base, 2, d)).abs().max().item()
            if reaches_0:
                assert delta0 > 1e-3 and delta2 > 1e-3, proj
            else:
                assert delta0 == 0.0 and delta2 == 0.0, (proj, delta0, delta2)
        # the query itself: mechanism 0's is a function of its slice and its own block only
        q = torch.baddbmm(ima.q_proj.bias.unsqueeze(1), x.reshape(-1, n, d).transpose(0, 1), ima.q_proj.weight)
        changed = make_inter(n, d)
        changed.q_proj.weight[1].mul_(2.0)
        q2 = torch.baddbmm(changed.q_proj.bias.unsqueeze(1), x.reshape(-1, n, d).transpose(0, 1), changed.q_proj.weight)
        assert torch.equal(q[0], q2[0]) and not torch.equal(q[1], q2[1])


@pytest.mark.parametrize("n, heads, head_dim", [(2, 2, 32), (3, 2, 5), (4, 3, 4), (2, 1, 8)])
def test_inter_mechanism_attention_equals_naive_step_3_in_double(n, heads, head_dim):
    d = 8
    ima = make_inter(n, d, heads, head_dim).double()
    torch.manual_seed(5)
    x = torch.randn(5, 3, n * d, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(ima(x), naive_inter_mechanism_attention(ima, x, n, d), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("competition", [True, False])
@pytest.mark.parametrize("mechanisms, heads, head_dim", [(2, 2, 32), (4, 2, 3)])
def test_whole_encoder_layer_equals_naive_algorithm_1_in_double(competition, mechanisms, heads, head_dim):
    layer = randomise(TIMEncoderLayer(make_cfg(), num_mechanisms=mechanisms, mechanism_attention_heads=heads,
                                      mechanism_attention_head_dim=head_dim, competition=competition,
                                      ffn_embed_dim=24)).double()
    x, padding = padded_batch()
    x = x.double()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, padding), naive_tim_encoder(layer, x, padding), rtol=1e-11, atol=1e-11)


def test_inter_mechanism_attention_configuration_errors():
    with pytest.raises(ValueError, match=r"num_heads \(3\) must divide the mechanism width d_m = mechanism_dim"):
        InterMechanismAttention(8, 3, num_mechanisms=2, head_dim=None)
    InterMechanismAttention(8, 3, num_mechanisms=2, head_dim=32)  # d_K need not divide d_m


# ----------------------------------------------------------------------------- mechanisms
def perturb_mechanism(x, j, d):
    y = x.clone()
    y[..., j * d:(j + 1) * d] += torch.randn_like(y[..., j * d:(j + 1) * d])
    return y


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
@pytest.mark.parametrize("competition, mechanism_attention", [(False, False), (True, False), (False, True)])
def test_mechanisms_are_independent_without_competition_and_communication(kind, competition, mechanism_attention):
    n, d = 4, 4
    cfg = make_cfg(embed=16, heads=4)
    kwargs = dict(num_mechanisms=n, competition=competition, mechanism_attention=mechanism_attention,
                  mechanism_attention_heads=2)
    layer = randomise(TIMEncoderLayer(cfg, **kwargs) if kind == "encoder" else TIMDecoderLayer(cfg, **kwargs))
    x, padding = padded_batch()
    enc, source_padding = padded_batch(length=7, seed=3)

    def run(inp):
        with torch.no_grad():
            if kind == "encoder":
                return layer(inp, padding)
            return layer(inp, enc, source_padding, self_attn_padding_mask=padding)[0]

    base = run(x)
    j = 1
    changed = run(perturb_mechanism(x, j, d))
    for i in range(n):
        delta = (changed[..., i * d:(i + 1) * d] - base[..., i * d:(i + 1) * d]).abs().max().item()
        if i == j:
            assert delta > 1e-2
        elif competition or mechanism_attention:
            assert delta > 1e-4, f"mechanism {i} should hear about mechanism {j}"
        else:
            assert delta < 1e-6, f"mechanism {i} changed by {delta}"


def test_competition_is_a_distribution_and_readable():
    layer = randomise(TIMEncoderLayer(make_cfg(), num_mechanisms=4, mechanism_attention_heads=2))
    x, padding = padded_batch()
    assert layer.last_competition is None
    layer(x.requires_grad_(), padding)
    c = layer.last_competition
    assert c.shape == (3, 6, 4) and not c.requires_grad
    torch.testing.assert_close(c.sum(-1), torch.ones(3, 6))
    assert (c > 0).all() and c.std() > 1e-3  # not uniform: the scores depend on the input
    off = TIMEncoderLayer(make_cfg(), num_mechanisms=4, competition=False).eval()
    off(x, padding)
    assert off.last_competition is None


def test_competition_scales_the_attention_update():
    """Doubling the competition logits' scale changes the output; no competition differs too."""
    layer = randomise(TIMEncoderLayer(make_cfg(), num_mechanisms=2))
    x, padding = padded_batch()
    with torch.no_grad():
        out = layer(x, padding)
        layer.competition.weight.mul_(3.0)
        assert not torch.allclose(layer(x, padding), out, atol=1e-4)


# ----------------------------------------------------------------------------- padding, gradients
def test_encoder_and_decoder_layers_are_padding_invariant():
    cfg = make_cfg()
    enc_layer = randomise(TIMEncoderLayer(cfg, num_mechanisms=2))
    dec_layer = randomise(TIMDecoderLayer(cfg, num_mechanisms=2), seed=4)
    x, padding = padded_batch()
    extra = torch.randn(3, 3, 16) * 5  # garbage in three more padded positions
    x_more = torch.cat([x, extra], 0)
    padding_more = torch.cat([padding, torch.ones(3, 3, dtype=torch.bool)], 1)
    real = ~padding.t()  # (T, B)
    with torch.no_grad():
        a, b = enc_layer(x, padding), enc_layer(x_more, padding_more)[:6]
        torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-5)
        y, y_padding = padded_batch(length=4, seed=5)
        d1, w1, _ = dec_layer(y, x, padding, self_attn_padding_mask=y_padding, need_attn=True)
        d2, w2, _ = dec_layer(y, x_more, padding_more, self_attn_padding_mask=y_padding, need_attn=True)
        torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w1, w2[..., :6], rtol=1e-5, atol=1e-6)
        assert w2[..., 6:].abs().max() == 0


def test_gradcheck_tiny_layers_in_double():
    from torch.func import functional_call

    cfg = make_cfg(embed=4, heads=2, ffn=4)
    layer = randomise(TIMEncoderLayer(cfg, num_mechanisms=2, mechanism_attention_heads=2,
                                      mechanism_attention_head_dim=3)).double()
    names = [name for name, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in layer.parameters())
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, dtype=torch.double, requires_grad=True)
    padding = torch.tensor([[False, False, False], [False, False, True]])

    def encoder(x, *params):
        return functional_call(layer, dict(zip(names, params)), (x, padding))

    assert torch.autograd.gradcheck(encoder, (x, *params))

    decoder = randomise(TIMDecoderLayer(cfg, num_mechanisms=2, mechanism_attention_heads=2,
                                        mechanism_attention_head_dim=3)).double()
    y = torch.randn(2, 2, 4, dtype=torch.double, requires_grad=True)
    causal = torch.triu(utils.fill_with_neg_inf(torch.zeros(2, 2, dtype=torch.double)), 1)
    assert torch.autograd.gradcheck(
        lambda y, enc: decoder(y, enc, padding, self_attn_mask=causal)[0], (y, x))


# ----------------------------------------------------------------------------- model level
TINY = ["--encoder-layers", "4", "--decoder-layers", "2", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "4",
        "--decoder-attention-heads", "4", "--dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture
def build(tiny_model):
    """build(*flags, arch=..., seed=0) -> (model, dictionary of 20 words) of a TINY model."""
    return lambda *extra, arch="tim_transformer", seed=0: tiny_model(arch, *TINY, *extra, seed=seed)[:2]


def test_model_places_tim_layers_where_asked(build):
    model, _ = build("--tim-decoder-layers", "1")
    kinds = [type(layer).__name__ for layer in model.encoder.layers]
    assert kinds == ["TransformerEncoderLayerBase"] * 2 + ["TIMEncoderLayer", "TransformerEncoderLayerBase"]
    assert [type(layer).__name__ for layer in model.decoder.layers] == ["TransformerDecoderLayerBase",
                                                                        "TIMDecoderLayer"]
    model, _ = build("--tim-encoder-layers", "0,3", "--tim-decoder-layers", "none", "--tim-mechanisms", "4",
                     "--tim-mechanism-attention-heads", "1", "--tim-no-competition")
    assert [isinstance(layer, TIMEncoderLayer) for layer in model.encoder.layers] == [True, False, False, True]
    layer = model.encoder.layers[0]
    assert layer.num_mechanisms == 4 and layer.competition is None and layer.mechanism_attn.num_heads == 1
    assert not any(isinstance(layer, TIMDecoderLayer) for layer in model.decoder.layers)


def test_model_competition_is_reported_per_layer_after_forward(build):
    model, vocab = build("--tim-decoder-layers", "auto", "--decoder-layers", "4")
    model.eval()
    src = torch.randint(4, len(vocab), (2, 5))
    prev = torch.randint(4, len(vocab), (2, 4))
    model(src, torch.tensor([5, 5]), prev)
    comp = model.competition()
    assert sorted(comp) == ["decoder.layers.2", "encoder.layers.2"]
    assert comp["encoder.layers.2"].shape == (2, 5, 2) and comp["decoder.layers.2"].shape == (2, 4, 2)
    # the model's own state dict round-trips (fairseq's upgrade_state_dict visits every layer)
    model.load_state_dict(model.state_dict())


@pytest.mark.parametrize("normalize_before", [False, True])
def test_incremental_decoding_with_tim_decoder_layers_matches_full_forward(normalize_before, build):
    extra = ["--encoder-normalize-before", "--decoder-normalize-before"] if normalize_before else []
    # decoder: standard layer 0, TIM layer 1 (the last layer, so the alignment comes from TIM)
    model, vocab = build("--tim-decoder-layers", "1", *extra)
    model.eval()
    assert isinstance(model.decoder.layers[1], TIMDecoderLayer)
    run = check_incremental_decoding(model, vocab)  # the alignment comes from the TIM layer
    # without the reorder the later steps differ (the test can fail)
    with torch.no_grad():
        unordered, _ = decode_incrementally(model, run.encoder_out, run.prev_ref, run.prev, run.t0, torch.arange(4))
    assert not torch.allclose(unordered[-1], run.full[:, -1:], atol=1e-4)


def test_model_outputs_ignore_extra_source_padding(build):
    model, vocab = build("--tim-decoder-layers", "1")
    model.eval()
    torch.manual_seed(2)
    src = torch.randint(4, len(vocab), (2, 5))
    src[1, :1] = vocab.pad()
    more = torch.cat([torch.full((2, 3), vocab.pad()), src], 1)  # three more left pads
    prev = torch.randint(4, len(vocab), (2, 4))
    with torch.no_grad():
        a, _ = model(src, torch.tensor([5, 4]), prev)
        b, _ = model(more, torch.tensor([5, 4]), prev)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- parameter counts
def count(module):
    return sum(p.numel() for p in module.parameters())


def test_parameter_count_of_tim_transformer_iwslt_de_en_by_hand(tiny_model):
    model, vocab, _, _ = tiny_model("tim_transformer_iwslt_de_en", dictionary=100)
    V = len(vocab)  # 100 symbols + bos, pad, eos, unk
    assert V == 104
    D, F_, n, d = 512, 1024, 2, 256
    embeddings = 3 * V * D  # encoder, decoder input, decoder output projection (not shared)
    attention = 4 * (D * D + D)  # q, k, v, out
    norm = 2 * D
    ffn = (D * F_ + F_) + (F_ * D + D)
    standard_encoder = attention + norm + ffn + norm  # 2,102,784
    standard_decoder = attention + norm + attention + norm + ffn + norm  # 3,154,432
    W = 2 * 32  # inter-mechanism attention: H_c = 2 heads of d_K = 32 units (the paper)
    tim_encoder = (
        4 * (n * d * d + D)  # grouped q, k, v, out: n blocks of d x d
        + norm
        + (n * d * 1 + n)  # competition GroupLinear(n, d, 1)
        + 3 * (n * d * W + n * W) + (n * W * d + D)  # inter-mechanism q, k, v: GroupLinear(n, d, W); out (n, W, d)
        + norm
        + (n * d * (F_ // n) + F_) + (n * (F_ // n) * d + D)  # grouped FFN
        + norm
    )  # 1,187,714
    assert (standard_encoder, standard_decoder, tim_encoder) == (2_102_784, 3_154_432, 1_187_714)
    # encoder layers 2, 3, 4 are TIM ('auto'); the decoder is standard
    expected = embeddings + 3 * standard_encoder + 3 * tim_encoder + 6 * standard_decoder
    assert count(model) == expected == 28_957_830


@pytest.mark.parametrize("arch, baseline, tim_ffn, counts", [
    ("tim_transformer_iwslt_de_en_matched", "transformer_iwslt_de_en", 2808, (31_703_406, 31_703_040)),
    ("tim_transformer_wmt_en_de_matched", "transformer_wmt_en_de", 4854, (44_298_600, 44_298_240)),
])
def test_matched_presets_have_the_transformers_parameter_count(arch, baseline, tim_ffn, counts, tiny_model):
    matched, reference = (tiny_model(name, dictionary=100).model for name in (arch, baseline))
    assert all(layer.ffn_embed_dim == tim_ffn for layer in matched.tim_layers().values())
    assert (count(matched), count(reference)) == counts  # the numbers in models/tim_transformer.py
    assert abs(count(matched) - count(reference)) / count(reference) < 0.005
    # in fact per layer within one FFN block of the standard layer
    for name, layer in matched.tim_layers().items():
        standard = count(reference.get_submodule(name))
        assert abs(count(layer) - standard) <= 2 * 256 + 1
    # and the unmatched preset is clearly smaller (the test can fail)
    plain = tiny_model(arch.replace("_matched", ""), dictionary=100).model
    assert count(plain) < 0.95 * count(reference)


@pytest.mark.parametrize("competition", [True, False])
@pytest.mark.parametrize("mechanism_attention", [True, False])
@pytest.mark.parametrize("head_dim", [32, 3, 0])
def test_parameter_formulas_match_built_layers(competition, mechanism_attention, head_dim, build):
    flags = (["--tim-no-competition"] if not competition else []) + (
        ["--tim-no-mechanism-attention"] if not mechanism_attention else [])
    model, _ = build("--tim-encoder-layers", "all", "--tim-decoder-layers", "all", "--tim-mechanisms", "4",
                     "--tim-mechanism-attention-heads", "2", "--tim-ffn-embed-dim", "48",
                     "--tim-mechanism-attention-head-dim", str(head_dim),
                     "--decoder-embed-dim", "32", "--decoder-attention-heads", "8", *flags)
    inter = dict(mechanism_attention_heads=2, mechanism_attention_head_dim=head_dim)
    enc, dec = model.encoder.layers[0], model.decoder.layers[0]
    if mechanism_attention:
        assert enc.mechanism_attn.head_dim == (head_dim or 16 // 4 // 2)
    assert count(enc) == tim_layer_params(16, 48, 4, competition, mechanism_attention, **inter)
    assert count(dec) == tim_layer_params(32, 48, 4, competition, mechanism_attention, decoder=True, encoder_dim=16,
                                          **inter)
    plain, _ = build(arch="transformer", seed=0)
    assert count(plain.encoder.layers[0]) == standard_layer_params(16, 32)
    assert count(plain.decoder.layers[0]) == standard_layer_params(16, 32, decoder=True)
    ffn = matched_ffn_dim(16, 32, 4, competition, mechanism_attention, **inter)
    assert ffn % 4 == 0
    best = min(range(4, 400, 4), key=lambda f: abs(tim_layer_params(16, f, 4, competition, mechanism_attention,
                                                                     **inter) - standard_layer_params(16, 32)))
    assert ffn == best
    # and --tim-match-params builds that width with these inter-mechanism settings
    matched, _ = build("--tim-encoder-layers", "all", "--tim-mechanisms", "4", "--tim-mechanism-attention-heads", "2",
                       "--tim-mechanism-attention-head-dim", str(head_dim), "--tim-match-params", *flags)
    assert matched.encoder.layers[0].ffn_embed_dim == ffn


# ----------------------------------------------------------------------------- configuration
def test_architecture_defaults_and_overrides():
    args = model_args("tim_transformer_iwslt_de_en")
    assert (args.tim_mechanisms, args.tim_encoder_layers, args.tim_decoder_layers) == (2, "auto", "none")
    assert (args.tim_mechanism_attention_heads, args.tim_no_competition, args.tim_no_mechanism_attention) == (
        2, False, False)
    assert args.tim_mechanism_attention_head_dim == 32
    assert args.tim_ffn_embed_dim is None and args.tim_match_params is False
    assert (args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_attention_heads) == (512, 1024, 4)
    assert model_args("tim_transformer_wmt_en_de_matched").tim_match_params is True
    args = model_args("tim_transformer", "--tim-mechanisms", "4", "--tim-encoder-layers", "1,2", "--tim-no-competition")
    assert (args.tim_mechanisms, args.tim_encoder_layers, args.tim_no_competition) == (4, "1,2", True)


def test_every_tim_flag_has_help_text():
    parser = argparse.ArgumentParser()
    TIMTransformerModel.add_args(parser)
    flags = [a for a in parser._actions if any(s.startswith("--tim-") for s in a.option_strings)]
    assert len(flags) == 9
    assert all(a.help for a in flags)
    assert all(a.default in (None, False) for a in flags)  # defaults come from the architectures


@pytest.mark.parametrize("flags, message", [
    (("--tim-mechanisms", "0"), "--tim-mechanisms"),
    (("--tim-mechanisms", "3"), "--encoder-embed-dim"),
    (("--tim-mechanisms", "8"), "--encoder-attention-heads"),
    (("--tim-decoder-layers", "0", "--decoder-attention-heads", "2", "--tim-mechanisms", "4"),
     "--decoder-attention-heads"),
    (("--tim-mechanism-attention-heads", "0"), "--tim-mechanism-attention-heads"),
    (("--tim-mechanism-attention-heads", "3", "--tim-mechanism-attention-head-dim", "0"),
     "--tim-mechanism-attention-heads"),
    (("--tim-mechanism-attention-head-dim", "-1"), "--tim-mechanism-attention-head-dim"),
    (("--tim-ffn-embed-dim", "33"), "--tim-ffn-embed-dim"),
    (("--tim-encoder-layers", "4"), "--tim-encoder-layers"),
    (("--tim-encoder-layers", "1,x"), "--tim-encoder-layers"),
    (("--tim-decoder-layers", "2"), "--tim-decoder-layers"),
    (("--tim-match-params", "--tim-ffn-embed-dim", "64"), "--tim-match-params"),
])
def test_bad_configuration_names_the_flag(flags, message, build):
    with pytest.raises(ValueError, match=message):
        build(*flags)


def test_beam_search_shares_encoder_keys_among_beams_exactly(build):
    model, vocab = build("--tim-decoder-layers", "auto", "--decoder-layers", "4")
    check_beam_shared_keys_are_exact(model, vocab)
