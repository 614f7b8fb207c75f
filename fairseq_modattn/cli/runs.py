"""One model run, trained and evaluated step by step and resumably: the steps that ``ablate``,
``quickstart`` and ``benchmarks/multi30k.py`` share.

A run lives in its own directory:

    RUN_DIR/checkpoints/        fairseq-train's --save-dir
    RUN_DIR/train.log           fairseq-train's output (appended to when a run continues)
    RUN_DIR/train.command       the command, written when training starts: an unfinished run is
                                only continued by the same command
    RUN_DIR/train.done          the command, written when training finished
    RUN_DIR/evaluation/         averaged.pt, generate-SUBSET.txt, results.json and the scored
                                text beside it, hyp.txt and ref.txt
    RUN_DIR/redundancy.json     parameter count and LR / HR per attention type

Every step leaves its marker when it completes; calling it again returns the recorded result,
and an interrupted ``fairseq-train`` continues from its ``checkpoint_last.pt``.
"""

import contextlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import child_processes
from ..analysis import AnalysisError
from ..atomic_files import write_json_atomically
from ..folder_lock import exclusive_use

Log = Callable[[str], None]

#: fairseq-train log records shown as progress (the rest goes to train.log only)
_PROGRESS = re.compile(r" \| INFO \| (train_inner|train|valid) \| | done training ")


@dataclass
class TrainingRun:
    """``command`` (a complete fairseq-train command line) run in ``run_dir`` under ``label``."""

    label: str
    run_dir: Path
    command: List[str]

    @property
    def done_marker(self) -> Path:
        return self.run_dir / "train.done"

    @property
    def command_record(self) -> Path:
        return self.run_dir / "train.command"

    def refuse_other_command(self, recorded: List[str]) -> None:
        if recorded != self.command:
            raise AnalysisError(f"{self.run_dir} holds a {self.label} model trained with another command "
                                f"({shlex.join(recorded)}); use another output directory")


def train(run: TrainingRun, log: Log) -> None:
    """Run fairseq-train unless ``train.done`` says it finished, streaming progress lines to LOG."""
    if run.done_marker.exists():
        run.refuse_other_command(json_load(run.done_marker)["command"])
        log(f"[{run.label}] already trained ({run.done_marker})")
        return
    resuming = (run.run_dir / "checkpoints" / "checkpoint_last.pt").exists()
    if resuming and run.command_record.exists():
        # continuing a checkpoint under another budget or learning rate would train a model that
        # neither command describes
        run.refuse_other_command(json_load(run.command_record)["command"])
    log(f"[{run.label}] {'continuing' if resuming else 'training'}: {shlex.join(run.command)}")
    run.run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomically({"command": run.command}, run.command_record)
    # line-buffered: whoever follows train.log (tail -f, multi30k.py --status) sees each record
    # as fairseq prints it, not blocks of 8 KiB hundreds of updates late
    with open(run.run_dir / "train.log", "a", encoding="utf-8", buffering=1) as out, child_processes.running(
            run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            out.write(line)
            if _PROGRESS.search(line):
                log(f"[{run.label}] {line.split(' | INFO | ', 1)[-1].rstrip()}")
        code = proc.wait()
    if code != 0:
        tail = "".join((run.run_dir / "train.log").read_text(encoding="utf-8").splitlines(True)[-20:])
        raise AnalysisError(f"fairseq-train for {run.label} exited with status {code}; "
                            f"last lines of {run.run_dir / 'train.log'}:\n{tail}")
    write_json_atomically({"command": run.command}, run.done_marker)


def run_concurrently(function: Callable, items: Sequence, jobs: int) -> List:
    """[function(item) for item in ITEMS], at most JOBS at a time (threads: each item's work is
    mostly a fairseq subprocess). Every item is attempted; the first failure is raised once all
    have stopped."""
    if jobs <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(function, item) for item in items]
        wait(futures)
    except BaseException:  # interrupted: the runs not started yet never start
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def limit_threads(threads: int) -> None:
    """Cap the intra-op threads of this process and of the fairseq processes it starts, so that
    JOBS concurrent runs share the cores instead of oversubscribing them."""
    import torch

    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def evaluate(run_dir: Path, label: str, data, *, average_last: int = 0, subset: str = "test", beam: int = 5,
             cpu: bool = False, compound_split: bool = False, generate_args: Sequence[str] = (),
             log: Log = print) -> Dict:
    """Translate SUBSET with the final model, or the average of the last AVERAGE_LAST epoch
    checkpoints, and score it (``fairseq-modattn evaluate``'s results, cached in
    ``evaluation/results.json``)."""
    result_path = run_dir / "evaluation" / "results.json"
    with exclusive_use(run_dir / "evaluation", error=AnalysisError, what="work dir"):
        if result_path.exists():
            log(f"[{label}] already evaluated ({result_path})")
            return _with_later_scores(json_load(result_path), result_path, label, log)
        return _evaluate(run_dir, label, data, result_path, average_last, subset, beam, cpu, compound_split,
                         generate_args, log)


