"""Noise that backward draws again instead of keeping it (modules/noise.py), and the GMM that
rebuilds its mean from it: the same values and gradients as keeping the mean."""

import math

import pytest
import torch

from fairseq_modattn.modules import native_normal
from fairseq_modattn.modules.gmm import DiagonalGMM
from fairseq_modattn.modules.noise import ReplayableNoise, standard_normal, standard_normal_like


@pytest.fixture(params=["native", "torch"])
def generator(request, monkeypatch):
    """Each test on both of noise.py's generators: the native CPU stream and torch's."""
    if request.param == "native":
        if native_normal.library() is None:
            pytest.skip("the native noise library is not available here (see its log line)")
    else:
        monkeypatch.setattr(native_normal, "library", lambda: None)
    return request.param


def test_replay_repeats_the_draws_and_leaves_the_generator_alone(generator):
    like = torch.randn(3, 4, 5).permute(2, 0, 1)
    torch.manual_seed(0)
    expected = [standard_normal_like(like), standard_normal((2, 3), torch.float32, torch.device("cpu"))]
    following = torch.rand(4)
    torch.manual_seed(0)
    noise = ReplayableNoise()
    drawn = noise.draw(like, ((2, 3), torch.float32, torch.device("cpu")))
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))
    assert drawn[0].shape == like.shape and drawn[0].is_contiguous()
    replayed = noise.replay()
    assert all(torch.equal(a, b) for a, b in zip(replayed, expected))
    assert torch.equal(torch.rand(4), following)  # replay did not advance the global generator
    with pytest.raises(RuntimeError):
        noise.draw(like)


def test_draws_follow_the_seed_and_take_the_generator_of_the_path(generator):
    cpu = torch.device("cpu")
    torch.manual_seed(1)
    first = standard_normal((64, 33), torch.float32, cpu)
    torch.manual_seed(1)
    assert torch.equal(standard_normal((64, 33), torch.float32, cpu), first)
    assert not torch.equal(standard_normal((64, 33), torch.float32, cpu), first)
    torch.manual_seed(1)
    same_as_torch = torch.equal(torch.randn(64, 33), first)
    assert same_as_torch == (generator == "torch")
    torch.manual_seed(1)
    doubled = standard_normal((64, 33), torch.float64, cpu)
    assert doubled.dtype == torch.float64
    if generator == "native":  # the fp32 stream, cast
        assert torch.equal(doubled, first.double())


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_gmm_rebuilding_its_mean_equals_keeping_it(scale, generator):
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
