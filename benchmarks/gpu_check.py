"""The first command of a session with a GPU: every GPU measurement this project owes, in one
run of about 8 minutes on an H200, most important first, so that a run cut short still holds
DMA's numbers.

    python benchmarks/gpu_check.py --out gpu_check/ [--data data-bin/multi30k.de-en]

Steps, in order (each a subprocess with its own time limit; a step that fails or runs out of
time is recorded as such and the next one runs):

 1. ``kernels``: the Triton kernels' tests on CUDA (tests/test_triton_attention.py
    ``--torch-device cuda``; fp32 dots in TF32 exactly where torch's matmuls use it);
 2. ``tiles``: the kernels' tile candidates timed at the bench's shapes (benchmarks/triton_tiles.py);
 3. ``dma_eager``, ``dma_triton``, ``dma_compile``: ``bench_dma.py --device cuda`` with each
    ``--dma-backend``, L = 32 / 128 / 512, step time, memory and generation;
 4. ``rim``, ``rim_compile``: ``bench_rim.py --device cuda`` without and with ``--compile``;
 5. ``variants``: ``bench_variants.py --device cuda``;
 6. ``fp16``: ``half_precision_train.py`` for DMA and RIM under ``--fp16`` (needs ``--data``, a
    prepared Multi30k data-bin; skipped without it).

After every step it rewrites OUT/gpu_check.md (one markdown table: step, exit, seconds, and the
headline numbers against the GPU targets) and OUT/gpu_check.json; each step's own output is in
OUT/STEP.log and, where the script writes one, OUT/STEP.json. The targets: DMA step <= 1.15 x the
transformer's at L <= 128 and <= 1.25 x at 512, memory <= 1.15 x, generation >= 0.95 x; RIM
encoder <= 4 x cuDNN's LSTM.

OUT must be new or empty (nothing in it is overwritten), and one run uses it at a time.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fairseq_modattn.child_processes import running, stopping_on_sigterm  # noqa: E402
from fairseq_modattn.folder_lock import FolderInUseError, exclusive_use  # noqa: E402

BENCH = REPO / "benchmarks"
#: DMA's targets on a GPU: (step ratio at L <= 128, at 512, memory ratio, generation ratio)
DMA_TARGETS = {"short": 1.15, "long": 1.25, "memory": 1.15, "generation": 0.95}
RIM_TARGET = 4.0


def steps(out: Path, data: Optional[Path]) -> List[Dict]:
    """(name, command, seconds allowed, JSON it writes or None), in the order they run."""
    py = sys.executable
    dma = [py, str(BENCH / "bench_dma.py"), "--device", "cuda", "--lengths", "32", "128", "512", "--repeats", "5",
           "--warmup", "2", "--gen-repeats", "2"]
    plan = [
        dict(name="kernels", seconds=100, json=None,
             cmd=[py, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "fast or e2e",
                  str(REPO / "tests" / "test_triton_attention.py"), "--torch-device", "cuda"]),
        dict(name="tiles", seconds=40, json="tiles.json",
             cmd=[py, str(BENCH / "triton_tiles.py"), "--device", "cuda", "--json", str(out / "tiles.json")]),
    ]
    for backend in ("eager", "triton", "compile"):
        # "compile" and "triton" compile their graphs (a minute or so) before timing
        plan.append(dict(name=f"dma_{backend}", seconds=50 if backend == "eager" else 90,
                         json=f"dma_{backend}.json",
                         cmd=[*dma, "--dma-backend", backend, "--json", str(out / f"dma_{backend}.json")]))
    rim = [py, str(BENCH / "bench_rim.py"), "--device", "cuda", "--repeats", "5", "--warmup", "2"]
    plan += [
        dict(name="rim", seconds=25, json="rim.json", cmd=[*rim, "--json", str(out / "rim.json")]),
        dict(name="rim_compile", seconds=40, json="rim_compile.json",
             cmd=[*rim, "--compile", "--json", str(out / "rim_compile.json")]),
        dict(name="variants", seconds=35, json="variants.json",
             cmd=[py, str(BENCH / "bench_variants.py"), "--device", "cuda", "--json", str(out / "variants.json")]),
    ]
    if data is not None:
        plan.append(dict(name="fp16", seconds=60, json=None,
                         cmd=[py, str(BENCH / "half_precision_train.py"), "--data", str(data), "--output-dir",
                              str(out / "fp16"), "--models", "dma", "rim", "--updates", "120"]))
    return plan


def dma_headline(results: dict) -> str:
    """The step and memory ratios per length and the generation ratio, each with its target."""
    parts = []
    for row in results.get("train", []):
        target = DMA_TARGETS["short"] if row["length"] <= 128 else DMA_TARGETS["long"]
        ratio, memory = row.get("time_ratio"), row.get("memory_ratio")
        if ratio is None:
            parts.append(f"L={row['length']}: out of memory")
            continue
        parts.append(f"L={row['length']}: step {ratio:.2f} x ({'met' if ratio <= target else 'not met'}, <= {target}), "
                     f"memory {memory:.2f} x ({'met' if memory <= DMA_TARGETS['memory'] else 'not met'})")
    generation = results.get("generation")
    if generation:
        ratio = generation["sentences_per_s_ratio"]
        parts.append(f"generation {ratio:.2f} x ({'met' if ratio >= DMA_TARGETS['generation'] else 'not met'}, "
                     f">= {DMA_TARGETS['generation']})")
    return "; ".join(parts)


def rim_headline(results: dict) -> str:
    parts = []
    for row in results.get("train", []):
        ratio = row["time_ratio"]["encoder"]
        parts.append(f"L={row['length']}: encoder {ratio:.2f} x cuDNN ({'met' if ratio <= RIM_TARGET else 'not met'}, "
                     f"<= {RIM_TARGET})")
    return "; ".join(parts)


def tiles_headline(results: dict) -> str:
    parts = []
    for row in results.get("rows", []):
        timings = {name: ms for name, ms in row["tiles"].items() if isinstance(ms, float)}
        best = min(timings, key=timings.get) if timings else "-"
        parts.append(f"L={row['length']}: path's tiles {row['own_ms'] / row['eager_ms']:.2f} x eager attention, "
                     f"fastest {best}")
    return "; ".join(parts)


HEADLINES = {"tiles": tiles_headline, "dma_eager": dma_headline, "dma_triton": dma_headline,
             "dma_compile": dma_headline, "rim": rim_headline, "rim_compile": rim_headline}


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def write_report(out: Path, records: List[Dict], device: str):
    (out / "gpu_check.json").write_text(json.dumps({"device": device, "steps": records}, indent=1))
    lines = [f"# gpu_check on {device}", "", "| step | exit | seconds | result |", "|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['name']} | {r['exit']} | {r['seconds']:.0f} | {r['headline'].replace('|', '/')} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="new or empty folder for the reports and logs")
    p.add_argument("--data", type=Path, default=None, help="a prepared Multi30k de-en data-bin (for the fp16 step)")
    p.add_argument("--only", nargs="+", default=None, metavar="STEP", help="run these steps only")
    p.add_argument("--list", action="store_true", help="print the steps and exit")
    args = p.parse_args(argv)
    plan = steps(args.out, args.data)
    if args.list:
        for step in plan:
            print(f"{step['name']:12} {step['seconds']:4d} s  {' '.join(step['cmd'])}")
        return 0
    if args.only:
        unknown = set(args.only) - {s["name"] for s in plan}
        if unknown:
            p.error(f"unknown steps {sorted(unknown)}; --list shows them")
        plan = [s for s in plan if s["name"] in args.only]
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        print(f"gpu_check: --out {args.out} exists and is not an empty folder; give a new one", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device here", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    records: List[Dict] = []
    try:
        with stopping_on_sigterm(), exclusive_use(args.out, what="--out"):
            for step in plan:
                log = args.out / f"{step['name']}.log"
                print(f"[gpu_check] {step['name']}: {' '.join(step['cmd'][1:])}", flush=True)
                start = time.monotonic()
                with open(log, "w") as stream, running(step["cmd"], stdout=stream, stderr=subprocess.STDOUT,
                                                       env=env, cwd=REPO) as proc:
                    try:
                        code = proc.wait(timeout=step["seconds"])
                    except subprocess.TimeoutExpired:
                        proc.terminate()
                        proc.wait()
                        code = "timeout"
                seconds = time.monotonic() - start
                headline = last_line(log)
                report = args.out / step["json"] if step["json"] else None
                if report is not None and report.exists() and step["name"] in HEADLINES:
                    try:
                        headline = HEADLINES[step["name"]](json.loads(report.read_text())) or headline
                    except (KeyError, TypeError, ValueError) as error:
                        headline = f"{headline} (report unreadable: {error})"
                records.append(dict(name=step["name"], exit=code, seconds=seconds, headline=headline,
                                    command=step["cmd"]))
                write_report(args.out, records, device)
                print(f"[gpu_check] {step['name']}: exit {code} in {seconds:.0f} s; {headline}", flush=True)
    except FolderInUseError as error:
        print(f"gpu_check: {error}", file=sys.stderr)
        return 2
    print(f"[gpu_check] reports in {args.out / 'gpu_check.md'} and {args.out / 'gpu_check.json'}")
    return 0 if all(r["exit"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
