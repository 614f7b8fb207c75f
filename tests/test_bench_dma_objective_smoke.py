"""Smoke test of benchmarks/dma_objective.py: the three models on a tiny budget through the real
fairseq-train, with L_Dqq read from the log and measured (value and gradient) at every epoch
checkpoint, LR / HR on the validation split, the summary and the checks.

The real run (3 models x 3 seeds x 1000 updates on the full corpus) is run on demand;
docs/results.md holds its output.
"""

import json
import subprocess
import sys

from conftest import REPO, cli_environment

SCRIPT = REPO / "benchmarks" / "dma_objective.py"


def test_dma_objective_benchmark_tiny(multi30k_bin, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, str(SCRIPT), "--data", str(multi30k_bin), "--output-dir", str(out),
               "--seeds", "1", "--max-update", "6", "--jobs", "2",
               "--train-args", "--max-tokens 1000 --num-workers 0 --max-epoch 2 --log-interval 1 "
                               "--encoder-embed-dim 32 --decoder-embed-dim 32 --encoder-ffn-embed-dim 64 "
                               "--decoder-ffn-embed-dim 64"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=cli_environment(), cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["model"], r["seed"]) for r in results["runs"]] == [
        ("transformer", 1), ("dma_authors", 1), ("dma_paper", 1)]
    runs = {r["model"]: r for r in results["runs"]}
    assert "--dma-objective" in runs["dma_paper"]["command"] and "--dma-objective" not in runs["dma_authors"]["command"]
    for name in ("dma_authors", "dma_paper"):
        run = runs[name]
        assert len(run["dqq_logged"]) == run["num_updates"]  # --log-interval 1
        # epoch checkpoints (the 500-sentence train split takes several updates per epoch) and the last
        assert [c["checkpoint"] for c in run["dqq_checkpoints"]][-1] == "checkpoint_last.pt"
        assert all(c["grad_norm"] >= 0 for c in run["dqq_checkpoints"])
    authors = runs["dma_authors"]
    # the bounded L_Dqq of the default objective is positive with a gradient at every checkpoint
    assert all(c["dqq"] > 0 and c["grad_norm"] > 0 for c in authors["dqq_checkpoints"])
    table = results["table"]
    assert set(table["dma_authors"]["redundancy"]) == {"enc_self", "dec_self", "enc_dec"}
    gap = table["dma_authors"]["nll_minus_transformer"]["values"][0]
    assert abs(gap - (authors["valid_nll_loss"] - runs["transformer"]["valid_nll_loss"])) < 1e-9
    assert [c["passed"] for c in results["checks"]] and all(isinstance(c["passed"], bool) for c in results["checks"])
    text = (out / "results.md").read_text()
    assert "| dma_authors |" in text and ("PASS" in text or "FAIL" in text)
