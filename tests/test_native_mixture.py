"""The GMM's C kernels (``native_mixture``, ``mixture_kernels.c``) against the matmul GMM.

The kernels compute the equations of ``gmm._MixtureStatistics`` point by point, so their fp32
results differ from the matmul path's by rounding only. Each comparison runs the matmul path in
fp64 as the oracle and requires the kernels' fp32 error to stay within a small multiple of the
matmul path's own fp32 error, for every output and every gradient, for each set of inputs that
needs a gradient and each subset of outputs that reaches the loss.
"""

import logging
import math
import os
from pathlib import Path

import pytest
import torch

import tiers
from fairseq_modattn.modules import gmm as gmm_module
from fairseq_modattn.modules import native_build, native_mixture
from fairseq_modattn.modules.gmm import DiagonalGMM

LIBRARY = native_mixture.library()
needs_library = pytest.mark.skipif(LIBRARY is None, reason="the native GMM kernels are not available here (log line)")

CASES = ["shared point", "own draw", "detached point", "detached mean", "replayed mean", "no sample"]
OUTPUTS = {"all": (0, 1, 2, 3), "kl": (3,), "posterior": (2,), "joint": (0,), "log posterior": (1,)}


def run_gmm(dtype, native, case="shared point", need_kl=True, outputs=OUTPUTS["all"], groups=3, scale=0.5,
            frozen=False, tokens=40, batch=3, dim=16, clusters=5, triton=False):
    """Outputs and gradients of one ``DiagonalGMM`` call on a head-split view of a token-major
    activation (``groups`` heads; one group: the heads flattened into the points), with the
    kernels on or off (``triton``: the Triton kernels, tests/test_mixture_triton.py). Values
    are drawn in fp32 and cast, so that every dtype sees the same."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native_mixture, "_library", LIBRARY if native else None)
        patch.setattr(native_mixture, "_looked_for", True)
        gen = torch.Generator().manual_seed(31)
        gmm = DiagonalGMM(clusters, dim, groups, centroid_grad_mult=3.0)
        with torch.no_grad():
            gmm.means.copy_(torch.randn(gmm.means.shape, generator=gen) * 0.6)
            gmm.log_vars.copy_(torch.randn(gmm.log_vars.shape, generator=gen) * 0.3)
            gmm.logits.copy_(torch.randn(gmm.logits.shape, generator=gen))
        gmm = gmm.to(dtype).requires_grad_(not frozen)
        heads = 4 if groups == 1 else groups
        base = torch.randn(tokens, batch, heads * dim, generator=gen).to(dtype)
        eps = torch.randn(tokens, batch, heads * dim, generator=gen).to(dtype)
        weights = [torch.randn(shape, generator=gen).to(dtype) for shape in
                   [(batch, heads, tokens, clusters)] * 3 + [(batch, heads, tokens)]]
        x = base.clone().requires_grad_(case != "detached mean")

        def split(t):  # (B, H, T, d); one group flattens the heads into its points
            return t.view(tokens, batch, heads, dim).permute(1, 2, 0, 3)

        kwargs = {"need_kl": need_kl, "sample": case != "no sample", "noise_var": 0.3, "scale": scale,
                  "triton": triton}
        sampled = None
        if case == "own draw":
            torch.manual_seed(5)
        elif case != "no sample":
            source = x.detach() if case == "detached point" else x
            sampled = torch.add(source, eps, alpha=math.sqrt(0.3) / scale)
            if case == "detached mean":
                sampled.requires_grad_()
            kwargs["point"] = split(sampled)
            if case == "replayed mean":
                kwargs["noise_replay"] = lambda: split(eps)
        stats = gmm(split(x), **kwargs)
        every = [stats.log_joint, stats.log_post, stats.post, stats.kl]
        loss = sum((every[i] * weights[i].view_as(every[i])).sum() for i in outputs if every[i] is not None)
        leaves = [t for t in (x, sampled, *gmm.parameters())
                  if t is not None and t.requires_grad and (t is not sampled or case == "detached mean")]
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if leaves else ()
        return [o.detach() for o in every if o is not None], list(grads)


def assert_as_close_to_fp64(kwargs):
    """The kernels' fp32 results are no further from the fp64 matmul results than 4 x the matmul
    path's fp32 results are (plus 1e-6 of the largest value, for results the matmuls get exact)."""
    oracle = run_gmm(torch.float64, False, **kwargs)
    matmul = run_gmm(torch.float32, False, **kwargs)
    native = run_gmm(torch.float32, True, **kwargs)
    for kind in range(2):
        assert len(native[kind]) == len(oracle[kind])
        for index, (expected, by_matmul, by_native) in enumerate(zip(oracle[kind], matmul[kind], native[kind])):
            if expected is None:
                assert by_native is None and by_matmul is None
                continue
            size = expected.abs().max().item()
            matmul_error = (by_matmul.double() - expected).abs().max().item()
            native_error = (by_native.double() - expected).abs().max().item()
            assert native_error <= 4 * matmul_error + 1e-6 * size, (
                f"{'output' if kind == 0 else 'gradient'} {index}: native {native_error:.2e}, matmul "
                f"{matmul_error:.2e} (largest value {size:.2e})")


