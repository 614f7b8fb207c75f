#!/usr/bin/env python
"""DMA's objective on real data, validation only: the tiny preset with its Table-5 weights against
the transformer, with the authors' objective (the default) and with the paper's text.

Trains, with the real fairseq-train and the same optimiser, schedule and budget (Multi30k de-en,
2 + 2 layers x 128, ``fairseq_modattn/cli/model_recipes.py``), once per seed:

    transformer   fairseq's transformer
    dma_authors   --arch dma_transformer_iwslt_de_en_tiny (c_qq 50, c_xq 5, c_kl 0.01, c_dv 1,
                  c_grad 10, n_c 4, gamma annealed at 5e-4: Table 5, nothing tuned)
    dma_paper     the same with --dma-objective paper

and reports, from the validation split only:

    * the last validation nll (fairseq's, base 2) and its difference to the transformer's of
      the same seed;
    * L_Dqq through the run: every logged training value (each --log-interval updates) and,
      at every epoch checkpoint, its value and the norm of its gradient with respect to the
      model's parameters on the validation batches (evaluation mode, per target token);
    * LR / HR of every attention type on the validation split (lower is less redundant).

It then checks the targets of the DMA-objective work (nll within 0.05 of the transformer's,
L_Dqq and its gradient non-zero throughout, LR and HR below the transformer's) and prints each
check with its numbers. Runs are resumable (rerun the same command); results go to
OUTPUT_DIR/results.{md,json}.

    python benchmarks/dma_objective.py --data data-bin/multi30k.de-en --output-dir runs/dma-objective

On the project's 2-core CPU the default (3 models x 3 seeds x 1000 updates, 2 at a time)
takes about 90 minutes; ``--paper-seeds 1`` trains the paper's objective once (about 60).
"""

import argparse
import datetime
import os
import re
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import torch

import fairseq_modattn  # noqa: F401  (registers the models)
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.atomic_files import write_json_atomically
from fairseq_modattn.child_processes import stopping_on_sigterm
from fairseq_modattn.cli import runs
from fairseq_modattn.cli.model_recipes import RECIPES, TRAIN_FLAGS, ModelRecipe
from fairseq_modattn.folder_lock import exclusive_use

ATTENTIONS = ("enc_self", "dec_self", "enc_dec")
MODELS: Dict[str, ModelRecipe] = {
    "transformer": RECIPES["transformer"],
    "dma_authors": ModelRecipe("dma_authors", "DMA tiny preset, the authors' objective (default)",
                               RECIPES["dma"].flags, RECIPES["dma"].criterion),
    "dma_paper": ModelRecipe("dma_paper", "DMA tiny preset, --dma-objective paper",
                             [*RECIPES["dma"].flags, "--dma-objective", "paper"], RECIPES["dma"].criterion),
}
IDENTITY_KEYS = ("data", "max_update", "train_args")
#: targets of the comparison with the transformer
NLL_MARGIN = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="prepared Multi30k de-en data-bin")
    p.add_argument("--output-dir", type=Path, required=True, help="runs and results go here")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), metavar="MODEL",
                   help=f"models to train, from {', '.join(MODELS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="one run per model and seed")
    p.add_argument("--paper-seeds", type=int, nargs="+", default=None, metavar="SEED",
                   help="seeds of dma_paper, the comparison beside the default objective (default: --seeds)")
    p.add_argument("--max-update", type=int, default=1000, help="training budget per run, in updates")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (the cores are shared among them)")
    p.add_argument("--train-args", default="", metavar="ARGS",
                   help="extra fairseq-train flags for every run, as one string (tests)")
    args = p.parse_args(argv)
    if args.max_update < 1 or args.jobs < 1:
        p.error("--max-update and --jobs must be positive")
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.models)) != len(args.models):
        p.error("--seeds and --models must not repeat a value")
    args.paper_seeds = args.seeds if args.paper_seeds is None else args.paper_seeds
    if not (args.data / "dict.de.txt").is_file():
        p.error(f"--data {args.data} is not a prepared de-en data-bin (no dict.de.txt)")
    return args


_TRAIN_DQQ = re.compile(r"\| train_inner \|.* dqq=([-\d.e+]+),.* num_updates=(\d+)")


def logged_dqq(train_log: Path) -> List[List[float]]:
    """[[update, L_Dqq]] of every train_inner record of fairseq-train's log."""
    text = train_log.read_text(encoding="utf-8") if train_log.exists() else ""
    return [[int(m.group(2)), float(m.group(1))] for m in map(_TRAIN_DQQ.search, text.splitlines()) if m]


