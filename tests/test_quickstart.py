"""``fairseq-modattn quickstart`` end to end on a tiny budget, and its option checks.

The end-to-end test runs the real command as a user would: Multi30k prepared from the raw
files (500 training pairs, a 500-merge BPE), a transformer and a DMA transformer of the
package's recipes trained for 3 updates each by the real fairseq-train (two at a time), both
translating the 1000 test sentences with the real fairseq-generate, and the redundancy of their
heads measured; then the same command again, which must reuse every finished step.
"""

import json
import re

import pytest

from conftest import MODATTN, run_cli


def quickstart(*args, check=True):
    return run_cli([MODATTN, "quickstart", *args], check=check)


def test_quickstart_prepares_trains_evaluates_and_tabulates(multi30k_dir, tmp_path):
    out = tmp_path / "qs"
    args = ["--output-dir", out, "--raw-dir", multi30k_dir, "--no-download", "--max-train-sentences", "500",
            "--bpe-size", "500", "--max-update", "3", "--jobs", "2", "--generate-args", "--max-len-b 5"]
    _, log = quickstart(*args)

    assert (out / "data-bin" / "multi30k.de-en" / "dict.de.txt").is_file()
    assert "sentences: train 500, valid 1,014, test 1,000" in log, log[-3000:]
    assert "2 at a time with 1 thread(s) each on CPU" in log
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["model"]: r for r in summary["rows"]}
    assert list(rows) == ["transformer", "dma"]
    for name, row in rows.items():
        assert row["updates"] == 3, row
        assert 0 <= row["BLEU"] <= 100 and row["valid nll"] > 0 and row["tokens/s"] > 0
        for attention in ("enc_self", "dec_self", "enc_dec"):
            assert 0 <= row[f"HR {attention}"] <= row[f"LR {attention}"] + 1e-9 <= 1 + 1e-9
        results = json.loads((out / name / "evaluation" / "results.json").read_text())
        assert results["sentences"] == 1000 and results["subset"] == "test" and results["beam"] == 5
        for column, key in (("sacreBLEU", "sacrebleu"), ("chrF", "chrf"), ("TER", "ter")):
            assert row[column] == results[key] and row[f"{column} signature"] == results[f"{key}_signature"]
        command = json.loads((out / name / "train.done").read_text())["command"]
        assert command[command.index("--max-update") + 1] == "3" and "--cpu" in command
        assert f"[{name}] training:" in log
    # the same architecture but for DMA's modules: DMA adds its GMMs' parameters only
    assert 0 < rows["dma"]["params"] - rows["transformer"]["params"] < 0.02 * rows["transformer"]["params"]
    assert summary["settings"]["max_update"] == 3

    table = (out / "table.md").read_text()
    header = "| model | params | BLEU | sacreBLEU | chrF | TER | LR / HR enc self | LR / HR dec self | LR / HR enc-dec |"
    assert header in table and header in log
    for name, row in rows.items():
        cells = " \\| ".join(f"{row[c]:.2f}" for c in ("BLEU", "sacreBLEU", "chrF", "TER"))
        assert re.search(rf"^\| {name} \| {row['params']:,} \| {cells} \| ", table, re.M), table
    for column in ("sacreBLEU", "chrF", "TER"):  # the signatures in the caption, once
        assert table.count(f"{column} `{rows['dma'][column + ' signature']}`") == 1, table
    # the table and summary.json name the data-bin where it lies, not a placeholder
    data_bin = str((out / "data-bin" / "multi30k.de-en").resolve())
    assert summary["settings"]["data"] == data_bin and f"Data `{data_bin}`" in table
    assert "OUTPUT_DIR" not in table + (out / "summary.json").read_text()
    # the caption, and the printed table, say that one seed at this budget compares nothing
    for text in (table, log):
        note = re.search(r"^A smoke run, not a comparison: one seed and 3 updates per model .*$", text, re.M)
        assert note and "docs/results.md" in note.group(0), text[-3000:]

    # a first run without false alarms: no warning from fairseq-train (its whole output is in
    # train.log) nor from quickstart itself, no traceback of a worker process
    for name in rows:
        train_log = (out / name / "train.log").read_text()
        assert not re.findall(r"^.*Warning: .*$", train_log, re.M), train_log[:3000]
    assert not re.findall(r"^.*Warning: .*$", log, re.M) and "Traceback" not in log, log[-3000:]

    # compare reads evaluate's real results JSONs (their hyp.txt / ref.txt) and scores each system
    # exactly as evaluate did
    _, log = run_cli([MODATTN, "compare", "--system", "transformer", out / "transformer" / "evaluation" / "results.json",
                      "--system", "dma", out / "dma" / "evaluation" / "results.json", "--samples", "100",
                      "--json", tmp_path / "compare.json"])
    compared = json.loads((tmp_path / "compare.json").read_text())
    assert compared["sentences"] == 1000 and compared["baseline"] == "transformer", log
    for name in rows:
        results = json.loads((out / name / "evaluation" / "results.json").read_text())
        for metric, key in (("bleu", "sacrebleu"), ("chrf", "chrf"), ("ter", "ter")):
            assert compared["metrics"][metric]["scores"][name] == pytest.approx(results[key], abs=1e-9), metric
    assert compared["metrics"]["bleu"]["comparisons"]["dma"]["verdict"] in ("better", "worse", "no difference")

    # rerunning the finished command reuses every step
    _, log = quickstart(*args)
    for name in rows:
        assert f"[{name}] already trained" in log and f"[{name}] already evaluated" in log
        assert f"[{name}] redundancy already measured" in log
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]

    # other settings in the same folder are refused, naming what changed
    code, log = quickstart(*[a if a != "3" else "4" for a in args], check=False)
    assert code == 1 and "holds runs made with other settings (max_update: 3 -> 4)" in log, log[-2000:]
    # so is a finished run whose recipe has changed since (here: its recorded command)
    done = out / "dma" / "train.done"
    done.write_text(json.dumps({"command": json.loads(done.read_text())["command"] + ["--dma-clusters", "8"]}))
    code, log = quickstart(*args, check=False)
    assert code == 1 and "holds a dma model trained with another command" in log, log[-2000:]


