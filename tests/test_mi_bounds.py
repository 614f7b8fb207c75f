"""DMA's mutual-information bounds and regularisers (``fairseq_modattn.modules.mi_bounds``):
L_Dqq (the CLUB form, exact and with sampled negatives), L_Dxq (InfoNCE) and L_dv (the
diversity penalty) against naive references written straight from the documented formulas,
their padding invariance and their gradients. The GMM posteriors they read are tested in
test_gmm.py.

Every reference below is deliberately naive (Python loops over sentences, heads and tokens,
float64), so that it shares no code path with the efficient implementation.
"""

import math

import pytest
import torch

import fairseq_modattn  # noqa: F401  (registers the plugin, applies compat fixes)
from attention_helpers import DOUBLE, loss_inputs, padding, real_tokens
from fairseq_modattn.modules.mi_bounds import (
    diversity_penalty,
    head_dependence_bound,
    head_dependence_estimates,
    infonce_bound,
    sample_negatives,
)


# ----------------------------------------------------------------------------- references
def naive_dqq_estimates(log_joint, log_post, valid, negatives=None):
    """{(h, h'): I_hh'} as documented in mi_bounds: for heads h != h' and real tokens i, j,
    p(q_j^h|c) = p(q_j^h, c) / sum_{j' real} p(q_j'^h, c),  S_ij = sum_c p(q_j^h|c) Q_ic^h',
    I_hh' = mean over the batch's real tokens i of [ log S_ii - (1/n) sum_{j real} log S_ij ];
    with ``negatives`` (the sampled form) the negative term is log S_{i j_i}, j_i = negatives[b, i]."""
    joint, post = log_joint.exp(), log_post.exp()
    bsz, heads, _, num_c = joint.shape
    estimates = {}
    for h in range(heads):
        for h2 in range(heads):
            if h == h2:
                continue
            total, count = 0.0, 0
            for b in range(bsz):
                idx = real_tokens(valid, b)

                def log_s(i, j):
                    s = 0.0
                    for c in range(num_c):
                        norm = sum(joint[b, h, j2, c].item() for j2 in idx)
                        s += joint[b, h, j, c].item() / norm * post[b, h2, i, c].item()
                    return math.log(s)

                for i in idx:
                    if negatives is None:
                        total += log_s(i, i) - sum(log_s(i, j) for j in idx) / len(idx)
                    else:
                        total += log_s(i, i) - log_s(i, int(negatives[b, i]))
                    count += 1
            estimates[h, h2] = total / count
    return estimates


def naive_dqq(log_joint, log_post, valid, negatives=None):
    """L_Dqq = mean over head pairs h != h' of max(0, I_hh')."""
    estimates = naive_dqq_estimates(log_joint, log_post, valid, negatives)
    return sum(max(0.0, v) for v in estimates.values()) / len(estimates)


def naive_dxq(post, valid):
    """mean over (sentence, head, real token i) of f_ii - log((1/n) sum_{j real} exp f_ij)."""
    bsz, heads, _, num_c = post.shape
    total, count = 0.0, 0
    for b in range(bsz):
        idx = real_tokens(valid, b)
        for h in range(heads):
            def f(i, j, b=b, h=h):
                return sum(post[b, h, i, c].item() * post[b, h, j, c].item() for c in range(num_c))
            for i in idx:
                total += f(i, i) - math.log(sum(math.exp(f(i, j)) for j in idx) / len(idx))
                count += 1
    return total / count


def naive_div(post, valid):
    """mean over (sentence with tokens, head) of (1/n) ||C C^T - I||_F^2, C built explicitly."""
    bsz, heads = post.shape[:2]
    values = []
    for b in range(bsz):
        idx = real_tokens(valid, b)
        if not idx:
            continue
        for h in range(heads):
            c_mat = post[b, h, idx]  # (n, C)
            gram = c_mat @ c_mat.t() - torch.eye(len(idx), dtype=post.dtype)
            values.append((gram**2).sum().item() / len(idx))
    return sum(values) / len(values)


