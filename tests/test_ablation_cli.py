"""``fairseq-modattn ablate`` end to end on a tiny budget: two n_c values, real fairseq-train and
fairseq-generate, the tables and the plot; then an interrupted run continued by the same command."""

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import MODATTN, run_cli

# a 1+1-layer model of width 32 trained for 2 epochs of the 100 valid sentences (1 update each),
# evaluated on the same split with short outputs
TINY = [
    "--clusters", "2", "3", "--arch", "dma_transformer_iwslt_de_en_tiny", "--max-epoch", "2", "--cpu",
    "--subset", "valid", "--generate-args", "--max-len-b 10 --batch-size 50",
    "--", "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64", "--train-subset", "valid",
    "--max-tokens", "2000", "--warmup-updates", "10", "--disable-validation", "--num-workers", "0",
]


def ablate(data, out, *extra, check=True):
    args = list(TINY)
    cut = args.index("--")
    return run_cli([MODATTN, "ablate", data, "--output-dir", out, *args[:cut], *extra, *args[cut:]], check=check)


def read_rows(out: Path):
    with open(out / "table.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_ablation_trains_evaluates_tabulates_and_resumes(multi30k_bin, tmp_path):
    out = tmp_path / "ablation"
    _, log = ablate(multi30k_bin, out)
    rows = read_rows(out)
    assert [r["n_c"] for r in rows] == ["2", "3"]
    params = [int(r["params"]) for r in rows]
    # one more cluster adds to each of the 3 DMA modules (encoder self, decoder self, enc-dec) a
    # mean, a log-variance (8 values each, the head width) and a weight logit per token GMM
    # (one per head, 4) and in the query GMM (one)
    assert params[1] - params[0] == 3 * (4 + 1) * (2 * 8 + 1)
    for r in rows:
        assert 0 <= float(r["LR"]) <= 1 and 0 <= float(r["HR"]) <= 1
        assert 0 <= float(r["BLEU"]) <= 100 and r["checkpoints averaged"] == "2"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["max_epoch"] == 2 and len(summary["rows"]) == 2
    table = (out / "table.md").read_text()
    assert "| n_c | params | LR | HR | BLEU |" in table and f"| 2 | {params[0]:,} |" in table
    assert (out / "bleu_vs_clusters.png").read_bytes()[:4] == b"\x89PNG"
    for clusters in (2, 3):
        results = json.loads((out / f"nc{clusters}" / "evaluation" / "results.json").read_text())
        assert results["sentences"] == 100 and results["subset"] == "valid"
        command = json.loads((out / f"nc{clusters}" / "train.done").read_text())["command"]
        assert command[command.index("--dma-clusters") + 1] == str(clusters)
    assert "[n_c=3] training:" in log and "wrote " in log

    # interrupt n_c = 3 after its first epoch: only checkpoint1 and checkpoint_last (= epoch 1) remain
    run3 = out / "nc3"
    for name in ("train.done", "redundancy.json"):
        (run3 / name).unlink()
    shutil.rmtree(run3 / "evaluation")
    (run3 / "checkpoints" / "checkpoint2.pt").unlink()
    shutil.copy(run3 / "checkpoints" / "checkpoint1.pt", run3 / "checkpoints" / "checkpoint_last.pt")
    (out / "table.csv").unlink()

    _, log = ablate(multi30k_bin, out)
    assert "[n_c=2] already trained" in log and "[n_c=2] already evaluated" in log
    assert "[n_c=3] continuing:" in log
    train_log = (run3 / "train.log").read_text()
    # fairseq names the epoch it continues with: epoch 2, after the first epoch's updates
    loaded = re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch 2 @ (\d+) updates\)", train_log)
    assert loaded, train_log[-3000:]
    per_epoch = int(loaded.group(1))
    assert re.search(rf"Saved checkpoint \S+checkpoint2\.pt \(epoch 2 @ {2 * per_epoch} updates", train_log)
    resumed = read_rows(out)
    assert [r["n_c"] for r in resumed] == ["2", "3"] and resumed[0] == rows[0]
    assert resumed[1]["checkpoints averaged"] == "2" and resumed[1]["params"] == rows[1]["params"]

    # other settings in the same folder are refused, naming what changed
    code, log = ablate(multi30k_bin, out, "--seed", "2", check=False)
    assert code == 1 and "holds runs made with other settings (seed: 1 -> 2)" in log, log[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--max-epoch", "1", "--arch", "transformer"], "--arch transformer is not a DMA architecture"),
    (["--clusters", "4", "4", "--max-epoch", "1"], "--clusters must be distinct positive integers"),
    ([], "give a training budget"),
    (["--max-epoch", "1", "--", "--dma-clusters", "3"], "--dma-clusters after '--' would override"),
])
def test_bad_flags(multi30k_bin, tmp_path, capsys, args, message):
    from fairseq_modattn.cli.ablate import ablate as run

    assert run([str(multi30k_bin), "--output-dir", str(tmp_path / "a"), *args]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
