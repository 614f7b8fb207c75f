"""Smoke test of benchmarks/bench_variants.py: the --quick run finishes and reports sane ratios.

Runs the script as a user would and checks its JSON: every model was really built with the
plugin's modules (talking-heads attentions, TIM layers), every time and memory ratio to the
transformer is present, finite, positive and equal to the quotient of the reported numbers, the
parameter-matched TIM model has (nearly) the transformer's parameter count and the unmatched one
fewer, and generation decoded the same number of tokens for every model.
"""

import json
import math
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_variants.py"
MODELS = ("transformer", "talking_heads", "tim_matched", "tim")


def positive_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_bench_variants_quick(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench_variants.py --quick exited {proc.returncode}:\n{output[-4000:]}"
    results = json.loads(out.read_text())

    models = results["models"]
    assert tuple(models) == MODELS
    assert models["transformer"]["talking_heads_attention"] == 0 and models["transformer"]["tim_layers"] == 0
    assert models["talking_heads"]["talking_heads_attention"] == 4  # encoder self-attention, 4 layers
    assert models["tim_matched"]["tim_layers"] == models["tim"]["tim_layers"] == 1  # 'auto' of 4 layers
    base = models["transformer"]["params"]
    assert abs(models["tim_matched"]["params"] - base) / base < 1e-3
    assert models["tim"]["params"] < base

    for row in results["train"]:
        assert row["batch"] == results["config"]["tokens"] // row["length"]
        m = row["models"]
        for name in MODELS:
            for key in ("ms", "mb", "time_ratio", "memory_ratio"):
                assert positive_finite(m[name][key]), f"length {row['length']}, {name}: {key} = {m[name][key]!r}"
            assert math.isclose(m[name]["time_ratio"], m[name]["ms"] / m["transformer"]["ms"], rel_tol=1e-9)
            assert math.isclose(m[name]["memory_ratio"], m[name]["mb"] / m["transformer"]["mb"], rel_tol=1e-9)

    gen = results["generation"]
    assert gen["output_tokens_per_hypothesis"] == results["config"]["gen_len"] + 1
    for name in MODELS:
        assert positive_finite(gen["models"][name]["sentences_per_s_ratio"])
    assert "x = ratio to the transformer" in proc.stdout and "ratio to transformer" in proc.stdout