def _with_later_scores(results: Dict, result_path: Path, label: str, log: Log) -> Dict:
    """RESULTS of an evaluation made before chrF and TER were scored, completed from its kept
    translations (no new translation) and saved back; other RESULTS as they are."""
    from .evaluate import complete_recorded_scores

    if complete_recorded_scores(results, result_path):
        write_json_atomically(results, result_path)
        log(f"[{label}] scored the kept translations with chrF and TER too")
    return results


def _evaluate(run_dir, label, data, result_path, average_last, subset, beam, cpu, compound_split, generate_args,
              log) -> Dict:
    from ..analysis.checkpoints import find_checkpoints
    from .evaluate import evaluate_checkpoints

    save_dir = run_dir / "checkpoints"
    if average_last and list(save_dir.glob("checkpoint[0-9]*.pt")):
        checkpoints = find_checkpoints(save_dir, average_last, allow_fewer=True)
    else:
        if average_last:  # a budget shorter than one epoch leaves no epoch checkpoint
            log(f"[{label}] no epoch checkpoint (budget under one epoch): evaluating checkpoint_last.pt")
        checkpoints = [save_dir / "checkpoint_last.pt"]
    results = evaluate_checkpoints(
        data, checkpoints, subset=subset, beam=beam, compound_split=compound_split, cpu=cpu,
        work_dir=run_dir / "evaluation", extra_generate_args=list(generate_args),
        log=lambda m: log(f"[{label}] {m}"),
    )
    write_json_atomically(results, result_path)
    log(f"[{label}] BLEU {results['bleu']:.2f}, sacreBLEU {results['sacrebleu']:.2f}, chrF {results['chrf']:.2f}, "
        f"TER {results['ter']:.2f} on {results['sentences']} {subset} sentences")
    return results


def redundancy(run_dir: Path, label: str, model_path, data, *, subset: str = "test",
               attentions: Sequence[str] = ("enc_self",), cpu: bool = False, log: Log = print) -> Dict:
    """{"parameters": N, "redundancy": {attention type: {"LR", "HR", ...}}} of the model at
    MODEL_PATH (cached in ``redundancy.json``; an empty ATTENTIONS gives the count alone)."""
    path = run_dir / "redundancy.json"
    if path.exists():
        log(f"[{label}] redundancy already measured ({path})")
        return json_load(path)
    with MEASURE_LOCK:
        return _measure(path, label, model_path, data, subset, attentions, cpu, log)


#: models loaded in this process are measured one at a time, also when runs are concurrent
MEASURE_LOCK = threading.Lock()


def _measure(path, label, model_path, data, subset, attentions, cpu, log) -> Dict:
    from ..analysis.extract import measure_redundancy
    from ..analysis.loading import load_model

    model, task, _ = load_model(str(model_path), data, cpu=cpu)
    report = {"parameters": sum(p.numel() for p in model.parameters()), "subset": subset, "redundancy": {}}
    for attention in attentions:
        # fairseq's pin_memory and mixed-mask warnings are filtered by compat fix 16
        result = measure_redundancy(model, task, subset, attention)
        report["redundancy"][attention] = result.as_dict()
        log(f"[{label}] {attention}: LR {result.lr:.4f}, HR {result.hr:.4f}")
    write_json_atomically(report, path)
    return report