# ----------------------------------------------------------------------------- losses
@pytest.mark.parametrize("lengths", [[5, 3], [2, 5, 4], [5, 5]])
def test_losses_match_naive(lengths):
    log_joint, log_post, valid = loss_inputs(10, lengths)
    post = log_post.exp()
    assert head_dependence_bound(log_joint, log_post, valid).item() == pytest.approx(
        naive_dqq(log_joint, log_post, valid), rel=1e-10
    )
    assert infonce_bound(post, valid).item() == pytest.approx(naive_dxq(post, valid), rel=1e-10)
    assert diversity_penalty(post, valid).item() == pytest.approx(naive_div(post, valid), rel=1e-10)
    if all(n == valid.size(1) for n in lengths):  # valid=None means "no padding"
        assert head_dependence_bound(log_joint, log_post, None).item() == pytest.approx(
            naive_dqq(log_joint, log_post, valid), rel=1e-10
        )
        assert infonce_bound(post, None).item() == pytest.approx(naive_dxq(post, valid), rel=1e-10)
        assert diversity_penalty(post, None).item() == pytest.approx(naive_div(post, valid), rel=1e-10)


def test_sampled_head_dependence_bound_matches_naive_and_averages_to_the_exact_bound():
    lengths, max_len = [4, 2, 4], 5
    log_joint, log_post, valid = loss_inputs(18, lengths, max_len=max_len)
    torch.manual_seed(0)
    negatives = sample_negatives(valid, len(lengths), max_len)
    got = head_dependence_bound(log_joint, log_post, valid, negatives)
    assert got.item() == pytest.approx(naive_dqq(log_joint, log_post, valid, negatives), rel=1e-10)
    # Unbiased: cycling every query's negative through the real tokens of its sentence (each
    # equally often: 4 rounds cover lengths 4 and 2 uniformly) averages to the exact mean over j.
    rounds = []
    for k in range(4):
        neg = torch.zeros(len(lengths), max_len, dtype=torch.long)
        for b in range(len(lengths)):
            idx = real_tokens(valid, b)
            neg[b, :] = idx[k % len(idx)]
        rounds.append(head_dependence_estimates(log_joint, log_post, valid, neg))
    exact = head_dependence_estimates(log_joint, log_post, valid)
    torch.testing.assert_close(torch.stack(rounds).mean(0), exact, rtol=1e-10, atol=1e-12)


def test_head_pairs_below_zero_add_neither_value_nor_gradient():
    """L_Dqq = mean_{h != h'} max(0, I_hh'); the inputs give pairs on both sides of 0."""
    log_joint, log_post, valid = loss_inputs(10, [5, 3], heads=4)
    log_joint.requires_grad_()
    estimates = head_dependence_estimates(log_joint, log_post, valid)
    naive = naive_dqq_estimates(log_joint, log_post, valid)
    for (h, h2), value in naive.items():
        assert estimates[h, h2].item() == pytest.approx(value, rel=1e-10)
    signs = {value > 0 for value in naive.values()}
    assert signs == {True, False}, naive
    head_dependence_bound(log_joint, log_post, valid).backward()
    positive = [pair for pair, value in naive.items() if value > 0]
    clamped = log_joint.grad.clone()
    log_joint.grad = None
    # the gradient is exactly that of the positive pairs' sum, divided by the pair count
    torch.stack([estimates[pair] for pair in positive]).sum().div(len(naive)).backward()
    torch.testing.assert_close(clamped, log_joint.grad)


