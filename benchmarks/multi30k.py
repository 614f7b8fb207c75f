#!/usr/bin/env python
"""Every method of the package against its baseline on real data: Multi30k de-en.

Trains each model of ``fairseq_modattn/cli/model_recipes.py`` (transformer, DMA with n_c 4 and 8,
talking heads, TIM, RIM-LSTM, fairseq's LSTM; about 1.7 M parameters each) with the real
fairseq-train for the same number of updates and the same optimiser, once per seed; evaluates
each final model on the test split (test_2016_flickr) with the real fairseq-generate (beam 5);
measures the redundancy LR / HR of the attention heads of the transformer-family models; and
writes a table of BLEU (mean and spread over seeds), LR / HR, validation nll, training speed
(fairseq's wps, target tokens per second) and parameter count, with the commands and the
machine, as Markdown and JSON.

Runs are resumable (``fairseq_modattn/cli/runs.py``): rerun the same command after an
interruption. Several runs go at a time (``--jobs``; the cores are split among them, which is
also the condition under which tokens/s is measured: say so when comparing with other tables).

    python benchmarks/multi30k.py --data data-bin/multi30k.de-en --output-dir runs/multi30k \\
        --markdown docs/results.md

Prepare the data first: ``fairseq-modattn prepare multi30k --raw-dir RAW --dest data-bin/multi30k.de-en
--bpe-size 8000``. On the project's 2-core CPU the default (7 models x 3 seeds x 250 updates,
2 at a time) takes about 85 minutes.
"""

import argparse
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import fairseq_modattn  # noqa: F401  (registers the models)
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.cli import runs
from fairseq_modattn.cli.evaluate import write_json_atomically
from fairseq_modattn.cli.model_recipes import RECIPES, TRAIN_FLAGS

ATTENTIONS = ("enc_self", "dec_self", "enc_dec")
BASELINES = {"dma": "transformer", "dma_nc8": "transformer", "talking_heads": "transformer", "tim": "transformer",
             "rim_lstm": "lstm"}
#: the models that train slowest per update on a CPU, started first so that the last runs are short
SLOW = ("dma", "dma_nc8", "rim_lstm")
IDENTITY_KEYS = ("data", "subset", "max_update", "beam", "train_args")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="prepared Multi30k de-en data-bin")
    p.add_argument("--output-dir", type=Path, required=True, help="runs and results go here")
    p.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="MODEL",
                   help=f"models to compare, from {', '.join(RECIPES)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one run per model and seed")
    p.add_argument("--max-update", type=int, default=250, help="training budget per run, in updates")
    p.add_argument("--subset", default="test", help="split to translate and measure redundancy on")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: one per CPU core)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here (e.g. docs/results.md)")
    p.add_argument("--generate-args", default="", metavar="ARGS", help="extra fairseq-generate flags (tests)")
    p.add_argument("--train-args", default="", metavar="ARGS",
                   help="extra fairseq-train flags for every run, as one string (tests)")
    args = p.parse_args(argv)
    if args.max_update < 1 or args.beam < 1 or (args.jobs is not None and args.jobs < 1):
        p.error("--max-update, --beam and --jobs must be positive")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.models)) != len(args.models):
        p.error("--seeds and --models must not repeat a value")
    if not (args.data / "dict.de.txt").is_file():
        p.error(f"--data {args.data} is not a prepared de-en data-bin (no dict.de.txt)")
    return args


def one_run(name: str, seed: int, args, log) -> Dict:
    recipe = RECIPES[name]
    label, run_dir = f"{name} seed {seed}", args.output_dir / name / f"seed{seed}"
    command = recipe.train_command(args.data.resolve(), run_dir / "checkpoints", seed=seed, max_update=args.max_update,
                                   cpu=True, extra=shlex.split(args.train_args))
    runs.train(runs.TrainingRun(label, run_dir, command), log)
    evaluation = runs.evaluate(run_dir, label, str(args.data), subset=args.subset, beam=args.beam, cpu=True,
                               generate_args=shlex.split(args.generate_args), log=log)
    measured = runs.redundancy(run_dir, label, evaluation["model_path"], str(args.data), subset=args.subset,
                               attentions=ATTENTIONS if recipe.has_attention_heads else (), cpu=True, log=log)
    stats = runs.training_stats(run_dir / "train.log")
    return {"model": name, "seed": seed, "bleu": evaluation["bleu"], "sacrebleu": evaluation["sacrebleu"],
            "parameters": measured["parameters"], "redundancy": {k: {"LR": v["LR"], "HR": v["HR"]}
                                                                 for k, v in measured["redundancy"].items()},
            **stats, "command": command}


def spread(values: List[float]) -> Dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def aggregate(results: List[Dict], models: List[str]) -> Dict[str, Dict]:
    table = {}
    for name in models:
        rows = [r for r in results if r["model"] == name]
        entry = {"parameters": rows[0]["parameters"], "seeds": [r["seed"] for r in rows],
                 "bleu": spread([r["bleu"] for r in rows]),
                 "valid_nll_loss": spread([r["valid_nll_loss"] for r in rows]),
                 "wps": spread([r["wps"] for r in rows]), "redundancy": {}}
        for attention in rows[0]["redundancy"]:
            entry["redundancy"][attention] = {k: statistics.fmean(r["redundancy"][attention][k] for r in rows)
                                              for k in ("LR", "HR")}
        table[name] = entry
    return table


