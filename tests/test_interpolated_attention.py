"""The one-pass interpolated masked attention (modules/interpolated_attention.py): values and
gradients against the equations written out naively, gradcheck, dropout on A^, extreme
posteriors, and the module's two implementations (fused and two SDPA calls) agreeing."""

import math

import pytest
import torch

import fairseq_modattn  # noqa: F401
from fairseq_modattn.modules import DisentangledMaskAttention, blocking
from fairseq_modattn.modules import interpolated_attention as ia
from fairseq_modattn.modules.interpolated_attention import interpolated_masked_attention

DOUBLE = torch.float64


def naive(q, k, v, log_pq, log_pk, mask, gamma, keep=None, dropout_p=0.0):
    """A = softmax(q k^T / sqrt(d) + mask), A~ = normalise(M * A), M = P^q P^k^T (a loop over
    clusters), out = dropout((1 - gamma) A + gamma A~) V; all differentiable."""
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if mask is not None:
        logits = logits + mask
    a = torch.softmax(logits, -1)
    pq, pk = log_pq.exp(), log_pk.exp()
    m = sum(pq[..., :, c, None] * pk[..., None, :, c] for c in range(pq.size(-1)))
    masked = m * a
    masked = masked / masked.sum(-1, keepdim=True)
    final = (1.0 - gamma) * a + gamma * masked
    if keep is not None:
        final = final * keep / (1.0 - dropout_p)
    return final @ v


def assert_values_and_gradients_equal(out, ref, tensors):
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * weight).sum(), tensors)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def inputs(seed, bsz=2, heads=3, tgt=4, src=5, d=4, num_c=3, dtype=DOUBLE, causal=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, tgt, d, generator=gen, dtype=dtype)
    k = torch.randn(bsz, heads, src, d, generator=gen, dtype=dtype)
    v = torch.randn(bsz, heads, src, d, generator=gen, dtype=dtype)
    log_pq = torch.log_softmax(2 * torch.randn(bsz, heads, tgt, num_c, generator=gen, dtype=dtype), -1)
    log_pk = torch.log_softmax(2 * torch.randn(bsz, heads, src, num_c, generator=gen, dtype=dtype), -1)
    # key padding on the last sentence (last two keys), plus a causal mask when asked
    mask = torch.zeros(bsz, 1, 1, src, dtype=dtype)
    mask[-1, ..., -2:] = float("-inf")
    if causal:
        mask = mask + torch.triu(torch.full((tgt, src), float("-inf"), dtype=dtype), src - tgt + 1)
    return [t.requires_grad_() for t in (q, k, v, log_pq, log_pk)], mask


@pytest.mark.parametrize("gamma", [0.3, 1.0])
@pytest.mark.parametrize("causal", [False, True])
def test_values_and_gradients_match_naive(gamma, causal):
    tensors, mask = inputs(0, causal=causal)
    out = interpolated_masked_attention(*tensors, mask, gamma)
    ref = naive(*tensors, mask, gamma)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    weight = torch.randn_like(out)
    grads = torch.autograd.grad((out * weight).sum(), tensors)
    ref_grads = torch.autograd.grad((ref * weight).sum(), tensors)
    for name, got, want in zip(("q", "k", "v", "log_pq", "log_pk"), grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)
        assert want.abs().max() > 0, name  # every input really receives a gradient


def test_gradcheck():
    tensors, mask = inputs(1, bsz=1, heads=2, tgt=3, src=4, d=3, num_c=2, causal=True)
    assert torch.autograd.gradcheck(lambda *t: interpolated_masked_attention(*t, mask, 0.4), tensors)


def test_dropout_drops_the_final_weights():
    tensors, mask = inputs(2)
    p = 0.3
    torch.manual_seed(7)
    out = interpolated_masked_attention(*tensors, mask, 0.5, dropout_p=p)
    torch.manual_seed(7)
    keep = torch.rand(2, 3, 4, 5) >= p  # the same draw, one per entry of A^
    assert 0 < keep.sum() < keep.numel()
    assert_values_and_gradients_equal(out, naive(*tensors, mask, 0.5, keep=keep, dropout_p=p), tensors)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_sentence_blocks_give_the_same_values_gradients_and_dropout(monkeypatch, dropout_p):
    """With BLOCK_ELEMENTS at one sentence's tables the kernel runs sentence by sentence (the
    dropout mask drawn block by block); values and gradients are the naive ones."""
    monkeypatch.setattr(blocking, "BLOCK_ELEMENTS", 3 * 4 * 5)
    assert len(blocking.sentence_blocks(3, 3 * 4 * 5)) == 3
    tensors, mask = inputs(4, bsz=3, causal=True)
    torch.manual_seed(5)
    out = interpolated_masked_attention(*tensors, mask, 0.6, dropout_p=dropout_p)
    keep = None
    if dropout_p:
        torch.manual_seed(5)
        keep = torch.cat([torch.rand(1, 3, 4, 5) >= dropout_p for _ in range(3)])
    assert_values_and_gradients_equal(out, naive(*tensors, mask, 0.6, keep=keep, dropout_p=dropout_p), tensors)
    if not dropout_p:
        assert torch.autograd.gradcheck(lambda *t: interpolated_masked_attention(*t, mask, 0.4), tensors)