def test_sample_negatives_is_uniform_over_real_tokens():
    valid = ~padding([5, 2, 1], 6)
    valid[1] = valid[1].flip(0)  # left padding, as fairseq's source side
    torch.manual_seed(1)
    counts = torch.zeros(3, 6)
    draws = 4000
    for _ in range(draws // 100):
        neg = sample_negatives(valid.repeat(100, 1), 300, 6).view(100, 3, 6)
        counts += torch.nn.functional.one_hot(neg, 6).sum((0, 2)).float()
    assert (counts[~valid] == 0).all()
    share = counts / counts.sum(1, keepdim=True)
    for b, n in enumerate([5, 2, 1]):
        torch.testing.assert_close(share[b][valid[b]], torch.full((n,), 1.0 / n), atol=0.02, rtol=0)
    assert sample_negatives(None, 2, 3).shape == (2, 3)


def test_losses_ignore_padded_values_and_give_them_no_gradient():
    log_joint, log_post, valid = loss_inputs(11, [5, 2, 3])
    torch.manual_seed(3)
    negatives = sample_negatives(valid, 3, 5)
    reference = [
        head_dependence_bound(log_joint, log_post, valid),
        head_dependence_bound(log_joint, log_post, valid, negatives),
        infonce_bound(log_post.exp(), valid),
        diversity_penalty(log_post.exp(), valid),
    ]
    # arbitrary (large, finite) values at padded positions
    pad = (~valid).view(3, 1, 5, 1).expand_as(log_joint)
    garbage_joint = torch.where(pad, 50.0 * torch.randn_like(log_joint), log_joint).requires_grad_()
    garbage_post = torch.where(pad, torch.log_softmax(20 * torch.randn_like(log_post), -1), log_post)
    garbage_post.requires_grad_()
    values = [
        head_dependence_bound(garbage_joint, garbage_post, valid),
        head_dependence_bound(garbage_joint, garbage_post, valid, negatives),
        infonce_bound(garbage_post.exp(), valid),
        diversity_penalty(garbage_post.exp(), valid),
    ]
    for got, want in zip(values, reference):
        assert got.item() == pytest.approx(want.item(), rel=1e-12)
    sum(values).backward()
    for grad in (garbage_joint.grad, garbage_post.grad):
        assert torch.isfinite(grad).all()
        assert (grad[pad] == 0).all()
        assert grad[~pad].abs().max() > 0


def test_infonce_with_an_all_padding_sentence_has_finite_gradients():
    _, log_post, valid = loss_inputs(19, [4, 0, 2])
    post = log_post.exp().requires_grad_()
    value = infonce_bound(post, valid)
    assert value.item() == pytest.approx(naive_dxq(post.detach(), valid), rel=1e-10)
    value.backward()
    assert torch.isfinite(post.grad).all() and (post.grad[1] == 0).all()


def test_head_dependence_bound_is_zero_for_uninformative_heads():
    """Documented property of the CLUB form: if Q^h' is the same for every token (head h' tells
    nothing about which token head h saw), L_Dqq = 0; informative heads give a non-zero value."""
    log_joint, _, valid = loss_inputs(17, [5, 3])
    flat = torch.log_softmax(torch.randn(2, 3, 1, 4, dtype=DOUBLE), -1).expand(2, 3, 5, 4)
    assert head_dependence_bound(log_joint, flat, valid).item() == pytest.approx(0.0, abs=1e-12)
    assert abs(head_dependence_bound(log_joint, torch.log_softmax(log_joint, -1), valid).item()) > 1e-3


def test_diversity_penalty_extremes():
    """One-hot rows in distinct clusters: C C^T = I -> 0; all tokens in one cluster -> n - 1."""
    eye = torch.eye(4, dtype=DOUBLE).view(1, 1, 4, 4)
    assert diversity_penalty(eye, None).item() == pytest.approx(0.0, abs=1e-12)
    same = torch.zeros(1, 1, 4, 4, dtype=DOUBLE)
    same[..., 0] = 1.0
    assert diversity_penalty(same, None).item() == pytest.approx(3.0)  # (16 - 4) / 4


# ----------------------------------------------------------------------------- gradients
def test_gradcheck_losses():
    log_joint, log_post, valid = loss_inputs(16, [4, 2], heads=3, max_len=4, num_c=3)
    log_joint.requires_grad_()
    log_post.requires_grad_()
    post = log_post.exp().detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: head_dependence_bound(a, b, valid), (log_joint, log_post))
    negatives = torch.tensor([[1, 0, 3, 2], [1, 0, 0, 1]])
    assert torch.autograd.gradcheck(lambda a, b: head_dependence_bound(a, b, valid, negatives), (log_joint, log_post))
    assert torch.autograd.gradcheck(lambda p: infonce_bound(p, valid), (post,))
    assert torch.autograd.gradcheck(lambda p: diversity_penalty(p, valid), (post,))