def machine() -> str:
    import torch
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), no GPU used; Python {platform.python_version()}, "
            f"torch {torch.__version__}, fairseq {version('fairseq-fixed') if _has('fairseq-fixed') else 'unknown'}")


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(table: Dict[str, Dict], settings: Dict, results: List[Dict]) -> str:
    def bleu(name):
        b = table[name]["bleu"]
        return f"{b['mean']:.2f} ± {b['std']:.2f} ({b['min']:.2f}-{b['max']:.2f})"

    def red(name, attention):
        r = table[name]["redundancy"].get(attention)
        return "n/a" if r is None else f"{r['LR']:.3f} / {r['HR']:.3f}"

    def delta(name):
        base = BASELINES.get(name)
        if base not in table:
            return ""
        return f"{table[name]['bleu']['mean'] - table[base]['bleu']['mean']:+.2f} vs {base}"

    lines = [
        "| model | params | BLEU mean ± std (min-max) | Δ BLEU | LR / HR enc self | LR / HR dec self | "
        "LR / HR enc-dec | valid nll | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in table.items():
        lines.append(
            f"| {name} | {entry['parameters']:,} | {bleu(name)} | {delta(name)} | {red(name, 'enc_self')} | "
            f"{red(name, 'dec_self')} | {red(name, 'enc_dec')} | {entry['valid_nll_loss']['mean']:.3f} | "
            f"{entry['wps']['mean']:.0f} |")
    example = {r["model"]: r["command"] for r in results if r["seed"] == settings["seeds"][0]}
    lines += ["", "Per-seed BLEU:", ""]
    lines += [f"- {name}: " + ", ".join(f"seed {s} {b:.2f}" for s, b in zip(e["seeds"], e["bleu"]["values"]))
              for name, e in table.items()]
    lines += ["", "fairseq-train command of each model (seed " + str(settings["seeds"][0]) + "; the other seeds "
              "differ in --seed and --save-dir only):", "", "```bash"]
    lines += [shlex.join(_portable(c, settings["data_as_given"])) for c in example.values()]
    lines += ["```", ""]
    return "\n".join(lines)


def _portable(command: List[str], data: str) -> List[str]:
    """The command as a user would type it: console script names, the data-bin as given on the
    command line, and the plugin folder instead of this machine's absolute paths."""
    out = [Path(command[0]).name, data]
    for arg in command[2:]:
        out.append("fairseq_modattn" if arg.endswith("/fairseq_modattn") else arg)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    lock = threading.Lock()

    def log(message):
        with lock:
            print(f"[{(time.monotonic() - started) / 60:6.1f} min] {message}", flush=True)

    jobs = args.jobs or (os.cpu_count() or 1)
    runs.limit_threads(max(1, (os.cpu_count() or 1) // jobs))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = {"data": str(args.data.resolve()), "subset": args.subset, "max_update": args.max_update,
                "beam": args.beam, "train_args": TRAIN_FLAGS + shlex.split(args.train_args), "seeds": args.seeds,
                "models": args.models, "jobs": jobs, "data_as_given": str(args.data)}
    try:
        runs.check_settings(args.output_dir, settings, IDENTITY_KEYS)
        # slowest models first, so that the last ones to finish are short
        order = sorted(((m, s) for s in args.seeds for m in args.models), key=lambda ms: (ms[0] not in SLOW, ms[1]))
        log(f"{len(order)} runs ({len(args.models)} models x {len(args.seeds)} seeds), {args.max_update} updates "
            f"each, {jobs} at a time")
        results = runs.run_concurrently(lambda ms: one_run(*ms, args, log), order, jobs)
    except AnalysisError as e:
        print(f"multi30k benchmark: error: {e}", file=sys.stderr)
        return 1
    results.sort(key=lambda r: (args.models.index(r["model"]), r["seed"]))
    table = aggregate(results, args.models)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        "# Multi30k de-en: every method against its baseline",
        "",
        f"Run {when}, commit {commit()}, {machine()}; {jobs} runs at a time, each on "
        f"{max(1, (os.cpu_count() or 1) // jobs)} thread(s). {len(args.seeds)} seeds "
        f"({', '.join(map(str, args.seeds))}) per model, {args.max_update} updates each (max-tokens 4096), the "
        f"final model translating `{args.subset}` (beam {args.beam}); BLEU is fairseq's tokenized BLEU on the "
        "lower-cased, Moses-tokenized text, mean ± sample standard deviation over seeds. LR / HR: head "
        "redundancy (lower is less redundant), mean over seeds; valid nll: the last validation, mean over seeds; "
        "tokens/s: fairseq's training wps (target tokens), mean over seeds.",
        "",
        "```bash",
        "python benchmarks/multi30k.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "```",
        "",
    ]
    text = "\n".join(header) + markdown(table, settings, results)
    (args.output_dir / "results.md").write_text(text, encoding="utf-8")
    write_json_atomically({"settings": settings, "table": table, "runs": results}, args.output_dir / "results.json")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text, encoding="utf-8")
    print()
    print(text)
    log(f"wrote {args.output_dir / 'results.md'}, results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
