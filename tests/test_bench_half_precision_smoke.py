"""benchmarks/half_precision_train.py: fairseq-train --fp16 of the benchmark's recipes, judged.

On a GPU the script is the real check (benchmarks/README.md has its results); here it runs
fairseq's CPU emulation of --fp16 for a few updates, through the real fairseq-train, and the
judging of a log is checked on logs that must fail.
"""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, cli_environment

SCRIPT = REPO / "benchmarks" / "half_precision_train.py"


def load_script():
    spec = importlib.util.spec_from_file_location("half_precision_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=cli_environment(), cwd=REPO)


def test_fp16_check_runs_fairseq_train_and_judges_it(multi30k_bin, tmp_path):
    out = tmp_path / "fp16"
    # DMA, the model with the most to overflow (tests/test_mixed_precision.py runs the others)
    proc = run("--data", multi30k_bin, "--output-dir", out, "--cpu", "--models", "dma", "--updates", 6,
               "--log-interval", 1, "--train-args", "--max-tokens 300 --fp16-init-scale 4")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    [r] = json.loads((out / "results.json").read_text())
    assert r["model"] == "dma" and r["problems"] == [] and r["exit"] == 0
    assert r["intervals"] == 6 and r["updates"] == 6
    assert r["nll_last"] < r["nll_first"] and r["loss_scale"] == 4  # logged only under --fp16
    assert "fp16 training, 6 updates per model:" in proc.stdout and "| dma |" in proc.stdout

    # the logs are the user's now: a rerun into the same directory is refused and changes nothing
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = run("--data", multi30k_bin, "--output-dir", out, "--cpu", timeout=120)
    assert proc.returncode == 2 and "exists and is not an empty directory" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def train_inner(num_updates, nll, **extra):
    values = {"epoch": 1, "loss": nll + 0.5, "nll_loss": nll, "wps": 100.0, "num_updates": num_updates,
              "loss_scale": 8, **extra}
    return f"2026-11-26 04:00:00 | INFO | train_inner | {json.dumps({k: str(v) for k, v in values.items()})}"


def test_judging_fails_non_finite_values_a_loss_that_does_not_fall_and_a_failed_exit():
    judge = load_script().judge
    falling = [train_inner(i, 10.0 - i) for i in range(1, 9)]
    assert judge("m", 0, "\n".join(falling), 1.0, 8, 1)["problems"] == []
    assert judge("m", 0, "\n".join(falling), 1.0, 9, 2)["problems"] == []  # the last interval logged: 8

    assert judge("m", 0, "\n".join(falling[:7]), 1.0, 8, 1)["problems"] == ["stopped at update 7 of 8"]

    nan = falling[:4] + [train_inner(5, 5.0, gnorm=float("nan"))] + falling[5:]
    assert judge("m", 0, "\n".join(nan), 1.0, 8, 1)["problems"] == ["non-finite gnorm"]

    rising = [train_inner(i, 1.0 + i) for i in range(1, 9)]
    assert judge("m", 0, "\n".join(rising), 1.0, 8, 1)["problems"] == ["nll did not fall (3.000 -> 8.000)"]

    crashed = judge("m", 1, "\n".join(falling[:2]) + "\nFloatingPointError: Minimum loss scale reached", 1.0, 8, 1)
    assert crashed["problems"] == ["fairseq-train exited with status 1", "only 2 training lines logged"]

    overflowing = "\n".join(falling[:4] + ["NOTE: gradient overflow detected, ignoring gradient"] + falling[4:])
    assert judge("m", 0, overflowing, 1.0, 8, 1)["overflows"] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_fp16_check_needs_a_gpu_unless_emulated(multi30k_bin, tmp_path):
    proc = run("--data", multi30k_bin, "--output-dir", tmp_path / "fp16", timeout=120)
    assert proc.returncode == 2 and "torch sees no CUDA device here" in proc.stderr
    assert not (tmp_path / "fp16").exists()