def test_quickstart_option_errors(multi30k_bin, tmp_path, capsys):
    """Bad options stop the command with exit status 1 and one clear line, before any work
    (called in-process: the console script is exercised above)."""
    from fairseq_modattn.cli.quickstart import quickstart as run

    out = str(tmp_path / "qs")
    cases = [
        (["--models", "transformer", "nope"], "unknown model(s) nope; choose from transformer, dma"),
        (["--models", "dma", "dma"], "--models lists a model twice"),
        (["--max-update", "0"], "--max-update must be a positive integer, got 0"),
        (["--jobs", "-1"], "--jobs must be a positive integer, got -1"),
        (["--average-last", "-2"], "--average-last must be >= 0"),
        (["--data", str(tmp_path)], "is not a prepared de-en data-bin"),
        (["--data", str(multi30k_bin), "--max-train-sentences", "10"], "--max-train-sentences prepares the data"),
        (["--data", str(multi30k_bin), "--", "--arch", "lstm"], "--arch after '--' would override what quickstart"),
        (["--raw-dir", str(tmp_path / "empty"), "--no-download"], "train.de.gz"),
    ]
    for extra, message in cases:
        assert run(["--output-dir", out, *extra]) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith("fairseq-modattn quickstart: error: ") and message in err, (extra, err)
    with pytest.raises(SystemExit) as exit_info:
        run(["--max-update", "many"])
    assert exit_info.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err


