"""The Triton kernels of ``--dma-backend triton`` compile for real GPUs, checked on a machine
without one (``benchmarks/triton_compile.py``: Triton's compiler with an explicit sm_80 / sm_90
target, and the ptxas inside the triton wheel for registers and spills).

The default suite compiles the attention's three kernels, the GMM's two and L_Dxq's two at the
bench's shapes (the iwslt architecture's heads of 128 units and 8 clusters), in fp32, for both architectures,
the attention with the two flag sets the path uses (padding, causal mask and dropout: the
decoder's self-attention in training; padding, a generic 2-D mask and dropout), and fails on a
compile error or a spill. ``-m slow`` compiles
every head width and cluster count the path can choose, in the three dtypes, and fails on a
compile error (a spill at other shapes is reported, costs speed, and is not a failure).

Run in a subprocess without ``TRITON_INTERPRET``: the interpreter (which the other kernel tests
turn on in their process) replaces the kernels by Python and compiles nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_compile.py"

if sys.platform != "linux":
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")


def compile_reports(tmp_path, *args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "reports.json"
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True,
                            text=True, env=env, timeout=timeout)
    assert out.exists(), result.stdout + result.stderr
    return result, json.loads(out.read_text())


@pytest.mark.e2e
def test_every_kernel_compiles_without_spills_at_the_bench_shapes(tmp_path):
    result, reports = compile_reports(tmp_path, "--arch", "80", "90", "--dtype", "float32", "--head-dim", "128",
                                      "--clusters", "8", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    kernels = {r["variant"]["kernel"] for r in reports}
    assert kernels == {"attention_forward", "attention_backward_queries", "attention_backward_keys", "gmm_forward",
                       "gmm_backward", "infonce_forward", "infonce_backward"}
    assert {r["variant"]["arch"] for r in reports} == {80, 90}
    assert len(reports) == (3 * 2 + 4) * 2  # the attention's kernels with two flag sets, the others with one
    problems = [f"{r['variant']}: {r['error'] or str(r['spill_bytes']) + ' bytes spilled'}" for r in reports
                if r["error"] or r["spill_bytes"]]
    assert not problems, "\n".join(problems)
    # what ptxas reported is real: registers within the hardware's 255 per thread, smem used
    assert all(0 < r["registers"] <= 255 and r["shared_bytes"] > 0 for r in reports)


@pytest.mark.slow
def test_every_configuration_the_path_can_choose_compiles(tmp_path):
    result, reports = compile_reports(tmp_path, "--arch", "80", "90", "--dtype", "float32", "float16", "bfloat16",
                                      "--head-dim", "16", "32", "64", "128", "--clusters", "1", "8", "16",
                                      timeout=5400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    assert len(reports) == (3 * 3 * 2 + 4) * 2 * 4 * 3
    assert not [r for r in reports if r["error"]]
