#!/usr/bin/env python
"""Train every model recipe with fairseq's --fp16 on a GPU and check that it trains.

fairseq's ``--fp16`` keeps an fp16 copy of the model, fp32 master weights and a dynamic loss
scale (halved on every overflow, which also skips that update). It is meant for CUDA: the test
suite can only emulate it on the CPU (``tests/test_mixed_precision.py``: ``--cpu
--fp16-no-flatten-grads`` at a small, fixed scale). This script is the real thing. For each
recipe of ``fairseq_modattn/cli/model_recipes.py`` (the benchmark's 2 + 2 layers x 128 models,
every family) it runs the real fairseq-train with the recipe's own optimiser and batch size
plus ``--fp16`` for ``--updates`` updates, logging every ``--log-interval``, and checks:

    * fairseq-train exits 0 (fairseq raises once the loss scale falls below its minimum);
    * every logged training value (loss, nll, DMA's auxiliary losses, gnorm, ...) is finite;
    * the mean nll of the last three logged intervals is below that of the first three;
    * the run reached its last logged interval (updates skipped on overflow do not count).

It also reports the overflows (fairseq's "gradient overflow detected" lines), the loss scale at
the end and the training speed. Runs go ``--jobs`` at a time (all at once by default: the
models are small, so they share one GPU well; the speeds are then shared ones, and say so).

    python benchmarks/half_precision_train.py --data data-bin/multi30k.de-en --output-dir runs/fp16

Logs go to OUTPUT_DIR/MODEL.log; nothing else is written (``--no-save``). ``--cpu`` runs the
emulation instead (for the smoke test; add a small ``--fp16-init-scale`` through
``--train-args``, as the CPU has no fast overflow check).
"""

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fairseq_modattn.child_processes import running, stopping_on_sigterm  # noqa: E402
from fairseq_modattn.cli.model_recipes import RECIPES  # noqa: E402
from fairseq_modattn.cli.runs import run_concurrently  # noqa: E402
from fairseq_modattn.folder_lock import FolderInUseError, exclusive_use  # noqa: E402

