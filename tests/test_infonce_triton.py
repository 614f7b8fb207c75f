"""L_Dxq's critic as Triton kernels (``infonce_triton``, ``--dma-backend triton``) against the
eager ``mi_bounds.infonce_bound`` and against the equation written out here, in Triton's
interpreter on a machine without CUDA (as tests/test_triton_attention.py explains).

The bound and its gradient in fp64 to 1e-12, for padded and unpadded batches, per-sentence
values and the batch mean, one to sixteen clusters and sentences longer than one block of keys;
gradcheck in fp64; and fp32 against fp64 within 1e-5 of the gradients' scale.
"""

import math
import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from fairseq_modattn.modules import infonce_triton  # noqa: E402
from fairseq_modattn.modules.mi_bounds import infonce_bound  # noqa: E402


def naive(post, valid, per_sentence):
    """mean over real tokens i of [ (1/H) sum_h (f_ii - log sum_{real j} exp f_ij) + log n ]."""
    values = []
    for b in range(post.size(0)):
        keep = valid[b] if valid is not None else torch.ones(post.size(2), dtype=torch.bool)
        q = post[b][:, keep]  # (H, n, C)
        n = q.size(1)
        if n == 0:
            values.append(post.new_zeros(()))
            continue
        critic = q @ q.transpose(-1, -2)
        score = (critic.diagonal(dim1=-2, dim2=-1) - critic.logsumexp(-1)).mean(0)  # (n,)
        values.append(score.mean() + math.log(n) if per_sentence else (score + math.log(n)))
    if per_sentence:
        return torch.stack(values)
    return torch.cat([v.view(-1) for v in values]).mean()


def batch(bsz=3, heads=2, length=11, clusters=4, padded=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    post = torch.randn(bsz, heads, length, clusters, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    valid = None
    if padded:
        valid = torch.ones(bsz, length, dtype=torch.bool)
        valid[0, -3:] = False
        valid[1, :2] = False
        post = post.masked_fill(~valid[:, None, :, None], 50.0)  # poison: padded tokens reach no sum
    return post.to(dtype).requires_grad_(), valid


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("per_sentence", [True, False])
@pytest.mark.parametrize("length, clusters", [(11, 4), (70, 1), (40, 16)])
def test_kernels_equal_the_eager_bound_and_the_equation_in_fp64(padded, per_sentence, length, clusters):
    post, valid = batch(length=length, clusters=clusters, padded=padded)
    got = infonce_bound(post, valid, per_sentence, triton=True)
    eager = infonce_bound(post, valid, per_sentence)
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, naive(post, valid, per_sentence), rtol=1e-12, atol=1e-12)
    weights = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(4))
    (grad,) = torch.autograd.grad((got * weights).sum(), post)
    (expected,) = torch.autograd.grad((eager * weights).sum(), post)
    # with one cluster every posterior is 1 and the gradient 0: both sides hold rounding only
    assert (grad - expected).abs().max().item() <= 1e-12 * expected.abs().max().item() + 1e-15


def test_gradcheck_in_fp64():
    post, valid = batch(2, 2, 7, 3)
    post = post.detach().clamp_max(1.0).requires_grad_()
    for per_sentence in (True, False):
        assert torch.autograd.gradcheck(lambda p: infonce_bound(p, valid, per_sentence, triton=True), (post,),
                                        fast_mode=True, atol=1e-9, rtol=1e-6)


def test_fp32_against_fp64():
    post, valid = batch(length=45, padded=True)
    single = post.detach().float().requires_grad_()
    got = infonce_bound(single, valid, True, triton=True)
    exact = infonce_bound(post, valid, True)
    assert (got.double() - exact).abs().max().item() <= 1e-5 * max(exact.abs().max().item(), 1.0)
    (grad,) = torch.autograd.grad(got.sum(), single)
    (want,) = torch.autograd.grad(exact.sum(), post)
    assert (grad.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_which_posteriors_take_the_kernels():
    post = torch.rand(2, 2, 5, 4)
    assert infonce_triton.available(post) and infonce_triton.available(post.double())
    assert not infonce_triton.available(post.half()) and not infonce_triton.available(torch.rand(2, 2, 5, 17))
