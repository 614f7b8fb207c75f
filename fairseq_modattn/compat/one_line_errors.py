"""Fix 15: fairseq's commands print the package's one-line errors as that one line.

The package raises errors whose message is one line saying what is wrong and what to do:
``DamagedCheckpointError`` (fix 9), ``UnknownArchitectureError`` (fix 11), ``FolderInUseError``
(fix 12), ``DiskFullError`` (fix 13) and ``DictionaryMismatchError``: a data-bin whose
dictionaries are not the ones a model of this package was built with is refused by the model's
``load_state_dict`` (``fairseq_modattn/dictionaries.py``; docs/design.md, "The model knows its
dictionaries"). fairseq's commands (``fairseq-train``, ``fairseq-generate``,
``fairseq-interactive``) have no handler of their own for them and would end in a traceback, so
this fix's ``sys.excepthook`` prints each of these classes as ``PROG: error: LINE`` alone. fairseq
0.12 ``Trainer.load_checkpoint`` (``fairseq-train`` resuming from ``--restore-file`` or
``checkpoint_last.pt``) catches every exception of ``load_state_dict`` and raises a bare
``Exception("Cannot load model parameters from checkpoint ...; please ensure that the
architectures match.")`` in its place, which hides the reason (a wrong data-bin is not a wrong
architecture). Where the installed trainer does that, the hook prints the one-line error that
the trainer's exception replaced (its ``__context__``) instead of two tracebacks. Any other
exception that ends a command is printed as before.

The errors come from this package's own code, so the hook is installed whatever fairseq is
installed; it is applied last, after the fixes that raise them.

When it can go: the unwrapping applies only where ``Trainer.load_checkpoint``'s source holds
"Cannot load model parameters from checkpoint"; the hook itself stays as long as fairseq's
commands print tracebacks for exceptions they do not handle.
"""

import os
import sys
from typing import Optional

from ..dictionaries import DictionaryMismatchError
from ..disk_space import DiskFullError
from ..folder_lock import FolderInUseError
from ._fairseq_source import source_of
from .damaged_checkpoints import DamagedCheckpointError
from .unknown_architecture import UnknownArchitectureError

ONE_LINE_ERRORS = (DamagedCheckpointError, UnknownArchitectureError, DictionaryMismatchError, DiskFullError,
                   FolderInUseError)
_TRAINER_LOAD_MESSAGE = "Cannot load model parameters from checkpoint"


def _trainer_hides_load_errors() -> bool:
    """Whether the installed fairseq's ``Trainer.load_checkpoint`` replaces the errors of the
    model's ``load_state_dict`` by its generic exception."""
    from fairseq.trainer import Trainer

    return _TRAINER_LOAD_MESSAGE in source_of(Trainer.load_checkpoint)


_TRAINER_HIDES_LOAD_ERRORS = False  # set by apply
_PREVIOUS_EXCEPTHOOK = sys.__excepthook__
_HOOK_INSTALLED = False


def _one_line_error(exc) -> Optional[BaseException]:
    """EXC when it is one of the one-line error classes, or the one-line error that fairseq's
    ``Trainer.load_checkpoint`` replaced by its generic exception; else None."""
    if isinstance(exc, ONE_LINE_ERRORS):
        return exc
    if _TRAINER_HIDES_LOAD_ERRORS and type(exc) is Exception and str(exc).startswith(_TRAINER_LOAD_MESSAGE) \
            and isinstance(exc.__context__, ONE_LINE_ERRORS):
        return exc.__context__
    return None


def report_one_line_errors(exc_type, exc, tb):
    """sys.excepthook: a one-line error that ends a command is printed as its one line
    (``fairseq-train: error: checkpoint ... is damaged ...``), also when fairseq's trainer put
    its own exception in its place; anything else as before."""
    one_line = _one_line_error(exc)
    if one_line is not None:
        print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {one_line}", file=sys.stderr)
    else:
        _PREVIOUS_EXCEPTHOOK(exc_type, exc, tb)


def apply() -> None:
    """Puts ``report_one_line_errors`` in front of the current sys.excepthook, once per process:
    a hook installed later in front of it (torch.distributed's ``init_process_group`` installs
    one that calls the previous hook) must not make a second call stack a second copy, and a
    second copy of this module is recognised by the hook's name."""
    global _PREVIOUS_EXCEPTHOOK, _TRAINER_HIDES_LOAD_ERRORS, _HOOK_INSTALLED
    _TRAINER_HIDES_LOAD_ERRORS = _trainer_hides_load_errors()
    if not _HOOK_INSTALLED and getattr(sys.excepthook, "__qualname__", "") != report_one_line_errors.__qualname__:
        _PREVIOUS_EXCEPTHOOK = sys.excepthook
        sys.excepthook = report_one_line_errors
    _HOOK_INSTALLED = True
