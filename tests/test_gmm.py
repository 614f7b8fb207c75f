"""The GMM posteriors and what DMA builds from them, against naive references written straight
from the paper / docstrings: ``DiagonalGMM``'s joint, posterior and VaDE KL, the semantic mask and
the other log-space products, DMA attention's weights and output, the gamma schedule, and
gradchecks of all of them. The mutual-information bounds are in test_mi_bounds.py.

Every reference below is deliberately naive (Python loops or explicit broadcasting over
clusters and dimensions, explicit exp / sum normalisation, float64), so that it shares no code
path with the efficient implementation in ``fairseq_modattn.modules``.
"""

import math

import pytest
import torch

import fairseq_modattn  # noqa: F401  (registers the plugin, applies compat fixes)
from attention_helpers import DOUBLE, causal_mask, make_dma, naive_posterior, padding
from fairseq_modattn.modules import DiagonalGMM, DisentangledMaskAttention, annealing_rate, log_semantic_mask
from fairseq_modattn.modules.logspace import log_matmul_exp
from fairseq_modattn.modules.noise import standard_normal_like


# ----------------------------------------------------------------------------- references
def naive_gmm_point(z, logits, means, log_vars):
    """log pi_c + log N(z; mu_c, sigma_c^2) and p(c | z) for ONE point z (d,), as Python floats.

    logits (C,), means (C, d), log_vars (C, d): plain lists / tensors of one mixture.
    """
    z, logits, means, log_vars = (t.tolist() if torch.is_tensor(t) else t for t in (z, logits, means, log_vars))
    num_c = len(logits)
    norm = sum(math.exp(logit) for logit in logits)
    log_joint = []
    for c in range(num_c):
        log_density = 0.0
        for j in range(len(z)):
            var = math.exp(log_vars[c][j])
            log_density += -0.5 * math.log(2.0 * math.pi * var) - (z[j] - means[c][j]) ** 2 / (2.0 * var)
        log_joint.append(math.log(math.exp(logits[c]) / norm) + log_density)
    shift = max(log_joint)
    unnorm = [math.exp(v - shift) for v in log_joint]
    total = sum(unnorm)
    return log_joint, [u / total for u in unnorm]


def naive_vade_kl(x, post, logits, means, log_vars, s2):
    """VaDE KL(q(z, c | x) || p(z, c)) with q(z | x) = N(x, s2 I) and q(c | x) = post:

        sum_c P_c [ KL(N(x, s2 I) || N(mu_c, diag sigma_c^2)) + log P_c - log pi_c ],

    the Gaussian KL written out per dimension: 0.5 (log sigma^2/s2 + (s2 + (x - mu)^2)/sigma^2 - 1).
    """
    x, logits, means, log_vars = (t.tolist() for t in (x, logits, means, log_vars))
    norm = sum(math.exp(logit) for logit in logits)
    kl = 0.0
    for c, p_c in enumerate(post):
        gauss_kl = 0.0
        for j in range(len(x)):
            var = math.exp(log_vars[c][j])
            gauss_kl += 0.5 * (math.log(var / s2) + (s2 + (x[j] - means[c][j]) ** 2) / var - 1.0)
        kl += p_c * (gauss_kl + math.log(p_c) - math.log(math.exp(logits[c]) / norm))
    return kl


