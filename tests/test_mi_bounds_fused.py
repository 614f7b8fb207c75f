"""The fused forms of DMA's regularisers (``fairseq_modattn.modules.mi_bounds``): L_dv, L_Dxq and
the bounded L_Dqq, each one autograd Function with an analytic backward, and the masked token
mean. Each against a naive reference written here from its formula (Python loops over
sentences, heads, head pairs and tokens, C C^T built explicitly, float64), in both reductions,
with padding (one sentence without a real token) and without; their gradchecks, fp32 against
fp64, bf16 autocast, and how many kernels a forward and backward launch (the reason for the
fusion: on a GPU each operator call is at least one launch).
"""

import math

import pytest
import torch

import fairseq_modattn  # noqa: F401  (registers the plugin, applies compat fixes)
from attention_helpers import DOUBLE, padding, real_tokens
from fairseq_modattn.modules import blocking
from fairseq_modattn.modules.mi_bounds import (
    BOUNDED_QQ_EPS,
    diversity_penalty,
    head_dependence_bound,
    infonce_bound,
    masked_token_mean,
)

LENGTHS = [5, 3, 0, 2]  # padding, and a sentence without a real token
FULL = [5, 5, 5]  # no padding: valid=None must give the same as an all-True mask
FORMS = ("paper", "entrywise")


def inputs(lengths, seed=0, heads=3, num_c=4, dtype=DOUBLE):
    """(log p(q, c), log Q, Q, valid) of right-padded sentences, float64; the padded positions
    hold large garbage (the functions must not read them)."""
    torch.manual_seed(seed)
    max_len = max(lengths)
    valid = ~padding(lengths, max_len)
    log_joint = 2.0 * torch.randn(len(lengths), heads, max_len, num_c, dtype=DOUBLE) - 3.0
    log_post = torch.log_softmax(log_joint + torch.randn_like(log_joint), -1)
    pad = (~valid).view(len(lengths), 1, max_len, 1).expand_as(log_joint)
    log_joint = torch.where(pad, 40.0 * torch.randn_like(log_joint), log_joint)
    log_post = torch.where(pad, torch.log_softmax(15.0 * torch.randn_like(log_post), -1), log_post)
    return log_joint.to(dtype), log_post.to(dtype), log_post.exp().to(dtype), valid


def reduce(per_sentence_values, counts, lengths, per_sentence):
    """The two reductions of documented per-sentence values: the (B,) vector (0 without real
    tokens), or the batch mean, weighted by ``counts`` (tokens for the token means, 1 per
    sentence with a real token for L_dv)."""
    values = [v if n else 0.0 for v, n in zip(per_sentence_values, lengths)]
    if per_sentence:
        return torch.tensor(values, dtype=DOUBLE)
    total = sum(c for c, n in zip(counts, lengths) if n)
    return torch.tensor(sum(v * c for v, c in zip(values, counts)) / max(total, 1), dtype=DOUBLE)


def naive_div(post, valid, form, per_sentence):
    """paper: (1/n) ||C C^T - I||_F^2; entrywise: (1/n^2) sum_ij w_ij ((C C^T)_ij - delta_ij)^2,
    w = 1.25 on the diagonal, 0.75 off it; mean over heads, then the sentences with a token."""
    lengths, per_sentence_values = [], []
    for b in range(post.size(0)):
        idx = real_tokens(valid, b)
        n, heads = len(idx), []
        for h in range(post.size(1)):
            c_mat = post[b, h, idx]
            diff = (c_mat @ c_mat.t() - torch.eye(n, dtype=DOUBLE)) ** 2
            if form == "paper":
                heads.append(diff.sum().item() / max(n, 1))
            else:
                weight = torch.full((n, n), 0.75, dtype=DOUBLE) + 0.5 * torch.eye(n, dtype=DOUBLE)
                heads.append((weight * diff).sum().item() / max(n, 1) ** 2)
        lengths.append(n)
        per_sentence_values.append(sum(heads) / len(heads))
    return reduce(per_sentence_values, [1] * len(lengths), lengths, per_sentence)


def naive_dxq(post, valid):
    """Per sentence: mean over heads and real tokens i of f_ii - log((1/n) sum_{j real} exp f_ij)."""
    lengths, values = [], []
    for b in range(post.size(0)):
        idx, acc = real_tokens(valid, b), 0.0
        for h in range(post.size(1)):
            def f(i, j, b=b, h=h):
                return sum(post[b, h, i, c].item() * post[b, h, j, c].item() for c in range(post.size(-1)))
            for i in idx:
                acc += f(i, i) - math.log(sum(math.exp(f(i, j)) for j in idx) / len(idx))
        lengths.append(len(idx))
        values.append(acc / (post.size(1) * len(idx)) if idx else 0.0)
    return lengths, values


