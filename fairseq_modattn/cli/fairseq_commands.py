"""Where fairseq's own console scripts are, and where this plugin is, for commands that launch them.

``fairseq-modattn evaluate`` and ``ablate``, and ``quickstart`` and the benchmarks through
``model_recipes.py``, run the real ``fairseq-generate`` / ``fairseq-train`` as child processes,
each with ``--user-dir PLUGIN_DIR``. The script must be the one of the running interpreter's
environment: a ``fairseq-generate`` found first on PATH may belong to another installation,
with another fairseq.
"""

import shutil
import sys
from pathlib import Path

from ..analysis import AnalysisError

#: the folder to pass as fairseq's ``--user-dir`` (the ``fairseq_modattn`` package)
PLUGIN_DIR = Path(__file__).resolve().parents[1]


def fairseq_script(name: str) -> str:
    """The fairseq console script NAME (e.g. 'fairseq-generate') of the running interpreter's
    environment, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise AnalysisError(f"{name} not found next to {sys.executable} nor on PATH: is fairseq installed?")
    return found
