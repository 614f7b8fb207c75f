#!/usr/bin/env python
"""Every method of the package against its baseline on real data: Multi30k de-en, at a budget
where the baselines have converged, with seeds and confidence intervals.

Two steps, each resumable (rerun the same command after an interruption: finished runs are
kept, an interrupted fairseq-train continues from its checkpoint_last.pt):

1. **The curve** (``--curve-updates N``): each family's baseline (fairseq's transformer; fairseq's
   LSTM with the LSTM family's settings) trains with seed 1 for N updates, validating after every
   epoch. The validation nll against the updates goes to OUTPUT_DIR/curve/ (curve.json, curve.md,
   curve.png) with the first budget after which the best validation nll improves by less than
   ``--flat-gain`` over the next 1,000 updates: the budget to compare the methods at.
2. **The comparison** (the default): every model of ``fairseq_modattn/cli/model_recipes.py``
   (transformer, DMA with n_c 4 and 8, talking heads, TIM; RIM-LSTM and fairseq's LSTM; about
   1.7 M parameters each) trains once per seed with the real fairseq-train. The transformer
   family shares one budget (``--max-update``) and optimiser; the LSTM family has its own budget
   and learning rate (``--lstm-max-update``, ``--lstm-lr``), the same for both of its models.
   Each final model translates the test split (test_2016_flickr, beam 5) with the real
   fairseq-generate; the attention heads' redundancy LR / HR is measured on it. Each method is
   compared with its family's baseline by paired bootstrap resampling of the test sentences
   (sacreBLEU's paired bootstrap, ``--bootstrap-samples`` resamples; analysis/significance.py):
   the 95 % interval of the BLEU difference with the seeds pooled, and each seed pair's (the
   JSON also holds the pooled chrF and TER comparisons, ``pooled_chrf`` and ``pooled_ter``).

Several runs go at a time (``--jobs``; the cores are split among them, which is also the
condition under which tokens/s is measured: the table says so).

    python benchmarks/multi30k.py --data data-bin/multi30k.de-en --output-dir runs/m30k --curve-updates 5000
    python benchmarks/multi30k.py --data data-bin/multi30k.de-en --output-dir runs/m30k \\
        --markdown docs/results.md --results-json benchmarks/results/multi30k.json

Prepare the data first: ``fairseq-modattn prepare multi30k --raw-dir RAW --dest data-bin/multi30k.de-en
--bpe-size 8000``. Budgets on the project's 2-core CPU are in docs/results.md.
"""

import argparse
import datetime
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

from learning_curve import curve_markdown, flat_point, plot_curves, validation_curve
from provenance import code_record, git_commit
from run_progress import DirectoryInUse, duration, exclusive_use, holder, run_state, seconds_per_update

import fairseq_modattn  # noqa: F401  (registers the models)
from fairseq_modattn.analysis import AnalysisError, scoring
from fairseq_modattn.analysis.significance import compare_systems, seed_pairs
from fairseq_modattn.atomic_files import atomic_path, check_marked_section, write_json_atomically, write_marked_section
from fairseq_modattn.child_processes import stopping_on_sigterm
from fairseq_modattn.cli import runs
from fairseq_modattn.cli.model_recipes import FAMILY_BASELINES, RECIPES, TRAIN_FLAGS
from fairseq_modattn.help_format import DefaultsHelpFormatter
from fairseq_modattn.models.attention_types import ATTENTION_TYPES

