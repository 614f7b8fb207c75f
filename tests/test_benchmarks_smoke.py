"""Smoke test of benchmarks/bench_dma.py: the --quick run finishes and reports sane ratios.

Runs the script as a user would (a subprocess of this interpreter) and checks its JSON: every
ratio the benchmark exists to report is present, finite and positive, the DMA mask was really
on (gamma > 0), and both models generated the same number of tokens. Any exception in the
script, a missing field, NaN/inf or a non-positive value fails the test.

The kernel-call counts (``--count-ops``) of bench_dma.py and bench_rim.py are checked here
too, with the counting rule of benchmarks/kernel_calls.py.
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
        low, high = row["time_ratio_range"]
        steps = [d / t for t, d in zip(row["transformer_ms_all"], row["dma_ms_all"])]
        assert positive_finite(low) and (low, high) == (min(steps), max(steps))

    gen = results["generation"]
    for key in ("transformer_sentences_per_s", "dma_sentences_per_s", "sentences_per_s_ratio",
                "transformer_shared_keys_sentences_per_s", "sentences_per_s_ratio_shared_keys"):
        assert positive_finite(gen.get(key)), f"generation: {key} = {gen.get(key)!r}"
    assert gen["output_tokens_per_hypothesis"] == results["config"]["gen_len"] + 1

    # The printed table carries the same numbers.
    assert "time ratio" in proc.stdout and "step ratios" in proc.stdout and "mem ratio" in proc.stdout
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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--count-ops", "--host-cost",
                           "--no-train", "--no-generate", "--json", str(out)],
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

    # --host-cost times the same layers at a negligible width: the same calls, counted again
    cost = json.loads(out.read_text())["host_cost"]
    for name, key in (("transformer", "transformer_ops"), ("dma", "dma_ops")):
        assert cost[name]["calls"] == rows[0][key], (name, cost[name], rows[0])
        assert positive_finite(cost[name]["ms"])
        assert math.isclose(cost[name]["us_per_call"], 1e3 * cost[name]["ms"] / cost[name]["calls"])
    assert math.isclose(cost["ratio"], cost["dma"]["ms"] / cost["transformer"]["ms"])
    assert "host cost of a training step" in proc.stdout


RIM_SCRIPT = REPO / "benchmarks" / "bench_rim.py"


def run_rim_count_ops(tmp_path, *extra):
    out = tmp_path / f"rim_ops{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run([sys.executable, str(RIM_SCRIPT), "--quick", "--threads", "1", "--count-ops", "--no-train",
                           "--json", str(out), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text()), proc.stdout


def test_bench_rim_counts_kernel_ops_per_step(tmp_path):
    results, stdout = run_rim_count_ops(tmp_path)
    assert "train" not in results  # --no-train: no timing
    counted = results["kernel_ops"]
    assert counted["path"] == "cuda, emulated on the cpu"
    l1, l2 = counted["lengths"]
    assert (l1, l2) == (8, 16)  # --quick's lengths: the shortest and the longest
    assert counted["batch"] == results["config"]["tokens"] // l2
    encoders = counted["encoders"]
    assert set(encoders) == {"rim_lstm_encoder", "lstm_encoder"}
    for name, e in encoders.items():
        forward, total = e["calls"]["forward"], e["calls"]["total"]
        assert len(forward) == len(total) == 2 and all(isinstance(n, int) for n in forward + total)
        # forward + backward holds the forward's calls, the loss's and the backward's
        assert all(0 < f < t for f, t in zip(forward, total)), (name, e["calls"])
        step = e["per_step"]
        assert step["forward"] == (forward[1] - forward[0]) / (l2 - l1)
        assert step["total"] == (total[1] - total[0]) / (l2 - l1)
        assert step["backward"] == step["total"] - step["forward"]
        assert e["fixed"] == {"forward": forward[0] - l1 * step["forward"], "total": total[0] - l1 * step["total"]}
        assert e["fixed"]["forward"] > 0 and e["fixed"]["total"] > e["fixed"]["forward"]  # embedding, loss, ...
    rim, lstm = encoders["rim_lstm_encoder"], encoders["lstm_encoder"]
    # The RIM layer runs its recurrence step by step: calls in both directions at every step.
    assert rim["per_step"]["forward"] > 0 and rim["per_step"]["backward"] > 0
    # fairseq's LSTMEncoder runs the whole sequence as one aten::lstm call (and one backward)
    assert 0 <= lstm["per_step"]["total"] < 0.1 * rim["per_step"]["total"]
    assert lstm["calls"]["total"][1] < rim["calls"]["total"][0]
    for kind, x in counted["ratios"]["per_step"].items():
        lstm_step = lstm["per_step"][kind]
        assert x == (rim["per_step"][kind] / lstm_step if lstm_step > 0 else None)
    for kind, xs in counted["ratios"]["calls"].items():
        assert xs == [r / s for r, s in zip(rim["calls"][kind], lstm["calls"][kind])]
        assert xs[1] > xs[0] > 1  # the RIM's calls grow with length, the LSTM's hardly
    # the emulated CUDA path runs the fused loop: the step-by-step loop is counted as its baseline
    stepwise = counted["stepwise_loop"]["per_step"]
    assert stepwise["total"] >= 1.5 * encoders["rim_lstm_encoder"]["per_step"]["total"]
    assert "against the step-by-step loop" in stdout
    top = counted["rim_top_ops_per_step"]
    assert 0 < len(top) <= 8 and all(n > 0 for n in top.values())
    assert list(top.values()) == sorted(top.values(), reverse=True)
    assert sum(top.values()) <= rim["per_step"]["total"]

    # Per step is the difference of two lengths' counts: another pair (same batch) gives the same
    # numbers, so the fixed costs really cancel and each count is of one step at its own length.
    again, _ = run_rim_count_ops(tmp_path, "--lengths", "4", "16")
    assert again["kernel_ops"]["lengths"] == [4, 16] and again["kernel_ops"]["batch"] == counted["batch"]
    for name, e in encoders.items():
        other = again["kernel_ops"]["encoders"][name]
        assert other["calls"]["total"][1] == e["calls"]["total"][1]  # the same length 16, counted again
        for kind, n in e["per_step"].items():
            assert math.isclose(other["per_step"][kind], n, rel_tol=0.05, abs_tol=0.5), (name, kind)

    assert "kernel calls per encoder time step" in stdout and "forward/step" in stdout
    assert "most frequent calls per step" in stdout
