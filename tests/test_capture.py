"""Recording per-head attention (fairseq_modattn.analysis.capture) leaves the computation alone
and returns the right weights, for fairseq's MultiheadAttention and for this package's modules."""

import pytest
import torch
from fairseq.modules import MultiheadAttention

from fairseq_modattn.analysis.capture import dma_posteriors, dma_semantic_mask, record_modules
from fairseq_modattn.modules.dma_attention import DisentangledMaskAttention

T, B, E, H = 5, 3, 16, 4


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, B, E, generator=g)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, -2:] = True  # right padding of sentence 1
    return x, padding


def naive_head_weights(mha, x, padding):
    """softmax(q k^T / sqrt(d)) per head from the module's own projections, (B, H, T, S)."""
    d = E // H
    q = (x @ mha.q_proj.weight.T + mha.q_proj.bias).view(T, B, H, d).permute(1, 2, 0, 3)
    k = (x @ mha.k_proj.weight.T + mha.k_proj.bias).view(T, B, H, d).permute(1, 2, 0, 3)
    logits = q @ k.transpose(-1, -2) / d ** 0.5
    logits = logits.masked_fill(padding.view(B, 1, 1, T), float("-inf"))
    return torch.softmax(logits, dim=-1)


def test_fairseq_attention_gives_per_head_weights_and_the_same_output():
    torch.manual_seed(0)
    mha = MultiheadAttention(E, H, self_attention=True).eval()
    x, padding = inputs()
    out_fast, none = mha(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)
    _, averaged = mha(query=x, key=x, value=x, key_padding_mask=padding, need_weights=True)
    assert none is None
    with record_modules([("attn", mha)], queries=True) as recorder:
        out, weights = mha(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)
        assert weights is None  # the caller's contract is kept
        _, mean = mha(query=x, key=x, value=x, key_padding_mask=padding, need_weights=True)
        assert mean.shape == (B, T, T)  # head-averaged, as the caller asked
    recorded = recorder.weights["attn"]
    assert recorded.shape == (B, H, T, T)
    assert torch.allclose(out, out_fast, atol=1e-6)
    assert torch.allclose(recorded, naive_head_weights(mha, x, padding), atol=1e-6)
    assert torch.allclose(recorded.mean(dim=1), averaged, atol=1e-6)
    assert torch.all(recorded[1, :, :, -2:] == 0)
    q = (x @ mha.q_proj.weight.T + mha.q_proj.bias).view(T, B, H, -1).permute(1, 2, 0, 3)
    assert torch.allclose(recorder.queries["attn"], q, atol=1e-6)
    # everything is undone after the block
    assert mha.skip_embed_dim_check is False
    assert not mha._forward_hooks and not mha._forward_pre_hooks and not mha.q_proj._forward_hooks


def test_fairseq_cross_attention_with_static_kv():
    torch.manual_seed(1)
    mha = MultiheadAttention(E, H, encoder_decoder_attention=True).eval()
    x, padding = inputs(1)
    y = torch.randn(3, B, E)
    expected, _ = mha(query=y, key=x, value=x, key_padding_mask=padding, static_kv=True, need_weights=False)
    with record_modules([("attn", mha)]) as recorder:
        out, heads = mha(query=y, key=x, value=x, key_padding_mask=padding, static_kv=True,
                         need_weights=True, need_head_weights=True)
    assert heads.shape == (H, B, 3, T)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(recorder.weights["attn"], heads.transpose(0, 1))


def test_dma_module_weights_posteriors_and_mask():
    torch.manual_seed(2)
    dma = DisentangledMaskAttention(E, H, self_attention=True, num_clusters=3)
    dma.set_num_updates(10_000)  # gamma = alpha: the mask is in force
    dma.eval()
    x, padding = inputs(2)
    expected, _ = dma(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)
    _, heads = dma(query=x, key=x, value=x, key_padding_mask=padding, need_head_weights=True)
    with record_modules([("dma", dma)], inputs=True) as recorder:
        out, _ = dma(query=x, key=x, value=x, key_padding_mask=padding, need_weights=False)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(recorder.weights["dma"], heads.transpose(0, 1).float(), atol=1e-6)
    x_query, x_key = recorder.inputs["dma"]
    assert torch.equal(x_query, x) and torch.equal(x_key, x)

    posteriors = dma_posteriors(dma, x_query)
    assert posteriors.shape == (B, H, T, 3)
    assert torch.allclose(posteriors.sum(-1), torch.ones(B, H, T), atol=1e-5)
    # naive reference: each head's token GMM posterior at z (no sampling)
    z = x.view(T, B, H, -1).permute(1, 2, 0, 3)
    reference = dma.token_gmm(z, dma.noise_var, sample=False, need_kl=False).log_post.exp()
    assert torch.allclose(posteriors, reference, atol=1e-6)
    mask = dma_semantic_mask(posteriors, posteriors)
    naive = torch.einsum("bhic,bhjc->bhij", posteriors, posteriors)
    assert torch.allclose(mask, naive, atol=1e-6)
    assert float(mask.max()) <= 1.0 + 1e-6


def test_a_raising_forward_still_removes_the_hooks():
    mha = MultiheadAttention(E, H, self_attention=True).eval()
    with pytest.raises(RuntimeError):
        with record_modules([("attn", mha)]):
            mha(query=torch.randn(T, B, E + 1), key=None, value=None)
    assert mha.skip_embed_dim_check is False and not mha._forward_pre_hooks