def test_disagreeing_one_hot_posteriors_stay_finite():
    """M underflows for every key of a query (posteriors one-hot on different clusters)."""
    (q, k, v, _, _), mask = inputs(3, dtype=torch.float32)
    log_pq = torch.full((2, 3, 4, 3), -1e4)
    log_pq[..., 0] = 0.0
    log_pk = torch.full((2, 3, 5, 3), -1e4)
    log_pk[..., 1] = 0.0
    log_pq, log_pk = log_pq.requires_grad_(), log_pk.requires_grad_()
    # M = 2 e^-10000 for every pair: rescaled, the product form holds it exactly
    assert uses_product_form([q, k, v, log_pq, log_pk], mask.float())
    out = interpolated_masked_attention(q, k, v, log_pq, log_pk, mask.float(), 0.5)
    assert torch.isfinite(out).all()
    out.sum().backward()
    for t in (q, k, v, log_pq, log_pk):
        assert torch.isfinite(t.grad).all()
    # a uniform log M shift leaves A~ = A, so the output is plain attention
    plain = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + mask.float(), -1) @ v
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)


def uses_product_form(tensors, mask):
    """Whether the kernel computes these inputs (one block) in the product form."""
    q, k, _, log_pq, log_pk = (t.detach() for t in tensors)
    post_q, post_k = ia._rescaled_posteriors(log_pq, log_pk, mask)
    return ia._product_form(q, k, post_q, post_k, mask, q.size(-1) ** -0.5, q.dtype) is not None


def test_the_naive_comparisons_run_the_product_form():
    """The comparisons with ``naive`` above test the product form, not the log-form fallback."""
    for causal in (False, True):
        tensors, mask = inputs(0, causal=causal)
        assert uses_product_form(tensors, mask)


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_product_form_is_as_close_to_fp64_as_the_log_form(monkeypatch, dropout_p):
    """fp32, peaked posteriors (some M_ij underflow, no row does), causal mask and padding: the
    product form and the log form (today's oracle, forced with LOG_FORM_BELOW = inf) against
    the same equations in fp64, values and every gradient."""
    tensors64, mask64 = inputs(9, bsz=3, heads=2, tgt=6, src=6, d=8, num_c=4, causal=True)
    with torch.no_grad():
        # posteriors on one random cluster (keys) or two neighbours (queries), log P = -200 on
        # the others, but for the first key, which every query sees and whose posterior is uniform
        one_hot = torch.nn.functional.one_hot
        clusters = tensors64[3].argmax(-1)
        tensors64[3].copy_(torch.log_softmax(200.0 * one_hot(clusters, 4) + 199.0 * one_hot((clusters + 1) % 4, 4), -1))
        tensors64[4].copy_(torch.log_softmax(200.0 * one_hot(tensors64[4].argmax(-1), 4).to(DOUBLE), -1))
        tensors64[4][:, :, 0] = -math.log(4.0)
    tensors32 = [t.detach().float().requires_grad_() for t in tensors64]
    mask32 = mask64.float()
    assert uses_product_form(tensors32, mask32)
    pq, pk = tensors32[3].detach().exp(), tensors32[4].detach().exp()
    assert ((pq @ pk.transpose(-1, -2)) < torch.finfo(torch.float32).tiny).any()  # entries underflow

    weight = torch.randn(3, 2, 6, 8, dtype=DOUBLE)

    def run(tensors, mask):
        torch.manual_seed(3)
        out = interpolated_masked_attention(*tensors, mask, 0.7, dropout_p=dropout_p)
        return [out.double(), *(g.double() for g in torch.autograd.grad((out * weight.to(out.dtype)).sum(), tensors))]

    exact = run(tensors64, mask64)
    product = run(tensors32, mask32)
    monkeypatch.setattr(ia, "LOG_FORM_BELOW", float("inf"))
    log_form = run(tensors32, mask32)
    for name, e, p, lg in zip(("out", "q", "k", "v", "log_pq", "log_pk"), exact, product, log_form):
        size = e.abs().max()
        err_product, err_log = ((p - e).abs().max() / size).item(), ((lg - e).abs().max() / size).item()
        assert err_product <= max(2.0 * err_log, 5e-7), f"{name}: product {err_product:.1e}, log {err_log:.1e}"


