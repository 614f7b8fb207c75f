"""Smoke test of benchmarks/multi30k.py on a tiny budget, through the real fairseq-train and
fairseq-generate: the curve step, then the comparison of two families (transformer and talking
heads; RIM-LSTM and the LSTM with the LSTM family's own budget and learning rate) over two seeds,
aggregated into the table, the paired bootstrap and the JSON.

The real benchmark (7 models x 3 seeds at a converged budget, several hours on 2 cores) is run
on demand; docs/results.md holds its output.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, cli_environment, run_commands

SCRIPT = REPO / "benchmarks" / "multi30k.py"
TINY = ["--jobs", "2", "--train-args", "--max-tokens 1000 --num-workers 0"]


def run(command):
    proc = subprocess.run([sys.executable, str(SCRIPT), *command], capture_output=True, text=True, timeout=900,
                          env=cli_environment(), cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    return output


def test_multi30k_benchmark_tiny(multi30k_bin, tmp_path):
    out = tmp_path / "bench"
    common = ["--data", str(multi30k_bin), "--output-dir", str(out), *TINY, "--lstm-lr", "0.001"]

    run([*common, "--models", "transformer", "lstm", "--curve-updates", "3"])
    report = json.loads((out / "curve" / "curve.json").read_text())
    assert set(report["curves"]) == {"transformer", "lstm"}
    for c in report["curves"].values():
        assert c["points"] and c["points"][-1][0] == 3 and c["flat_at"] is None  # too short to tell
        assert c["command"][c["command"].index("--max-update") + 1] == "3"
    lstm_command = report["curves"]["lstm"]["command"]
    assert lstm_command[-3:-1] == ["--lr", "0.001"] and "--lr" not in report["curves"]["transformer"]["command"][-4:]
    assert (out / "curve" / "curve.png").read_bytes()[:4] == b"\x89PNG"

    run([*common, "--models", "transformer", "talking_heads", "rim_lstm", "lstm", "--seeds", "1", "2",
         "--max-update", "2", "--lstm-max-update", "3", "--subset", "valid", "--bootstrap-samples", "20",
         "--generate-args", "--max-len-b 5", "--markdown", str(tmp_path / "results.md"),
         "--results-json", str(tmp_path / "copy" / "multi30k.json")])
    results = json.loads((out / "results.json").read_text())
    assert results == json.loads((tmp_path / "copy" / "multi30k.json").read_text())
    assert [(r["model"], r["seed"]) for r in results["runs"]] == [
        (m, s) for m in ("transformer", "talking_heads", "rim_lstm", "lstm") for s in (1, 2)]
    for r in results["runs"]:
        lstm_family = r["model"] in ("rim_lstm", "lstm")
        assert r["num_updates"] == (3 if lstm_family else 2) and r["wps"] > 0 and 0 <= r["sacrebleu"] <= 100
        assert r["wps_median"] == r["wps"]  # one epoch record (a budget under one epoch)
        # chrF and TER beside sacreBLEU, and the scored text kept in the run's own folder
        evaluation = json.loads((out / r["model"] / f"seed{r['seed']}" / "evaluation" / "results.json").read_text())
        assert {k: r[k] for k in ("chrf", "chrf_signature", "ter", "ter_signature")} == {
            k: evaluation[k] for k in ("chrf", "chrf_signature", "ter", "ter_signature")}
        evaluation_dir = out / r["model"] / f"seed{r['seed']}" / "evaluation"
        assert Path(r["hypotheses_file"]) == (evaluation_dir / "hyp.txt").resolve()
        assert len(Path(r["hypotheses_file"]).read_text(encoding="utf-8").splitlines()) == 100
        assert r["command"][r["command"].index("--seed") + 1] == str(r["seed"])
        assert (r["command"][-3:-1] == ["--lr", "0.001"]) == lstm_family
        # the code that trained the run: one record, for its one start
        [code] = r["code"]
        assert len(code["plugin_sources_sha256"]) == 16 and set(code) == {
            "started", "git_commit", "plugin_dirty", "plugin_sources_sha256"}
    hashes = {r["code"][0]["plugin_sources_sha256"] for r in results["runs"]}
    assert len(hashes) == 1
    table = results["table"]
    assert set(table["transformer"]["redundancy"]) == {"enc_self", "dec_self", "enc_dec"}
    assert table["rim_lstm"]["redundancy"] == {}
    bleus = [r["sacrebleu"] for r in results["runs"] if r["model"] == "transformer"]
    assert abs(table["transformer"]["sacrebleu"]["mean"] - sum(bleus) / 2) < 1e-9
    chrfs = [r["chrf"] for r in results["runs"] if r["model"] == "transformer"]
    assert table["transformer"]["chrf"]["values"] == chrfs and table["transformer"]["ter"]["std"] >= 0

    comparisons = results["comparisons"]
    assert {n: c["baseline"] for n, c in comparisons.items()} == {"talking_heads": "transformer", "rim_lstm": "lstm"}
    for c in comparisons.values():
        low, high = c["pooled"]["ci95"]
        assert low <= high and c["pooled"]["samples"] == 20 and c["pooled"]["seeds"] == 2
        assert set(c["per_seed"]) == {"1", "2"}
        assert c["pooled"]["verdict"] in ("better", "worse", "no difference")
        assert (c["pooled_chrf"]["metric"], c["pooled_ter"]["metric"]) == ("chrf", "ter")
        assert c["pooled_ter"]["higher_is_better"] is False and c["pooled_chrf"]["seeds"] == 2

    # --markdown: the report, one heading level down, between the page's markers; the rest is kept
    page = (tmp_path / "results.md").read_text()
    text = (out / "results.md").read_text()
    first_run = results["runs"][0]
    assert page.startswith("<!-- benchmarks/multi30k.py report: begin") and "\n## Multi30k de-en: " in page
    assert page.count("\n### The baselines' validation curves") == 1 and text.startswith("# Multi30k de-en: ")
    assert "| talking_heads | " in text and " vs transformer: **" in text and "| lstm | " in text
    assert "| sacreBLEU mean ± std | Δ sacreBLEU [95 % CI], seeds pooled | chrF mean ± std | TER mean ± std |" in text
    assert f"chrF `{first_run['chrf_signature']}`" in text and f"TER `{first_run['ter_signature']}`" in text
    assert (f"- transformer: seed 1 {first_run['sacrebleu']:.2f} / {first_run['chrf']:.2f} / "
            f"{first_run['ter']:.2f}, seed 2 ") in text
    assert "## The baselines' validation curves" in text  # the curve measured first is part of the report
    assert f"Every run trained with plugin sources {hashes.pop()}" in text
    threads = max(1, (os.cpu_count() or 1) // 2)
    each = "1 thread" if threads == 1 else f"{threads} threads"
    assert f"; 2 runs at a time, each on {each}, so " in text and " 2 seeds (1, 2) per model." in text
    assert f"fairseq-train {multi30k_bin} --user-dir fairseq_modattn --save-dir {out}/transformer/seed1/" in text

    # --status reads the same directory: every run done, with the scores the table has
    output = run([*common, "--models", "transformer", "talking_heads", "rim_lstm", "lstm", "--seeds", "1", "2",
                  "--max-update", "2", "--lstm-max-update", "3", "--status"])
    assert output.startswith(f"{out}: 8 of 8 runs done; no benchmark process is working on it\n")
    first = results["runs"][0]
    assert (f"  transformer seed 1: done, sacreBLEU {first['sacrebleu']:.2f}, chrF {first['chrf']:.2f}, "
            f"TER {first['ter']:.2f}, valid nll {first['valid_nll_loss']:.3f}\n") in output
    assert output.endswith("No training left.\n")

    # a family's runs can be (re)run on their own: the transformer family's finished runs are reused
    # whatever the LSTM family's settings
    output = run([*common, "--models", "transformer", "talking_heads", "--seeds", "1", "2", "--max-update", "2",
                  "--lstm-max-update", "7", "--subset", "valid", "--bootstrap-samples", "20",
                  "--generate-args", "--max-len-b 5"])
    assert "[transformer seed 2] already trained" in output and "training:" not in output
    assert len(json.loads((out / "transformer" / "seed2" / "code.json").read_text())) == 1  # reuse trains nothing

    # what is refused, each run of the script as `python multi30k.py` calls it, in one process:
    # a page without the report's markers is never overwritten; a run is never continued (seed 1,
    # stopped after its last checkpoint) nor reused (seed 2) under another budget, as the table
    # would mix two budgets; and another evaluation (here: another beam) is refused for the whole
    # directory
    mine = tmp_path / "notes.md"
    mine.write_text("my notes\n")
    (out / "transformer" / "seed1" / "train.done").unlink()
    main = f"{SCRIPT}:main"
    budget = [*common, "--models", "transformer", "--max-update", "4", "--subset", "valid"]
    (notes, _, notes_err), *seeds, (beam, _, beam_err) = run_commands([
        (main, [*common, "--markdown", mine]),
        *[(main, [*budget, "--seeds", seed]) for seed in ("1", "2")],
        (main, [*common, "--models", "transformer", "--max-update", "2", "--subset", "valid", "--beam", "2"]),
    ], cwd=REPO)
    assert notes == 2 and "has no 'benchmarks/multi30k.py report' section" in notes_err
    assert mine.read_text() == "my notes\n"
    for seed, (code, seed_out, seed_err) in zip(("1", "2"), seeds):
        assert code == 1, seed_out[-3000:]
        assert f"holds a transformer seed {seed} model trained with another command" in seed_err, seed_err
    assert beam == 1 and "holds runs made with other settings (beam: 5 -> 2)" in beam_err


def test_multi30k_benchmark_refuses_cuda_without_a_gpu(multi30k_bin, tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal is for machines without one")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--data", str(multi30k_bin), "--output-dir",
                           str(tmp_path / "bench"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=300, env=cli_environment(), cwd=REPO)
    assert proc.returncode == 2 and "--device cuda: torch sees no CUDA device here" in proc.stderr, proc.stderr
    assert not (tmp_path / "bench").exists()


def load_benchmark():
    import importlib.util

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("multi30k_bench", SCRIPT)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return bench


def test_report_names_the_code_of_every_run():
    bench = load_benchmark()

    def code(h, commit="abcdef0123", dirty=False):
        return {"started": "2026-11-26 04:00 UTC", "git_commit": commit, "plugin_dirty": dirty,
                "plugin_sources_sha256": h}

    same = [{"model": "dma", "seed": s, "code": [code("aaaa")]} for s in (1, 2)]
    assert bench.code_summary(same) == "Every run trained with plugin sources aaaa (commit abcdef0)."
    mixed = same[:1] + [{"model": "dma", "seed": 2, "code": [code("aaaa"), code("bbbb", "1234567890", True)]},
                        {"model": "tim", "seed": 1, "code": []}]
    text = bench.code_summary(mixed)
    assert text.startswith("The runs trained with different plugin sources (commits 1234567, abcdef0; with "
                           "uncommitted plugin changes)")
    assert text.endswith("aaaa: dma seed 1; aaaa + bbbb: dma seed 2; not recorded (trained before code records "
                         "were kept): tim seed 1.")
    # one known code beside runs from before records were kept is not "different plugin sources"
    older = same + [{"model": "tim", "seed": 1, "code": []}]
    assert bench.code_summary(older) == ("Every run with a code record trained with plugin sources aaaa (commit "
                                         "abcdef0); not recorded (trained before code records were kept): tim seed 1.")
    assert bench.code_summary(older[2:]) == "No run recorded its code (all trained before code records were kept)."


def test_report_shows_only_the_curves_trained_as_its_runs(tmp_path):
    """A curve measured with other flags (here: the LSTM at the shared learning rate, the
    comparison's LSTM family at 5e-3) chose no budget of the table and is left out, by name."""
    from fairseq_modattn.cli.model_recipes import TRAIN_FLAGS

    bench = load_benchmark()
    data, out = tmp_path / "data-bin", tmp_path / "bench"
    data.mkdir()
    (data / "dict.de.txt").write_text("")
    (out / "curve").mkdir(parents=True)
    curve = {"points": [[123, 3.5], [246, 3.0]], "flat_at": None, "command": ["fairseq-train", "DATA"]}
    (out / "curve" / "curve.json").write_text(json.dumps({
        "settings": {"train_args": TRAIN_FLAGS, "lstm_train_args": []}, "window": 1000, "gain": 0.02,
        "curves": {"transformer": curve, "lstm": curve}}))

    def section(*flags):
        return "\n".join(bench.curve_for_report(bench.parse_args(["--data", str(data), "--output-dir", str(out),
                                                                   *flags])))

    both = section()
    assert "- transformer: best 3.000" in both and "- lstm: best 3.000" in both and "Not shown" not in both
    faster_lstm = section("--lstm-lr", "5e-3")
    assert "- transformer: best 3.000" in faster_lstm and "- lstm:" not in faster_lstm
    assert f"Not shown: the curve of lstm in {out / 'curve'}, trained with other flags" in faster_lstm
    other = section("--train-args", "--max-tokens 1000")
    assert "## " not in other and "Not shown: the curve of transformer, lstm" in other


def test_runs_start_longest_first(tmp_path):
    """Slow models first, then the family with the larger budget, then by seed: started last, a
    4,000-update LSTM run would have kept one core busy alone long after the others ended."""
    bench = load_benchmark()
    (tmp_path / "dict.de.txt").write_text("")
    args = bench.parse_args(["--data", str(tmp_path), "--output-dir", str(tmp_path / "bench"), "--max-update", "3000",
                             "--lstm-max-update", "4000", "--seeds", "1", "2",
                             "--models", "transformer", "lstm", "dma", "rim_lstm", "tim"])
    order = bench.run_order(args)
    assert order[:4] == [("rim_lstm", 1), ("rim_lstm", 2), ("dma", 1), ("dma", 2)]
    assert order[4:] == [("lstm", 1), ("lstm", 2), ("transformer", 1), ("tim", 1), ("transformer", 2), ("tim", 2)]
    args.lstm_max_update = 2000
    assert bench.run_order(args)[4:] == [("transformer", 1), ("tim", 1), ("transformer", 2), ("tim", 2),
                                         ("lstm", 1), ("lstm", 2)]


def test_report_table_has_chrf_and_ter_columns_and_per_seed_values():
    """The markdown table of a synthetic comparison: chrF and TER mean ± std beside sacreBLEU, and
    each seed's three scores."""
    bench = load_benchmark()

    def spread(values):
        return bench.spread(values)

    def entry(sacre, chrf, ter):
        return {"family": "transformer", "parameters": 1234567, "seeds": [1, 2], "updates": 3000,
                "bleu": spread([30.0, 31.0]), "sacrebleu": spread(sacre), "chrf": spread(chrf), "ter": spread(ter),
                "valid_nll_loss": spread([2.0, 2.1]), "wps": spread([5000.0, 5100.0]), "redundancy": {}}

    table = {"transformer": entry([40.0, 42.0], [60.5, 61.5], [45.25, 44.75]),
             "dma": entry([41.0, 41.0], [62.0, 63.0], [44.0, 46.0])}
    results = [{"model": m, "seed": s, "command": ["/x/fairseq-train", "/data", "--seed", str(s)]}
               for m in table for s in (1, 2)]
    text = bench.markdown(table, {}, {"seeds": [1, 2], "data_as_given": "data-bin/m30k"}, results)
    lines = text.splitlines()
    assert lines[0].startswith("| model | params | updates | sacreBLEU mean ± std | Δ sacreBLEU [95 % CI], seeds "
                               "pooled | chrF mean ± std | TER mean ± std | tok. BLEU | ")
    assert lines[1].count("---") == lines[0].count("|") - 1
    assert lines[2].startswith("| transformer | 1,234,567 | 3,000 | 41.00 ± 1.41 | (baseline) | 61.00 ± 0.71 | "
                               "45.00 ± 0.35 | 30.50 ± 0.71 | ")
    assert "| dma | 1,234,567 | 3,000 | 41.00 ± 0.00 |  | 62.50 ± 0.71 | 45.00 ± 1.41 | " in text
    assert "- transformer: seed 1 40.00 / 60.50 / 45.25, seed 2 42.00 / 61.50 / 44.75" in lines
    assert "- dma: seed 1 41.00 / 62.00 / 44.00, seed 2 41.00 / 63.00 / 46.00" in lines
