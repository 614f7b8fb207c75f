"""Smoke test of benchmarks/bench_dma.py: the --quick run finishes and reports sane ratios.

Runs the script as a user would (a subprocess of this interpreter) and checks its JSON: every
ratio the benchmark exists to report is present, finite and positive, the DMA mask was really
on (gamma > 0), and both models generated the same number of tokens. Any exception in the
script, a missing field, NaN/inf or a non-positive value fails the test.
"""

import json
import math
import os
import subprocess
import sys
import time

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_dma.py"
TIME_LIMIT_S = 60


def positive_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_bench_dma_quick(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=TIME_LIMIT_S, env=env,
    )
    elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench_dma.py --quick exited {proc.returncode}:\n{output[-4000:]}"
    assert elapsed < TIME_LIMIT_S, f"--quick took {elapsed:.1f} s"
    assert out.exists(), f"no JSON written:\n{output[-2000:]}"
    results = json.loads(out.read_text())

    rows = results["train"]
    assert [r["length"] for r in rows] == results["config"]["lengths"]
    for row in rows:
        for key in ("transformer_ms", "dma_ms", "time_ratio", "transformer_mb", "dma_mb", "memory_ratio"):
            assert positive_finite(row.get(key)), f"length {row['length']}: {key} = {row.get(key)!r}"
        assert row["batch"] == results["config"]["tokens"] // row["length"]
        assert math.isclose(row["time_ratio"], row["dma_ms"] / row["transformer_ms"], rel_tol=1e-9)
        assert math.isclose(row["memory_ratio"], row["dma_mb"] / row["transformer_mb"], rel_tol=1e-9)
        assert row["dma_gamma"] > 0, "the DMA mask path was not exercised"

    gen = results["generation"]
    for key in ("transformer_sentences_per_s", "dma_sentences_per_s", "sentences_per_s_ratio",
                "transformer_shared_keys_sentences_per_s", "sentences_per_s_ratio_shared_keys"):
        assert positive_finite(gen.get(key)), f"generation: {key} = {gen.get(key)!r}"
    assert gen["output_tokens_per_hypothesis"] == results["config"]["gen_len"] + 1

    # The printed table carries the same numbers.
    assert "time ratio" in proc.stdout and "mem ratio" in proc.stdout
    assert "ratio DMA/transformer" in proc.stdout


# The rule by which harness.kernel_op_counts counts a step's kernel launches, on ops whose
# answer is known. It runs in a child process: importing harness switches logging off.
KERNEL_CALLS_CHECK = r"""
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, sys.argv[1])
from kernel_calls import kernel_calls

x = torch.ones(4, 4)  # made before profiling
with profile(activities=[ProfilerActivity.CPU]) as prof:
    torch.zeros(3)                 # counted: the op fills memory
    y = x.view(16)                 # a view: no kernel
    y.to(torch.float32)            # already float32: returns its input, no kernel
    y.to(torch.float64)            # a copy: counted once (not also its inner _to_copy / copy_)
    (x * 2.0).sum()                # mul and sum; the scalar's conversion inside mul is mul's own
    x.contiguous()                 # already contiguous: no kernel
    x.t().contiguous()             # transpose is a view; contiguous copies: counted
counts = {}
for name in kernel_calls(prof.profiler.kineto_results.experimental_event_tree()):
    counts[name] = counts.get(name, 0) + 1
print(json.dumps(counts))
"""


def test_kernel_calls_count_the_ops_that_launch_kernels():
    proc = subprocess.run([sys.executable, "-c", KERNEL_CALLS_CHECK, str(REPO / "benchmarks")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts == {"aten::zeros": 1, "aten::to": 1, "aten::mul": 1, "aten::sum": 1, "aten::contiguous": 1}


def test_bench_dma_counts_kernel_ops(tmp_path):
    out = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--count-ops", "--no-train",
                           "--no-generate", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    counted = json.loads(out.read_text())["kernel_ops"]
    assert counted["path"] == "cuda, emulated on the cpu"
    rows = counted["train"]
    assert [r["length"] for r in rows] == [8, 32]
    for r in rows:
        # DMA's step has the transformer's calls and its own on top: GMMs, MI bounds, masks
        assert 0 < r["transformer_ops"] < r["dma_ops"] and r["ops_ratio"] == r["dma_ops"] / r["transformer_ops"]
        assert sum(r["dma_top_ops"].values()) <= r["dma_ops"]
    assert counted["dma_calls_growth"] == rows[-1]["dma_ops"] / rows[0]["dma_ops"]
    step = counted["decoding_step"]
    assert 0 < step["transformer"] <= step["dma"] and step["ratio"] == step["dma"] / step["transformer"]
    assert "kernel launches per training step" in proc.stdout and "decoding step" in proc.stdout