def resumable_command(prog: str, body: Callable[[], int], output_dir: Optional[Path] = None) -> int:
    """Run BODY, the work of command PROG, holding the lock of its OUTPUT_DIR (a second command
    pointed at the same folder is refused: ``folder_lock``); an AnalysisError becomes its message
    and exit status 1, an interruption (Ctrl-C, or SIGTERM, which first stops the fairseq commands
    it runs) a reminder that rerunning the command continues it (status 130)."""
    try:
        with child_processes.stopping_on_sigterm(), contextlib.ExitStack() as stack:
            if output_dir is not None:
                stack.enter_context(exclusive_use(output_dir, error=AnalysisError, what="--output-dir"))
            return body()
    except AnalysisError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; finished steps are kept, rerun the same command to continue", file=sys.stderr)
        return 130


def check_settings(output_dir: Path, settings: Dict, identity_keys: Sequence[str]) -> None:
    """Record SETTINGS in OUTPUT_DIR/settings.json, or refuse when the directory holds runs made
    with settings that differ in one of IDENTITY_KEYS: results that are not comparable are never
    mixed in one table (other keys, e.g. which models, may change between calls)."""
    path = output_dir / "settings.json"
    if path.exists():
        recorded = json_load(path)
        changed = [k for k in identity_keys if recorded.get(k) != settings.get(k)]
        if changed:
            details = "; ".join(f"{k}: {recorded.get(k)!r} -> {settings.get(k)!r}" for k in changed)
            raise AnalysisError(f"{output_dir} holds runs made with other settings ({details}); rerun with "
                                "the same flags to continue them, or use another --output-dir")
    write_json_atomically(settings, path)


def json_load(path: Path):
    import json

    return json.loads(Path(path).read_text(encoding="utf-8"))


_EPOCH_STATS = re.compile(r"\| INFO \| train \| epoch (\d+) \|(.*)$")


def training_stats(train_log: Path) -> Dict:
    """From fairseq-train's log: the training speed in target tokens per second (fairseq's
    per-epoch ``wps``, averaged with each epoch's training time as weight, so that a short last
    epoch counts for what it is), its median over the epochs (``wps_median``: a few epochs
    slowed by other work on the machine do not move it), the training time in seconds (sum of
    the epochs' ``train_wall``), the number of updates, and the last validation loss and nll."""
    stats = {"wps": None, "wps_median": None, "train_wall": None, "num_updates": None, "valid_loss": None,
             "valid_nll_loss": None}
    wps, walls = {}, {}
    text = Path(train_log).read_text(encoding="utf-8") if Path(train_log).exists() else ""
    for line in text.splitlines():
        match = _EPOCH_STATS.search(line)
        if match:
            fields = dict(re.findall(r"(\w+) ([-\d.e+]+)", match.group(2)))
            epoch = int(match.group(1))  # a continued run repeats no epoch, but keep the last record
            wps[epoch] = float(fields["wps"])
            walls[epoch] = float(fields.get("train_wall", 0.0))
            stats["num_updates"] = int(float(fields["num_updates"]))
        elif "| valid |" in line and "valid on" in line:
            fields = dict(re.findall(r"\| (\w+) ([-\d.e+]+)", line))
            stats["valid_loss"] = float(fields["loss"]) if "loss" in fields else None
            stats["valid_nll_loss"] = float(fields["nll_loss"]) if "nll_loss" in fields else None
    if wps:
        total = sum(walls.values())
        stats["wps"] = (sum(wps[e] * walls[e] for e in wps) / total) if total > 0 else sum(wps.values()) / len(wps)
        stats["train_wall"] = total
        stats["wps_median"] = statistics.median(wps.values())
    return stats