def naive_dma(m, query, key, key_padding_mask=None, attn_mask=None):
    """DMA attention straight from the paper, loop over sentences and heads (float64).

    Returns (output (T, B, E), per-head weights A^ (B, H, T, S)).
    """
    query, key = query.to(DOUBLE), key.to(DOUBLE)
    tgt_len, bsz, embed = query.shape
    src_len = key.size(0)
    heads, d = m.num_heads, m.head_dim
    gamma = m.gamma

    def lin(layer, x):
        return x @ layer.weight.detach().to(DOUBLE).t() + layer.bias.detach().to(DOUBLE)

    q = lin(m.q_proj, query).view(tgt_len, bsz, heads, d)
    k = lin(m.k_proj, key).view(src_len, bsz, heads, d)
    v = lin(m.v_proj, key).view(src_len, bsz, heads, d)
    # z_i^h: the module *inputs* split into heads, one token GMM per head.
    p_q = naive_posterior(query.view(tgt_len, bsz, heads, d).permute(1, 2, 0, 3), m.token_gmm)
    p_k = naive_posterior(key.view(src_len, bsz, heads, d).permute(1, 2, 0, 3), m.token_gmm)

    out = torch.zeros(tgt_len, bsz, heads, d, dtype=DOUBLE)
    weights = torch.zeros(bsz, heads, tgt_len, src_len, dtype=DOUBLE)
    for b in range(bsz):
        for h in range(heads):
            logits = torch.zeros(tgt_len, src_len, dtype=DOUBLE)
            for i in range(tgt_len):
                for j in range(src_len):
                    logits[i, j] = torch.dot(q[i, b, h], k[j, b, h]) / math.sqrt(d)
                    if attn_mask is not None:
                        logits[i, j] += float(attn_mask[i, j])
                    if key_padding_mask is not None and key_padding_mask[b, j]:
                        logits[i, j] = float("-inf")
            a = torch.exp(logits - logits.max(-1, keepdim=True).values)
            a = a / a.sum(-1, keepdim=True)
            mask = torch.zeros(tgt_len, src_len, dtype=DOUBLE)
            for c in range(m.num_clusters):  # M_ij = sum_c P^q_ic P^k_jc
                mask += p_q[b, h, :, c].unsqueeze(1) * p_k[b, h, :, c].unsqueeze(0)
            masked = mask * a
            masked = masked / masked.sum(-1, keepdim=True)  # A~ = normalise_j(M * A)
            final = (1.0 - gamma) * a + gamma * masked  # A^
            weights[b, h] = final
            out[:, b, h] = final @ v[:, b, h]
    return lin(m.out_proj, out.reshape(tgt_len, bsz, embed)), weights


def random_gmm(num_c, dim, groups, seed):
    torch.manual_seed(seed)
    gmm = DiagonalGMM(num_c, dim, num_groups=groups).double()
    with torch.no_grad():
        gmm.logits.normal_()
        gmm.log_vars.uniform_(-0.7, 0.7)
        gmm.means.mul_(0.7)
    return gmm


# ----------------------------------------------------------------------------- GMM
@pytest.mark.parametrize("noise_var", [0.1, 0.35])
def test_gmm_posterior_joint_and_kl_match_naive_per_head(noise_var):
    """num_groups = H mixtures against a loop over heads, points, clusters and dimensions."""
    batch, heads, n, d, num_c = 2, 3, 4, 3, 4
    gmm = random_gmm(num_c, d, heads, seed=0)
    x = torch.randn(batch, heads, n, d, dtype=DOUBLE) * 1.5
    stats = gmm(x, noise_var=noise_var, sample=False, need_kl=True)
    assert stats.log_joint.shape == stats.log_post.shape == (batch, heads, n, num_c)
    assert stats.kl.shape == (batch, heads, n)
    for b in range(batch):
        for h in range(heads):  # head h uses mixture h
            for i in range(n):
                log_joint, post = naive_gmm_point(x[b, h, i], gmm.logits[h], gmm.means[h], gmm.log_vars[h])
                assert stats.log_joint[b, h, i].tolist() == pytest.approx(log_joint, rel=1e-10, abs=1e-10)
                assert stats.log_post[b, h, i].exp().tolist() == pytest.approx(post, rel=1e-10, abs=1e-12)
                kl = naive_vade_kl(x[b, h, i], post, gmm.logits[h], gmm.means[h], gmm.log_vars[h], noise_var)
                assert stats.kl[b, h, i].item() == pytest.approx(kl, rel=1e-10, abs=1e-10)


