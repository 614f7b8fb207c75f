"""Properties of DisentangledMaskAttention and the DMA transformer: reduction to fairseq's
attention, degenerate masks, padding invariance, incremental decoding (with beam reordering),
bf16 autocast and input validation."""

import math

import pytest
import torch
from fairseq.modules import MultiheadAttention

import fairseq_modattn  # noqa: F401  (registers the plugin)
from attention_helpers import causal_mask, check_incremental_decoding, make_dma, padding, small_dma_model
from beam_search_checks import check_beam_shared_keys_are_exact
from fairseq_modattn.modules import DisentangledMaskAttention
from fairseq_modattn.modules.dma_attention import AUX_LOSS_NAMES

EMBED, HEADS = 16, 2  # make_dma's default width and heads


# ----------------------------------------------------------------------------- gamma = 0 is fairseq
def fairseq_twin(dma, **kwargs):
    ref = MultiheadAttention(EMBED, HEADS, dropout=0.0, **kwargs)
    missing, unexpected = dma.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected
    assert missing and all("_gmm." in name for name in missing)
    return ref.eval()


def test_gamma_zero_self_attention_equals_fairseq():
    dma = make_dma(1, num_updates=0, self_attention=True).eval()
    assert dma.gamma == 0.0
    ref = fairseq_twin(dma, self_attention=True)
    tgt_len, bsz = 6, 3
    x = torch.randn(tgt_len, bsz, EMBED)
    kpm = padding([6, 4, 2], tgt_len)
    for attn_mask in (None, causal_mask(tgt_len)):
        kwargs = dict(key_padding_mask=kpm, attn_mask=attn_mask)
        out_ref, w_ref = ref(x, x, x, need_weights=True, **kwargs)
        out, w = dma(x, x, x, need_weights=True, **kwargs)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)
        # fairseq's fused path ignores need_head_weights; static_kv=True takes its explicit path
        # (for self-attention static_kv changes nothing else outside incremental decoding)
        out_ref_h, w_ref_h = ref(x, x, x, need_head_weights=True, static_kv=True, **kwargs)
        torch.testing.assert_close(out_ref_h, out_ref, rtol=1e-5, atol=1e-5)
        _, w_h = dma(x, x, x, need_head_weights=True, **kwargs)
        assert w_h.shape == w_ref_h.shape == (HEADS, bsz, tgt_len, tgt_len)
        torch.testing.assert_close(w_h, w_ref_h, rtol=1e-5, atol=1e-5)
        fused, _ = dma(x, x, x, need_weights=False, **kwargs)
        torch.testing.assert_close(fused, out_ref, rtol=1e-5, atol=1e-5)


def test_gamma_zero_encoder_decoder_attention_equals_fairseq():
    dma = make_dma(2, num_updates=0, encoder_decoder_attention=True).eval()
    ref = fairseq_twin(dma, kdim=EMBED, vdim=EMBED, encoder_decoder_attention=True)
    tgt_len, src_len, bsz = 5, 7, 2
    y = torch.randn(tgt_len, bsz, EMBED)
    enc = torch.randn(src_len, bsz, EMBED)
    kpm = padding([7, 3], src_len)
    kwargs = dict(key_padding_mask=kpm, static_kv=True)
    out_ref, w_ref = ref(y, enc, enc, need_weights=True, **kwargs)
    out, w = dma(y, enc, enc, need_weights=True, **kwargs)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-5)
    fused, none = dma(y, enc, enc, need_weights=False, **kwargs)
    assert none is None
    torch.testing.assert_close(fused, out_ref, rtol=1e-5, atol=1e-5)
    # the same comparison under incremental decoding (fairseq's own incremental path)
    inc_ref, inc = {}, {}
    for t in range(tgt_len):
        o_ref, _ = ref(y[t : t + 1], enc, enc, incremental_state=inc_ref, **kwargs)
        o, _ = dma(y[t : t + 1], enc, enc, incremental_state=inc, **kwargs)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


