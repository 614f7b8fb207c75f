"""Noise that backward draws again instead of keeping it (modules/noise.py), and the GMM that
rebuilds its mean from it: the same values and gradients as keeping the mean."""

import math

import pytest
import torch

from fairseq_modattn.modules.gmm import DiagonalGMM
from fairseq_modattn.modules.noise import ReplayableNoise


def test_replay_repeats_the_draws_and_leaves_the_generator_alone():
    like = torch.randn(3, 4, 5).permute(2, 0, 1)  # strided, as randn_like draws for it
    torch.manual_seed(0)
    expected = [torch.randn_like(like), torch.randn(2, 3)]
    following = torch.rand(4)
    torch.manual_seed(0)
    noise = ReplayableNoise()
    drawn = noise.draw(like, ((2, 3), torch.float32, torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))
    assert drawn[0].stride() == like.stride()
    replayed = noise.replay()
    assert all(torch.equal(a, b) for a, b in zip(replayed, expected))
    assert torch.equal(torch.rand(4), following)  # replay did not advance the global generator
    with pytest.raises(RuntimeError):
        noise.draw(like)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_gmm_rebuilding_its_mean_equals_keeping_it(scale):
    torch.manual_seed(3)
    gmm = DiagonalGMM(3, 4, 2, init="spread").double()
    base = torch.randn(5, 3, 8, dtype=torch.float64)
    noise_var, results = 0.2, []
    for replayed in (False, True):
        x = base.clone().requires_grad_()
        heads = x.view(5, 3, 2, 4).permute(1, 2, 0, 3)  # token-major points seen by head, as DMA passes them
        torch.manual_seed(7)
        noise = ReplayableNoise()
        (eps,) = noise.draw((heads.shape, heads.dtype, heads.device))
        point = torch.add(heads, eps, alpha=math.sqrt(noise_var) / scale)
        stats = gmm(heads, noise_var, sample=True, need_kl=True, point=point, scale=scale,
                    noise_replay=(lambda: noise.replay()[0]) if replayed else None)
        loss = stats.kl.sum() + (stats.post * torch.arange(3.0, dtype=torch.float64)).sum() + stats.log_joint.sum()
        grads = torch.autograd.grad(loss, [x, *gmm.parameters()])
        results.append((stats, grads))
    (kept, kept_grads), (rebuilt, rebuilt_grads) = results
    for a, b in zip(kept, rebuilt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(kept_grads, rebuilt_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
