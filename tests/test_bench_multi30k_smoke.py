"""Smoke test of benchmarks/multi30k.py: two models x two seeds on a tiny budget, through the
real fairseq-train and fairseq-generate, aggregated into the results table and JSON.

The real benchmark (7 models x 3 seeds x 250 updates on the full corpus, about 85 minutes on
2 cores) is run on demand; docs/results.md holds its output.
"""

import json
import subprocess
import sys

from conftest import REPO, cli_environment

SCRIPT = REPO / "benchmarks" / "multi30k.py"


def test_multi30k_benchmark_tiny(multi30k_bin, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, str(SCRIPT), "--data", str(multi30k_bin), "--output-dir", str(out),
               "--models", "transformer", "rim_lstm", "--seeds", "1", "2", "--max-update", "2", "--subset", "valid",
               "--jobs", "2", "--generate-args", "--max-len-b 5", "--train-args", "--max-tokens 1000 --num-workers 0",
               "--markdown", str(tmp_path / "results.md")]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=cli_environment(), cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    results = json.loads((out / "results.json").read_text())
    assert [(r["model"], r["seed"]) for r in results["runs"]] == [
        ("transformer", 1), ("transformer", 2), ("rim_lstm", 1), ("rim_lstm", 2)]
    for run in results["runs"]:
        assert run["num_updates"] == 2 and run["wps"] > 0 and 0 <= run["bleu"] <= 100
        assert run["command"][run["command"].index("--seed") + 1] == str(run["seed"])
    transformer, rim = results["table"]["transformer"], results["table"]["rim_lstm"]
    assert set(transformer["redundancy"]) == {"enc_self", "dec_self", "enc_dec"} and rim["redundancy"] == {}
    bleus = [r["bleu"] for r in results["runs"] if r["model"] == "transformer"]
    assert abs(transformer["bleu"]["mean"] - sum(bleus) / 2) < 1e-9 and transformer["bleu"]["values"] == bleus
    text = (tmp_path / "results.md").read_text()
    assert text == (out / "results.md").read_text()
    assert "| rim_lstm | " in text and " vs lstm" not in text  # no baseline row, no delta
    assert f"fairseq-train {multi30k_bin} --user-dir fairseq_modattn --save-dir {out}/transformer/seed1/" in text