#: the models that train slowest per update on a CPU, started first so that the last runs are short
SLOW = ("dma", "dma_nc8", "rim_lstm")
#: settings that make two tables incomparable: a directory never mixes runs that differ in one. A
#: family's budget and learning rate are in each run's own command, which its directory keeps and
#: checks (cli/runs.py), so one family can be run and rerun before the other's settings are chosen
IDENTITY_KEYS = ("data", "subset", "beam", "train_args")
CURVE_IDENTITY_KEYS = ("data", "curve_updates", "train_args", "lstm_train_args")
#: the name of the report's section in the --markdown page
REPORT_SECTION = "benchmarks/multi30k.py report"
#: the look-ahead of the flatness rule, in updates
FLAT_WINDOW = 1000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="prepared Multi30k de-en data-bin")
    p.add_argument("--output-dir", type=Path, required=True, help="runs and results go here (outside the repository)")
    p.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="MODEL",
                   help=f"models to compare, from {', '.join(RECIPES)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one run per model and seed")
    p.add_argument("--max-update", type=int, default=3000,
                   help="training budget of every transformer-family run, in updates (choose it from the curve)")
    p.add_argument("--lstm-max-update", type=int, default=None,
                   help="training budget of the LSTM-family runs (default: --max-update)")
    p.add_argument("--lstm-lr", type=float, default=None,
                   help="learning rate of the LSTM family (default: the recipes' shared --lr)")
    p.add_argument("--curve-updates", type=int, default=None, metavar="N",
                   help="measure the baselines' validation curves for N updates instead of comparing")
    p.add_argument("--flat-gain", type=float, default=0.02,
                   help=f"the curve has flattened once the best validation nll improves by less than this "
                        f"over the next {FLAT_WINDOW:,} updates")
    p.add_argument("--subset", default="test", help="split to translate and measure redundancy on")
    p.add_argument("--beam", type=int, default=5, help="fairseq-generate --beam")
    p.add_argument("--bootstrap-samples", type=int, default=1000, help="resamples of the paired bootstrap")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: one per CPU core)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (default): train and evaluate with fairseq's --cpu; cuda: on the GPU, which the "
                        "--jobs runs share. The device is part of each run's command, so a directory's runs "
                        "continue only on the device they started on")
    p.add_argument("--markdown", type=Path, default=None,
                   help="also write the report into this page (e.g. docs/results.md), between its lines "
                        f"'<!-- {REPORT_SECTION}: begin ... -->' and '<!-- {REPORT_SECTION}: end -->', one heading "
                        "level down; a page without them is refused, a missing one is created")
    p.add_argument("--results-json", type=Path, default=None,
                   help="also write the results JSON here (e.g. benchmarks/results/multi30k.json)")
    p.add_argument("--status", action="store_true",
                   help="print where the runs of this command stand and how long the rest will take at the "
                        "speed measured so far, then exit; trains nothing (safe while the benchmark runs)")
    p.add_argument("--generate-args", default="", metavar="ARGS", help="extra fairseq-generate flags (tests)")
    p.add_argument("--train-args", default="", metavar="ARGS",
                   help="extra fairseq-train flags for every run, as one string (tests)")
    args = p.parse_args(argv)
    if args.lstm_max_update is None:
        args.lstm_max_update = args.max_update
    budgets = [args.max_update, args.lstm_max_update, args.beam, args.bootstrap_samples, args.curve_updates or 1]
    if min(budgets) < 1 or (args.jobs is not None and args.jobs < 1):
        p.error("--max-update, --lstm-max-update, --curve-updates, --beam, --bootstrap-samples and --jobs must "
                "be positive")
    if args.status and args.curve_updates:
        p.error("--status reports on the comparison; the curve step prints its progress as it trains")
    if args.lstm_lr is not None and not args.lstm_lr > 0:
        p.error("--lstm-lr must be positive")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.models)) != len(args.models):
        p.error("--seeds and --models must not repeat a value")
    if not (args.data / "dict.de.txt").is_file():
        p.error(f"--data {args.data} is not a prepared de-en data-bin (no dict.de.txt)")
    if args.device == "cuda" and not _cuda_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    for flag, path in (("--markdown", args.markdown), ("--results-json", args.results_json)):
        if path is not None and path.is_dir():
            p.error(f"{flag} {path} is a directory; give a file path")
    if args.markdown is not None:
        try:
            check_marked_section(args.markdown, REPORT_SECTION)
        except FileExistsError as e:
            p.error(f"--markdown {e}")
    return args