def dqq_at_checkpoints(run_dir: Path, data: Path) -> List[Dict]:
    """L_Dqq per target token and the norm of its parameter gradient on the validation split,
    at every epoch checkpoint and the last one (cached in dqq_checkpoints.json)."""
    from fairseq_modattn.analysis.loading import iterate_batches, load_model

    cache = run_dir / "dqq_checkpoints.json"
    if cache.exists():
        return runs.json_load(cache)
    save_dir = run_dir / "checkpoints"
    paths = sorted(save_dir.glob("checkpoint[0-9]*.pt"), key=lambda p: int(re.findall(r"\d+", p.stem)[0]))
    rows = []
    with runs.MEASURE_LOCK:  # one model in memory at a time, also when runs are concurrent
        for path in [*paths, save_dir / "checkpoint_last.pt"]:
            model, task, _ = load_model(path, str(data))
            model.zero_grad(set_to_none=True)
            total, tokens = 0.0, 0
            for sample in iterate_batches(task, model, "valid"):
                aux = model(**sample["net_input"])[1]
                value = aux["aux_losses"]["dqq"]
                if aux["aux_reduction"] == "mean":  # a per-token mean: weigh it by the batch's tokens
                    value = value * sample["ntokens"]
                value.backward()
                total, tokens = total + value.item(), tokens + sample["ntokens"]
            grads = [p.grad.flatten() / tokens for p in model.parameters() if p.grad is not None]
            norm = torch.cat(grads).norm().item() if grads else 0.0
            rows.append({"checkpoint": path.name, "num_updates": model.decoder.layers[0].self_attn.num_updates,
                         "dqq": total / tokens, "grad_norm": norm})
    write_json_atomically(rows, cache)
    return rows


def one_run(name: str, seed: int, args, log) -> Dict:
    recipe = MODELS[name]
    label, run_dir = f"{name} seed {seed}", args.output_dir / name / f"seed{seed}"
    command = recipe.train_command(args.data.resolve(), run_dir / "checkpoints", seed=seed,
                                   max_update=args.max_update, keep_last_epochs=1000, cpu=True,
                                   extra=shlex.split(args.train_args))
    runs.train(runs.TrainingRun(label, run_dir, command), log)
    measured = runs.redundancy(run_dir, label, run_dir / "checkpoints" / "checkpoint_last.pt", str(args.data),
                               subset="valid", attentions=ATTENTIONS, cpu=True, log=log)
    result = {"model": name, "seed": seed, **runs.training_stats(run_dir / "train.log"),
              "parameters": measured["parameters"],
              "redundancy": {k: {"LR": v["LR"], "HR": v["HR"]} for k, v in measured["redundancy"].items()},
              "command": command}
    if name != "transformer":
        result["dqq_logged"] = logged_dqq(run_dir / "train.log")
        result["dqq_checkpoints"] = dqq_at_checkpoints(run_dir, args.data)
        log(f"[{label}] L_Dqq at checkpoints: " + ", ".join(
            f"{r['num_updates']}: {r['dqq']:.4g} (grad {r['grad_norm']:.3g})" for r in result["dqq_checkpoints"]))
    return result


def mean_std(values: List[float]) -> Dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def summarise(results: List[Dict], models: List[str]) -> Dict:
    table = {}
    baseline = {r["seed"]: r for r in results if r["model"] == "transformer"}
    for name in models:
        rows = [r for r in results if r["model"] == name]
        entry = {"parameters": rows[0]["parameters"], "seeds": [r["seed"] for r in rows],
                 "valid_nll_loss": mean_std([r["valid_nll_loss"] for r in rows]),
                 "wps": mean_std([r["wps"] for r in rows]),
                 "redundancy": {a: {k: statistics.fmean(r["redundancy"][a][k] for r in rows) for k in ("LR", "HR")}
                                for a in ATTENTIONS}}
        if baseline and name != "transformer":
            entry["nll_minus_transformer"] = mean_std(
                [r["valid_nll_loss"] - baseline[r["seed"]]["valid_nll_loss"] for r in rows if r["seed"] in baseline])
        if "dqq_logged" in rows[0]:
            entry["dqq_logged_min"] = min(v for r in rows for _, v in r["dqq_logged"])
            entry["dqq_checkpoint_min"] = min(c["dqq"] for r in rows for c in r["dqq_checkpoints"])
            entry["dqq_grad_norm_min"] = min(c["grad_norm"] for r in rows for c in r["dqq_checkpoints"])
        table[name] = entry
    return table


def checks(table: Dict) -> List[Dict]:
    """The targets for the default (authors') objective, each with its numbers."""
    if "dma_authors" not in table or "transformer" not in table:
        return []
    dma, base = table["dma_authors"], table["transformer"]
    gap = dma["nll_minus_transformer"]["mean"]
    out = [{"check": f"valid nll within {NLL_MARGIN} of the transformer's (mean over seeds)",
            "value": f"{dma['valid_nll_loss']['mean']:.3f} vs {base['valid_nll_loss']['mean']:.3f} ({gap:+.3f})",
            "passed": gap <= NLL_MARGIN},
           {"check": "L_Dqq > 0 at every logged update and checkpoint, with a non-zero gradient",
            "value": f"min logged {dma['dqq_logged_min']:.3g}, min at checkpoints {dma['dqq_checkpoint_min']:.3g}, "
                     f"min gradient norm {dma['dqq_grad_norm_min']:.3g}",
            "passed": dma["dqq_logged_min"] > 0 and dma["dqq_checkpoint_min"] > 0 and dma["dqq_grad_norm_min"] > 0}]
    for attention in ATTENTIONS:
        d, b = dma["redundancy"][attention], base["redundancy"][attention]
        out.append({"check": f"LR and HR of {attention} below the transformer's",
                    "value": f"LR {d['LR']:.3f} vs {b['LR']:.3f}, HR {d['HR']:.3f} vs {b['HR']:.3f}",
                    "passed": d["LR"] < b["LR"] and d["HR"] < b["HR"]})
    return out


