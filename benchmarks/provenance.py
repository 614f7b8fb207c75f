"""Which code a benchmark measured: the checkout's git commit, whether the plugin's sources
differ from it, and a hash of those sources (results depend on the plugin code that ran, which
a commit alone does not pin down while the tree has changes).

Shared by ``harness.py`` (the speed benchmarks' JSON) and ``multi30k.py`` (which records the code
of every start of every run, as its runs can span sessions); it imports neither torch nor fairseq.
"""

import hashlib
import subprocess
from pathlib import Path
from typing import Dict, Optional

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "fairseq_modattn"


def plugin_sources_hash() -> str:
    """The first 16 hex digits of a SHA-256 over the plugin's source files, .py and the C of
    ``modules/native_normal.py`` (path and bytes)."""
    digest = hashlib.sha256()
    for path in sorted([*PLUGIN.rglob("*.py"), *PLUGIN.rglob("*.c")]):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _git(*args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def git_commit(short: bool = False) -> Optional[str]:
    """HEAD of the checkout (None outside a git checkout)."""
    return _git("rev-parse", *(["--short"] if short else []), "HEAD")


def code_record() -> Dict:
    """{"git_commit", "plugin_dirty" (the plugin differs from that commit), "plugin_sources_sha256"};
    the git fields are None outside a git checkout."""
    status = _git("status", "--porcelain", "--", "fairseq_modattn")
    return {"git_commit": git_commit(), "plugin_dirty": None if status is None else bool(status),
            "plugin_sources_sha256": plugin_sources_hash()}
