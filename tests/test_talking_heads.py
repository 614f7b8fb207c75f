"""Talking-heads attention: the paper's equations against a naive per-head reference, the
identity case against fairseq's MultiheadAttention, masking after the logits projection,
incremental decoding with beam reordering, gradients, the model family and its errors."""

import pytest
import torch
from fairseq.models.transformer import TransformerModel
from fairseq.modules import MultiheadAttention

import fairseq_modattn  # noqa: F401  (registers the plugin)
from attention_helpers import causal_mask, check_incremental_decoding, padding, randomise_biases
from beam_search_checks import check_beam_shared_keys_are_exact
from fairseq_modattn.models.talking_heads_transformer import TalkingHeadsTransformerModel
from fairseq_modattn.modules import TalkingHeadsAttention
from tiny_models import model_args

EMBED = 24  # divisible by 2, 3, 4 and 6: h_k, h and h_v can all differ


def make_th(seed=0, heads=3, key_heads=2, value_heads=4, dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    m = TalkingHeadsAttention(EMBED, heads, key_heads=key_heads, value_heads=value_heads, **kwargs)
    with torch.no_grad():  # non-trivial biases and head projections
        randomise_biases(m)
        for p in (m.logits_proj, m.weights_proj):
            if p is not None:
                p.normal_(0, 0.7)
    return m.to(dtype)


def naive_talking_heads(m, query, key, value, key_padding_mask=None, attn_mask=None):
    """Shazeer et al. (2020), appendix A, one head and one output position at a time."""
    tgt_len, bsz, _ = query.shape
    src_len = key.size(0)
    dk, dv = EMBED // m.key_heads, EMBED // m.value_heads
    q = torch.nn.functional.linear(query, m.q_proj.weight, m.q_proj.bias)
    k = torch.nn.functional.linear(key, m.k_proj.weight, m.k_proj.bias)
    v = torch.nn.functional.linear(value, m.v_proj.weight, m.v_proj.bias)
    p_l = m.logits_proj if m.logits_proj is not None else torch.eye(m.key_heads, m.num_heads)
    p_w = m.weights_proj if m.weights_proj is not None else torch.eye(m.num_heads, m.value_heads)
    out = torch.zeros(tgt_len, bsz, EMBED, dtype=query.dtype)
    weights = torch.zeros(bsz, m.num_heads, tgt_len, src_len, dtype=query.dtype)
    for b in range(bsz):
        J = [q[:, b, a * dk:(a + 1) * dk] @ k[:, b, a * dk:(a + 1) * dk].T / dk ** 0.5 for a in range(m.key_heads)]
        W = []
        for h in range(m.num_heads):
            logits = sum(J[a] * p_l[a, h] for a in range(m.key_heads))
            if attn_mask is not None:
                logits = logits + attn_mask
            if key_padding_mask is not None:
                logits = logits.masked_fill(key_padding_mask[b].view(1, -1), float("-inf"))
            W.append(torch.softmax(logits, dim=-1))
            weights[b, h] = W[h]
        for c in range(m.value_heads):
            U = sum(W[h] * p_w[h, c] for h in range(m.num_heads))
            out[:, b, c * dv:(c + 1) * dv] = U @ v[:, b, c * dv:(c + 1) * dv]
    return torch.nn.functional.linear(out, m.out_proj.weight, m.out_proj.bias), weights


# ----------------------------------------------------------------------------- equations
@pytest.mark.parametrize("heads", [(2, 3, 4), (6, 2, 3), (4, 4, 4)])
@pytest.mark.parametrize("projections", [(True, True), (True, False), (False, True)])
def test_self_attention_matches_naive_reference(heads, projections):
    key_heads, num_heads, value_heads = heads
    project_logits, project_weights = projections
    if not project_logits:
        key_heads = num_heads
    if not project_weights:
        value_heads = num_heads
    m = make_th(1, num_heads, key_heads, value_heads, self_attention=True,
                project_logits=project_logits, project_weights=project_weights).eval()
    x = torch.randn(5, 3, EMBED)
    kpm = padding([5, 3, 4], 5)
    for attn_mask in (None, causal_mask(5)):
        ref_out, ref_w = naive_talking_heads(m, x, x, x, kpm, attn_mask)
        out, w = m(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_head_weights=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.transpose(0, 1), ref_w, rtol=1e-5, atol=1e-6)
        fast, none = m(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
        assert none is None
        torch.testing.assert_close(fast, ref_out, rtol=1e-5, atol=1e-5)


def test_encoder_decoder_attention_matches_naive_reference():
    m = make_th(2, 3, 2, 4, encoder_decoder_attention=True, kdim=EMBED, vdim=EMBED).eval()
    y, enc = torch.randn(4, 2, EMBED), torch.randn(6, 2, EMBED)
    kpm = padding([6, 2], 6)
    ref_out, ref_w = naive_talking_heads(m, y, enc, enc, kpm)
    out, w = m(y, enc, enc, key_padding_mask=kpm, static_kv=True, need_head_weights=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.transpose(0, 1), ref_w, rtol=1e-5, atol=1e-6)


def test_masks_are_applied_after_the_logits_projection():
    """A padded key gets weight exactly 0 in every softmax head although the logits
    projection mixes all key heads, and nothing becomes NaN; masking J before mixing would
    spread -inf (or, with negative mixing entries, +inf) across heads."""
    m = make_th(3, 3, 2, 4, self_attention=True).eval()
    with torch.no_grad():
        m.logits_proj.copy_(torch.tensor([[1.0, -0.5, 2.0], [0.3, 1.0, -1.0]]))
    x = torch.randn(4, 2, EMBED)
    kpm = padding([4, 2], 4)
    out, w = m(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(4), need_head_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    assert (w[:, 1, :, 2:] == 0).all()  # padded keys of sentence 1
    assert (w.triu(1) == 0).all()  # future keys
    torch.testing.assert_close(w.sum(-1), torch.ones_like(w.sum(-1)))


def test_heads_talk():
    """With a non-diagonal logits projection each softmax head depends on every key head."""
    m = make_th(4, 2, 2, 2, self_attention=True).eval()
    x = torch.randn(4, 1, EMBED)
    _, w = m(x, x, x, need_head_weights=True)
    with torch.no_grad():  # change only key head 1's query weights
        m.q_proj.weight[EMBED // 2:] += 0.5
    _, w2 = m(x, x, x, need_head_weights=True)
    assert not torch.allclose(w[0], w2[0], atol=1e-4)  # softmax head 0 hears key head 1
    with torch.no_grad():
        m.logits_proj.copy_(torch.eye(2))
    _, w3 = m(x, x, x, need_head_weights=True)
    with torch.no_grad():
        m.q_proj.weight[EMBED // 2:] -= 0.5
    _, w4 = m(x, x, x, need_head_weights=True)
    torch.testing.assert_close(w3[0], w4[0])  # ...and not with the identity


def test_identity_initialisation():
    m = TalkingHeadsAttention(EMBED, 4, key_heads=2, value_heads=6, self_attention=True)
    torch.testing.assert_close(m.logits_proj.data, torch.eye(2, 4))
    torch.testing.assert_close(m.weights_proj.data, torch.eye(4, 6))


# ----------------------------------------------------------------------------- identity = fairseq
def fairseq_twin(th, **kwargs):
    ref = MultiheadAttention(EMBED, th.num_heads, dropout=0.0, **kwargs)
    missing, unexpected = th.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and sorted(missing) == ["logits_proj", "weights_proj"]
    return ref.eval()


@pytest.mark.parametrize("kind", ["self", "enc_dec"])
def test_identity_projections_equal_fairseq_multihead_attention(kind):
    th = make_th(5, 4, 4, 4, **({"self_attention": True} if kind == "self" else
                                {"encoder_decoder_attention": True, "kdim": EMBED, "vdim": EMBED})).eval()
    with torch.no_grad():
        th.logits_proj.copy_(torch.eye(4))
        th.weights_proj.copy_(torch.eye(4))
    ref = fairseq_twin(th, **({"self_attention": True} if kind == "self" else
                              {"kdim": EMBED, "vdim": EMBED, "encoder_decoder_attention": True}))
    y = torch.randn(5, 3, EMBED)
    kv = y if kind == "self" else torch.randn(7, 3, EMBED)
    kpm = padding([kv.size(0), 3, 4], kv.size(0))
    masks = (None, causal_mask(5)) if kind == "self" else (None,)
    for attn_mask in masks:
        kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask, static_kv=kind != "self")
        out_ref, w_ref = ref(y, kv, kv, need_weights=True, **kwargs)
        out, w = th(y, kv, kv, need_weights=True, **kwargs)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)
    # and step by step, against fairseq's own incremental path
    inc_ref, inc = {}, {}
    for t in range(5):
        step = y[t:t + 1]
        kv_t = step if kind == "self" else kv
        o_ref, _ = ref(step, kv_t, kv_t, incremental_state=inc_ref, static_kv=kind != "self",
                       key_padding_mask=None if kind == "self" else kpm)
        o, _ = th(step, kv_t, kv_t, incremental_state=inc, static_kv=kind != "self",
                  key_padding_mask=None if kind == "self" else kpm)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5, msg=f"step {t}")


# ----------------------------------------------------------------------------- incremental decoding
def test_self_attention_incremental_with_reorder():
    m = make_th(6, 3, 2, 4, self_attention=True).eval()
    bsz, steps, t0 = 4, 6, 2
    x = torch.randn(steps, bsz, EMBED)
    new_order = torch.tensor([2, 0, 3, 2])
    x_ref = x.clone()
    x_ref[: t0 + 1] = x[: t0 + 1, new_order]
    full, full_w = m(x_ref, x_ref, x_ref, attn_mask=causal_mask(steps), need_head_weights=True)
    inc = {}
    for t in range(steps):
        step = x_ref[t:t + 1] if t > t0 else x[t:t + 1]
        o, w = m(step, step, step, incremental_state=inc, need_head_weights=True)
        rows = new_order if t <= t0 else torch.arange(bsz)
        torch.testing.assert_close(o[:, rows], full[t:t + 1], rtol=1e-5, atol=1e-6, msg=f"step {t}")
        torch.testing.assert_close(w[:, rows, 0], full_w[:, :, t, : t + 1], rtol=1e-5, atol=1e-6)
        if t == t0:
            m.reorder_incremental_state(inc, new_order)
    buffer = m._get_input_buffer(inc)
    assert buffer["prev_key"].shape == (bsz, 2, steps, EMBED // 2)  # h_k key heads cached
    assert buffer["prev_value"].shape == (bsz, 4, steps, EMBED // 4)  # h_v value heads cached


def test_encoder_decoder_attention_shared_encoder_states():
    """Beam search passes encoder states once per sentence (kv_bsz = bsz / beam)."""
    m = make_th(7, 3, 2, 4, encoder_decoder_attention=True, kdim=EMBED, vdim=EMBED).eval()
    n_sent, beam = 2, 3
    enc = torch.randn(5, n_sent, EMBED)
    kpm = padding([5, 3], 5)
    y = torch.randn(4, n_sent * beam, EMBED)
    full, _ = m(y, enc.repeat_interleave(beam, 1), enc.repeat_interleave(beam, 1),
                key_padding_mask=kpm.repeat_interleave(beam, 0), static_kv=True)
    inc = {}
    for t in range(4):
        o, _ = m(y[t:t + 1], enc, enc, key_padding_mask=kpm, static_kv=True, incremental_state=inc)
        torch.testing.assert_close(o, full[t:t + 1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- gradients, precision
def test_gradcheck_double():
    m = make_th(8, 3, 2, 4, self_attention=True, dtype=torch.float64).eval()
    x = torch.randn(3, 2, EMBED, dtype=torch.float64, requires_grad=True)
    kpm = padding([3, 2], 3)

    def fn(x, p_l, p_w):
        params = {"logits_proj": p_l, "weights_proj": p_w}
        kwargs = dict(key_padding_mask=kpm, attn_mask=causal_mask(3).double(), need_weights=False)
        return torch.func.functional_call(m, params, (x, x, x), kwargs)[0]

    p_l = m.logits_proj.detach().clone().requires_grad_()
    p_w = m.weights_proj.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (x, p_l, p_w), eps=1e-6, atol=1e-5)


def test_projection_gradients_reach_zero_initialised_heads():
    """Extra heads start at zero (eye_ of a rectangle) and still learn."""
    m = TalkingHeadsAttention(EMBED, 4, key_heads=2, value_heads=6, self_attention=True)
    x = torch.randn(5, 2, EMBED)
    m(x, x, x)[0].pow(2).sum().backward()
    assert m.logits_proj.grad[:, 2:].abs().sum() > 0
    assert m.weights_proj.grad[:, 4:].abs().sum() > 0


def test_bf16_autocast_is_finite():
    m = make_th(9, 3, 2, 4, self_attention=True).train()
    x = torch.randn(6, 2, EMBED, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(x, x, x, key_padding_mask=padding([6, 3], 6), attn_mask=causal_mask(6))
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------- model family
LANGS = ["--source-lang", "de", "--target-lang", "en"]
SMALL = [*LANGS, "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", str(EMBED),
         "--decoder-embed-dim", str(EMBED), "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]


def parse(arch, *extra):
    return model_args(arch, *LANGS, *extra)


@pytest.fixture
def build_model(tiny_model):
    """build_model(*flags, arch=..., seed=0) -> (model, dictionary) of a SMALL model, its head
    projections moved off their initialisation."""
    def build(*extra, arch="talking_heads_transformer", seed=0):
        model, dictionary, _, _ = tiny_model(arch, *SMALL, *extra, seed=seed)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, TalkingHeadsAttention):
                    for p in (m.logits_proj, m.weights_proj):
                        if p is not None:
                            p.add_(0.3 * torch.randn_like(p))
        return model, dictionary

    return build


@pytest.mark.parametrize("arch,base", [
    ("talking_heads_transformer_iwslt_de_en", "transformer_iwslt_de_en"),
    ("talking_heads_transformer_wmt_en_de", "transformer_wmt_en_de"),
    ("talking_heads_transformer", "transformer"),
])
def test_named_architectures_keep_transformer_dimensions(arch, base):
    args, ref = parse(arch), parse(base)
    for name in ("encoder_embed_dim", "encoder_ffn_embed_dim", "encoder_attention_heads", "encoder_layers",
                 "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads", "decoder_layers"):
        assert getattr(args, name) == getattr(ref, name), name
    assert args.th_attention == "enc_self"
    assert not args.th_no_logits_projection and not args.th_no_weights_projection


def test_parameter_count_is_transformer_plus_head_projections(tiny_model):
    counts = {}
    for arch in ("talking_heads_transformer_iwslt_de_en", "transformer_iwslt_de_en"):
        model = tiny_model(arch, *LANGS, "--encoder-embed-dim", "64", "--decoder-embed-dim", "64").model
        counts[arch] = sum(p.numel() for p in model.parameters())
    # 6 encoder self-attentions, each with a 4 x 4 logits and a 4 x 4 weights projection
    assert counts["talking_heads_transformer_iwslt_de_en"] - counts["transformer_iwslt_de_en"] == 6 * (16 + 16)


def test_attention_types_flag_places_talking_heads(build_model):
    model, _ = build_model("--th-attention", "dec_self,enc_dec", "--th-key-heads", "2", "--th-value-heads", "6")
    assert isinstance(model, TalkingHeadsTransformerModel)
    assert not isinstance(model.encoder.layers[0].self_attn, TalkingHeadsAttention)
    for layer in model.decoder.layers:
        for m in (layer.self_attn, layer.encoder_attn):
            assert isinstance(m, TalkingHeadsAttention)
            assert (m.key_heads, m.num_heads, m.value_heads) == (2, 4, 6)
    model, _ = build_model("--th-no-logits-projection")
    attn = model.encoder.layers[0].self_attn
    assert attn.logits_proj is None and attn.weights_proj is not None


def test_model_incremental_decoding_matches_full_forward(build_model):
    model, dictionary = build_model("--th-attention", "enc_self,dec_self,enc_dec", "--th-key-heads", "2",
                                    "--th-heads", "3", "--th-value-heads", "6")
    check_incremental_decoding(model.eval(), dictionary)


@pytest.mark.parametrize("flags,message", [
    (["--th-key-heads", "0"], "--th-key-heads must be >= 1"),
    (["--th-heads", "0"], "--th-heads must be >= 1"),
    (["--th-value-heads", "0"], "--th-value-heads must be >= 1"),
    (["--th-heads", "5"], r"--th-heads \(5\) must divide --encoder-embed-dim \(24\)"),
    (["--th-value-heads", "5", "--th-attention", "enc_dec"], r"--th-value-heads \(5\) must divide --decoder-embed-dim"),
    (["--th-attention", "enc_self,cross"], "--th-attention: unknown attention type"),
    (["--th-no-logits-projection", "--th-key-heads", "2"], "--th-key-heads 2.*must equal the softmax heads"),
    (["--th-no-weights-projection", "--th-value-heads", "6"], "--th-value-heads 6.*must equal the softmax heads"),
])
def test_bad_configurations_fail_clearly(flags, message, build_model):
    with pytest.raises(ValueError, match=message):
        build_model(*flags)


def test_checkpoint_of_another_architecture_is_refused(tiny_model, build_model):
    plain = tiny_model("transformer", *SMALL).model
    assert isinstance(plain, TransformerModel)
    model, _ = build_model()
    with pytest.raises(RuntimeError, match="no talking-heads parameters"):
        model.load_state_dict(plain.state_dict())


def test_beam_search_shares_encoder_keys_among_beams_exactly(build_model):
    model, dictionary = build_model("--th-attention", "enc_self,dec_self,enc_dec", "--th-value-heads", "2")
    check_beam_shared_keys_are_exact(model, dictionary)


def test_module_errors_name_its_parameters():
    with pytest.raises(ValueError, match=r"key_heads \(5\) must divide embed_dim \(24\)"):
        TalkingHeadsAttention(24, 4, key_heads=5, self_attention=True)
    with pytest.raises(ValueError, match=r"\(project_logits=False\) the key heads \(key_heads 2\)"):
        TalkingHeadsAttention(24, 4, key_heads=2, project_logits=False, self_attention=True)