def test_gmm_single_group_is_shared_by_heads():
    """num_groups = 1 (the query GMM) broadcasts one mixture over the head axis."""
    batch, heads, n, d, num_c = 2, 3, 3, 4, 3
    gmm = random_gmm(num_c, d, 1, seed=1)
    x = torch.randn(batch, heads, n, d, dtype=DOUBLE)
    stats = gmm(x, noise_var=0.1, sample=False, need_kl=True)
    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                log_joint, post = naive_gmm_point(x[b, h, i], gmm.logits[0], gmm.means[0], gmm.log_vars[0])
                assert stats.log_joint[b, h, i].tolist() == pytest.approx(log_joint, rel=1e-10, abs=1e-10)
                assert stats.log_post[b, h, i].exp().tolist() == pytest.approx(post, rel=1e-10, abs=1e-12)
                kl = naive_vade_kl(x[b, h, i], post, gmm.logits[0], gmm.means[0], gmm.log_vars[0], 0.1)
                assert stats.kl[b, h, i].item() == pytest.approx(kl, rel=1e-10, abs=1e-10)


def test_gmm_sampling_clusters_the_noisy_point_and_takes_kl_at_the_mean():
    """sample=True: P from z~ = x + s eps (same eps drawn again here), distances of the KL at x."""
    heads, n, d, num_c, s2 = 2, 3, 3, 3, 0.1
    gmm = random_gmm(num_c, d, heads, seed=2)
    x = torch.randn(1, heads, n, d, dtype=DOUBLE)
    torch.manual_seed(123)
    stats = gmm(x, noise_var=s2, sample=True, need_kl=True)
    torch.manual_seed(123)  # the GMM draws eps in its group-major order, here (H, N, d) = x's
    z = x + math.sqrt(s2) * standard_normal_like(x)
    clean = gmm(x, noise_var=s2, sample=False, need_kl=True)
    assert not torch.allclose(stats.log_post, clean.log_post)  # the noise is really applied
    for h in range(heads):
        for i in range(n):
            log_joint, post = naive_gmm_point(z[0, h, i], gmm.logits[h], gmm.means[h], gmm.log_vars[h])
            assert stats.log_joint[0, h, i].tolist() == pytest.approx(log_joint, rel=1e-10, abs=1e-10)
            assert stats.log_post[0, h, i].exp().tolist() == pytest.approx(post, rel=1e-10, abs=1e-12)
            kl = naive_vade_kl(x[0, h, i], post, gmm.logits[h], gmm.means[h], gmm.log_vars[h], s2)
            assert stats.kl[0, h, i].item() == pytest.approx(kl, rel=1e-10, abs=1e-10)


def test_gmm_centroid_gradient_multiplier():
    """c_grad scales the gradient reaching the means and nothing else."""
    x = torch.randn(1, 2, 4, 3, dtype=DOUBLE)
    grads = []
    for mult in (1.0, 10.0):
        gmm = random_gmm(3, 3, 2, seed=3)
        gmm.centroid_grad_mult = mult
        stats = gmm(x, need_kl=True)
        (stats.kl.sum() + stats.log_post[..., 0].sum()).backward()
        grads.append({name: p.grad.clone() for name, p in gmm.named_parameters()})
    torch.testing.assert_close(grads[1]["means"], 10.0 * grads[0]["means"])
    torch.testing.assert_close(grads[1]["log_vars"], grads[0]["log_vars"])
    torch.testing.assert_close(grads[1]["logits"], grads[0]["logits"])
    assert grads[0]["means"].abs().max() > 0


# ----------------------------------------------------------------------------- semantic mask
def naive_mask(log_pq, log_pk):
    """M_ij = sum_c P^q_ic P^k_jc with a loop over clusters (float64)."""
    pq, pk = log_pq.to(DOUBLE).exp(), log_pk.to(DOUBLE).exp()
    mask = torch.zeros(*pq.shape[:-1], pk.size(-2), dtype=DOUBLE)
    for c in range(pq.size(-1)):
        mask += pq[..., :, c].unsqueeze(-1) * pk[..., :, c].unsqueeze(-2)
    return mask


def test_semantic_mask_matches_naive():
    torch.manual_seed(4)
    log_pq = torch.log_softmax(3 * torch.randn(2, 3, 4, 5), -1)
    log_pk = torch.log_softmax(3 * torch.randn(2, 3, 6, 5), -1)
    log_m = log_semantic_mask(log_pq, log_pk)
    assert log_m.shape == (2, 3, 4, 6)
    torch.testing.assert_close(log_m.exp().double(), naive_mask(log_pq, log_pk), rtol=1e-5, atol=1e-7)


