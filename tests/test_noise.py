"""modules/noise.py: DMA's N(0, 1) draws, chunked over CPU threads."""

import math

import pytest
import torch

from fairseq_modattn.modules import noise
from fairseq_modattn.modules.noise import CHUNK, PARALLEL_MIN, standard_normal

CPU = torch.device("cpu")


@pytest.fixture
def threads():
    """Run a test body at a given torch thread count, restoring the count afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def draw(shape, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return standard_normal(shape, dtype, CPU)


def test_small_tensors_are_torch_randn():
    torch.manual_seed(3)
    expected = torch.randn(7, 5, dtype=torch.float64)
    torch.testing.assert_close(draw((7, 5), 3, torch.float64), expected, rtol=0, atol=0)


def test_large_tensors_follow_the_seed_not_the_thread_count(threads):
    shape = (PARALLEL_MIN // 64 + 3, 64)  # more than PARALLEL_MIN values, a partial last chunk
    threads(1)
    one = draw(shape, 5)
    threads(2)
    two = draw(shape, 5)
    torch.testing.assert_close(one, two, rtol=0, atol=0)
    assert not torch.equal(one, draw(shape, 6))


def test_large_tensors_are_standard_normal_with_independent_chunks(threads):
    threads(2)
    x = draw((PARALLEL_MIN + CHUNK // 2,), 0)
    n = x.numel()
    assert abs(x.mean().item()) < 5 / math.sqrt(n)
    assert x.var().item() == pytest.approx(1.0, abs=5 * math.sqrt(2 / n))
    assert torch.isfinite(x).all()
    chunks = x[: (n // CHUNK) * CHUNK].view(-1, CHUNK)
    # every chunk has its own stream: no two start alike, and neighbours are uncorrelated
    assert len({round(c[0].item(), 6) for c in chunks}) == chunks.size(0)
    correlation = (chunks[:-1] * chunks[1:]).mean(1)
    assert correlation.abs().max().item() < 5 / math.sqrt(CHUNK)
    # standard normal quantiles: P(|x| < 1) = 0.6827, P(|x| < 2) = 0.9545
    assert (x.abs() < 1).float().mean().item() == pytest.approx(0.6827, abs=0.005)
    assert (x.abs() < 2).float().mean().item() == pytest.approx(0.9545, abs=0.003)


def test_a_forked_process_gets_its_own_pool(threads, monkeypatch):
    threads(2)
    draw((PARALLEL_MIN,), 0)
    parent_pool = noise._pool
    monkeypatch.setattr(noise.os, "getpid", lambda: -1)
    draw((PARALLEL_MIN,), 0)
    assert noise._pool is not parent_pool
