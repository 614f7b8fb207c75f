"""Resumable steps: each writes its outputs atomically, then a marker saying what it was made from.

``Steps(work_dir)``; ``steps.run(name, outputs, fn, inputs=(), params=None)`` calls
``fn(*tmp_outputs)`` with temporary sibling paths of ``outputs``, renames them into place and
only then writes the step's marker (atomically, in ``WORK_DIR/.steps/``). The marker records
the params, the checksums of the inputs and, for each output, the file THIS run produced: its
size, sha256 and modification time, taken from the temporary before the rename (so a file that
another writer put at the path in between is not vouched for). A step is skipped when its params
and inputs are the same and every output is still the file the marker describes (same size, and
the same modification time or, for a copied folder, the same sha256); an interrupted step leaves
no marker, so a rerun redoes it (and overwrites its own outputs, never other files). A rerun
first removes the temporaries a killed run left beside the step's outputs (``.NAME.tmp-*``, and
the nested ``..NAME.tmp-*`` of older versions).

Every recipe is a sequence of such steps, which is what lets ``fairseq-modattn prepare`` resume.
"""

import contextlib
import hashlib
import json
import sys
from pathlib import Path
from typing import Callable, List, Sequence

from ..atomic_files import PathLike, atomic_path, remove_stale_temporaries
from ..disk_space import reporting_disk_full, size_of


def sha256sum(path: PathLike) -> str:
    """Hex sha256 of a file, or of a folder's files (names and contents, sorted)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        if path.is_dir():
            h.update(str(p.relative_to(path)).encode() + b"\0")
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> str:
    """Sizes and modification times of PATH's files (a cheap identity: a rename keeps both, any
    rewrite changes the time); hashed for a folder, so the record stays one short string."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(path) if path.is_dir() else ''}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _produced(path: Path) -> dict:
    """What the marker records of an output (read from the temporary the step wrote)."""
    return {"size": size_of(path), "sha256": sha256sum(path), "stamp": _stamp(path)}


class Steps:
    """Resumable, atomic data-preparation steps whose completion markers live in WORK_DIR/.steps/.

    ``run(name, outputs, fn, inputs=(), params=None)``: if the marker of NAME exists and
    records the same PARAMS (JSON-able), the same sha256 of every INPUT and the current size
    of every OUTPUT, the step is skipped (returns False). Otherwise ``fn(*tmp_paths)`` writes
    each output to a temporary sibling path, the runner renames them into place and then
    writes the marker atomically (returns True). An exception in FN removes the temporaries
    and leaves the step unmarked, so nothing it touched is trusted by a rerun; one that finds
    the disk full raises ``DiskFullError`` (its line names the folder, what the step had written
    and the size of its inputs, the estimate of what it needs).
    """

    def __init__(self, work_dir: PathLike, log: Callable[[str], None] = None):
        self.work_dir = Path(work_dir)
        self.marker_dir = self.work_dir / ".steps"
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.ran: List[str] = []
        self.skipped: List[str] = []

    def marker(self, name: str) -> Path:
        return self.marker_dir / f"{name}.done.json"

    def _record(self, name, inputs, params, produced=None):
        produced = produced or {}
        return {
            "step": name,
            "params": json.loads(json.dumps(params, default=str)),
            "inputs": {str(p): sha256sum(p) for p in inputs},
            "outputs": {p: files["size"] for p, files in produced.items()},
            "produced": produced,
        }

    @staticmethod
    def _still_produced(path: Path, recorded: dict) -> bool:
        """Whether PATH is the output the marker describes. Markers of versions before
        ``produced`` was recorded only had sizes, which is all they can be checked against."""
        size = recorded.get("outputs", {}).get(str(path))
        if size != size_of(path):
            return False
        produced = recorded.get("produced", {}).get(str(path))
        if produced is None:
            return "produced" not in recorded
        return produced["stamp"] == _stamp(path) or produced["sha256"] == sha256sum(path)

    def is_done(self, name: str, outputs: Sequence[PathLike], inputs: Sequence[PathLike] = (),
                params=None) -> bool:
        marker = self.marker(name)
        if not marker.is_file():
            return False
        try:
            recorded = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        outputs = [Path(p) for p in outputs]
        if any(not p.exists() for p in outputs):
            return False
        want = self._record(name, [Path(p) for p in inputs], params)
        if recorded.get("params") != want["params"] or recorded.get("inputs") != want["inputs"]:
            return False
        return all(self._still_produced(p, recorded) for p in outputs)

    def run(self, name: str, outputs: Sequence[PathLike], fn: Callable, inputs: Sequence[PathLike] = (),
            params=None) -> bool:
        outputs = [Path(p) for p in outputs]
        inputs = [Path(p) for p in inputs]
        if self.is_done(name, outputs, inputs, params):
            self.log(f"[{name}] up to date, skipped")
            self.skipped.append(name)
            return False
        self.log(f"[{name}] running")
        marker = self.marker(name)
        if marker.exists():
            marker.unlink()
        for p in outputs:  # temporaries of a run that was killed outright (SIGKILL, power loss)
            remove_stale_temporaries(p)
        with contextlib.ExitStack() as stack:
            tmps = [stack.enter_context(atomic_path(p)) for p in outputs]
            # a full disk: one line naming the folder, what the step had written and its inputs' size
            with reporting_disk_full(outputs[0], partial=tmps, inputs_size=sum(size_of(p) for p in inputs),
                                     what=f"the outputs of step {name}"):
                fn(*tmps)
            produced = {str(p): _produced(Path(tmp)) for p, tmp in zip(outputs, tmps)}
            # leaving the stack renames every temporary onto its output (in reverse order)
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        record = self._record(name, inputs, params, produced)
        with atomic_path(marker) as tmp:
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
        self.ran.append(name)
        return True