def test_log_matmul_exp_matches_logsumexp_for_unnormalised_inputs():
    """The shifted log-space product (used by L_Dqq) for inputs far outside [0, 1] in exp space."""
    torch.manual_seed(20)
    log_a = 30.0 * torch.randn(2, 4, 5, dtype=DOUBLE) - 200.0
    log_b = 30.0 * torch.randn(2, 3, 5, dtype=DOUBLE) + 150.0
    reference = torch.logsumexp(log_a.unsqueeze(-2) + log_b.unsqueeze(-3), -1)
    torch.testing.assert_close(log_matmul_exp(log_a, log_b), reference, rtol=1e-12, atol=1e-9)
    got = log_matmul_exp(log_a.float(), log_b.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-3)


def test_semantic_mask_peaked_posteriors_stay_finite():
    """One-hot-like posteriors that disagree: M underflows in fp32 but log M must stay finite."""
    num_c = 4
    # query tokens peaked on clusters 0, 1, 2; keys peaked on 0, 1, 3 (log P of the others very low)
    def peaked(clusters, low):
        logp = torch.full((1, 1, len(clusters), num_c), low)
        for i, c in enumerate(clusters):
            logp[0, 0, i, c] = 0.0
        return torch.log_softmax(logp, -1)

    # moderate disagreement (M ~ e^-60): still represented accurately in fp32
    log_pq, log_pk = peaked([0, 1, 2], -60.0), peaked([0, 1, 3], -60.0)
    log_m = log_semantic_mask(log_pq, log_pk)
    reference = torch.logsumexp(log_pq.double().unsqueeze(-2) + log_pk.double().unsqueeze(-3), -1)
    torch.testing.assert_close(log_m.double(), reference, rtol=1e-5, atol=1e-4)

    # extreme disagreement (M ~ e^-1000, below fp32 and even fp64 range)
    for low in (-1000.0, -1e5):
        log_pq = peaked([0, 1, 2], low).requires_grad_()
        log_pk = peaked([0, 1, 3], low).requires_grad_()
        log_m = log_semantic_mask(log_pq, log_pk)
        assert torch.isfinite(log_m).all()
        # agreeing pairs keep log M ~ 0, disagreeing pairs are pushed far down
        assert log_m[0, 0, 0, 0].abs() < 1e-4 and log_m[0, 0, 1, 1].abs() < 1e-4
        assert log_m[0, 0, 2].max() < -80 and log_m[0, 0, 0, 1] < -80
        weights = torch.softmax(torch.zeros(1, 1, 3, 3) + log_m, -1)
        assert torch.isfinite(weights).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 1, 3))
        weights[..., 0].sum().backward()
        assert torch.isfinite(log_pq.grad).all() and torch.isfinite(log_pk.grad).all()


