"""The GMM's passes over its points as Triton kernels (``mixture_triton``, ``--dma-backend
triton``) against the matmul GMM, run in Triton's interpreter on a machine without CUDA (as
tests/test_triton_attention.py explains) and compiled with ``--torch-device cuda``.

The kernels compute the equations of ``gmm._MixtureStatistics`` point by point, as the C
kernels do (tests/test_native_mixture.py, whose ``run_gmm`` runs both here): in fp64 they equal
the fp64 matmul GMM to rounding (the scales used are exact in fp32, the precision a GPU passes
a kernel's float arguments in), and in fp32 their error against that fp64 oracle stays within
4 x the fp32 matmul path's own, for every output and every gradient, for each set of inputs that
needs a gradient and each subset of outputs that reaches the loss. gradcheck in fp64 covers
the hand-written backward through ``DiagonalGMM``.
"""

import sys

import pytest
import torch

if sys.platform != "linux":
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")

from fairseq_modattn.modules import mixture_triton  # noqa: E402
from fairseq_modattn.modules.gmm import DiagonalGMM  # noqa: E402
from test_native_mixture import CASES, OUTPUTS, run_gmm  # noqa: E402


def compare(kwargs, fp64_rtol=1e-11):
    oracle = run_gmm(torch.float64, False, **kwargs)
    exact = run_gmm(torch.float64, False, triton=True, **kwargs)
    matmul = run_gmm(torch.float32, False, **kwargs)
    kernels = run_gmm(torch.float32, False, triton=True, **kwargs)
    problems = []
    for kind in range(2):
        assert len(kernels[kind]) == len(oracle[kind]) == len(exact[kind])
        for index, (expected, by_fp64, by_matmul, by_kernels) in enumerate(
                zip(oracle[kind], exact[kind], matmul[kind], kernels[kind])):
            what = f"{'output' if kind == 0 else 'gradient'} {index}"
            if expected is None:
                assert by_kernels is None and by_fp64 is None, what
                continue
            size = max(expected.abs().max().item(), 1e-30)
            fp64_error = (by_fp64 - expected).abs().max().item()
            if not fp64_error <= fp64_rtol * size:
                problems.append(f"{what} in fp64: {fp64_error:.2e} of {size:.2e}")
            matmul_error = (by_matmul.double() - expected).abs().max().item()
            kernel_error = (by_kernels.double() - expected).abs().max().item()
            if not kernel_error <= 4 * matmul_error + 1e-6 * size:
                problems.append(f"{what} in fp32: kernels {kernel_error:.2e}, matmuls {matmul_error:.2e} "
                                f"(largest value {size:.2e})")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("need_kl", [True, False])
def test_kernels_match_the_matmul_gmm_for_each_input_that_needs_a_gradient(case, need_kl):
    compare({"case": case, "need_kl": need_kl, "tokens": 12})


@pytest.mark.parametrize("outputs", list(OUTPUTS))
@pytest.mark.parametrize("groups", [3, 1])
def test_kernels_match_the_matmul_gmm_for_each_output_that_reaches_the_loss(outputs, groups):
    compare({"outputs": OUTPUTS[outputs], "groups": groups, "scale": 1.0 if groups == 3 else 0.25, "tokens": 12})


@pytest.mark.parametrize("dim, clusters", [(12, 1), (40, 16), (130, 8)])
def test_kernels_at_other_widths_and_cluster_counts_and_frozen_parameters(dim, clusters):
    # d not a power of two (padded tiles), one cluster, the most clusters, more points than a block
    compare({"dim": dim, "clusters": clusters, "tokens": 23, "frozen": clusters == 8})


def test_gradcheck_through_the_gmm_in_fp64():
    # c_grad = 1: any other multiplies the means' gradient on purpose, which gradcheck would flag
    torch.manual_seed(3)
    gmm = DiagonalGMM(3, 16, 2, centroid_grad_mult=1.0).double()
    x = torch.randn(2, 2, 3, 16, dtype=torch.float64, requires_grad=True)
    eps = torch.randn(2, 2, 3, 16, dtype=torch.float64)

    def statistics(points, logits, means, log_vars):
        # the sample z~ = x + (s / a) eps with s = 0.5 and a = 0.5, as the module's contract asks
        stats = torch.func.functional_call(
            gmm, {"logits": logits, "means": means, "log_vars": log_vars}, (points,),
            {"noise_var": 0.25, "sample": True, "need_kl": True, "point": points + eps, "scale": 0.5, "triton": True})
        return stats.log_joint, stats.log_post, stats.post, stats.kl

    inputs = (x, *(p.detach().clone().requires_grad_() for p in (gmm.logits, gmm.means, gmm.log_vars)))
    assert torch.autograd.gradcheck(statistics, inputs, fast_mode=True, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("need_kl", [True, False])
@pytest.mark.parametrize("groups", [3, 1])
def test_the_graphs_gmm_backward_passes_gradcheck_in_fp64(need_kl, groups):
    # ``dma_compiled._MixtureKernelBackward``, the "triton" backend's GMM in its graph: the
    # forward's broadcast products, the kernel's backward from the kernel's per-block sums, for
    # points (tokens, sentences, heads, d) sampled at z = x + 0.5 eps, per-head mixtures (G = H,
    # the points taken head by head) or one shared one; the mixtures' constants as free inputs;
    # 13 x 3 points are two blocks of 32
    from fairseq_modattn.modules import dma_compiled, triton_ops  # noqa: F401 - registers the operators

    torch.manual_seed(4)
    heads, dim, clusters = 3, 16, 3
    x = torch.randn(13, 3, heads, dim, dtype=torch.float64)
    eps = torch.randn(x.shape, dtype=torch.float64)
    inv_var = torch.rand(groups, clusters, dim, dtype=torch.float64) + 0.5
    scaled_means = torch.randn(groups, clusters, dim, dtype=torch.float64)
    log_norm, offset = (torch.randn(groups, clusters, dtype=torch.float64) for _ in range(2))

    def statistics(x, inv_var, scaled_means, log_norm, offset):
        out = dma_compiled._MixtureKernelBackward.apply(
            x, x + 0.5 * eps, inv_var, scaled_means, log_norm, offset, 1.7, need_kl, 2)
        return out if need_kl else out[:3]

    inputs = tuple(t.requires_grad_() for t in (x, inv_var, scaled_means, log_norm, offset))
    assert torch.autograd.gradcheck(statistics, inputs, fast_mode=True, atol=1e-8, rtol=1e-6)


def test_which_points_take_the_kernels():
    points = torch.randn(2, 10, 8)
    assert mixture_triton.available(points, 4) and mixture_triton.available(points.double(), 16)
    assert not mixture_triton.available(points.half(), 4)
    assert not mixture_triton.available(points.transpose(1, 2), 4)
    assert not mixture_triton.available(points, mixture_triton.MAX_CLUSTERS + 1)