#: logged intervals averaged at each end of the run for the "loss falls" check
ENDS = 3
OVERFLOW = "gradient overflow detected"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", type=Path, required=True, help="prepared Multi30k de-en data-bin")
    p.add_argument("--output-dir", type=Path, required=True,
                   help="new or empty directory for the training logs")
    p.add_argument("--models", nargs="+", default=list(RECIPES), choices=list(RECIPES), metavar="MODEL",
                   help=f"recipes to train (default: all: {', '.join(RECIPES)})")
    p.add_argument("--updates", type=int, default=300, help="training updates per model (default 300)")
    p.add_argument("--log-interval", type=int, default=10, help="updates per logged training line (default 10)")
    p.add_argument("--jobs", type=int, default=None, help="runs at a time (default: all at once)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="emulate on the CPU (smoke test)")
    p.add_argument("--train-args", default="", metavar="ARGS", help="extra fairseq-train flags, last")
    args = p.parse_args(argv)
    if min(args.updates, args.log_interval, args.jobs or 1) < 1:
        p.error("--updates, --log-interval and --jobs must be positive")
    if args.updates < 2 * ENDS * args.log_interval:
        p.error(f"--updates must be at least {2 * ENDS} x --log-interval, so that the first and the last "
                f"{ENDS} logged intervals do not overlap")
    if not (args.data / "dict.de.txt").is_file():
        p.error(f"--data {args.data} is not a prepared de-en data-bin (no dict.de.txt)")
    if args.output_dir.exists() and (not args.output_dir.is_dir() or any(args.output_dir.iterdir())):
        p.error(f"--output-dir {args.output_dir} exists and is not an empty directory; give a new one")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            p.error("torch sees no CUDA device here; --fp16 training needs one (--cpu emulates it)")
    return args


def command(name: str, args) -> List[str]:
    extra = ["--fp16", "--no-save", "--disable-validation", "--log-format", "json",
             "--log-interval", str(args.log_interval)]
    if args.cpu:
        extra.append("--fp16-no-flatten-grads")  # the flattened path calls torch.cuda.current_device()
    return RECIPES[name].train_command(args.data.resolve(), args.output_dir / name, seed=args.seed,
                                       max_update=args.updates, cpu=args.cpu,
                                       extra=extra + shlex.split(args.train_args))


def train_inner_rows(log_text: str) -> List[Dict[str, float]]:
    """The values of fairseq's json ``train_inner`` lines, in order."""
    rows = []
    for line in log_text.splitlines():
        if "| train_inner |" in line:
            values = json.loads(line.split("| train_inner |", 1)[1])
            rows.append({k: float(v) for k, v in values.items()})
    return rows


def judge(name: str, code: int, log_text: str, seconds: float, updates: int, log_interval: int) -> Dict:
    """The checks of the module docstring on one run's log, its problems listed in words."""
    rows = train_inner_rows(log_text)
    result = {"model": name, "exit": code, "intervals": len(rows), "seconds": round(seconds, 1),
              "overflows": log_text.count(OVERFLOW), "problems": []}
    if code != 0:
        result["problems"].append(f"fairseq-train exited with status {code}")
    if len(rows) < 2 * ENDS:
        result["problems"].append(f"only {len(rows)} training lines logged")
        return result
    bad = sorted({k for row in rows for k, v in row.items() if not math.isfinite(v)})
    if bad:
        result["problems"].append(f"non-finite {', '.join(bad)}")
    first = statistics.mean(r["nll_loss"] for r in rows[:ENDS])
    last = statistics.mean(r["nll_loss"] for r in rows[-ENDS:])
    if not last < first:
        result["problems"].append(f"nll did not fall ({first:.3f} -> {last:.3f})")
    reached = int(rows[-1].get("num_updates", 0))
    if reached != updates - updates % log_interval:  # the last logged interval
        result["problems"].append(f"stopped at update {reached} of {updates}")
    result.update(nll_first=round(first, 3), nll_last=round(last, 3),
                  loss_scale=rows[-1].get("loss_scale"), updates=reached,
                  ups=round(updates / seconds, 2), wps=round(statistics.mean(r["wps"] for r in rows[ENDS:]), 0))
    return result


def train(name: str, args, log) -> Dict:
    cmd = command(name, args)
    log(f"[{name}] {shlex.join(cmd)}")
    start = time.perf_counter()
    with open(args.output_dir / f"{name}.log", "w", encoding="utf-8") as out, \
            running(cmd, stdout=out, stderr=subprocess.STDOUT) as proc:
        code = proc.wait()
    seconds = time.perf_counter() - start
    result = judge(name, code, (args.output_dir / f"{name}.log").read_text(encoding="utf-8"), seconds,
                   args.updates, args.log_interval)
    log(f"[{name}] {'ok' if not result['problems'] else '; '.join(result['problems'])} ({seconds:.0f} s)")
    return result


def table(results: List[Dict], args, jobs: int) -> str:
    shared = f", {jobs} runs sharing the device" if jobs > 1 else ""
    lines = [f"fp16 training, {args.updates} updates per model{shared}:", "",
             "| model | nll (first → last logged) | overflows | final loss scale | updates/s | tokens/s | result |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        nll = f"{r['nll_first']:.3f} → {r['nll_last']:.3f}" if "nll_first" in r else "-"
        scale = f"{r['loss_scale']:g}" if r.get("loss_scale") is not None else "-"
        speed = (f"{r['ups']:.1f} | {r['wps']:,.0f}") if "ups" in r else "- | -"
        verdict = "ok" if not r["problems"] else "FAILED: " + "; ".join(r["problems"])
        lines.append(f"| {r['model']} | {nll} | {r['overflows']} | {scale} | {speed} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # one writer per folder (fairseq_modattn.folder_lock)
        with exclusive_use(args.output_dir, what="--output-dir"):
            return check(args)
    except FolderInUseError as e:
        print(f"half-precision check: error: {e}", file=sys.stderr)
        return 1


def check(args) -> int:
    """Train every model of ARGS, with OUTPUT_DIR held by this process."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    started, lock = time.monotonic(), threading.Lock()

    def log(message):
        with lock:
            print(f"[{time.monotonic() - started:6.0f} s] {message}", flush=True)

    jobs = args.jobs or len(args.models)
    try:
        results = run_concurrently(lambda name: train(name, args, log), args.models, jobs)
    except KeyboardInterrupt:
        print("half-precision check: interrupted", file=sys.stderr)
        return 130
    results.sort(key=lambda r: args.models.index(r["model"]))
    print()
    print(table(results, args, jobs))
    (args.output_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    with stopping_on_sigterm():
        sys.exit(main())
