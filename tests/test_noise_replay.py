"""Noise that backward draws again instead of keeping it (modules/noise.py), and the GMM that
rebuilds its mean from it: the same values and gradients as keeping the mean."""

import math

import pytest
import torch

from fairseq_modattn.modules import noise as noise_module
from fairseq_modattn.modules.gmm import DiagonalGMM
from fairseq_modattn.modules.noise import ReplayableNoise, standard_normal, standard_normal_like


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


@pytest.fixture
def small_parallel_draws(monkeypatch):
    """Chunked draws from 64 values on, in chunks of 16, so that tests stay small."""
    monkeypatch.setattr(noise_module, "PARALLEL_DRAW_MIN", 64)
    monkeypatch.setattr(noise_module, "CHUNK", 16)


def _draw_with_threads(threads, draw):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(11)
        return draw(), torch.rand(3)
    finally:
        torch.set_num_threads(previous)


def test_chunked_draws_depend_on_the_seed_alone(small_parallel_draws):
    """The same values on one thread and on two, the global generator left in the same state;
    each chunk its own stream; below the threshold exactly torch's own draw."""
    draw = lambda: standard_normal((5, 20), torch.float32, torch.device("cpu"))  # noqa: E731
    (one, after_one), (two, after_two) = _draw_with_threads(1, draw), _draw_with_threads(2, draw)
    assert torch.equal(one, two) and torch.equal(after_one, after_two)
    chunks = one.view(-1)[:96].view(6, 16)
    assert all(not torch.equal(chunks[i], chunks[j]) for i in range(6) for j in range(i))
    torch.manual_seed(11)
    assert not torch.equal(one, torch.randn(5, 20))  # chunked: not torch's own stream
    torch.manual_seed(11)
    small = standard_normal((7, 9), torch.float32, torch.device("cpu"))
    torch.manual_seed(11)
    assert torch.equal(small, torch.randn(7, 9))


def test_chunked_draws_follow_memory_order_and_replay(small_parallel_draws):
    """A permuted (dense) layout is filled in memory order, as its contiguous twin is, and
    ReplayableNoise draws the large tensor again exactly."""
    like = torch.empty(6, 4, 5).permute(2, 0, 1)
    torch.manual_seed(2)
    strided = standard_normal_like(like)
    torch.manual_seed(2)
    contiguous = standard_normal((6, 4, 5), torch.float32, torch.device("cpu"))
    assert strided.stride() == like.stride()
    assert torch.equal(strided.permute(1, 2, 0), contiguous)
    noise = ReplayableNoise()
    (drawn,) = noise.draw(like)
    (again,) = noise.replay()
    assert torch.equal(drawn, again) and drawn.stride() == like.stride()


def test_chunked_draws_are_standard_normal():
    """The real chunk size: four chunks of 2^20 values, mean 0 and variance 1 within 5 sigma,
    and no two chunks alike."""
    torch.manual_seed(0)
    values = standard_normal((4, noise_module.CHUNK), torch.float32, torch.device("cpu"))
    n = values.numel()
    assert abs(values.mean().item()) < 5.0 / math.sqrt(n)
    assert abs(values.var().item() - 1.0) < 5.0 * math.sqrt(2.0 / n)
    assert not torch.equal(values[0], values[1])


def test_emulated_gpu_path_draws_as_torch_does(small_parallel_draws):
    """Under device_paths.emulate("cuda") the draw is one normal_ call, as on a GPU."""
    from fairseq_modattn.modules import device_paths

    torch.manual_seed(4)
    with device_paths.emulate("cuda"):
        drawn = standard_normal((5, 20), torch.float32, torch.device("cpu"))
    torch.manual_seed(4)
    assert torch.equal(drawn, torch.randn(5, 20))