def test_dma_attention_with_one_hot_posteriors_is_finite():
    """Far-apart, very narrow token clusters (one-hot posteriors) with gamma = 1: no NaN/inf."""
    torch.manual_seed(5)
    m = DisentangledMaskAttention(16, 2, self_attention=True, num_clusters=3, alpha=1.0, anneal_rate=1.0)
    with torch.no_grad():
        m.token_gmm.means.mul_(20.0)
        m.token_gmm.log_vars.fill_(-8.0)
    m.set_num_updates(10**6)
    assert m.gamma == 1.0
    m.eval()
    x = torch.randn(5, 2, 16)
    out, w = m(x, x, x, need_head_weights=True)
    fused, _ = m(x, x, x, need_weights=False)
    assert torch.isfinite(out).all() and torch.isfinite(w).all() and torch.isfinite(fused).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 5))
    torch.testing.assert_close(fused, out, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- masked attention
def annealed_dma(seed, num_updates=500, alpha=0.6, embed_dim=16, **kwargs):
    """This file's DMA module, in eval mode: gamma part-way through its annealing (t = 500,
    alpha = 0.6); the token GMM is randomised before the biases, the random draws these tests'
    tolerances were set against."""
    return make_dma(seed, embed_dim=embed_dim, num_updates=num_updates, alpha=alpha,
                    randomise=("token_gmm", "biases"), **kwargs).eval()


def test_annealed_gamma_is_strictly_between_0_and_alpha_in_these_tests():
    m = annealed_dma(0, self_attention=True)
    expected = 1.0 - max(0.4, math.exp(-5e-4 * 500))
    assert m.gamma == pytest.approx(expected) and 0.1 < m.gamma < 0.6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_self_attention_weights_and_output_match_naive(dtype):
    m = annealed_dma(6, self_attention=True).to(dtype)
    tgt_len, bsz = 5, 2
    x = torch.randn(tgt_len, bsz, 16, dtype=dtype)
    kpm = padding([5, 3], tgt_len)
    attn_mask = causal_mask(tgt_len, dtype)
    ref_out, ref_w = naive_dma(m, x, x, kpm, attn_mask)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)

    out, w = m(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_head_weights=True)
    assert w.shape == (2, bsz, tgt_len, tgt_len)  # (H, B, T, S)
    torch.testing.assert_close(w.transpose(0, 1).double(), ref_w, **tol)
    torch.testing.assert_close(out.double(), ref_out, **tol)

    out_avg, w_avg = m(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=True)
    torch.testing.assert_close(w_avg.double(), ref_w.mean(1), **tol)
    torch.testing.assert_close(out_avg, out)

    fused, none = m(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=False)
    assert none is None
    torch.testing.assert_close(fused.double(), ref_out, **tol)
    torch.testing.assert_close(fused, out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_encoder_decoder_attention_weights_and_output_match_naive(dtype):
    m = annealed_dma(7, encoder_decoder_attention=True).to(dtype)
    tgt_len, src_len, bsz = 4, 6, 2
    y = torch.randn(tgt_len, bsz, 16, dtype=dtype)
    enc = torch.randn(src_len, bsz, 16, dtype=dtype)
    kpm = padding([6, 4], src_len)
    ref_out, ref_w = naive_dma(m, y, enc, kpm)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)

    out, w = m(y, enc, enc, key_padding_mask=kpm, static_kv=True, need_head_weights=True)
    torch.testing.assert_close(w.transpose(0, 1).double(), ref_w, **tol)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    _, w_avg = m(y, enc, enc, key_padding_mask=kpm, static_kv=True)
    torch.testing.assert_close(w_avg.double(), ref_w.mean(1), **tol)
    fused, _ = m(y, enc, enc, key_padding_mask=kpm, static_kv=True, need_weights=False)
    torch.testing.assert_close(fused.double(), ref_out, **tol)
    torch.testing.assert_close(fused, out, rtol=1e-5, atol=1e-6)


def test_full_gamma_uses_only_the_masked_attention():
    """gamma = 1 (alpha = 1, t large): A^ = A~ exactly, in both the explicit and fused paths."""
    m = annealed_dma(8, num_updates=10**7, alpha=1.0, self_attention=True).double()
    assert m.gamma == 1.0
    x = torch.randn(4, 2, 16, dtype=DOUBLE)
    ref_out, ref_w = naive_dma(m, x, x)
    out, w = m(x, x, x, need_head_weights=True)
    fused, _ = m(x, x, x, need_weights=False)
    torch.testing.assert_close(w.transpose(0, 1), ref_w)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(fused, ref_out)


# ----------------------------------------------------------------------------- gamma schedule
def test_annealing_rate_formula():
    alpha, rate = 0.5, 5e-4
    assert annealing_rate(0, alpha, rate) == 0.0
    previous = 0.0
    for t in (1, 10, 100, 500, 1000, 1386, 1387, 2000, 10**4, 10**6):
        gamma = annealing_rate(t, alpha, rate)
        assert gamma == pytest.approx(1.0 - max(1.0 - alpha, math.exp(-rate * t)), abs=1e-15)
        assert previous <= gamma <= alpha
        previous = gamma
    assert annealing_rate(100, alpha, rate) == pytest.approx(1 - math.exp(-0.05))
    assert annealing_rate(10**6, alpha, rate) == pytest.approx(alpha, abs=1e-12)
    assert annealing_rate(10**6, 0.8, rate) == pytest.approx(0.8, abs=1e-12)
    assert annealing_rate(10**6, 0.0, rate) == 0.0


