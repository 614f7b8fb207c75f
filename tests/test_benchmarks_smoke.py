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