def family_settings(name: str, args) -> Dict:
    """The budget and the extra fairseq-train flags of model NAME's family."""
    lstm = RECIPES[name].family == "lstm"
    extra = shlex.split(args.train_args) + (["--lr", repr(args.lstm_lr)] if lstm and args.lstm_lr else [])
    return {"max_update": args.lstm_max_update if lstm else args.max_update, "extra": extra}


def one_run(name: str, seed: int, args, log) -> Dict:
    recipe, family, cpu = RECIPES[name], family_settings(name, args), args.device == "cpu"
    label, run_dir = f"{name} seed {seed}", args.output_dir / name / f"seed{seed}"
    command = recipe.train_command(args.data.resolve(), run_dir / "checkpoints", seed=seed,
                                   max_update=family["max_update"], cpu=cpu, extra=family["extra"])
    run = runs.TrainingRun(label, run_dir, command)
    if not run.done_marker.exists():
        record_code(run_dir)
    runs.train(run, log)
    evaluation = runs.evaluate(run_dir, label, str(args.data), subset=args.subset, beam=args.beam, cpu=cpu,
                               generate_args=shlex.split(args.generate_args), log=log)
    measured = runs.redundancy(run_dir, label, evaluation["model_path"], str(args.data), subset=args.subset,
                               attentions=ATTENTION_TYPES if recipe.has_attention_heads else (), cpu=cpu, log=log)
    stats = runs.training_stats(run_dir / "train.log")
    return {"model": name, "seed": seed, "bleu": evaluation["bleu"], "sacrebleu": evaluation["sacrebleu"],
            "sacrebleu_signature": evaluation["sacrebleu_signature"],
            "chrf": evaluation["chrf"], "chrf_signature": evaluation["chrf_signature"],
            "ter": evaluation["ter"], "ter_signature": evaluation["ter_signature"],
            "generate_output": evaluation["generate_output"],
            # the detokenized text that was scored, kept in the run's folder, for re-scoring with other metrics
            "hypotheses_file": evaluation["hypotheses_file"], "references_file": evaluation["references_file"],
            "parameters": measured["parameters"], "redundancy": {k: {"LR": v["LR"], "HR": v["HR"]}
                                                                 for k, v in measured["redundancy"].items()},
            **stats, "command": command, "code": trained_with(run_dir)}


#: one record per start of a run's training (a run can continue over several sessions)
CODE_RECORDS = "code.json"


def record_code(run_dir: Path) -> None:
    """Append the code about to train in RUN_DIR (commit, plugin source hash) to its records."""
    records = trained_with(run_dir)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomically(records + [{"started": when, **code_record()}], run_dir / CODE_RECORDS)


def trained_with(run_dir: Path) -> List[Dict]:
    """The code records of RUN_DIR's training starts ([] for runs trained before they were kept)."""
    path = run_dir / CODE_RECORDS
    return runs.json_load(path) if path.exists() else []


def code_summary(results: List[Dict]) -> str:
    """Which plugin sources trained the runs: one hash for all, or the runs of each; runs trained
    before code records were kept are named apart (their code is unknown, not different)."""
    by_hash: Dict[str, List[str]] = {}
    unrecorded: List[str] = []
    for r in results:
        name = f"{r['model']} seed {r['seed']}"
        if not r["code"]:
            unrecorded.append(name)
            continue
        by_hash.setdefault(" + ".join(sorted({c["plugin_sources_sha256"] for c in r["code"]})), []).append(name)
    commits = sorted({c["git_commit"][:7] for r in results for c in r["code"] if c.get("git_commit")})
    dirty = any(c.get("plugin_dirty") for r in results for c in r["code"])
    label = "commit" if len(commits) == 1 else "commits"
    note = (f" ({label} {', '.join(commits)}" + ("; with uncommitted plugin changes" if dirty else "") + ")"
            if commits else "")
    if not by_hash:
        return "No run recorded its code (all trained before code records were kept)."
    missing = f"; not recorded (trained before code records were kept): {', '.join(unrecorded)}" if unrecorded else ""
    if len(by_hash) == 1:
        who = "Every run with a code record" if unrecorded else "Every run"
        return f"{who} trained with plugin sources {next(iter(by_hash))}{note}{missing}."
    parts = [f"{h}: {', '.join(names)}" for h, names in by_hash.items()]
    return (f"The runs trained with different plugin sources{note}, by hash of `fairseq_modattn/` "
            f"(`benchmarks/provenance.py`; a run continued across code changes lists each): " + "; ".join(parts)
            + missing + ".")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def spread(values: List[float]) -> Dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "values": values}


