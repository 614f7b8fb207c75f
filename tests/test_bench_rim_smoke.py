"""Smoke test of benchmarks/bench_rim.py: the --quick run finishes and reports sane ratios.

Runs the script as a user would and checks its JSON: the RIM model really has a RIM encoder of
the LSTM baseline's width (n * d_r), every time and ratio is present, finite, positive and equal
to the quotient of the reported medians, and the ablation flags given with --rim-args reach the
model (the bidirectional LSTM baseline follows them).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_rim.py"
STEPS = ("lstm_encoder", "rim_lstm_encoder", "lstm", "rim_lstm")


def positive_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def run(tmp_path, *extra):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--json", str(out), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench_rim.py --quick exited {proc.returncode}:\n{output[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("extra, directions, steps", [((), 1, STEPS),
                                                      (("--rim-args=--rim-bidirectional", "--no-model"), 2,
                                                       STEPS[:2])])
def test_bench_rim_quick(tmp_path, extra, directions, steps):
    results, stdout = run(tmp_path, *extra)
    models = results["models"]
    assert set(models) == {"rim_lstm", "lstm"}
    assert models["rim_lstm"]["arch"] == "rim_lstm_iwslt_de_en"
    assert models["lstm"]["arch"] == "lstm_wiseman_iwslt_de_en"
    width = 6 * 8 * directions  # quick: n = 6 RIMs of d_r = 8
    assert models["rim_lstm"]["encoder_output_units"] == models["lstm"]["encoder_output_units"] == width
    assert "--encoder-hidden-size" in models["lstm"]["flags"] and "48" in models["lstm"]["flags"]

    assert [row["length"] for row in results["train"]] == results["config"]["lengths"]
    for row in results["train"]:
        assert row["batch"] == results["config"]["tokens"] // row["length"]
        assert sorted(row["ms"]) == sorted(steps)
        assert all(positive_finite(row["ms"][s]) for s in steps)
        assert all(len(row["ms_all"][s]) == row["repeats"] for s in steps)
        ratio = row["time_ratio"]
        assert math.isclose(ratio["encoder"], row["ms"]["rim_lstm_encoder"] / row["ms"]["lstm_encoder"])
        if "rim_lstm" in steps:
            assert math.isclose(ratio["model"], row["ms"]["rim_lstm"] / row["ms"]["lstm"])
        else:
            assert "model" not in ratio
    assert "x = RIM / LSTM time" in stdout and "target: RIM encoder <= 4 x the LSTM encoder" in stdout