def test_blocks_with_underflowing_rows_take_the_log_form(monkeypatch):
    """Blocks of one sentence. In the first, every query's cluster is shared by one key only,
    which a mask of -100 keeps from the attention: Z < 2^-60, and the block runs in the log
    form, as today's implementation (forced everywhere with LOG_FORM_BELOW = inf) does it. The
    second is ordinary (product form) and equals the naive equations."""
    monkeypatch.setattr(blocking, "BLOCK_ELEMENTS", 3 * 4 * 5)
    tensors, mask = inputs(5)
    with torch.no_grad():
        tensors[3][0] = -1e4
        tensors[3][0, ..., 0] = 0.0
        tensors[4][0] = -1e4
        tensors[4][0, :, 1:, 1] = 0.0
        tensors[4][0, :, 0, 0] = 0.0
    mask = mask.expand(2, 1, 1, 5).clone()
    mask[0, ..., 0] = -100.0
    assert not uses_product_form([t[:1] for t in tensors], mask[:1])
    assert uses_product_form([t[1:] for t in tensors], mask[1:])
    weight = torch.randn(2, 3, 4, 4, dtype=DOUBLE)

    def run():
        out = interpolated_masked_attention(*tensors, mask, 0.6)
        return out, torch.autograd.grad((out * weight).sum(), tensors)

    out, grads = run()
    with monkeypatch.context() as patch:
        patch.setattr(ia, "LOG_FORM_BELOW", float("inf"))
        log_out, log_grads = run()
    torch.testing.assert_close(out, log_out, rtol=1e-12, atol=1e-14)  # the first block: the log form
    ref = naive(*(t[1:] for t in tensors), mask[1:], 0.6)
    torch.testing.assert_close(out[1:], ref, rtol=1e-10, atol=1e-12)
    ref_grads = torch.autograd.grad((ref * weight[1:]).sum(), tensors)
    for name, got, log_got, want in zip(("q", "k", "v", "log_pq", "log_pk"), grads, log_grads, ref_grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got[:1], log_got[:1], rtol=1e-12, atol=1e-14, msg=name)
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-9, atol=1e-11, msg=name)


def test_mask_requiring_grad_is_refused():
    tensors, mask = inputs(4)
    with pytest.raises(ValueError, match="mask"):
        interpolated_masked_attention(*tensors, mask.requires_grad_(), 0.5)


@pytest.mark.parametrize("kind", ["self", "enc_dec"])
def test_module_fused_and_sdpa_implementations_agree_in_training(kind):
    """Same module, same sampled noise: outputs, aux losses and every gradient agree."""
    kwargs = {"self_attention": True} if kind == "self" else {"encoder_decoder_attention": True}
    results = []
    for impl in ("fused", "sdpa"):
        torch.manual_seed(0)
        m = DisentangledMaskAttention(16, 2, num_clusters=3, attention_impl=impl, **kwargs).train()
        m.set_num_updates(3000)
        m.collect_aux = True
        x = torch.randn(5, 3, 16, requires_grad=True)
        key = x if kind == "self" else torch.randn(6, 3, 16, requires_grad=True)
        kpm = torch.zeros(3, key.size(0), dtype=torch.bool)
        kpm[1, -2:] = True
        mask = torch.triu(torch.full((5, 5), float("-inf")), 1) if kind == "self" else None
        torch.manual_seed(1)
        out, _ = m(x, key, key, key_padding_mask=kpm, attn_mask=mask, need_weights=False)
        loss = (out * torch.randn_like(out)).sum() + sum(m.aux_losses.values())
        loss.backward()
        grads = {name: p.grad.clone() for name, p in m.named_parameters()}
        grads["input"] = x.grad.clone()
        results.append((out.detach(), grads))
    (out_f, grads_f), (out_s, grads_s) = results
    torch.testing.assert_close(out_f, out_s, rtol=1e-5, atol=1e-6)
    for name in grads_s:
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=1e-4, atol=1e-5, msg=name)
    assert grads_f["token_gmm.means"].abs().max() > 0


def test_module_refuses_unknown_implementation():
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        DisentangledMaskAttention(16, 2, self_attention=True, attention_impl="flash")