def aggregate(results: List[Dict], models: List[str]) -> Dict[str, Dict]:
    table = {}
    for name in models:
        rows = [r for r in results if r["model"] == name]
        entry = {"family": RECIPES[name].family, "parameters": rows[0]["parameters"],
                 "seeds": [r["seed"] for r in rows],
                 "updates": rows[0]["num_updates"], "bleu": spread([r["bleu"] for r in rows]),
                 "sacrebleu": spread([r["sacrebleu"] for r in rows]),
                 "chrf": spread([r["chrf"] for r in rows]), "ter": spread([r["ter"] for r in rows]),
                 "valid_nll_loss": spread([r["valid_nll_loss"] for r in rows]),
                 "wps": spread([r["wps_median"] for r in rows]), "redundancy": {}}
        for attention in rows[0]["redundancy"]:
            entry["redundancy"][attention] = {k: statistics.fmean(r["redundancy"][attention][k] for r in rows)
                                              for k in ("LR", "HR")}
        table[name] = entry
    return table


def detokenized_translations(generate_output: str, lang: str = "en"):
    """(hypotheses, references) of a fairseq-generate output, in sentence-id order, Moses-
    detokenized as ``fairseq-modattn evaluate`` scores them with sacreBLEU."""
    result = scoring.parse_generate_output(Path(generate_output).read_text(encoding="utf-8"))
    ids = sorted(result.hypotheses)
    return (scoring.detokenize([result.hypotheses[i] for i in ids], lang),
            scoring.detokenize([result.targets[i] for i in ids], lang))


def compare(results: List[Dict], models: List[str], samples: int, log) -> Dict[str, Dict]:
    """Each model against its family's baseline: the paired bootstrap with all seeds pooled and
    per seed pair (same seed), on sacreBLEU of the detokenized test translations; chrF and TER
    with the seeds pooled too (``fairseq-modattn compare``'s code, analysis/significance.py)."""
    translations, references = {}, None
    for r in results:
        hyps, refs = detokenized_translations(r["generate_output"])
        if references is not None and refs != references:
            raise AnalysisError(f"{r['model']} seed {r['seed']} translated another test set than the other runs")
        references, translations[r["model"], r["seed"]] = refs, hyps
    out = {}
    for name in models:
        base = FAMILY_BASELINES[RECIPES[name].family]
        if name == base or base not in models:
            continue
        seeds = sorted(s for (m, s) in translations if m == name and (base, s) in translations)
        system, baseline = [translations[name, s] for s in seeds], [translations[base, s] for s in seeds]
        metrics = compare_systems([(base, baseline), (name, system)], references, samples=samples)
        pooled = metrics["bleu"].comparisons[name]
        pairs = seed_pairs(baseline, system, references, samples=samples)
        out[name] = {"baseline": base, "seeds": seeds, "pooled": pooled.as_dict(),
                     "per_seed": {str(s): c.as_dict() for s, c in zip(seeds, pairs)},
                     **{f"pooled_{m}": metrics[m].comparisons[name].as_dict() for m in ("chrf", "ter")}}
        log(f"{name} vs {base}: sacreBLEU {pooled.delta:+.2f} [{pooled.ci_low:+.2f}, {pooled.ci_high:+.2f}] "
            f"({pooled.verdict}; per seed: {', '.join(c.verdict for c in pairs)})")
    return out


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def machine(device: str = "cpu") -> str:
    from importlib.metadata import version

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f"GPU {torch.cuda.get_device_name(0)}" if device == "cuda" else "no GPU used"
    return (f"{os.cpu_count()} cores ({cpu}), {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, fairseq {version('fairseq-fixed') if _has('fairseq-fixed') else 'unknown'}")


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def _mean_std(entry: Dict, digits: int = 2) -> str:
    return f"{entry['mean']:.{digits}f} ± {entry['std']:.{digits}f}"


