"""Fix 1: no "Please install tensorboardX" line from ``import fairseq``.

fairseq 0.12 ``tasks/text_to_speech.py`` (as installed by ``fairseq-fixed`` 0.12.3.1) tries
``from tensorboardX import SummaryWriter`` when it is imported, which ``import fairseq`` always
does, and without tensorboardX logs "Please install tensorboardX: pip install tensorboardX" at
INFO. The speech task is the only one that uses that writer, so every ``fairseq-modattn``
command printed a line about a package that translation does not need before its help or its
one-line error. A logging filter on that task's logger drops that one record
(``DropTensorboardXNotice``); nothing else changes: the import is still tried, and
``--tensorboard-logdir`` (fairseq's ``logging/progress_bar.py``, which takes
``torch.utils.tensorboard`` and else tensorboardX) still writes its event files once either is
installed (``pip install 'fairseq-modattn[tensorboard]'``), or warns that it is missing.

Order: the notice is logged while fairseq is first imported, so this fix is applied before
anything of fairseq is imported (first in ``compat.FIXES``, and this module imports no fairseq).
fairseq's own commands (``fairseq-train``, ``fairseq-generate``) import fairseq before
``--user-dir`` loads this package, so they still print the notice.

When it can go: ``apply`` attaches the filter only where the installed ``text_to_speech.py``
(read as text, not imported) holds the notice; once no supported fairseq logs it, the fix is
a no-op and can be deleted.
"""

import importlib.util
import logging
from pathlib import Path

TENSORBOARDX_NOTICE = "Please install tensorboardX"
_TEXT_TO_SPEECH_LOGGER = "fairseq.tasks.text_to_speech"


def _logs_tensorboardx_notice() -> bool:
    """Whether the installed fairseq's ``tasks/text_to_speech.py`` logs the notice; its source is
    read as a file, since importing it (or anything of fairseq) would log the notice."""
    try:
        spec = importlib.util.find_spec("fairseq")  # finds the package without importing it
        folder = list(spec.submodule_search_locations)[0]
        source = Path(folder, "tasks", "text_to_speech.py").read_text(encoding="utf-8")
    except (ImportError, AttributeError, TypeError, IndexError, ValueError, OSError):
        return False
    return TENSORBOARDX_NOTICE in source


class DropTensorboardXNotice(logging.Filter):
    """Drops the one record "Please install tensorboardX: pip install tensorboardX" that fairseq's
    text_to_speech task logs when imported; every other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == _TEXT_TO_SPEECH_LOGGER and str(record.msg).startswith(TENSORBOARDX_NOTICE))


def _drops_tensorboardx_notice(log: logging.Logger) -> bool:
    return any(type(f).__name__ == DropTensorboardXNotice.__name__ for f in log.filters)


def apply() -> None:
    """Attaches the filter to the text_to_speech logger, once. A logger's filters see the records
    logged on that logger itself, which is where the notice is logged; the filter stays attached,
    so the notice is dropped whenever fairseq is imported later."""
    log = logging.getLogger(_TEXT_TO_SPEECH_LOGGER)
    if not _drops_tensorboardx_notice(log) and _logs_tensorboardx_notice():
        log.addFilter(DropTensorboardXNotice())