def test_module_gamma_follows_set_num_updates():
    m = DisentangledMaskAttention(16, 2, self_attention=True, num_clusters=2, alpha=0.7, anneal_rate=1e-3)
    m.train()
    assert m.gamma == 0.0
    for t in (10, 300, 5000):
        m.set_num_updates(t)
        assert m.gamma == pytest.approx(1.0 - max(0.3, math.exp(-1e-3 * t)))
    m.eval()
    assert m.gamma == pytest.approx(0.7)  # mask_at_inference defaults to True


def test_decoder_self_attention_drops_mask_at_inference():
    torch.manual_seed(9)
    m = DisentangledMaskAttention(16, 2, self_attention=True, num_clusters=3, mask_at_inference=False)
    m.set_num_updates(4000)
    m.train()
    assert m.gamma > 0.4
    m.eval()
    assert m.gamma == 0.0
    x = torch.randn(5, 2, 16)
    out, w = m(x, x, x, attn_mask=causal_mask(5), need_head_weights=True)
    # no mask: plain softmax attention
    q = m.q_proj(x).view(5, 2, 2, 8).permute(1, 2, 0, 3)
    k = m.k_proj(x).view(5, 2, 2, 8).permute(1, 2, 0, 3)
    plain = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + causal_mask(5), -1)
    torch.testing.assert_close(w.transpose(0, 1), plain)
    # and the same module with the mask at inference really differs
    m.mask_at_inference = True
    out_masked, _ = m(x, x, x, attn_mask=causal_mask(5))
    assert not torch.allclose(out, out_masked, atol=1e-4)


# ----------------------------------------------------------------------------- gradients
def test_gradcheck_log_semantic_mask():
    torch.manual_seed(12)
    log_pq = torch.log_softmax(torch.randn(1, 2, 3, 4, dtype=DOUBLE), -1).requires_grad_()
    log_pk = torch.log_softmax(torch.randn(1, 2, 5, 4, dtype=DOUBLE), -1).requires_grad_()
    assert log_semantic_mask(log_pq, log_pk).dtype == DOUBLE
    assert torch.autograd.gradcheck(lambda a, b: log_semantic_mask(a, b), (log_pq, log_pk))
    log_a = (5.0 * torch.randn(1, 3, 4, dtype=DOUBLE)).requires_grad_()
    log_b = (5.0 * torch.randn(1, 2, 4, dtype=DOUBLE) - 20.0).requires_grad_()
    assert torch.autograd.gradcheck(log_matmul_exp, (log_a, log_b))


def test_gradcheck_dma_self_attention_explicit_path():
    m = annealed_dma(13, self_attention=True, embed_dim=8).double()
    x = torch.randn(4, 2, 8, dtype=DOUBLE, requires_grad=True)
    kpm = padding([4, 3], 4)

    def fn(inp):
        out, w = m(inp, inp, inp, key_padding_mask=kpm, attn_mask=causal_mask(4, DOUBLE), need_head_weights=True)
        return out, w

    assert torch.autograd.gradcheck(fn, (x,))


def test_gradcheck_dma_encoder_decoder_attention_explicit_path():
    m = annealed_dma(14, encoder_decoder_attention=True, embed_dim=8).double()
    y = torch.randn(3, 2, 8, dtype=DOUBLE, requires_grad=True)
    enc = torch.randn(4, 2, 8, dtype=DOUBLE, requires_grad=True)
    kpm = padding([4, 2], 4)

    def fn(query, key):
        return m(query, key, key, key_padding_mask=kpm, static_kv=True, need_head_weights=True)

    assert torch.autograd.gradcheck(fn, (y, enc))


def test_gradcheck_gmm_wrt_inputs_and_parameters():
    gmm = random_gmm(3, 3, 2, seed=15)
    x = torch.randn(1, 2, 3, 3, dtype=DOUBLE, requires_grad=True)
    params = tuple(p.detach().clone().requires_grad_() for p in (gmm.logits, gmm.means, gmm.log_vars))

    def fn(inp, logits, means, log_vars):
        stats = torch.func.functional_call(
            gmm, {"logits": logits, "means": means, "log_vars": log_vars}, (inp,), {"need_kl": True}
        )
        return stats.log_joint, stats.log_post, stats.kl

    assert torch.autograd.gradcheck(fn, (x,) + params)