def markdown(table: Dict, verdicts: List[Dict], settings: Dict) -> str:
    lines = ["| model | params | valid nll (mean ± std) | Δ nll vs transformer | min L_Dqq (logged / checkpoints) "
             "| min ‖∇L_Dqq‖ | LR / HR enc self | LR / HR dec self | LR / HR enc-dec | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in table.items():
        nll = e["valid_nll_loss"]
        delta = e.get("nll_minus_transformer")
        red = " | ".join(f"{e['redundancy'][a]['LR']:.3f} / {e['redundancy'][a]['HR']:.3f}" for a in ATTENTIONS)
        dqq = (f"{e['dqq_logged_min']:.3g} / {e['dqq_checkpoint_min']:.3g}" if "dqq_logged_min" in e else "-")
        grad = f"{e['dqq_grad_norm_min']:.3g}" if "dqq_grad_norm_min" in e else "-"
        delta = "" if delta is None else f"{delta['mean']:+.3f} ± {delta['std']:.3f}"
        lines.append(f"| {name} | {e['parameters']:,} | {nll['mean']:.3f} ± {nll['std']:.3f} | {delta} | {dqq} | "
                     f"{grad} | {red} | {e['wps']['mean']:.0f} |")
    lines += ["", "Per-seed validation nll:", ""]
    lines += [f"- {name}: " + ", ".join(f"seed {s} {v:.3f}" for s, v in zip(e["seeds"], e["valid_nll_loss"]["values"]))
              for name, e in table.items()]
    if verdicts:
        lines += ["", "Targets (dma_authors against the transformer):", ""]
        lines += [f"- {'PASS' if v['passed'] else 'FAIL'}: {v['check']}: {v['value']}" for v in verdicts]
    lines += ["", "Flags of every run besides the data, --save-dir and --seed: " + shlex.join(settings["train_args"]),
              ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # one writer per folder (fairseq_modattn.folder_lock)
        with exclusive_use(args.output_dir, error=AnalysisError, what="--output-dir"):
            return compare(args, argv)
    except AnalysisError as e:
        print(f"dma_objective benchmark: error: {e}", file=sys.stderr)
        return 1


def compare(args, argv) -> int:
    """The runs, their table and checks, with OUTPUT_DIR held by this process."""
    started, lock = time.monotonic(), threading.Lock()

    def log(message):
        with lock:
            print(f"[{(time.monotonic() - started) / 60:6.1f} min] {message}", flush=True)

    runs.limit_threads(max(1, (os.cpu_count() or 1) // args.jobs))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    settings = {"data": str(args.data.resolve()), "max_update": args.max_update, "seeds": args.seeds,
                "paper_seeds": args.paper_seeds, "models": args.models,
                "train_args": TRAIN_FLAGS + shlex.split(args.train_args)}
    try:
        runs.check_settings(args.output_dir, settings, IDENTITY_KEYS)
        # seed by seed, so that the first complete comparison is known early
        order = [(m, s) for s in sorted(set(args.seeds) | set(args.paper_seeds)) for m in args.models
                 if s in (args.paper_seeds if m == "dma_paper" else args.seeds)]
        paper = f", dma_paper {args.paper_seeds}" if "dma_paper" in args.models else ""
        log(f"{len(order)} runs ({', '.join(args.models)}; seeds {args.seeds}{paper}), "
            f"{args.max_update} updates each, {args.jobs} at a time")
        results = runs.run_concurrently(lambda ms: one_run(*ms, args, log), order, args.jobs)
    except AnalysisError as e:
        print(f"dma_objective benchmark: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dma_objective benchmark: interrupted; finished runs are kept, rerun the same command to continue",
              file=sys.stderr)
        return 130
    table = summarise(results, args.models)
    verdicts = checks(table)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"# DMA objective on Multi30k validation ({when})\n\n```bash\npython benchmarks/dma_objective.py "
            + shlex.join(sys.argv[1:] if argv is None else argv) + "\n```\n\n" + markdown(table, verdicts, settings))
    (args.output_dir / "results.md").write_text(text, encoding="utf-8")
    write_json_atomically({"settings": settings, "table": table, "checks": verdicts, "runs": results},
                          args.output_dir / "results.json")
    print()
    print(text)
    log(f"wrote {args.output_dir / 'results.md'}, results.json")
    return 0


if __name__ == "__main__":
    with stopping_on_sigterm():  # SIGTERM stops the fairseq runs and ends as Ctrl-C does
        sys.exit(main())