# epochs 1 and 3 (of 3) of a real DMA fairseq-train log (quickstart, 300 updates): a full epoch of 126
# updates in 212 s and the last, short one of 48 updates in 81 s
REAL_LOG = (
    "2026-11-23 19:13:31 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.081 | nll_loss 6.76 | ce_loss 7.637 | kl 92.0346 | dqq 0.0007 | dxq 0.5458 | div 6.7728 | gamma 0.4647 | ppl 108.38 | wps 4940.9 | wpb 2195 | bsz 144.9 | num_updates 126\n"
    "2026-11-23 19:13:31 | INFO | train | epoch 001 | loss 9.463 | nll_loss 9.291 | ce_loss 9.796 | kl 95.3953 | dqq 0.0064 | dxq 0.4124 | div 7.9997 | gamma 0.2553 | ppl 626.6 | wps 2016.1 | ups 0.59 | wpb 3442.5 | bsz 230.2 | num_updates 126 | lr 0.00126 | gnorm 1.326 | train_wall 212 | wall 218\n"
    "2026-11-23 19:18:42 | INFO | valid | epoch 003 | valid on 'valid' subset | loss 5.114 | nll_loss 4.566 | ce_loss 5.741 | kl 89.9453 | dqq 0 | dxq 0.5884 | div 6.4236 | gamma 0.5 | ppl 23.69 | wps 4414.3 | wpb 2195 | bsz 144.9 | num_updates 300 | best_loss 5.114\n"
    "2026-11-23 19:18:42 | INFO | train | epoch 003 | loss 5.168 | nll_loss 4.663 | ce_loss 5.794 | kl 92.0392 | dqq 0.0002 | dxq 0.5847 | div 5.8824 | gamma 0.5 | ppl 25.34 | wps 2008.3 | ups 0.57 | wpb 3553.4 | bsz 249.2 | num_updates 300 | lr 0.00163299 | gnorm 0.706 | train_wall 81 | wall 529\n"
)


def test_training_stats_weights_each_epoch_by_its_training_time(tmp_path):
    from fairseq_modattn.cli.runs import training_stats

    log = tmp_path / "train.log"
    log.write_text(REAL_LOG)
    stats = training_stats(log)
    assert stats["num_updates"] == 300 and stats["train_wall"] == 212 + 81
    assert abs(stats["wps"] - (2016.1 * 212 + 2008.3 * 81) / 293) < 1e-6
    assert stats["wps_median"] == (2016.1 + 2008.3) / 2
    assert stats["valid_nll_loss"] == 4.566 and stats["valid_loss"] == 5.114
    assert training_stats(tmp_path / "missing.log")["wps"] is None


def test_training_stats_median_leaves_out_epochs_slowed_by_other_work(tmp_path):
    from fairseq_modattn.cli.runs import training_stats

    def epoch(n, wps, wall):
        return (f"2026-11-26 07:0{n}:00 | INFO | train | epoch 00{n} | loss 5 | nll_loss 4 | wps {wps} | ups 0.6 | "
                f"num_updates {100 * n} | train_wall {wall} | wall {300 * n}\n")

    log = tmp_path / "train.log"
    log.write_text(epoch(1, 2400.0, 150) + epoch(2, 1000.0, 360) + epoch(3, 2300.0, 156))  # epoch 2 shared the CPU
    stats = training_stats(log)
    assert stats["wps_median"] == 2300.0 and stats["wps"] < 1800


@pytest.mark.e2e  # the training run is a child process (tests/tiers.py)
def test_train_log_holds_each_progress_line_when_it_is_shown(tmp_path):
    """train.log is line-buffered: a reader following it (tail -f, multi30k.py --status) sees
    every record as soon as the progress line is shown, not a block later."""
    import sys

    from fairseq_modattn.cli import runs

    lines = [f"2026-11-26 07:00:0{i} | INFO | train_inner | epoch 001:  {i} / 9 loss=5.0, num_updates={i}"
             for i in range(1, 4)]
    printer = "import sys\nfor line in sys.argv[1:]:\n    print(line, flush=True)\n"
    run = runs.TrainingRun("fake", tmp_path / "run", [sys.executable, "-c", printer, *lines])
    seen = []

    def log(message):
        path = tmp_path / "run" / "train.log"
        seen.append((message, path.read_text(encoding="utf-8") if path.exists() else ""))

    runs.train(run, log)
    progress = [(m, text) for m, text in seen if m.startswith("[fake] train_inner")]
    assert len(progress) == 3
    for line, (message, text) in zip(lines, progress):
        assert message.endswith(line.split(" | INFO | ", 1)[1]) and text.endswith(line + "\n")
    assert (tmp_path / "run" / "train.done").exists()