@pytest.mark.parametrize("need_kl", [True, False])
def test_gradcheck_gmm_sampled_point(need_kl):
    """The hand-written backward of the noisy and the mean distances (the same noise each call)."""
    gmm = random_gmm(3, 4, 2, seed=17)
    # token-major points seen through a head-split view, as the attention modules pass them
    x = torch.randn(3, 2, 8, dtype=DOUBLE, requires_grad=True)
    params = tuple(p.detach().clone().requires_grad_() for p in (gmm.logits, gmm.means, gmm.log_vars))

    def fn(inp, logits, means, log_vars):
        torch.manual_seed(5)
        heads = inp.view(3, 2, 2, 4).permute(1, 2, 0, 3)
        stats = torch.func.functional_call(
            gmm, {"logits": logits, "means": means, "log_vars": log_vars}, (heads,),
            {"need_kl": need_kl, "sample": True, "noise_var": 0.3},
        )
        return (stats.log_joint, stats.log_post) + ((stats.kl,) if need_kl else ())

    assert torch.autograd.gradcheck(fn, (x,) + params)


@pytest.mark.parametrize("need_kl", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_gradcheck_gmm_given_point_read_elsewhere_too(need_kl, scale):
    """A caller's sample z~ = x + (s / scale) eps that something else reads as well (DMA's
    attention): the GMM returns dx + dz~ through x, and the total reaching x is still exact."""
    gmm = random_gmm(3, 4, 2, seed=19)
    x = torch.randn(3, 2, 8, dtype=DOUBLE, requires_grad=True)
    eps = torch.randn(2, 2, 3, 4, dtype=DOUBLE, generator=torch.Generator().manual_seed(6))
    reader = torch.randn(2, 2, 3, 4, dtype=DOUBLE, generator=torch.Generator().manual_seed(7))
    params = tuple(p.detach().clone().requires_grad_() for p in (gmm.logits, gmm.means, gmm.log_vars))

    def fn(inp, logits, means, log_vars):
        heads = inp.view(3, 2, 2, 4).permute(1, 2, 0, 3)
        point = torch.add(heads, eps, alpha=math.sqrt(0.3) / scale)
        stats = torch.func.functional_call(
            gmm, {"logits": logits, "means": means, "log_vars": log_vars}, (heads,),
            {"need_kl": need_kl, "sample": True, "noise_var": 0.3, "point": point, "scale": scale},
        )
        return (stats.log_joint, stats.post, (point * reader).sum()) + ((stats.kl,) if need_kl else ())

    assert torch.autograd.gradcheck(fn, (x,) + params)


def test_gmm_point_without_gradient_sends_the_mean_its_own():
    """Only x needs a gradient (the sample was made from a detached copy): x gets the KL's
    gradient alone, as if z~ were a constant; reference: the VaDE KL written out with explicit
    broadcasting, differentiated by autograd."""
    gmm = random_gmm(3, 4, 1, seed=21)
    x = torch.randn(5, 4, dtype=DOUBLE, requires_grad=True)
    point = x.detach() + 0.5 * torch.randn(5, 4, dtype=DOUBLE)
    s2 = 0.3
    stats = gmm(x, s2, sample=True, need_kl=True, point=point)
    (grad,) = torch.autograd.grad(stats.kl.sum() + stats.post.sum(), x)

    post = naive_posterior(point.view(1, 1, 5, 4), gmm)[0, 0]  # (N, C), a constant for x
    means, log_vars = gmm.means.detach()[0], gmm.log_vars.detach()[0]
    log_pi = torch.log_softmax(gmm.logits.detach()[0], -1)
    gauss = 0.5 * (log_vars - math.log(s2) + (s2 + (x.unsqueeze(1) - means) ** 2) / log_vars.exp() - 1.0).sum(-1)
    kl = (post * (gauss + post.log() - log_pi)).sum(-1)
    torch.testing.assert_close(stats.kl, kl.detach(), rtol=1e-10, atol=1e-10)
    (expected,) = torch.autograd.grad(kl.sum(), x)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", ["shared point", "own draw", "detached point", "detached mean", "replayed mean"])
@pytest.mark.parametrize("need_kl", [True, False])
def test_point_blocks_give_the_values_and_gradients_of_one_block(monkeypatch, case, need_kl):
    """On the CPU the passes over the points run block by block (``blocking.point_blocks``):
    with blocks of 3 points (and a shorter last one) every output and every gradient equals the
    one-block computation, for each set of inputs that needs a gradient."""
    from fairseq_modattn.modules import blocking

    def run(block_elements):
        monkeypatch.setattr(blocking, "POINT_BLOCK_ELEMENTS", block_elements)
        gmm = random_gmm(3, 4, 2, seed=23)
        base = torch.randn(5, 2, 8, dtype=DOUBLE, generator=torch.Generator().manual_seed(8))
        eps = torch.randn(5, 2, 8, dtype=DOUBLE, generator=torch.Generator().manual_seed(9))
        x = base.clone().requires_grad_(case != "detached mean")
        heads = x.view(5, 2, 2, 4).permute(1, 2, 0, 3)
        kwargs = {"need_kl": need_kl, "sample": True, "noise_var": 0.3, "scale": 0.5}
        sampled = None
        if case == "own draw":
            torch.manual_seed(5)
        else:
            source = x.detach() if case == "detached point" else x
            sampled = torch.add(source, eps, alpha=math.sqrt(0.3) / 0.5)
            if case == "detached mean":
                sampled.requires_grad_()
            kwargs["point"] = sampled.view(5, 2, 2, 4).permute(1, 2, 0, 3)
            if case == "replayed mean":
                kwargs["noise_replay"] = lambda: eps.view(5, 2, 2, 4).permute(1, 2, 0, 3)
        stats = gmm(heads, **kwargs)
        outputs = [stats.log_joint, stats.log_post, stats.post] + ([stats.kl] if need_kl else [])
        loss = sum((o * torch.linspace(-1, 2, o.numel(), dtype=DOUBLE).view_as(o)).sum() for o in outputs)
        leaves = [t for t in (x, sampled, gmm.logits, gmm.means, gmm.log_vars)
                  if t is not None and t.requires_grad and (t is not sampled or case == "detached mean")]
        return [o.detach() for o in outputs], torch.autograd.grad(loss, leaves, allow_unused=True)

    blocked_outputs, blocked_grads = run(3 * 8)  # 3 points of 2 groups x 4 values a block
    assert len(blocking.point_blocks(10, 8)) == 4  # the 5 x 2 points of each group: 3, 3, 3, 1
    outputs, grads = run(1 << 30)
    for got, expected in zip(blocked_outputs + list(blocked_grads), outputs + list(grads)):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_gradcheck_gmm_in_point_blocks(monkeypatch):
    """The blocked backward against finite differences, a sample that something else reads too."""
    from fairseq_modattn.modules import blocking

    monkeypatch.setattr(blocking, "POINT_BLOCK_ELEMENTS", 2 * 8)
    gmm = random_gmm(3, 4, 2, seed=25)
    x = torch.randn(5, 1, 8, dtype=DOUBLE, requires_grad=True)
    eps = torch.randn(1, 2, 5, 4, dtype=DOUBLE, generator=torch.Generator().manual_seed(10))
    params = tuple(p.detach().clone().requires_grad_() for p in (gmm.logits, gmm.means, gmm.log_vars))

    def fn(inp, logits, means, log_vars):
        heads = inp.view(5, 1, 2, 4).permute(1, 2, 0, 3)
        point = torch.add(heads, eps, alpha=math.sqrt(0.3))
        stats = torch.func.functional_call(
            gmm, {"logits": logits, "means": means, "log_vars": log_vars}, (heads,),
            {"need_kl": True, "sample": True, "noise_var": 0.3, "point": point},
        )
        return stats.log_joint, stats.post, stats.kl, (point * point).sum()

    assert len(blocking.point_blocks(5, 8)) == 3
    assert torch.autograd.gradcheck(fn, (x,) + params)
