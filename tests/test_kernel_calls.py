"""The launch counter of the benchmarks (benchmarks/kernel_calls.py) and the device-path switch
that lets the CPU count what a GPU launches (fairseq_modattn/modules/device_paths.py)."""

import pytest
import torch
import torch.nn.functional as F

from fairseq_modattn.modules import device_paths, native_normal, noise
from fairseq_modattn.modules.dma_attention import DisentangledMaskAttention
from fairseq_modattn.modules.gmm import log_softmax_over_clusters


def test_math_path_sdpa_counts_as_one_fused_call_each_way(kernel_calls):
    q = torch.randn(2, 2, 5, 4, requires_grad=True)
    bias = torch.randn(2, 2, 5, 5, requires_grad=True)  # a bias with a gradient: the CPU's math path

    def step():
        F.scaled_dot_product_attention(q, q, q, attn_mask=bias).sum().backward()

    plain = kernel_calls.count_kernel_calls(step)
    fused = kernel_calls.count_kernel_calls(step, math_sdpa_as_fused=True)
    assert fused["aten::scaled_dot_product_attention"] == 1
    assert fused["aten::scaled_dot_product_attention [backward]"] == 1
    assert "aten::bmm" in plain and "aten::bmm" not in fused  # the decomposed backward's matmuls
    assert kernel_calls.total(plain) > kernel_calls.total(fused)
    # an SDPA that took a fused kernel anyway is counted as it ran
    q.grad = None
    flash = kernel_calls.count_kernel_calls(lambda: F.scaled_dot_product_attention(q, q, q).sum().backward(),
                                            math_sdpa_as_fused=True)
    assert "aten::scaled_dot_product_attention [backward]" not in flash


def test_views_and_detach_are_not_launches(kernel_calls):
    x = torch.randn(3, 4, 5, requires_grad=True)
    counts = kernel_calls.count_kernel_calls(lambda: x.movedim(0, -1).sum().backward())
    assert "aten::movedim" not in counts and "aten::detach" not in counts
    assert counts["aten::sum"] == 1


def test_a_native_kernel_counts_once_and_emulating_a_gpu_takes_torchs_draw(kernel_calls):
    if native_normal.library() is None:
        pytest.skip("the native noise library is not available here")
    shape, cpu = (64, 8), torch.device("cpu")
    # the key (from torch's generator) and the C kernel
    assert kernel_calls.count_kernel_calls(lambda: noise.standard_normal(shape, torch.float32, cpu)) == {
        "aten::random_": 1, "fairseq_modattn::philox_normal": 1}
    with device_paths.emulate("cuda"):
        assert kernel_calls.count_kernel_calls(lambda: noise.standard_normal(shape, torch.float32, cpu)) == {
            "aten::randn": 1}


def test_emulate_switches_the_path_and_restores_it():
    x = torch.zeros(1)
    assert device_paths.path_device(x) == "cpu"
    with pytest.raises(RuntimeError):
        with device_paths.emulate("cuda"):
            assert device_paths.path_device(x) == "cuda"
            raise RuntimeError
    assert device_paths.path_device(x) == "cpu"


def test_emulated_paths_compute_the_same_values():
    torch.manual_seed(0)
    joint = torch.randn(3, 17, 4, dtype=torch.float64)
    with device_paths.emulate("cuda"):
        gpu_form = log_softmax_over_clusters(joint)
    torch.testing.assert_close(gpu_form, log_softmax_over_clusters(joint), rtol=1e-14, atol=1e-14)

    m = DisentangledMaskAttention(16, 2, num_clusters=3, self_attention=True).double().eval()
    m.set_num_updates(2000)
    x = torch.randn(6, 2, 16, dtype=torch.float64)
    assert m.uses_fused_kernel(x)
    with device_paths.emulate("cuda"):
        assert not m.uses_fused_kernel(x)
        emulated, _ = m(x, x, x, need_weights=False)
    fused, _ = m(x, x, x, need_weights=False)
    torch.testing.assert_close(emulated, fused, rtol=1e-12, atol=1e-12)