def test_positive_gamma_differs_from_fairseq():
    """The counterpart of the tests above: with gamma > 0 the mask really changes the output."""
    dma = make_dma(1, num_updates=3000, self_attention=True).eval()
    ref = fairseq_twin(dma, self_attention=True)
    x = torch.randn(5, 2, EMBED)
    assert not torch.allclose(dma(x, x, x)[0], ref(x, x, x)[0], atol=1e-4)


# ----------------------------------------------------------------------------- uniform mask
def make_uniform(m):
    """All token-GMM components identical -> P_ic = 1/n_c for every token -> M constant."""
    with torch.no_grad():
        gmm = m.token_gmm
        gmm.means.copy_(gmm.means[:, :1].expand_as(gmm.means))
        gmm.log_vars.copy_(gmm.log_vars[:, :1].expand_as(gmm.log_vars))
        gmm.logits.zero_()
    return m


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("kind", ["self", "enc_dec"])
def test_uniform_mask_reduces_to_plain_attention(kind, training):
    kwargs = {"self_attention": True} if kind == "self" else {"encoder_decoder_attention": True}
    m = make_uniform(make_dma(3, num_updates=5000, **kwargs))
    m.train(training)  # training: sampled points, still uniform posteriors (dropout is 0)
    plain = make_uniform(make_dma(3, num_updates=0, **kwargs)).train(training)
    assert m.gamma == pytest.approx(0.5) and plain.gamma == 0.0
    x = torch.randn(5, 2, EMBED)
    key = x if kind == "self" else torch.randn(6, 2, EMBED)
    kpm = padding([x.size(0) if kind == "self" else 6, 3], key.size(0))
    mask = causal_mask(5) if kind == "self" else None
    for need_weights in (True, False):
        out, w = m(x, key, key, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights)
        ref, w_ref = plain(x, key, key, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        if need_weights:
            torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    # sanity: the non-uniform GMM of the same seed does change the output
    varied = make_dma(3, num_updates=5000, **kwargs).train(training)
    assert not torch.allclose(
        varied(x, key, key, key_padding_mask=kpm, attn_mask=mask)[0], ref, atol=1e-4
    )


# ----------------------------------------------------------------------------- padding
def pad_time(x, extra, scale=10.0):
    """Append ``extra`` garbage time steps to (T, B, E)."""
    return torch.cat([x, scale * torch.randn(extra, *x.shape[1:])], 0)


def pad_mask(mask, extra):
    return torch.cat([mask, torch.ones(mask.size(0), extra, dtype=torch.bool)], 1)


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_padding_invariance(causal):
    m = make_dma(4, num_updates=2000, self_attention=True).eval()
    m.collect_aux = True
    tgt_len, extra = 5, 2
    x = torch.randn(tgt_len, 2, EMBED)
    kpm = padding([5, 3], tgt_len)
    out, _ = m(x, x, x, key_padding_mask=kpm, attn_mask=causal_mask(tgt_len) if causal else None)
    aux = dict(m.aux_losses)
    xp, kpmp = pad_time(x, extra), pad_mask(kpm, extra)
    out_p, _ = m(xp, xp, xp, key_padding_mask=kpmp, attn_mask=causal_mask(tgt_len + extra) if causal else None)
    aux_p = m.aux_losses
    real = ~kpm
    torch.testing.assert_close(out_p[:tgt_len][real.t()], out[real.t()], rtol=1e-5, atol=1e-6)
    assert set(aux) == set(aux_p) == set(AUX_LOSS_NAMES)
    for name in AUX_LOSS_NAMES:
        assert torch.isfinite(aux[name]), name
        torch.testing.assert_close(aux_p[name], aux[name], rtol=1e-5, atol=1e-6, msg=name)
    # and the padding really is visible to the module when unmasked (the test can fail)
    m(xp, xp, xp, key_padding_mask=torch.zeros(2, tgt_len + extra, dtype=torch.bool))
    assert not torch.allclose(m.aux_losses["kl"], aux["kl"])


def test_encoder_decoder_attention_padding_invariance():
    m = make_dma(5, num_updates=2000, encoder_decoder_attention=True).eval()
    m.collect_aux = True
    tgt_len, src_len = 4, 5
    y = torch.randn(tgt_len, 2, EMBED)
    enc = torch.randn(src_len, 2, EMBED)
    qpm, kpm = padding([4, 2], tgt_len), padding([5, 3], src_len)
    m.query_padding_mask = qpm
    out, _ = m(y, enc, enc, key_padding_mask=kpm, static_kv=True)
    aux = dict(m.aux_losses)

    yp, encp = pad_time(y, 2), pad_time(enc, 2)
    m.query_padding_mask = pad_mask(qpm, 2)
    out_p, _ = m(yp, encp, encp, key_padding_mask=pad_mask(kpm, 2), static_kv=True)
    aux_p = dict(m.aux_losses)
    real = ~qpm
    torch.testing.assert_close(out_p[:tgt_len][real.t()], out[real.t()], rtol=1e-5, atol=1e-6)
    for name in AUX_LOSS_NAMES:
        assert torch.isfinite(aux[name]), name
        torch.testing.assert_close(aux_p[name], aux[name], rtol=1e-5, atol=1e-6, msg=name)

    # without the query padding mask the padded queries would count (the test can fail)
    m.query_padding_mask = None
    m(yp, encp, encp, key_padding_mask=pad_mask(kpm, 2), static_kv=True)
    assert not torch.allclose(m.aux_losses["dxq"], aux["dxq"])


# ----------------------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("mask_at_inference", [True, False])
def test_decoder_self_attention_incremental_with_reorder(mask_at_inference):
    m = make_dma(6, num_updates=5000, self_attention=True, mask_at_inference=mask_at_inference).eval()
    assert (m.gamma > 0) == mask_at_inference
    bsz, steps, t0 = 4, 6, 2
    x = torch.randn(steps, bsz, EMBED)
    new_order = torch.tensor([2, 0, 3, 2])  # beam search may duplicate and drop hypotheses
    # reference: hypothesis b's history (steps <= t0) is that of new_order[b]
    x_ref = x.clone()
    x_ref[: t0 + 1] = x[: t0 + 1, new_order]
    full, _ = m(x_ref, x_ref, x_ref, attn_mask=causal_mask(steps))

    inc, outs = {}, []
    for t in range(steps):
        step = x_ref[t : t + 1] if t > t0 else x[t : t + 1]
        o, _ = m(step, step, step, incremental_state=inc)
        outs.append(o)
        if t == t0:
            m.reorder_incremental_state(inc, new_order)
    for t in range(steps):
        got = outs[t][:, new_order] if t <= t0 else outs[t]
        torch.testing.assert_close(got, full[t : t + 1], rtol=1e-5, atol=1e-6, msg=f"step {t}")
    # without the reorder the steps after t0 would differ (the test can fail)
    inc2 = {}
    for t in range(steps):
        step = x_ref[t : t + 1] if t > t0 else x[t : t + 1]
        o, _ = m(step, step, step, incremental_state=inc2)
    assert not torch.allclose(o, full[-1:], atol=1e-4)


def test_decoder_self_attention_incremental_weights():
    m = make_dma(7, num_updates=5000, self_attention=True, mask_at_inference=True).eval()
    x = torch.randn(5, 2, EMBED)
    _, full_w = m(x, x, x, attn_mask=causal_mask(5), need_head_weights=True)
    inc = {}
    for t in range(5):
        _, w = m(x[t : t + 1], x[t : t + 1], x[t : t + 1], incremental_state=inc, need_head_weights=True)
        torch.testing.assert_close(w[:, :, 0], full_w[:, :, t, : t + 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("expand_encoder", [True, False])
@pytest.mark.parametrize("beam_size_set", [False, True])
def test_encoder_decoder_attention_incremental_with_reorder(expand_encoder, beam_size_set):
    """Beams of one sentence share identical encoder states: a reorder within each sentence's
    beams leaves the encoder cache valid; a shrinking batch (finished sentence) selects rows.
    expand_encoder=False feeds the encoder states un-expanded (kv_bsz = bsz / beam).
    beam_size_set: fairseq's set_beam_size was called (SequenceGenerator does), so the cache
    holds one copy of the keys per sentence and the beams' queries share it."""
    m = make_dma(8, num_updates=5000, encoder_decoder_attention=True).eval()
    n_sent, beam, src_len, steps, t0 = 3, 2, 5, 5, 1
    if beam_size_set:
        m.set_beam_size(beam)
    projected = []
    m.k_proj.register_forward_hook(lambda mod, inp, out: projected.append(inp[0].size(1)))
    bsz = n_sent * beam
    enc = torch.randn(src_len, n_sent, EMBED)
    kpm = padding([5, 3, 4], src_len)
    enc_exp, kpm_exp = enc.repeat_interleave(beam, 1), kpm.repeat_interleave(beam, 0)
    enc_in, kpm_in = (enc_exp, kpm_exp) if expand_encoder else (enc, kpm)
    y = torch.randn(steps, bsz, EMBED)
    full, full_w = m(y, enc_exp, enc_exp, key_padding_mask=kpm_exp, static_kv=True, need_head_weights=True)
    projected.clear()

    within = torch.tensor([1, 1, 2, 3, 5, 4])  # reorder/duplicate within each sentence's beams
    keep = torch.tensor([2, 3, 4, 5])  # sentence 0 finished: drop its beams
    inc = {}
    for t in range(steps):
        if t <= t0:
            rows = torch.arange(bsz)
        elif t <= t0 + 2:
            rows = within
        else:
            rows = within[keep]
        o, w = m(
            y[t : t + 1, rows], enc_in, enc_in, key_padding_mask=kpm_in, static_kv=True, incremental_state=inc,
            need_weights=(t % 2 == 1), need_head_weights=(t % 2 == 1),
        )
        torch.testing.assert_close(o, full[t : t + 1, rows], rtol=1e-5, atol=1e-6, msg=f"step {t}")
        if w is not None:
            torch.testing.assert_close(w, full_w[:, rows, t : t + 1], rtol=1e-5, atol=1e-6, msg=f"step {t}")
        if t == t0:
            m.reorder_incremental_state(inc, within)
        if t == t0 + 2:
            m.reorder_incremental_state(inc, keep)
            cached = m._get_input_buffer(inc)
            expected_rows = len(keep) // beam if beam_size_set else len(keep)
            assert cached["prev_key"].size(0) == cached["prev_log_p"].size(0) == expected_rows
    # the encoder states are projected once, one copy per sentence when the beams share them
    assert projected == [n_sent if beam_size_set or not expand_encoder else bsz]


def test_incremental_cache_holds_projected_keys_growing_by_one():
    m = make_dma(9, num_updates=5000, self_attention=True).eval()
    projected = []
    m.k_proj.register_forward_hook(lambda mod, inp, out: projected.append(inp[0].size(0)))
    x = torch.randn(5, 2, EMBED)
    inc = {}
    for t in range(5):
        m(x[t : t + 1], x[t : t + 1], x[t : t + 1], incremental_state=inc)
        buffer = m._get_input_buffer(inc)
        assert buffer["prev_key"].shape == (2, HEADS, t + 1, EMBED // HEADS)
        assert buffer["prev_value"].shape == (2, HEADS, t + 1, EMBED // HEADS)
        assert buffer["prev_log_p"].shape == (2, HEADS, t + 1, 3)
        # the cached keys are exactly the projections of the inputs so far
        k_full = torch.nn.functional.linear(x[: t + 1], m.k_proj.weight, m.k_proj.bias)
        k_full = k_full.view(t + 1, 2, HEADS, -1).permute(1, 2, 0, 3)
        torch.testing.assert_close(buffer["prev_key"], k_full)
    assert projected == [1] * 5  # only the new token is projected at each step

    # encoder-decoder attention projects the encoder states once
    m = make_dma(9, num_updates=5000, encoder_decoder_attention=True).eval()
    projected.clear()
    m.k_proj.register_forward_hook(lambda mod, inp, out: projected.append(inp[0].size(0)))
    enc, inc = torch.randn(6, 2, EMBED), {}
    for t in range(4):
        m(x[t : t + 1], enc, enc, static_kv=True, incremental_state=inc)
        assert m._get_input_buffer(inc)["prev_key"].size(2) == 6
    assert projected == [6]


# ----------------------------------------------------------------------------- model level
@pytest.fixture
def build_model(tiny_model):
    """build_model(*flags) -> (model, dictionary): attention_helpers.small_dma_model."""
    return lambda *extra, seed=0: small_dma_model(tiny_model, *extra, seed=seed)[:2]


@pytest.mark.parametrize("mask_at_inference", [False, True])
def test_model_incremental_decoding_matches_full_forward(mask_at_inference, build_model):
    extra = ["--dma-decoder-mask-at-inference"] if mask_at_inference else []
    model, dictionary = build_model(*extra)
    model.set_num_updates(3000)
    model.eval()
    dec_self = model.decoder.layers[0].self_attn
    assert isinstance(dec_self, DisentangledMaskAttention)
    assert (dec_self.gamma > 0) == mask_at_inference
    assert model.decoder.layers[0].encoder_attn.gamma > 0
    assert model.encoder.layers[0].self_attn.gamma > 0

    run = check_incremental_decoding(model, dictionary)

    # the decoder self-attention flag matters: the other setting gives different outputs
    dec_self.mask_at_inference = not mask_at_inference
    with torch.no_grad():
        other, _ = model.decoder(run.prev_ref, encoder_out=run.encoder_out)
    assert not torch.allclose(other, run.full, atol=1e-4)


def test_model_forward_collects_finite_aux_losses_and_gamma(build_model):
    model, dictionary = build_model()
    model.set_num_updates(1000)
    model.train()
    src = torch.randint(4, len(dictionary), (2, 5))
    prev = torch.randint(4, len(dictionary), (2, 4))
    prev[1, 3] = dictionary.pad()
    _, extra = model(src, torch.tensor([5, 5]), prev)
    assert set(extra["aux_losses"]) == set(AUX_LOSS_NAMES)
    assert all(torch.isfinite(v) for v in extra["aux_losses"].values())
    assert extra["aux_metrics"]["gamma"] == pytest.approx(1 - math.exp(-0.5))
    assert all(not m.collect_aux and m.query_padding_mask is None for m in model.dma_modules())


# ----------------------------------------------------------------------------- bf16 autocast
@pytest.mark.parametrize("kind", ["self", "enc_dec"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bf16_autocast_forward_backward_is_finite(kind, need_weights):
    kwargs = {"self_attention": True} if kind == "self" else {"encoder_decoder_attention": True}
    m = make_dma(10, num_updates=3000, dropout=0.1, **kwargs).train()
    m.collect_aux = True
    x = torch.randn(6, 2, EMBED, requires_grad=True)
    key = x if kind == "self" else torch.randn(7, 2, EMBED, requires_grad=True)
    kpm = padding([key.size(0), 3], key.size(0))
    if kind == "enc_dec":
        m.query_padding_mask = padding([6, 4], 6)
    mask = causal_mask(6) if kind == "self" else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(x, key, key, key_padding_mask=kpm, attn_mask=mask, need_weights=need_weights)
        aux = m.aux_losses
        loss = out.float().pow(2).mean() + sum(aux.values())
    assert torch.isfinite(out.float()).all()
    assert all(torch.isfinite(v) for v in aux.values())
    loss.backward()
    grads = [p.grad for p in m.parameters()] + [x.grad] + ([key.grad] if kind == "enc_dec" else [])
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.token_gmm.means.grad.abs().max() > 0 and m.q_proj.weight.grad.abs().max() > 0


# ----------------------------------------------------------------------------- bad input
def test_embed_dim_not_divisible_by_heads():
    with pytest.raises(ValueError, match="heads"):
        DisentangledMaskAttention(30, 4, self_attention=True)


def test_too_few_clusters(build_model):
    with pytest.raises(ValueError, match="num_clusters must be >= 1"):
        DisentangledMaskAttention(16, 2, self_attention=True, num_clusters=0)
    with pytest.raises(ValueError, match="--dma-clusters"):
        build_model("--dma-clusters", "0")


def test_beam_search_shares_encoder_keys_among_beams_exactly(build_model):
    """fairseq's SequenceGenerator: one cached copy of each sentence's encoder keys and key
    posteriors for its beams gives the hypotheses and scores of one copy per beam."""
    model, dictionary = build_model()
    model.set_num_updates(3000)
    check_beam_shared_keys_are_exact(model, dictionary)
