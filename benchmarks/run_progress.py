"""Where a directory of benchmark runs stands, and how long the rest will take at the speed its
runs have shown so far: what ``multi30k.py --status`` prints, and the lock that keeps two
benchmark processes out of one directory.

A run's state comes from the markers ``fairseq_modattn/cli/runs.py`` leaves (``train.done``,
``evaluation/results.json``, ``redundancy.json``) and from the last ``num_updates`` that
fairseq-train logged. The speed of a model is the median wall-clock time per update between two
consecutive epoch records of one fairseq-train process: it includes validation and checkpoint
saving, and it was measured under whatever sharing of the machine the runs had.
"""

import datetime
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from fairseq_modattn import folder_lock

#: a fairseq-train epoch record (``--log-format simple`` prefixes the time)
_EPOCH = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \| INFO \| train \| epoch \d+ \|.*\| num_updates (\d+)")
#: fairseq-train's configuration dump, the first record of each process (a continued run has several)
_PROCESS_START = " | INFO | fairseq_cli.train | {"
_UPDATES = re.compile(r"\bnum_updates[= ](\d+)")


@dataclass
class RunState:
    """One run's progress: ``state`` is "done", "trained" (evaluation not finished), "training" or
    "not started"; ``updates`` the last update fairseq-train logged."""

    state: str
    updates: int
    budget: int

    @property
    def updates_left(self) -> int:
        return 0 if self.state in ("done", "trained") else max(0, self.budget - self.updates)


def run_state(run_dir: Path, budget: int) -> RunState:
    if (run_dir / "train.done").exists():
        done = (run_dir / "evaluation" / "results.json").exists() and (run_dir / "redundancy.json").exists()
        return RunState("done" if done else "trained", logged_updates(run_dir / "train.log"), budget)
    if (run_dir / "train.log").exists():
        return RunState("training", logged_updates(run_dir / "train.log"), budget)
    return RunState("not started", 0, budget)


def logged_updates(train_log: Path) -> int:
    """The last update count fairseq-train logged (0 before its first log record)."""
    if not train_log.exists():
        return 0
    found = _UPDATES.findall(train_log.read_text(encoding="utf-8", errors="replace"))
    return int(found[-1]) if found else 0


def seconds_per_update(train_logs: Iterable[Path]) -> Optional[float]:
    """The median wall-clock seconds per update over the epochs in TRAIN_LOGS (None without two
    epoch records of one process)."""
    rates = []
    for path in train_logs:
        previous = None
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if _PROCESS_START in line:  # a restarted process: its first epoch includes the start-up
                previous = None
                continue
            match = _EPOCH.match(line)
            if match:
                when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
                updates = int(match.group(2))
                if previous is not None and updates > previous[1]:
                    rates.append((when - previous[0]).total_seconds() / (updates - previous[1]))
                previous = (when, updates)
    return statistics.median(rates) if rates else None


def duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


# ------------------------------------------------------------------ one process per directory
class DirectoryInUse(RuntimeError):
    """Another process holds the benchmark's output directory."""


def exclusive_use(directory: Path):
    """Hold DIRECTORY for this process while the block runs, or raise DirectoryInUse naming the
    process that holds it: two benchmarks working on one directory would train the same run into
    the same checkpoints. The package's lock (``fairseq_modattn.folder_lock``, which every
    command of the package takes on what it writes)."""
    return folder_lock.exclusive_use(directory, error=DirectoryInUse, what="--output-dir")


def holder(directory: Path) -> Optional[str]:
    """The pid of the process working on DIRECTORY, or None when none is."""
    pid = folder_lock.current_holder(directory)
    return None if pid is None else str(pid)
