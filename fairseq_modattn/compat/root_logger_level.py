"""Fix 2: ``import fairseq`` leaves the root logger as it was.

fairseq 0.12 ``models/wav2vec/wav2vec2_classification.py`` calls
``logging.basicConfig(level=logging.DEBUG)`` at import time, and ``import fairseq`` imports it:
a process whose first import of fairseq is this package's (``fairseq-modattn``, the benchmarks,
a user's script) got a root logger at DEBUG with a stderr handler, so every library's debug
records were printed (matplotlib's font search filled the multi30k benchmark's log with
hundreds of lines). When that import of fairseq is ours and it changed the root logger, the root
logger's level and handlers are put back as they were. Where fairseq was imported before the
plugin (``fairseq-train --user-dir``, which configures logging itself first), nothing is touched.

Order: this fix performs the package's first import of fairseq itself, so that it sees the root
logger before and after; it is applied second in ``compat.FIXES``, after fix 1 (which must act
before that import), and this module imports no fairseq at import time.

When it can go: once the installed fairseq's ``wav2vec2_classification.py`` no longer calls
``basicConfig(level=logging.DEBUG)``, the root logger is never found at DEBUG after the import
and the fix does nothing (tests/test_cli_help.py skips its check of fairseq's behaviour then).
"""

import logging
import sys


def apply() -> None:
    """Imports fairseq, then restores the root logger's level and handlers if that first import
    set it to DEBUG; nothing when fairseq was imported already."""
    if "fairseq" in sys.modules:
        return
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    import fairseq  # noqa: F401  (the import whose side effect is undone)

    if root.level == logging.DEBUG != level:
        root.setLevel(level)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