@needs_library
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("need_kl", [True, False])
def test_kernels_match_the_matmul_gmm_for_each_input_that_needs_a_gradient(case, need_kl):
    assert_as_close_to_fp64({"case": case, "need_kl": need_kl})


@needs_library
@pytest.mark.parametrize("outputs", list(OUTPUTS))
@pytest.mark.parametrize("groups", [3, 1])
def test_kernels_match_the_matmul_gmm_for_each_output_that_reaches_the_loss(outputs, groups):
    assert_as_close_to_fp64({"outputs": OUTPUTS[outputs], "groups": groups, "scale": 1.0 if groups == 3 else 0.25})


@needs_library
def test_kernels_match_the_matmul_gmm_with_frozen_parameters():
    assert_as_close_to_fp64({"frozen": True, "case": "replayed mean"})


@needs_library
def test_the_gmm_takes_the_kernels_on_the_cpu_in_fp32(monkeypatch):
    """Forward and backward of a training call run the kernels (not the matmuls) where they can."""
    calls = []
    for name in ("forward", "backward"):
        original = getattr(native_mixture, name)
        monkeypatch.setattr(native_mixture, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    run_gmm(torch.float32, True)
    assert calls == ["forward", "backward"]
    calls.clear()
    run_gmm(torch.float64, True)
    assert calls == []


@needs_library
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_results_do_not_depend_on_the_parts_or_the_other_points(parts, monkeypatch):
    """A point's outputs and gradient are the same bits whether the points run as one part or
    several at once, and whatever other points share the call (incremental decoding clusters a
    step's query alone, the full forward all of them); the column sums agree to rounding."""
    monkeypatch.setattr(native_mixture, "MIN_PART", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: parts)
    assert native_mixture._parts(40) == parts
    gen = torch.Generator().manual_seed(4)
    points = torch.randn(40, 2, 3 * 16, generator=gen).view(40, 2, 3, 16).permute(2, 1, 0, 3).reshape(3, 80, 16)
    sampled = points + 0.3 * torch.randn(points.shape, generator=gen)
    gmm = DiagonalGMM(5, 16, 3)
    constants = gmm_module.mixture_constants(gmm.logits.detach(), gmm.means.detach(), gmm.log_vars.detach())
    offset = constants[2] - 0.1
    whole = native_mixture.forward(points, sampled, 0.5, 1.0, True, *constants, offset)
    some = native_mixture.forward(points[:, 7:19], sampled[:, 7:19], 0.5, 1.0, True, *constants, offset)
    for all_points, few in zip(whole, some):
        assert torch.equal(all_points[:, 7:19], few)
    grads = [torch.randn(3, 80, 5, generator=gen) for _ in range(3)] + [torch.randn(3, 80, generator=gen)]
    backward = native_mixture.backward(points, sampled, 0.5, -2.0, *constants[:2], whole[2], whole[4], *grads,
                                       True, True, True, True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one_part = native_mixture.backward(points, sampled, 0.5, -2.0, *constants[:2], whole[2], whole[4], *grads,
                                       True, True, True, True)
    assert backward[1] is None and one_part[1] is None
    assert torch.equal(backward[0], one_part[0])
    for got, expected in zip(backward[2:], one_part[2:]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_which_points_take_the_kernels():
    points = torch.zeros(2, 6, 8)
    usable = LIBRARY is not None
    assert native_mixture.available(points, 4) is usable
    assert not native_mixture.available(points.double(), 4)
    assert not native_mixture.available(points.transpose(1, 2), 4)  # d values not contiguous
    assert not native_mixture.available(points, native_mixture.MAX_CLUSTERS + 1)


@needs_library
def test_a_gmm_with_more_clusters_than_the_kernels_take_keeps_the_matmuls():
    assert_as_close_to_fp64({"clusters": native_mixture.MAX_CLUSTERS + 1, "tokens": 4})


@tiers.starts_processes
def build_into(directory):
    return native_mixture.build(directory, native_build.compiler())


def test_the_kernels_build_from_scratch_and_match_the_sessions_library(tmp_path):
    """A fresh build (the session's may come from the cache) loads, and gives the same bits."""
    if LIBRARY is None:
        pytest.skip("the native GMM kernels are not available here")
    path = build_into(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left behind
    fresh = native_mixture.load(path)
    gen = torch.Generator().manual_seed(2)
    points = torch.randn(2, 4000, 16, generator=gen)
    gmm = DiagonalGMM(3, 16, 2)
    constants = gmm_module.mixture_constants(gmm.logits.detach(), gmm.means.detach(), gmm.log_vars.detach())
    results = []
    for lib in (LIBRARY, fresh):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(native_mixture, "_library", lib)
            results.append(native_mixture.forward(points, points + 0.1, 1.0, 0.5, True, *constants, constants[2]))
    for ours, theirs in zip(*results):
        assert torch.equal(ours, theirs)


@tiers.starts_processes
def look_for_the_library(monkeypatch):
    """``library()`` as a fresh process finds it (it may run the compiler); the session's result
    comes back at the test's end (monkeypatch)."""
    monkeypatch.setattr(native_mixture, "_looked_for", False)
    monkeypatch.setattr(native_mixture, "_library", None)
    return native_mixture.library()


@pytest.mark.parametrize("setting, message", [
    ({native_mixture.DISABLE_VARIABLE: "0"}, None),
    ({"CC": "false", "PATH": ""}, "no C compiler"),
    ({"CC": "false"}, "could not build mixture_kernels.c"),
])
def test_without_the_library_the_gmm_keeps_its_matmuls_with_one_log_line(setting, message, tmp_path, monkeypatch,
                                                                           caplog):
    monkeypatch.setenv(native_build.CACHE_VARIABLE, str(tmp_path / "cache"))
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    if "CC" in setting:  # only $CC and cc: Python's own compiler may be an absolute path
        monkeypatch.setattr(native_build.sysconfig, "get_config_var", lambda name: None)
    with caplog.at_level(logging.INFO, logger=native_mixture.__name__):
        assert look_for_the_library(monkeypatch) is None
        assert native_mixture.library() is None  # looked for once
        assert not native_mixture.available(torch.zeros(1, 2, 4), 3)
    lines = [r.getMessage() for r in caplog.records if r.name == native_mixture.__name__]
    if message is None:
        assert lines == []
    else:
        assert len(lines) == 1 and message in lines[0]


def test_the_fallbacks_leave_the_sessions_library_in_place():
    assert native_mixture.library() is LIBRARY


@tiers.starts_processes
def openmp_flags_under(backend, monkeypatch):
    monkeypatch.setattr(torch.__config__, "parallel_info", lambda: f"ATen parallel backend: {backend}\n")
    return native_build.openmp_flags(native_build.compiler())


@tiers.starts_processes
def gcc_runtime_path():
    """The libgomp that GCC links by default (the system's), resolved; None if not GCC's."""
    import subprocess

    cc = native_build.compiler()
    out = subprocess.run([*cc, "-print-file-name=libgomp.so.1"], capture_output=True, text=True).stdout.strip()
    return os.path.realpath(out) if os.path.isabs(out) else None


def test_the_kernels_run_on_torchs_openmp_runtime_or_on_none(monkeypatch):
    """-fopenmp only where torch's operators run on OpenMP; and then the process maps no second
    libgomp beside torch's (the kernels' parts run on torch's worker threads)."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler here")
    assert openmp_flags_under("native thread pool", monkeypatch) == ("-fopenmp-simd",)
    if LIBRARY is None or "-fopenmp" not in native_mixture.flags(native_build.compiler()):
        return
    torch_runtime = [p for p in (Path(torch.__file__).parent / "lib").glob("libgomp*")]
    if not torch_runtime or not Path("/proc/self/maps").exists():
        pytest.skip("torch brings no libgomp of its own here, or no /proc")
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "libgomp" in line.split()[-1]}
    system = gcc_runtime_path()
    assert system is None or system not in {os.path.realpath(p) for p in mapped}, mapped