def naive_bounded_dqq(log_joint, log_post, valid):
    """Per sentence: (1/H^2) sum_{h != h'} mean_{i real} -log(1 + eps - min(1, p)),
    p = sum_c [p(q_i^h, c) / sum_{j real} p(q_j^h, c)] Q_ic^h'."""
    joint, post = log_joint.exp(), log_post.exp()
    heads, num_c = joint.shape[1], joint.shape[-1]
    lengths, values = [], []
    for b in range(joint.size(0)):
        idx, acc = real_tokens(valid, b), 0.0
        for h in range(heads):
            for h2 in range(heads):
                for i in idx if h != h2 else []:
                    p = sum(
                        joint[b, h, i, c].item() / sum(joint[b, h, j, c].item() for j in idx) * post[b, h2, i, c].item()
                        for c in range(num_c)
                    )
                    acc += -math.log(1.0 + BOUNDED_QQ_EPS - min(1.0, p))
        lengths.append(len(idx))
        values.append(acc / (heads**2 * len(idx)) if idx else 0.0)
    return lengths, values


def valid_or_none(valid, lengths):
    return None if lengths is FULL else valid


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("lengths", [LENGTHS, FULL], ids=["padded", "full"])
@pytest.mark.parametrize("form", FORMS)
def test_diversity_penalty_matches_explicit_cc_t(form, lengths, per_sentence):
    _, _, post, valid = inputs(lengths)
    got = diversity_penalty(post, valid_or_none(valid, lengths), form, per_sentence)
    torch.testing.assert_close(got, naive_div(post, valid, form, per_sentence), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("lengths", [LENGTHS, FULL], ids=["padded", "full"])
def test_infonce_matches_naive(lengths, per_sentence):
    _, _, post, valid = inputs(lengths, seed=1)
    counts, values = naive_dxq(post, valid)
    got = infonce_bound(post, valid_or_none(valid, lengths), per_sentence)
    torch.testing.assert_close(got, reduce(values, counts, counts, per_sentence), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("lengths", [LENGTHS, FULL], ids=["padded", "full"])
def test_bounded_head_dependence_matches_naive(lengths, per_sentence):
    log_joint, log_post, _, valid = inputs(lengths, seed=2)
    counts, values = naive_bounded_dqq(log_joint, log_post, valid)
    valid_arg = valid_or_none(valid, lengths)
    got = head_dependence_bound(log_joint, log_post, valid_arg, form="bounded", per_sentence=per_sentence)
    torch.testing.assert_close(got, reduce(values, counts, counts, per_sentence), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("per_sentence", [False, True])
def test_masked_token_mean_matches_loop_and_ignores_infinite_padding(per_sentence):
    torch.manual_seed(3)
    valid = ~padding(LENGTHS, 5)
    values = torch.randn(len(LENGTHS), 3, 5, dtype=DOUBLE)
    values[~valid.unsqueeze(1).expand_as(values)] = float("inf")
    values[0, 1, 4] = 7.0  # a real token
    values[1, 0, 4] = -float("inf")  # a padded one
    values.requires_grad_()
    got = masked_token_mean(values, valid, per_sentence)
    per_sentence_means = [values[b, :, real_tokens(valid, b)].mean().item() if LENGTHS[b] else 0.0 for b in range(4)]
    torch.testing.assert_close(got, reduce(per_sentence_means, LENGTHS, LENGTHS, per_sentence))
    (grad,) = torch.autograd.grad(got.sum(), values)
    assert torch.isfinite(grad).all() and (grad[~valid.unsqueeze(1).expand_as(grad)] == 0).all()
    full = torch.randn(2, 3, 4, dtype=DOUBLE)
    want = full.mean((1, 2)) if per_sentence else full.mean()
    torch.testing.assert_close(masked_token_mean(full, None, per_sentence), want)


def test_a_sentence_without_real_tokens_adds_nothing():
    """Its per-sentence value is 0, its garbage changes no batch mean, no gradient (not even
    NaN) reaches it, and a batch of such sentences gives 0 with a zero gradient."""
    log_joint, log_post, post, valid = inputs(LENGTHS, seed=4)
    empty = LENGTHS.index(0)
    others = [b for b in range(len(LENGTHS)) if b != empty]
    leaves = [t.clone().requires_grad_() for t in (log_joint, log_post, post)]

    def terms(log_joint, log_post, post, valid, per_sentence):
        return [
            *(diversity_penalty(post, valid, form, per_sentence) for form in FORMS),
            infonce_bound(post, valid, per_sentence),
            head_dependence_bound(log_joint, log_post, valid, form="bounded", per_sentence=per_sentence),
        ]

    for per_sentence in terms(*leaves, valid, True):
        assert per_sentence[empty].item() == 0.0
        for grad in torch.autograd.grad(per_sentence.sum(), leaves, allow_unused=True):
            assert grad is None or (torch.isfinite(grad).all() and (grad[empty] == 0).all())
    for got, want in zip(terms(*leaves, valid, False), terms(*(t[others] for t in leaves), valid[others], False)):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    none_real = torch.zeros_like(valid)
    for per_sentence in (False, True):
        values = terms(*leaves, none_real, per_sentence)
        assert all((value == 0).all() for value in values)
        grads = torch.autograd.grad(sum(value.sum() for value in values), leaves)
        assert all((grad == 0).all() for grad in grads)


@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_diversity_penalty_of_several_posteriors_is_their_sum(form, per_sentence):
    _, log_post, post, valid = inputs(LENGTHS, seed=5)
    other = torch.softmax(log_post.flip(1) * 2.0, -1)
    a, b = post.clone().requires_grad_(), other.clone().requires_grad_()
    together = diversity_penalty([a, b], valid, form, per_sentence)
    separate = diversity_penalty(post, valid, form, per_sentence) + diversity_penalty(other, valid, form, per_sentence)
    torch.testing.assert_close(together, separate, rtol=1e-13, atol=1e-15)
    weights = torch.rand_like(together)
    grads = torch.autograd.grad((together * weights).sum(), (a, b))
    for grad, single in zip(grads, (post, other)):
        single = single.clone().requires_grad_()
        (want,) = torch.autograd.grad((diversity_penalty(single, valid, form, per_sentence) * weights).sum(), single)
        torch.testing.assert_close(grad, want, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="one shape"):
        diversity_penalty([a, b[:, :2]], valid, form)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("lengths", [[3, 2, 0], [3, 3]], ids=["padded", "full"])
def test_gradcheck_fused_functions(lengths, per_sentence):
    """Each autograd Function's analytic backward against finite differences (the bounded
    L_Dqq's in both arguments, L_dv's for one and for two posteriors). No one-token sentence:
    there p(q_i^h | c) = 1, so p = sum_c Q_ic^h' is 1 up to rounding, on the kink of min(p, 1)."""
    log_joint, log_post, post, valid = inputs(lengths, seed=6, heads=2, num_c=3)
    valid = None if lengths == [3, 3] else valid
    log_joint, log_post, post = (t.detach().requires_grad_() for t in (log_joint, log_post, post))
    other = torch.softmax(torch.randn_like(post), -1).requires_grad_()
    for form in FORMS:
        assert torch.autograd.gradcheck(lambda p: diversity_penalty(p, valid, form, per_sentence), (post,))
        both = lambda p, q: diversity_penalty((p, q), valid, form, per_sentence)  # noqa: E731
        assert torch.autograd.gradcheck(both, (post, other))
    assert torch.autograd.gradcheck(lambda p: infonce_bound(p, valid, per_sentence), (post,))
    bounded = lambda a, b: head_dependence_bound(a, b, valid, form="bounded", per_sentence=per_sentence)  # noqa: E731
    assert torch.autograd.gradcheck(bounded, (log_joint, log_post))


def all_terms(log_joint, log_post, post, valid, per_sentence):
    return {
        **{f"div {form}": diversity_penalty(post, valid, form, per_sentence) for form in FORMS},
        "dxq": infonce_bound(post, valid, per_sentence),
        "dqq": head_dependence_bound(log_joint, log_post, valid, form="bounded", per_sentence=per_sentence),
        "mean": masked_token_mean(log_post[..., 0], valid, per_sentence),
    }


@pytest.mark.parametrize("per_sentence", [False, True])
def test_fp32_matches_fp64(per_sentence):
    double = inputs(LENGTHS, seed=7)
    single = inputs(LENGTHS, seed=7, dtype=torch.float32)
    want = all_terms(*double, per_sentence)
    for name, got in all_terms(*single, per_sentence).items():
        assert got.dtype == torch.float32, name
        torch.testing.assert_close(got.double(), want[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_autocast_is_off_inside(dtype):
    """Under bf16 autocast the terms run in fp32 (autocast off inside, inputs widened): the
    values are finite, fp32, and with fp32 inputs the very values of a run without autocast;
    the gradients are finite."""
    log_joint, log_post, post, valid = (t.to(dtype) if t.is_floating_point() else t for t in inputs(LENGTHS, seed=8))
    leaves = [t.detach().requires_grad_() for t in (log_joint, log_post, post)]
    plain = all_terms(*leaves, valid, per_sentence=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = all_terms(*leaves, valid, per_sentence=False)
        grads = torch.autograd.grad(sum(under.values()), leaves)
    for name, value in under.items():
        assert value.dtype == (torch.float32 if name != "mean" else dtype) and torch.isfinite(value), name
        if dtype == torch.float32:
            assert value.item() == plain[name].item(), name
    assert all(torch.isfinite(grad).all() for grad in grads)


# ----------------------------------------------------------------------------- blocks
def test_sentence_blocks_are_one_block_off_the_cpu():
    """Blocks are a CPU cache optimisation; on any other device each block repeats every
    operator call (kernel launches), so the whole batch is one block."""
    assert blocking.sentence_blocks(64, blocking.BLOCK_ELEMENTS) == [slice(i, i + 1) for i in range(64)]
    assert len(blocking.sentence_blocks(64, blocking.BLOCK_ELEMENTS, torch.device("cpu"))) == 64
    for device in (torch.device("cuda"), torch.device("meta"), "cuda:1"):
        assert blocking.sentence_blocks(64, blocking.BLOCK_ELEMENTS, device) == [slice(None)]


def test_infonce_runs_block_by_block_on_the_cpu_only(monkeypatch):
    """One sentence per block on the CPU gives the same value and gradient as the whole batch."""
    _, _, post, valid = inputs(LENGTHS, seed=9)
    post.requires_grad_()
    whole = infonce_bound(post, valid, per_sentence=True)
    (grad_whole,) = torch.autograd.grad(whole.sum(), post)
    calls = []
    original = blocking.sentence_blocks
    monkeypatch.setattr(blocking, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(blocking, "sentence_blocks", lambda *a, **k: calls.append((a, k)) or original(*a, **k))
    blocked = infonce_bound(post, valid, per_sentence=True)
    (args, kwargs), = calls  # told the device, so that off the CPU it would be one block
    assert post.device.type in (*args, *kwargs.values())  # the path's device (device_paths)
    torch.testing.assert_close(blocked, whole, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(blocked.sum(), post)[0], grad_whole, rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------- launches
def launches(kernel_calls, term, leaves):
    """Kernel launches of ``term()``'s forward and backward (its ``sum`` and the seed of the
    backward, two calls, included), counted by ``benchmarks/kernel_calls.py``."""
    torch.autograd.grad(term().sum(), leaves)  # once before: nothing lazy is counted
    return kernel_calls.total(kernel_calls.count_kernel_calls(lambda: torch.autograd.grad(term().sum(), leaves)))


# The most launches allowed, (padded, per_sentence) -> count: the counts measured when the
# functions were fused; in the comments those of the unfused code they replaced, in the same
# order. The shapes do not change them: B=8, H=4, N=32, C=4 in fp32 gave the same.
LAUNCHES = {
    "div paper": {(True, False): 15, (True, True): 12, (False, False): 8, (False, True): 8},  # 41 37 31 33
    "div entrywise": {(True, False): 19, (True, True): 16, (False, False): 11, (False, True): 11},  # 57 53 44 46
    "dxq": {(True, False): 23, (True, True): 21, (False, False): 13, (False, True): 13},  # 47 47 31 31
    "dqq bounded": {(True, False): 26, (True, True): 26, (False, False): 22, (False, True): 22},  # 49 49 38 38
    "token mean": {(True, False): 9, (True, True): 9, (False, False): 4, (False, True): 4},  # 12 12 4 4
}


def term_and_leaves(name, padded, per_sentence):
    log_joint, log_post, post, valid = (t.requires_grad_() if t.is_floating_point() else t for t in inputs(LENGTHS))
    valid = valid if padded else None
    if name.startswith("div"):
        return lambda: diversity_penalty(post, valid, name.split()[1], per_sentence), [post]
    if name == "dxq":
        return lambda: infonce_bound(post, valid, per_sentence), [post]
    if name == "dqq bounded":
        return (
            lambda: head_dependence_bound(log_joint, log_post, valid, form="bounded", per_sentence=per_sentence),
            [log_joint, log_post],
        )
    values = log_post.detach()[..., 0].requires_grad_()
    return lambda: masked_token_mean(values, valid, per_sentence), [values]


@pytest.mark.parametrize("name, padded, per_sentence", [(name, *key) for name in LAUNCHES for key in LAUNCHES[name]])
def test_forward_and_backward_launches(kernel_calls, name, padded, per_sentence):
    term, leaves = term_and_leaves(name, padded, per_sentence)
    assert launches(kernel_calls, term, leaves) <= LAUNCHES[name][padded, per_sentence]


@pytest.mark.parametrize("per_sentence", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_several_posteriors_launch_one_concatenation_more(kernel_calls, form, per_sentence):
    _, _, post, valid = inputs(LENGTHS)
    post.requires_grad_()
    other = post.detach().flip(1).requires_grad_()
    both = launches(kernel_calls, lambda: diversity_penalty([post, other], valid, form, per_sentence), [post, other])
    assert both <= LAUNCHES[f"div {form}"][True, per_sentence] + 1