def markdown(table: Dict[str, Dict], comparisons: Dict[str, Dict], settings: Dict, results: List[Dict]) -> str:
    def red(name, attention):
        r = table[name]["redundancy"].get(attention)
        return "n/a" if r is None else f"{r['LR']:.3f} / {r['HR']:.3f}"

    def delta(name):
        c = comparisons.get(name)
        if c is None:
            return "(baseline)" if name in FAMILY_BASELINES.values() else ""
        p = c["pooled"]
        return f"{p['delta']:+.2f} [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}] vs {c['baseline']}: **{p['verdict']}**"

    lines = [
        "| model | params | updates | sacreBLEU mean ± std | Δ sacreBLEU [95 % CI], seeds pooled | "
        "chrF mean ± std | TER mean ± std | tok. BLEU | "
        "LR / HR enc self | LR / HR dec self | LR / HR enc-dec | valid nll | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in table.items():
        lines.append(
            f"| {name} | {entry['parameters']:,} | {entry['updates']:,} | {_mean_std(entry['sacrebleu'])} | "
            f"{delta(name)} | "
            f"{_mean_std(entry['chrf'])} | {_mean_std(entry['ter'])} | {_mean_std(entry['bleu'])} | "
            f"{red(name, 'enc_self')} | {red(name, 'dec_self')} | {red(name, 'enc_dec')} | "
            f"{_mean_std(entry['valid_nll_loss'], 3)} | {entry['wps']['mean']:.0f} |")
    if comparisons:
        lines += ["", "Each seed pair alone (paired bootstrap of seed s against the baseline's seed s; "
                  "Δ sacreBLEU [95 % CI], p):", ""]
        for name, c in comparisons.items():
            cells = [f"seed {s}: {p['delta']:+.2f} [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}], p {p['p_value']:.3f}"
                     for s, p in c["per_seed"].items()]
            lines.append(f"- {name} vs {c['baseline']}: " + "; ".join(cells))
    lines += ["", "Per-seed sacreBLEU / chrF / TER:", ""]
    for name, e in table.items():
        scores = zip(e["seeds"], e["sacrebleu"]["values"], e["chrf"]["values"], e["ter"]["values"])
        lines.append(f"- {name}: " + ", ".join(f"seed {s} {b:.2f} / {c:.2f} / {t:.2f}" for s, b, c, t in scores))
    example = {r["model"]: r["command"] for r in results if r["seed"] == settings["seeds"][0]}
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


# ------------------------------------------------------------------ the curve
def measure_curve(args, log, jobs: int) -> Dict:
    """Train each family's baseline (seed 1) for --curve-updates updates and read its curve."""
    curve_dir = args.output_dir / "curve"
    curve_dir.mkdir(parents=True, exist_ok=True)
    settings = {"data": str(args.data.resolve()), "curve_updates": args.curve_updates,
                "train_args": TRAIN_FLAGS + shlex.split(args.train_args),
                "lstm_train_args": family_settings("lstm", args)["extra"]}
    runs.check_settings(curve_dir, settings, CURVE_IDENTITY_KEYS)
    baselines = [b for b in FAMILY_BASELINES.values() if b in args.models]

    def train(name):
        run_dir = curve_dir / name
        command = RECIPES[name].train_command(args.data.resolve(), run_dir / "checkpoints", seed=1,
                                              max_update=args.curve_updates, cpu=args.device == "cpu",
                                              extra=family_settings(name, args)["extra"])
        runs.train(runs.TrainingRun(f"{name} curve", run_dir, command), log)
        return name, command

    commands = dict(runs.run_concurrently(train, baselines, jobs))
    curves = {name: validation_curve(curve_dir / name / "train.log") for name in baselines}
    report = {"settings": settings, "window": FLAT_WINDOW, "gain": args.flat_gain, "curves": {}}
    for name, points in curves.items():
        flat = flat_point(points, FLAT_WINDOW, args.flat_gain)
        report["curves"][name] = {"points": points, "flat_at": flat, "command": commands[name]}
        log(f"{name}: best validation nll {min(v for _, v in points):.3f}; flattened at "
            + (f"{flat:,} updates" if flat else "no point yet (the run is too short to tell)"))
    plot_curves(curves, {n: c["flat_at"] for n, c in report["curves"].items() if c["flat_at"]},
                curve_dir / "curve.png")
    write_json_atomically(report, curve_dir / "curve.json")
    (curve_dir / "curve.md").write_text("\n".join(curve_section(report, args.data)) + "\n", encoding="utf-8")
    return report


def curve_section(report: Dict, data) -> List[str]:
    lines = ["## The baselines' validation curves", "",
             f"Seed 1, validated after every epoch; validation nll is fairseq's (base 2, per target token). "
             f"A curve has flattened at the first budget U whose best validation nll is within "
             f"{report['gain']} of the best reached by U + {report['window']:,} updates.", ""]
    for name, c in report["curves"].items():
        best = min(v for _, v in c["points"])
        flat = f"flattened at {c['flat_at']:,} updates" if c["flat_at"] else "not flattened within the run"
        lines.append(f"- {name}: best {best:.3f}; {flat}.")
    lines += ["", *curve_markdown({n: c["points"] for n, c in report["curves"].items()}), "", "```bash"]
    lines += [shlex.join(_portable(c["command"], str(data))) for c in report["curves"].values()]
    lines += ["```", ""]
    return lines


# ------------------------------------------------------------------ progress
def run_order(args) -> List[tuple]:
    """(model, seed) of every run, longest first so that the last runs to finish are short and no
    core idles long at the end: the models slowest per update, then the family with the larger
    budget, then by seed."""
    def longest_first(ms):
        return ms[0] not in SLOW, -family_settings(ms[0], args)["max_update"], ms[1]

    return sorted(((m, s) for s in args.seeds for m in args.models), key=longest_first)


def status(args, jobs: int) -> int:
    """Print the state of every run of this command and an estimate of the time left."""
    if not (args.output_dir / "settings.json").exists():
        print(f"multi30k benchmark: error: {args.output_dir} holds no comparison yet (no settings.json)",
              file=sys.stderr)
        return 1
    order, states = run_order(args), {}
    for name, seed in order:
        states[name, seed] = run_state(args.output_dir / name / f"seed{seed}",
                                       family_settings(name, args)["max_update"])
    done = sum(s.state == "done" for s in states.values())
    pid = holder(args.output_dir)
    print(f"{args.output_dir}: {done} of {len(order)} runs done; "
          + (f"a benchmark process (pid {pid}) is working on it" if pid else "no benchmark process is working on it"))
    for (name, seed), state in states.items():
        run_dir, line = args.output_dir / name / f"seed{seed}", f"  {name} seed {seed}: {state.state}"
        if state.state == "done":
            evaluation = runs.json_load(run_dir / "evaluation" / "results.json")
            nll = runs.training_stats(run_dir / "train.log")["valid_nll_loss"]
            line += f", sacreBLEU {evaluation['sacrebleu']:.2f}"
            if "chrf" in evaluation:  # evaluations made before chrF and TER were scored lack them
                line += f", chrF {evaluation['chrf']:.2f}, TER {evaluation['ter']:.2f}"
            line += f", valid nll {nll:.3f}"
        elif state.state == "trained":
            line += "; its translation or redundancy measurement is not finished"
        elif state.state == "training":
            line += f", update {state.updates:,} of {state.budget:,} in its train.log"
        print(line)
    rates = {name: seconds_per_update([*args.output_dir.glob(f"{name}/seed*/train.log"),
                                       *args.output_dir.glob(f"curve/{name}/train.log")])
             for name in args.models}
    left = {name: sum(s.updates_left for (m, _), s in states.items() if m == name) for name in args.models}
    unknown = [n for n in args.models if left[n] and rates[n] is None]
    seconds = sum(left[n] * rates[n] for n in args.models if left[n] and rates[n] is not None)
    if not any(left.values()):
        print("No training left" + ("." if done == len(order) else "; rerun the command to finish the evaluations."))
        return 0
    speeds = ", ".join(f"{n} {rates[n]:.2f} s" for n in args.models if left[n] and rates[n] is not None)
    print(f"Left: {sum(left.values()):,} updates; about {duration(seconds / jobs)} at {jobs} runs at a time"
          + (f", at the seconds per update measured in this directory ({speeds})" if speeds else "")
          + (f"; not counted: {', '.join(unknown)} (no speed measured yet)" if unknown else "") + ".")
    return 0


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    lock = threading.Lock()

    def log(message):
        with lock:
            print(f"[{(time.monotonic() - started) / 60:6.1f} min] {message}", flush=True)

    jobs = args.jobs or (os.cpu_count() or 1)
    threads = max(1, (os.cpu_count() or 1) // jobs)
    if args.status:
        return status(args, jobs)
    runs.limit_threads(threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_use(args.output_dir):
            return benchmark(args, argv, log, jobs, threads)
    except DirectoryInUse as e:
        print(f"multi30k benchmark: error: {e} (--status shows where it stands)", file=sys.stderr)
        return 2


def benchmark(args, argv, log, jobs: int, threads: int) -> int:
    """The curve or the comparison, with OUTPUT_DIR held by this process."""
    try:
        if args.curve_updates:
            report = measure_curve(args, log, jobs)
            print("\n".join(curve_section(report, args.data)))
            log(f"wrote {args.output_dir / 'curve'}/curve.{{json,md,png}}")
            return 0
        settings = {"data": str(args.data.resolve()), "subset": args.subset, "max_update": args.max_update,
                    "lstm_max_update": args.lstm_max_update, "beam": args.beam,
                    "train_args": TRAIN_FLAGS + shlex.split(args.train_args),
                    "lstm_train_args": family_settings("lstm", args)["extra"], "seeds": args.seeds,
                    "models": args.models, "device": args.device, "jobs": jobs, "threads": threads,
                    "data_as_given": str(args.data),
                    "bootstrap_samples": args.bootstrap_samples}
        runs.check_settings(args.output_dir, settings, IDENTITY_KEYS)
        order = run_order(args)
        if len({RECIPES[m].family for m in args.models}) > 1:
            each = f"{args.max_update} updates (LSTM family {args.lstm_max_update})"
        else:
            each = f"{family_settings(args.models[0], args)['max_update']} updates"
        log(f"{len(order)} runs ({len(args.models)} models x {len(args.seeds)} seeds), {each} each, {jobs} at a time")
        results = runs.run_concurrently(lambda ms: one_run(*ms, args, log), order, jobs)
        results.sort(key=lambda r: (args.models.index(r["model"]), r["seed"]))
        table = aggregate(results, args.models)
        comparisons = compare(results, args.models, args.bootstrap_samples, log)
    except AnalysisError as e:
        print(f"multi30k benchmark: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("multi30k benchmark: interrupted; finished runs are kept, rerun the same command to continue",
              file=sys.stderr)
        return 130
    text = report_text(args, argv, settings, table, comparisons, results, jobs, threads)
    with atomic_path(args.output_dir / "results.md") as tmp:
        tmp.write_text(text, encoding="utf-8")
    document = {"settings": settings, "table": table, "comparisons": comparisons, "runs": results}
    write_json_atomically(document, args.output_dir / "results.json")
    if args.markdown is not None:  # a section of a page, one heading level down
        section = re.sub(r"^(#+) ", r"#\1 ", text, flags=re.MULTILINE)
        write_marked_section(args.markdown, REPORT_SECTION, section)
    if args.results_json is not None:
        write_json_atomically(document, args.results_json)
    print()
    print(text)
    log(f"wrote {args.output_dir / 'results.md'}, results.json")
    return 0


def report_text(args, argv, settings, table, comparisons, results, jobs, threads) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lstm_lr = f"learning rate {args.lstm_lr}" if args.lstm_lr else "the same optimiser"
    header = [
        "# Multi30k de-en: every method against its baseline",
        "",
        f"Run {when}, commit {git_commit(short=True) or 'unknown'}, {machine(args.device)}; "
        f"{plural(jobs, 'run')} at a time, each on {plural(threads, 'thread')}, so "
        f"tokens/s (fairseq's training wps in target tokens: each run's median over its epochs, so that "
        f"epochs slowed by other work on the machine do not count; mean over seeds) is measured with "
        f"{plural(jobs, 'run')} sharing "
        f"the cores{' and the GPU' if args.device == 'cuda' else ''}. {plural(len(args.seeds), 'seed')} "
        f"({', '.join(map(str, args.seeds))}) per model. The transformer family "
        f"trains for {args.max_update:,} updates, the LSTM family for {args.lstm_max_update:,} with {lstm_lr} "
        f"(max-tokens 4096). The final model translates `{args.subset}` (beam {args.beam}). "
        + code_summary(results),
        "",
        "How to read it: sacreBLEU is detokenized BLEU (13a) against the detokenized references, mean ± "
        "sample standard deviation over seeds; chrF (character n-gram F-score) and TER (translation edit rate, "
        "lower is better) score the same detokenized translations, mean ± std over seeds; the signatures: "
        f"{scoring.signatures_text(results)}. Each run's scored text is kept in its `evaluation/hyp.txt` "
        "and `ref.txt`. tok. BLEU is fairseq's tokenized BLEU of the same translations. "
        f"Δ sacreBLEU is the method minus its family's baseline with all seeds pooled, and its 95 % interval "
        f"comes from paired bootstrap resampling of the test sentences ({args.bootstrap_samples} resamples, "
        "sacreBLEU's resampling; each sentence carries all seeds' translations of it): **better** or "
        "**worse** when the interval excludes 0, else **no difference**. The interval covers the test "
        "set's sampling; the spread over seeds is the ± column. LR / HR: head redundancy (lower is less "
        "redundant), mean over seeds; valid nll: fairseq's last validation (base 2), mean ± std over seeds.",
        "",
        "```bash",
        "python benchmarks/multi30k.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "```",
        "",
    ]
    text = "\n".join(header) + markdown(table, comparisons, settings, results)
    curve = curve_for_report(args)
    return text + ("\n" + "\n".join(curve) + "\n" if curve else "")


def curve_for_report(args) -> List[str]:
    """The section of OUTPUT_DIR/curve with the curves of the baselines that trained as this
    comparison's runs do (same flags, the family's learning rate included): a curve measured
    under other settings chose no budget of this table, so it is named and left out."""
    path = args.output_dir / "curve" / "curve.json"
    if not path.exists():
        return []
    report = runs.json_load(path)
    trained = report["settings"]
    same_flags = trained["train_args"] == TRAIN_FLAGS + shlex.split(args.train_args)
    kept, left_out = {}, []
    for name, curve in report["curves"].items():
        lstm = RECIPES[name].family == "lstm"  # the LSTM's curve also has the family's own flags
        if same_flags and (not lstm or trained["lstm_train_args"] == family_settings(name, args)["extra"]):
            kept[name] = curve
        else:
            left_out.append(name)
    lines = curve_section({**report, "curves": kept}, args.data) if kept else []
    if left_out:
        lines.append(f"Not shown: the curve of {', '.join(left_out)} in {args.output_dir / 'curve'}, trained with "
                     "other flags than this comparison's runs (e.g. another learning rate).")
        lines.append("")
    return lines


if __name__ == "__main__":
    with stopping_on_sigterm():  # SIGTERM stops the fairseq runs and ends as Ctrl-C does
        sys.exit(main())
