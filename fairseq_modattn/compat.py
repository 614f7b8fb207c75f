"""The one place where this package adjusts fairseq / torch behaviour, each fix with its reason.

Imported first by ``fairseq_modattn/__init__.py``, so loading the plugin (``--user-dir`` or
``import fairseq_modattn``) applies all of them. Each fix checks that the behaviour it corrects is
present and does nothing otherwise, so an installed fairseq that already behaves is untouched.

1. fairseq main since Dec 2022 (so ``fairseq-fixed`` 0.12.3.x), ``data_utils.batch_by_size``:
   ``if bsz_mult > 1 and len(b[-1]) % bsz_mult != 0: b = b[:-1]`` silently drops the last batch
   of every iterator whose size is not a multiple of ``--required-batch-size-multiple``
   (upstream issue #5036). Batches are sorted by length, so that batch holds the LONGEST
   sentences: ``fairseq-generate`` translated 296 of 300 test sentences, and validation and
   ``--eval-bleu`` lose sentences the same way. v0.12.2 kept every batch; we restore that.

2. torch >= 2.6 defaults ``torch.load(weights_only=True)``; fairseq's
   ``checkpoint_utils.load_checkpoint_to_cpu`` calls ``torch.load`` without ``weights_only``,
   and fairseq checkpoints hold ``argparse.Namespace`` (legacy model args), so
   ``fairseq-generate``, ``fairseq-interactive``, ``--restore-file`` and checkpoint averaging
   fail on every checkpoint. Rather than turning the safe loader off, we allow-list
   exactly the classes fairseq itself writes into checkpoints (``FAIRSEQ_CHECKPOINT_GLOBALS``);
   any other class in a file is still refused by torch. fairseq 0.12 ``TranslationTask``
   with ``--eval-bleu`` also logs numpy int64 arrays (``_bleu_counts``, ``_bleu_totals``) into
   the metrics every checkpoint stores (upstream issue #5603), so each checkpoint of such a run
   was refused (``Unsupported global: numpy._core.multiarray._reconstruct``): the names a
   numeric numpy array or scalar is pickled with map to guards that build only numeric arrays
   (``FAIRSEQ_NUMPY_GLOBALS``); object, string and structured arrays, numpy subclasses and
   direct calls of ``numpy.ndarray`` stay refused.

3. fairseq 0.12 ``MultiheadAttention.forward`` hands the whole computation to
   ``F.multi_head_attention_forward`` whenever there is no incremental state and no
   ``static_kv``; that path returns head-AVERAGED weights even with ``need_head_weights=True``
   and applies ``q_proj`` by its weight, not as a module. The analysis code (per-head
   redundancy, queries) needs fairseq's own per-head path for the duration of one analysis
   forward: ``fairseq_attention_per_head_path`` turns the fast path off for a module by setting
   the instance flag fairseq checks (``skip_embed_dim_check``, whose only other effect is to
   skip an input-width assert) and restores it afterwards. Nothing global is changed.

4. fairseq 0.12 ``distributed.utils``, the torchrun / ``torch.distributed.launch`` path
   (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` in the environment):
   (a) ``_infer_torch_distributed_launch_init`` sets ``device_id = rank %
   torch.cuda.device_count()``, a ZeroDivisionError on a machine without CUDA (CPU training
   with gloo) and the wrong device whenever a node runs fewer processes than it has GPUs;
   we use ``LOCAL_RANK``, which torchrun sets, falling back to fairseq's formula, and 0
   without CUDA. (b) ``infer_init_method`` returns before looking at the environment when
   ``--distributed-world-size`` is 1, its default on a machine with one GPU or none, so
   ``torchrun --nnodes 2`` of one-GPU machines (or any CPU run) silently trains independent
   models that overwrite each other's checkpoints; when torchrun says ``WORLD_SIZE`` > 1 and
   the flag was left at 1, we take the world size from torchrun (fairseq's torchrun path
   takes it from ``WORLD_SIZE`` anyway once it is reached).

5. fairseq 0.12 resumes a distributed run by loading the checkpoint on rank 0 and sending it
   to the other ranks (``Trainer.load_checkpoint`` -> ``distributed_utils.broadcast_object``
   -> ``_broadcast_object_slow``), which pickles the state with ``torch.save`` and unpickles it
   with a bare ``torch.load``. Under torch >= 2.6 that load is ``weights_only=True`` and
   refuses the omegaconf ``DictConfig`` in the state, so every rank but 0 crashes and no
   multi-GPU or multi-node run can be resumed. The bytes are not a file: rank 0 of the same
   job produced them a moment earlier from a checkpoint it has already loaded with the safe
   loader (fix 2), so the receiving side unpickles them with ``weights_only=False``.

6. fairseq 0.12 ``distributed_utils.distributed_main`` ends every rank with a barrier and returns
   without ``torch.distributed.destroy_process_group()``, so the gloo process groups (CPU
   training) are torn down by the interpreter's own exit, and a rank can then abort with
   "terminate called without an active exception" (SIGABRT, exit status 134) after training
   has finished and its checkpoints are written: the job looks failed to its launcher. It
   happened to rank 1 of a 2-rank ``fairseq-train`` in this package's CI (torch 2.13); two gloo
   ranks that all-reduce and exit without destroying the group abort in about one job in ten
   here (12 of 100), none of 40 when the group is destroyed first (torch's documented rule for a
   normal exit; pytorch/pytorch PR #179291 describes the teardown). Once fairseq's closing
   barrier has returned, no collective is pending on any rank, and we destroy the groups
   there; a rank that raises is left as fairseq leaves it, since destroying a group with work
   in flight can block. This makes the abort rarer, not impossible: after the fix it still hit
   a rank other than 0 in two of three fresh-clone suite runs on 2026-11-26 (each beside two
   trainings), and in none of 52 two-rank jobs run in a loop; its work was complete each time,
   as rank 0 had passed the closing barrier (tests/test_distributed.py reports that case as a
   warning).

7. fairseq 0.12 ``checkpoint_utils.load_checkpoint_to_cpu`` hands the file to ``torch.load``
   unchecked, so a truncated ``checkpoint_last.pt`` (fairseq writes it with a non-atomic
   ``PathManager.copy``; a run killed or out of disk during that copy leaves half a file) ends
   ``fairseq-train`` (resume), ``fairseq-generate`` and ``fairseq-interactive`` with a
   ~125-line traceback about a "central directory". When the load fails and the file is not
   a complete torch archive, the wrapper raises ``DamagedCheckpointError`` whose one line names
   the file and the newest intact ``checkpoint_E_U.pt`` / ``checkpointE.pt`` /
   ``checkpoint_best.pt`` of its folder to restore from; an uncaught one is printed as that
   line alone (``sys.excepthook``, for this exception class and those of fixes 10 and 14
   only). The package's own loaders (``analysis.checkpoints``, ``analysis.loading``) report the
   same line.

8. ``fairseq-score`` (fairseq 0.12 ``fairseq_cli/score.py``) calls
   ``sacrebleu.corpus_bleu(file, [file])``, which sacrebleu >= 2.0 refuses ("Each element of
   refs should be a sequence of strings"), and builds ``bleu.Scorer(pad, eos, unk)`` for
   ``--sentence-bleu`` although 0.12's Scorer takes one ``BleuConfig``. fairseq-score has no
   ``--user-dir`` and imports no plugin, so nothing here can reach that process;
   ``fairseq-modattn score`` runs fairseq's own ``cli_main`` (same flags, same output) with
   both calls adjusted for its duration only (``fairseq_score_adjusted``), each adjustment
   applied only when the installed sacrebleu / fairseq shows the behaviour. fairseq-score
   also reads its files unchecked: an empty one ends it with a ZeroDivisionError, a folder
   with IsADirectoryError, non-UTF-8 bytes with UnicodeDecodeError, each in a traceback;
   ``fairseq-modattn score`` checks ``--ref`` and ``--sys`` first and says what is wrong in one
   line (``score_input_problem``).

9. fairseq 0.12 ``tasks/text_to_speech.py`` (as installed by ``fairseq-fixed`` 0.12.3.1) tries
   ``from tensorboardX import SummaryWriter`` when it is imported, which ``import fairseq``
   always does, and without tensorboardX logs "Please install tensorboardX: pip install
   tensorboardX" at INFO. The speech task is the only one that uses that writer, so every
   ``fairseq-modattn`` command printed a line about a package that translation does not need
   before its help or its one-line error. A logging filter on that task's logger drops that
   one record (``DropTensorboardXNotice``); it is attached before this module imports fairseq,
   and only where the installed file logs the notice (read as text, not imported). Nothing else
   changes: the import is still tried, and ``--tensorboard-logdir`` (fairseq's
   ``logging/progress_bar.py``, which takes ``torch.utils.tensorboard`` and else tensorboardX)
   still writes its event files once either is installed (``pip install
   'fairseq-modattn[tensorboard]'``), or warns that it is missing. fairseq's own commands
   (``fairseq-train``, ``fairseq-generate``) import fairseq before ``--user-dir`` loads this
   package, so they still print the notice.

10. fairseq 0.12 ``models.build_model``, given a model type that nothing registers (a checkpoint
   of another plugin loaded without that plugin's ``--user-dir``, or any architecture name no
   loaded code defines), fails on its own assertion: the message is an f-string holding the
   model config, joined to ``"Available models: {}"`` and then ``.format``-ted, and the braces
   in the config's text (every fairseq config holds ``eval_bleu_args='{}'``) break that
   formatting, so the command ends, deep in a traceback, with ``IndexError: Replacement index 1
   out of range for positional args tuple`` instead of the model's name. The wrapper looks the
   model type up first and raises ``UnknownArchitectureError``, one line naming it and saying
   which ``--user-dir`` is missing (printed as that line alone by fix 7's ``sys.excepthook``; the
   package's loaders report it as their one-line error). A checkpoint of THIS plugin loaded
   without ``--user-dir`` never imports this module: README.md, "Troubleshooting", quotes what
   fairseq prints then.

11. fairseq 0.12 ``models/wav2vec/wav2vec2_classification.py`` calls
   ``logging.basicConfig(level=logging.DEBUG)`` at import time, and ``import fairseq`` imports it:
   a process whose first import of fairseq is this package's (``fairseq-modattn``, the
   benchmarks, a user's script) got a root logger at DEBUG with a stderr handler, so every
   library's debug records were printed (matplotlib's font search filled the multi30k
   benchmark's log with hundreds of lines). When that import of fairseq is ours and it changed
   the root logger, the root logger's level and handlers are put back as they were. Where
   fairseq was imported before the plugin (``fairseq-train --user-dir``, which configures logging
   itself first), nothing is touched.

12. fairseq 0.12 ``fairseq_cli/train.py`` checks ``--save-dir`` with
   ``checkpoint_utils.verify_checkpoint_directory`` (it creates the folder and writes and
   removes a file called ``dummy``) and never asks whether another training writes there: two
   ``fairseq-train`` runs given one ``--save-dir`` both ran to the end and exited 0, and
   ``checkpoint_last.pt`` and half the interval checkpoints were one model, the rest the other
   (resuming either then failed or continued the wrong model). The wrapper takes the package's
   folder lock (``folder_lock``: an flock on ``.NAME.lock`` beside the folder, held until the
   process exits and released by the kernel however it exits) before fairseq's check; a second
   training into the folder stops at once with one line naming the first one's pid and command
   (``FolderInUseError``, printed as that line by fix 7's ``sys.excepthook``). fairseq calls the
   check on the master rank only, so the ranks of one distributed job do not refuse each other.
13. fairseq 0.12 ``checkpoint_utils.save_checkpoint`` writes its first checkpoint (say
   ``checkpoint_1_4.pt``) with ``torch_persistent_save`` and then copies it over
   ``checkpoint_best.pt`` and ``checkpoint_last.pt`` with ``PathManager.copy``, which without
   iopath is ``shutil.copyfile`` (with iopath a copy just as direct): the destination itself is
   rewritten, so a full disk or a kill during the copy leaves a fragment where the last complete
   checkpoint was (a 10 MB ``--save-dir`` kept 3.6 MB of a 6.9 MB ``checkpoint_last.pt``; the
   rerun then stopped at fix 7's "damaged checkpoint" line). ``torch_persistent_save`` writes
   ``NAME.tmp`` and renames it, but a failed write leaves ``NAME.tmp`` behind (5.7 MB on a 12 MB
   disk) and is retried twice into the same, half-written file object, 2.5 s apart, before its
   traceback is logged; torch's zip writer reports ENOSPC as ``RuntimeError: [enforce fail at
   inline_container.cc:672] ... unexpected pos``, which never says the disk is full. For local
   paths (iopath URLs keep fairseq's code): ``checkpoint_utils.PathManager`` becomes a subclass
   whose ``copy`` writes a temporary ``.NAME.tmp-PID`` beside the destination, fsyncs it and
   renames it (``atomic_files.atomic_copy``), and ``torch_persistent_save`` writes the same way
   (each retry into a fresh temporary); both first remove the temporaries a killed save left
   (``.NAME.tmp-*``, fairseq's ``NAME.tmp``), and a failed write removes its own. A write that
   finds the disk full (``disk_space.is_disk_full``: ENOSPC in the error's chain, or torch's
   RuntimeError while the filesystem has less room than the write still needed) raises
   ``DiskFullError`` at once: one line naming the folder, the bytes the file needs (the
   checkpoint's tensor bytes, or the copied file's size), the bytes free, and that
   ``checkpoint_last.pt`` is intact and a rerun resumes from it (on the first save, which complete
   checkpoint to copy there); an uncaught one is printed as
   that line alone (fix 7's ``sys.excepthook``). Each part is applied only where the installed
   ``save_checkpoint`` copies with ``PathManager.copy`` / ``torch_persistent_save`` writes a
   ``.tmp`` it never removes. The price: replacing ``checkpoint_last.pt`` needs room for the old
   and the new file side by side for a moment, which the in-place copy did not.
14. A data-bin whose dictionaries are not the ones a model of this package was built with is
   refused by the model's ``load_state_dict`` with ``DictionaryMismatchError``
   (``fairseq_modattn/dictionaries.py``; docs/design.md, "The model knows its dictionaries").
   fairseq's commands have no handler of their own for it, so ``fairseq-generate`` and
   ``fairseq-interactive`` would end in a traceback: fix 7's ``sys.excepthook`` prints this class
   as its one line too. fairseq 0.12 ``Trainer.load_checkpoint`` (``fairseq-train`` resuming from
   ``--restore-file`` or ``checkpoint_last.pt``) catches every exception of ``load_state_dict``
   and raises a bare ``Exception("Cannot load model parameters from checkpoint ...; please
   ensure that the architectures match.")`` in its place, which hides the reason (a wrong
   data-bin is not a wrong architecture). Where the installed trainer does that, the hook prints
   the one-line error that the trainer's exception replaced (its ``__context__``) instead of two
   tracebacks. Any other exception that ends a command is printed as before.
"""

import argparse
import inspect
import io
import logging
import os
import pickle
import re
import sys
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from .atomic_files import atomic_copy, atomic_write, remove_stale_temporaries
from .disk_space import DiskFullError, tensor_bytes
from . import folder_lock
from .folder_lock import FolderInUseError

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ 9. the tensorboardX notice
# Placed before this module's first import of fairseq (fairseq/__init__.py imports its tasks,
# and the notice is logged while fairseq.tasks.text_to_speech is being imported).
TENSORBOARDX_NOTICE = "Please install tensorboardX"
_TEXT_TO_SPEECH_LOGGER = "fairseq.tasks.text_to_speech"


def _logs_tensorboardx_notice() -> bool:
    """Whether the installed fairseq's ``tasks/text_to_speech.py`` logs the notice; its source is
    read as a file, since importing it (or anything of fairseq) would log the notice."""
    import importlib.util

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


# A logger's filters see the records logged on that logger itself, which is where the notice is
# logged; the filter stays attached, so the notice is dropped whenever fairseq is imported later.
if not _drops_tensorboardx_notice(logging.getLogger(_TEXT_TO_SPEECH_LOGGER)) and _logs_tensorboardx_notice():
    logging.getLogger(_TEXT_TO_SPEECH_LOGGER).addFilter(DropTensorboardXNotice())


# ------------------------------------------------------------------ 11. the root logger at DEBUG
_ROOT_LOGGER = logging.getLogger()
_root_before_fairseq = None if "fairseq" in sys.modules else (_ROOT_LOGGER.level, list(_ROOT_LOGGER.handlers))

from fairseq import checkpoint_utils  # noqa: E402  (after fix 9, which must precede fairseq's import)

if _root_before_fairseq is not None and _ROOT_LOGGER.level == logging.DEBUG != _root_before_fairseq[0]:
    _ROOT_LOGGER.setLevel(_root_before_fairseq[0])
    for _handler in [h for h in _ROOT_LOGGER.handlers if h not in _root_before_fairseq[1]]:
        _ROOT_LOGGER.removeHandler(_handler)
from fairseq import file_io  # noqa: E402
from fairseq.data import data_utils  # noqa: E402
from fairseq.distributed import utils as distributed_utils  # noqa: E402
from fairseq import models as fairseq_models  # noqa: E402


def _source_of(function) -> str:
    """The installed fairseq function's source, which each fix reads to see whether the
    behaviour it corrects is there; "" where it cannot be read (no fix is applied then)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


# ------------------------------------------------------------------ 1. keep the last batch
def _drops_last_batch(batch_by_size) -> bool:
    return "b = b[:-1]" in _source_of(batch_by_size)


def batch_by_size_keeping_all(
    indices,
    num_tokens_fn,
    num_tokens_vec=None,
    max_tokens=None,
    max_sentences=None,
    required_batch_size_multiple=1,
    fixed_shapes=None,
):
    """fairseq's ``data_utils.batch_by_size`` as in v0.12.2: every index ends up in a batch."""
    if fixed_shapes is not None:  # this branch never dropped anything
        return _FAIRSEQ_BATCH_BY_SIZE(
            indices, num_tokens_fn, num_tokens_vec, max_tokens, max_sentences,
            required_batch_size_multiple, fixed_shapes,
        )
    from fairseq.data.data_utils_fast import batch_by_size_fn, batch_by_size_vec

    max_tokens = int(max_tokens) if max_tokens is not None else -1
    max_sentences = max_sentences if max_sentences is not None else -1
    if not isinstance(indices, np.ndarray):
        indices = np.fromiter(indices, dtype=np.int64, count=-1)
    if num_tokens_vec is None:
        return batch_by_size_fn(indices, num_tokens_fn, max_tokens, max_sentences, required_batch_size_multiple)
    if not isinstance(num_tokens_vec, np.ndarray):
        num_tokens_vec = np.fromiter(num_tokens_vec, dtype=np.int64, count=-1)
    return batch_by_size_vec(indices, num_tokens_vec, max_tokens, max_sentences, required_batch_size_multiple)


_FAIRSEQ_BATCH_BY_SIZE = data_utils.batch_by_size
if getattr(_FAIRSEQ_BATCH_BY_SIZE, "__module__", "") != __name__ and _drops_last_batch(_FAIRSEQ_BATCH_BY_SIZE):
    # Callers go through the module attribute (``data_utils.batch_by_size(...)`` in
    # FairseqDataset.batch_by_size), so replacing it reaches every dataset.
    data_utils.batch_by_size = batch_by_size_keeping_all


# ------------------------------------------------------------------ 2. load fairseq checkpoints
# The non-tensor objects fairseq writes into its checkpoints: argparse.Namespace (legacy model
# args), and, in ``extra_state["metrics"]`` of every run trained with ``--eval-bleu``, the numpy
# int64 arrays ``_bleu_counts`` / ``_bleu_totals`` (fairseq 0.12 ``TranslationTask.reduce_metrics``
# logs them with ``metrics.log_scalar(np.array(...))``; upstream issue #5603). fairseq's meters
# also accept numpy scalars (``meters.safe_round``). torch.serialization.
# get_unsafe_globals_in_checkpoint reports, for such a checkpoint under numpy 2:
# numpy._core.multiarray._reconstruct, numpy.ndarray, numpy.dtype (numpy 1.x writes numpy.core...).
FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace]

# numpy arrays are NOT allow-listed as numpy's own objects: ``numpy.ndarray`` and ``numpy.dtype``
# called by a pickle can build object arrays (``np.ndarray((2,), "O", buffer)`` even turns raw
# bytes into object pointers). Each name a numeric array's pickle uses maps to a guard instead:
#   numpy.ndarray                -> _PickledNdarrayType, a marker that cannot be instantiated;
#   numpy.[_]core.multiarray._reconstruct -> an empty np.ndarray, only for that marker;
#   numpy.dtype                  -> np.dtype from a type string, only of a numeric kind;
#   numpy.[_]core.multiarray.scalar -> a numpy scalar of a numeric dtype from its bytes.
# torch's BUILD step (``ndarray.__setstate__``, ``dtype.__setstate__``) also needs the types of
# the objects built (np.ndarray, the numeric dtype classes) among the allowed values: they are
# registered under names holding a newline, which no pickle GLOBAL can spell (module and name
# are read as one line each), so a file can never call or instantiate them. numpy itself
# refuses a list payload for a numeric array and checks the byte count against the shape.
NUMERIC_DTYPE_KINDS = "biufc"  # bool, signed / unsigned integer, floating point, complex


class _PickledNdarrayType:
    """What the safe loader gets for the global ``numpy.ndarray``: a marker only
    :func:`reconstruct_numeric_array` accepts; calling it (REDUCE / NEWOBJ) is refused."""

    def __new__(cls, *args, **kwargs):
        raise pickle.UnpicklingError("numpy.ndarray called directly refused: only numeric numpy arrays rebuilt "
                                     "by numpy's _reconstruct are allowed")


def _numeric(dtype):
    if not isinstance(dtype, np.dtype) or dtype.kind not in NUMERIC_DTYPE_KINDS or dtype.hasobject \
            or dtype.fields is not None or dtype.subdtype is not None:
        shown = str(dtype) if isinstance(dtype, np.dtype) else type(dtype).__name__
        raise pickle.UnpicklingError(
            f"numpy dtype {shown!r} refused: only numeric numpy arrays and scalars (what fairseq "
            "writes into checkpoint metrics) are allowed by fairseq_modattn.compat")
    return dtype


def numeric_dtype(spec, align=False, copy=True):
    """``numpy.dtype`` as unpickled from a checkpoint: a fresh numeric dtype from a type string."""
    if not isinstance(spec, str):
        raise pickle.UnpicklingError(f"numpy dtype from {type(spec).__name__} refused: only type strings are allowed")
    return _numeric(np.dtype(spec, bool(align), True))  # a copy: BUILD sets its state


def reconstruct_numeric_array(subtype, shape, typecode):
    """``numpy.core.multiarray._reconstruct`` as unpickled from a checkpoint: the empty plain
    ndarray that ``ndarray.__reduce__`` starts from, filled by ``ndarray.__setstate__`` (BUILD)."""
    if subtype is not _PickledNdarrayType or tuple(shape) != (0,) or not isinstance(typecode, (bytes, str)) \
            or len(typecode) != 1:
        raise pickle.UnpicklingError("numpy _reconstruct refused: only plain numpy arrays are allowed")
    _numeric(np.dtype(typecode.decode("ascii") if isinstance(typecode, bytes) else typecode))
    return _NUMPY_RECONSTRUCT(np.ndarray, (0,), typecode)


def numeric_scalar(dtype, data=None):
    """``numpy.core.multiarray.scalar`` as unpickled from a checkpoint: a numeric numpy scalar."""
    _numeric(dtype)
    if not isinstance(data, bytes) or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError(f"numpy scalar of {dtype} refused: expected {dtype.itemsize} bytes")
    return _NUMPY_SCALAR(dtype, data)


def empty_bytes(*args):
    """``bytes()`` as unpickled from a checkpoint: protocol 2 writes an empty ``bytes`` (the data
    of an empty numpy array) as a call of ``builtins.bytes`` without arguments; nothing else."""
    if args:
        raise pickle.UnpicklingError("builtins.bytes with arguments refused: only b'' is allowed")
    return b""


_NUMPY_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_NUMPY_SCALAR = np.float64(0).__reduce__()[0]
_BUILD_ONLY = "\n(fairseq_modattn.compat: BUILD of numeric numpy objects only, no pickle can name this)"
FAIRSEQ_NUMPY_GLOBALS = [
    (_PickledNdarrayType, "numpy.ndarray"),
    (numeric_dtype, "numpy.dtype"),
    *[(guard, f"{module}.multiarray.{name}") for module in ("numpy._core", "numpy.core")
      for guard, name in ((reconstruct_numeric_array, "_reconstruct"), (numeric_scalar, "scalar"))],
    (empty_bytes, "builtins.bytes"),
    (np.ndarray, "numpy.ndarray" + _BUILD_ONLY),
    *[(cls, f"{cls.__module__}.{cls.__qualname__}" + _BUILD_ONLY)
      for cls in {type(np.dtype(code)) for code in np.typecodes["AllInteger"] + np.typecodes["AllFloat"] + "?"}],
]
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS + FAIRSEQ_NUMPY_GLOBALS)


# ------------------------------------------------------------------ 3. per-head attention weights
@contextmanager
def fairseq_attention_per_head_path(module):
    """Within the block, ``module`` (a fairseq ``MultiheadAttention``) takes fairseq's own
    implementation, which honours ``need_head_weights`` (fix 3 in the module docstring)."""
    from fairseq.modules import MultiheadAttention

    if not isinstance(module, MultiheadAttention) or not hasattr(module, "skip_embed_dim_check"):
        yield module
        return
    saved = module.skip_embed_dim_check
    module.skip_embed_dim_check = True
    try:
        yield module
    finally:
        module.skip_embed_dim_check = saved


# ------------------------------------------------------------------ 4. torchrun without CUDA
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in TORCHRUN_ENV)


def torchrun_device_id(rank: int) -> int:
    """The CUDA device of this process: torchrun's LOCAL_RANK; 0 when there is no CUDA."""
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        local_rank = rank % max(torch.cuda.device_count(), 1)
    return local_rank if torch.cuda.device_count() > 0 else 0


def torchrun_launch_init(cfg):
    """fairseq's ``_infer_torch_distributed_launch_init`` with the device from LOCAL_RANK."""
    cfg.distributed_init_method = "env://"
    cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    cfg.distributed_rank = int(os.environ["RANK"])
    cfg.device_id = torchrun_device_id(cfg.distributed_rank)
    cfg.distributed_no_spawn = True  # torchrun started the processes


def infer_init_method_from_torchrun(cfg, force_distributed=False):
    """fairseq's ``infer_init_method``, which also sees torchrun when the world size flag is 1."""
    if (cfg.distributed_init_method is None and launched_by_torchrun()
            and cfg.distributed_world_size == 1 and int(os.environ["WORLD_SIZE"]) > 1):
        logger.info("launched by torchrun: distributed world size %s from WORLD_SIZE", os.environ["WORLD_SIZE"])
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    return _FAIRSEQ_INFER_INIT_METHOD(cfg, force_distributed)


def _divides_by_cuda_count(launch_init) -> bool:
    return "% torch.cuda.device_count()" in _source_of(launch_init)


def _returns_before_torchrun(infer_init_method) -> bool:
    source = _source_of(infer_init_method)
    early, torchrun = source.find("distributed_world_size == 1"), source.find('"WORLD_SIZE"')
    return 0 <= early < torchrun


_FAIRSEQ_LAUNCH_INIT = getattr(distributed_utils, "_infer_torch_distributed_launch_init", None)
_FAIRSEQ_INFER_INIT_METHOD = distributed_utils.infer_init_method
# call_main looks both functions up as module globals of fairseq.distributed.utils at call
# time, and the plugin is imported (while parsing --user-dir) before call_main runs.
if _FAIRSEQ_LAUNCH_INIT is not None and _divides_by_cuda_count(_FAIRSEQ_LAUNCH_INIT):
    distributed_utils._infer_torch_distributed_launch_init = torchrun_launch_init
if getattr(_FAIRSEQ_INFER_INIT_METHOD, "__module__", "") != __name__ and _returns_before_torchrun(
        _FAIRSEQ_INFER_INIT_METHOD):
    distributed_utils.infer_init_method = infer_init_method_from_torchrun


# ------------------------------------------------------------------ 5. resume on several ranks
def broadcast_pickled_object(obj, src_rank, group, dist_device):
    """fairseq's ``_broadcast_object_slow`` (fix 5): rank ``src_rank`` pickles ``obj`` and
    broadcasts length and bytes; every other rank unpickles them without the file loader's
    ``weights_only`` restriction, as they come from this job's own rank."""
    if distributed_utils.get_rank(group) == src_rank:
        pickled = io.BytesIO()
        torch.save(obj, pickled)
        payload = torch.ByteTensor(pickled.getbuffer()).to(dist_device)
        distributed_utils.broadcast(torch.LongTensor([payload.numel()]).to(dist_device), src=src_rank, group=group)
        distributed_utils.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.LongTensor([0]).to(dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    payload = torch.ByteTensor(int(length.item())).to(dist_device)
    distributed_utils.broadcast(payload, src=src_rank, group=group)
    return torch.load(io.BytesIO(payload.cpu().numpy()), map_location="cpu", weights_only=False)


def _unpickles_with_default_loader(broadcast_slow) -> bool:
    source = _source_of(broadcast_slow)
    return "torch.load(" in source and "weights_only" not in source


_FAIRSEQ_BROADCAST_OBJECT_SLOW = getattr(distributed_utils, "_broadcast_object_slow", None)
# broadcast_object and broadcast_tensors look it up as a module global at call time.
if _FAIRSEQ_BROADCAST_OBJECT_SLOW is not None and _unpickles_with_default_loader(_FAIRSEQ_BROADCAST_OBJECT_SLOW):
    distributed_utils._broadcast_object_slow = broadcast_pickled_object


# ------------------------------------------------------------------ 6. destroy the process group
def distributed_main_destroying_group(i, main, cfg, kwargs):
    """fairseq's ``distributed_main`` (fix 6), then ``destroy_process_group`` once it returned
    past its closing barrier. Module-level so ``torch.multiprocessing.spawn`` can pickle it."""
    _FAIRSEQ_DISTRIBUTED_MAIN(i, main, cfg, kwargs)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _leaves_group_alive(distributed_main) -> bool:
    source = _source_of(distributed_main)  # this module's wrapper says destroy_process_group
    return bool(source) and "destroy_process_group" not in source


_FAIRSEQ_DISTRIBUTED_MAIN = distributed_utils.distributed_main
# call_main calls (or spawns) it through its module global at call time.
if _leaves_group_alive(_FAIRSEQ_DISTRIBUTED_MAIN):
    distributed_utils.distributed_main = distributed_main_destroying_group


# ------------------------------------------------------------------ 7. damaged checkpoint files
class DamagedCheckpointError(RuntimeError):
    """A checkpoint file that is not a complete torch archive; the message is one line naming
    the file and the intact checkpoints beside it to restore from."""


_UPDATE_CHECKPOINT = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")
_EPOCH_CHECKPOINT = re.compile(r"^checkpoint(\d+)\.pt$")


def checkpoint_damage(path) -> Optional[str]:
    """Why the file PATH is not a complete checkpoint ("truncated ..."), or None when it looks
    whole. torch >= 1.6 writes checkpoints as zip archives: every member's CRC is checked (this
    reads the file, so it runs only after a load has failed). A legacy (non-zip) file is only
    judged damaged when empty."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None  # a missing or unreadable file is not "damaged": keep the loader's own error
    if size == 0:
        return "empty file"
    if head[:2] != b"PK":
        return None if head[:1] == b"\x80" else "not a torch checkpoint (neither a zip archive nor a pickle)"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        return f"truncated or corrupt: {size} bytes without a readable zip directory, {e}"
    if bad is not None:
        return f"corrupt data in its member {bad}"
    return None


def _looks_complete(path: Path) -> bool:
    """A quick check for the restore candidates: a zip archive whose directory can be read and
    whose members all lie within the file (a copy or write cut short fails it)."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            return bool(archive.infolist()) and all(
                info.header_offset + info.compress_size <= size for info in archive.infolist())
    except (zipfile.BadZipFile, EOFError, OSError, ValueError):
        return False


def restore_candidates(damaged) -> List[Path]:
    """The complete fairseq checkpoints in DAMAGED's folder, newest first: ``checkpoint_E_U.pt``
    and ``checkpointE.pt`` by (epoch, updates) (an epoch's own checkpoint after its update
    checkpoints), then ``checkpoint_best.pt`` and ``checkpoint_last.pt``; DAMAGED excluded."""
    damaged = Path(damaged)
    numbered, named = [], []
    try:
        entries = list(damaged.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name == damaged.name:
            continue
        update, epoch = _UPDATE_CHECKPOINT.match(entry.name), _EPOCH_CHECKPOINT.match(entry.name)
        if update:
            numbered.append(((int(update.group(1)), int(update.group(2))), entry))
        elif epoch:
            numbered.append(((int(epoch.group(1)), float("inf")), entry))
        elif entry.name in ("checkpoint_best.pt", "checkpoint_last.pt"):
            named.append(entry)
    ordered = [p for _, p in sorted(numbered, key=lambda item: item[0], reverse=True)] + sorted(named)
    return [p for p in ordered if p.is_file() and _looks_complete(p)]


def damaged_checkpoint_message(path, damage: str) -> str:
    """One line: which file is damaged and which checkpoints of its folder to restore from."""
    path = Path(path)
    intact = restore_candidates(path)
    message = f"cannot load checkpoint {path}: the file is damaged ({damage})"
    if not intact:
        return message + (f"; no intact checkpoint in {path.parent} to restore from: delete it to start "
                          "again without it")
    others = ", ".join(p.name for p in intact[1:4]) + (f" and {len(intact) - 4} more" if len(intact) > 4 else "")
    if _UPDATE_CHECKPOINT.match(path.name) or _EPOCH_CHECKPOINT.match(path.name):
        message += f"; intact checkpoints in {path.parent}: {intact[0].name}"
        return message + (f", {others}" if others else "")
    message += f"; restore it from the newest intact one: cp {intact[0]} {path}"
    return message + (f" (also intact there: {others})" if others else "")


def load_checkpoint_to_cpu_reporting_damage(path, *args, **kwargs):
    """fairseq's ``checkpoint_utils.load_checkpoint_to_cpu`` (fix 7): a file that is not a
    complete checkpoint raises DamagedCheckpointError with a one-line message instead."""
    try:
        return _FAIRSEQ_LOAD_CHECKPOINT_TO_CPU(path, *args, **kwargs)
    except Exception as e:
        damage = checkpoint_damage(path) if isinstance(path, (str, os.PathLike)) else None
        if damage is None:
            raise
        raise DamagedCheckpointError(damaged_checkpoint_message(path, damage)) from e


def _loads_without_checking_file(load_checkpoint_to_cpu) -> bool:
    source = _source_of(load_checkpoint_to_cpu)
    return "torch.load(" in source and "DamagedCheckpointError" not in source


def _report_damaged_checkpoint(exc_type, exc, tb):
    """sys.excepthook: a DamagedCheckpointError (fix 7), UnknownArchitectureError (fix 10) or
    DiskFullError (fix 13), FolderInUseError (fix 12) or DictionaryMismatchError (fix 14) that
    ends a command is printed as its one line (``fairseq-train: error: checkpoint ... is damaged
    ...``), also when fairseq's trainer put its own exception in its place (fix 14); anything else
    as before."""
    one_line = _one_line_error(exc)
    if one_line is not None:
        print(f"{os.path.basename(sys.argv[0]) or 'python'}: error: {one_line}", file=sys.stderr)
    else:
        _PREVIOUS_EXCEPTHOOK(exc_type, exc, tb)


def _one_line_error(exc) -> Optional[BaseException]:
    """EXC when it is one of the one-line error classes, or the one-line error that fairseq's
    ``Trainer.load_checkpoint`` replaced by its generic exception (fix 14); else None."""
    one_line = (DamagedCheckpointError, UnknownArchitectureError, DictionaryMismatchError, DiskFullError,
                FolderInUseError)
    if isinstance(exc, one_line):
        return exc
    if _TRAINER_HIDES_LOAD_ERRORS and type(exc) is Exception and str(exc).startswith(_TRAINER_LOAD_MESSAGE) \
            and isinstance(exc.__context__, one_line):
        return exc.__context__
    return None


_PREVIOUS_EXCEPTHOOK = sys.__excepthook__


def _install_one_line_excepthook():
    """Puts ``_report_damaged_checkpoint`` in front of the current sys.excepthook, once."""
    global _PREVIOUS_EXCEPTHOOK
    if getattr(sys.excepthook, "__qualname__", "") != _report_damaged_checkpoint.__qualname__:
        _PREVIOUS_EXCEPTHOOK = sys.excepthook
        sys.excepthook = _report_damaged_checkpoint


_FAIRSEQ_LOAD_CHECKPOINT_TO_CPU = checkpoint_utils.load_checkpoint_to_cpu
# Trainer.load_checkpoint calls checkpoint_utils.load_checkpoint_to_cpu, and
# load_model_ensemble_and_task (fairseq-generate, -interactive, our analysis loader) calls it as
# a module global of checkpoint_utils: both look it up at call time.
if getattr(_FAIRSEQ_LOAD_CHECKPOINT_TO_CPU, "__module__", "") != __name__ and _loads_without_checking_file(
        _FAIRSEQ_LOAD_CHECKPOINT_TO_CPU):
    checkpoint_utils.load_checkpoint_to_cpu = load_checkpoint_to_cpu_reporting_damage
    _install_one_line_excepthook()


def describe_load_failure(path, error: BaseException) -> str:
    """One line saying why loading the checkpoint PATH with torch's safe loader failed: a damaged
    file (fix 7, with what to restore from), a class refused by the allow-list (fix 2), else the
    first line of the error."""
    damage = checkpoint_damage(path)
    if damage is not None:
        return damaged_checkpoint_message(path, damage)
    text = str(error)
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return (f"cannot load checkpoint {path} with torch.load(weights_only=True): it holds {refused.group(1)}, "
                "which is not among what fairseq writes into checkpoints (argparse.Namespace, numeric numpy "
                "arrays); refused as unsafe")
    guard = re.search(r"^.*refused.*allowed.*$", text, re.MULTILINE)  # the guards of fix 2
    if isinstance(error, pickle.UnpicklingError) and guard:
        return f"cannot load checkpoint {path} with torch.load(weights_only=True): {guard.group(0).strip()}"
    first_line = (text.strip().splitlines() or [""])[0][:300]
    return f"cannot load checkpoint {path} with torch.load(weights_only=True): {type(error).__name__}: {first_line}"


# ------------------------------------------------------------------ 8. fairseq-score
_SACREBLEU_CORPUS_BLEU = _FAIRSEQ_BLEU_SCORER = None  # set by fairseq_score_adjusted


def corpus_bleu_reading_files(hypotheses, references, *args, **kwargs):
    """``sacrebleu.corpus_bleu`` that also takes open files (one sentence a line), as sacrebleu
    1.x did: files are read into lists of lines first."""
    def lines(stream):
        return stream if isinstance(stream, (str, Sequence)) else [line.rstrip("\n") for line in stream]

    return _SACREBLEU_CORPUS_BLEU(lines(hypotheses), [lines(r) for r in references], *args, **kwargs)


def bleu_scorer_of_indices(*args, **kwargs):
    """``fairseq.scoring.bleu.Scorer`` that also takes ``(pad, eos, unk)``, the call of
    fairseq-score --sentence-bleu, as well as its ``BleuConfig``."""
    from fairseq.scoring import bleu

    if len(args) == 3 and not kwargs:
        args = (bleu.BleuConfig(pad=args[0], eos=args[1], unk=args[2]),)
    return _FAIRSEQ_BLEU_SCORER(*args, **kwargs)


def _sacrebleu_refuses_files(corpus_bleu) -> bool:
    try:
        corpus_bleu(io.StringIO("a b c d\n"), [io.StringIO("a b c d\n")])
    except TypeError:
        return True
    return False


@contextmanager
def fairseq_score_adjusted():
    """Within the block, fairseq-score's ``--sacrebleu`` and ``--sentence-bleu`` work (fix 8);
    both module attributes are restored afterwards."""
    global _SACREBLEU_CORPUS_BLEU, _FAIRSEQ_BLEU_SCORER
    import sacrebleu
    from fairseq.scoring import bleu
    from fairseq_cli import score

    saved = sacrebleu.corpus_bleu, bleu.Scorer
    _SACREBLEU_CORPUS_BLEU, _FAIRSEQ_BLEU_SCORER = saved
    if _sacrebleu_refuses_files(sacrebleu.corpus_bleu):
        sacrebleu.corpus_bleu = corpus_bleu_reading_files
    if "Scorer(dict.pad(), dict.eos(), dict.unk())" in _source_of(score.cli_main) and \
            list(inspect.signature(bleu.Scorer.__init__).parameters) == ["self", "cfg"]:
        bleu.Scorer = bleu_scorer_of_indices
    try:
        yield
    finally:
        sacrebleu.corpus_bleu, bleu.Scorer = saved


def score_input_problem(argv: List[str]) -> Optional[str]:
    """Why fairseq-score cannot score the files ARGV names, or None (fix 8): each of ``--ref``
    and ``--sys`` (unless ``-``, stdin) must be a file of UTF-8 lines with at least one line.
    fairseq's own reader ends with a ZeroDivisionError on an empty file, IsADirectoryError on
    a folder and UnicodeDecodeError on other bytes, each deep in a traceback."""
    from fairseq_cli import score

    from .data.errors import DataError
    from .data.readers import iter_lines

    parser = score.get_parser()
    parser.prog = "fairseq-modattn score"
    args = parser.parse_args(argv)  # a usage error exits 2 with argparse's one line, as fairseq's would
    for flag, path in (("--ref", args.ref), ("--sys", args.sys)):
        if path == "-" or not os.path.exists(path):  # a missing file: fairseq's own assertion says so
            continue
        try:
            for _ in iter_lines(path):
                pass
        except DataError as e:
            return f"{flag} {e}"
    return None


def fairseq_score(argv: List[str]) -> int:
    """``fairseq-modattn score``: fairseq-score with its own flags and output (fix 8)."""
    from fairseq_cli import score

    def fail(message) -> int:
        print(f"fairseq-modattn score: error: {message}", file=sys.stderr)
        return 1

    problem = score_input_problem(argv)
    if problem:
        return fail(problem)
    saved_argv = sys.argv
    sys.argv = ["fairseq-modattn score", *argv]  # fairseq's parser reads sys.argv
    try:
        with fairseq_score_adjusted():
            score.cli_main()
    except (AssertionError, FileNotFoundError) as e:  # fairseq asserts that both files exist
        return fail(e)
    except ZeroDivisionError:  # only stdin is left unchecked
        return fail("the system output (--sys -, standard input) is empty: nothing to score")
    except UnicodeDecodeError as e:
        return fail(f"the system output (--sys -, standard input) is not UTF-8 text ({e.reason} at byte "
                    f"{e.start}): convert it to UTF-8")
    finally:
        sys.argv = saved_argv
    return 0


# ------------------------------------------------------------------ 10. unknown architectures
class UnknownArchitectureError(RuntimeError):
    """A checkpoint (or ``--arch``) names a model architecture that nothing loaded registers; the
    message is one line saying so and what to load."""


def unknown_architecture_message(model_type: str) -> str:
    """One line: MODEL_TYPE is registered by neither fairseq nor any loaded plugin, and why that
    happens (a model of another plugin, whose ``--user-dir`` is missing)."""
    import difflib

    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

    known = sorted(set(ARCH_MODEL_REGISTRY) | set(MODEL_DATACLASS_REGISTRY))
    close = difflib.get_close_matches(model_type, known, n=3)
    message = (f"unknown model architecture {model_type!r}: neither fairseq nor the plugins loaded (fairseq_modattn) "
               "register it; a checkpoint trained with another fairseq plugin needs that plugin's --user-dir too")
    return message + (f" (similar registered names: {', '.join(close)})" if close else "")


def build_model_naming_unknown_architecture(cfg, task, *args, **kwargs):
    """fairseq's ``models.build_model`` (fix 10): a model type nothing registers raises
    UnknownArchitectureError instead of fairseq's IndexError."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

    model_type = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)  # as fairseq reads it
    if isinstance(model_type, str) and model_type not in ARCH_MODEL_REGISTRY \
            and model_type not in MODEL_DATACLASS_REGISTRY:
        raise UnknownArchitectureError(unknown_architecture_message(model_type))
    return _FAIRSEQ_BUILD_MODEL(cfg, task, *args, **kwargs)


def _unknown_model_message_breaks(build_model) -> bool:
    """fairseq 0.12's assertion message: an f-string with the config joined to a plain string
    that is then ``.format``-ted, so the braces of the config's text break the formatting."""
    source = _source_of(build_model)
    return "from {cfg}" in source and '"Available models: {}".format(' in source


_FAIRSEQ_BUILD_MODEL = fairseq_models.build_model
# Every task builds its model through the module attribute (``from fairseq import models;
# models.build_model(...)``, FairseqTask.build_model and the others), looked up at call time.
if getattr(_FAIRSEQ_BUILD_MODEL, "__module__", "") != __name__ and _unknown_model_message_breaks(_FAIRSEQ_BUILD_MODEL):
    fairseq_models.build_model = build_model_naming_unknown_architecture
    _install_one_line_excepthook()


# ------------------------------------------------------------------ 12. one training per --save-dir
def verify_checkpoint_directory_locked(save_dir: str) -> None:
    """fairseq's ``checkpoint_utils.verify_checkpoint_directory`` (fix 12), after taking the lock
    of SAVE_DIR for the rest of this process: FolderInUseError while another process holds it."""
    folder_lock.hold_until_exit(save_dir, what="--save-dir")
    _FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY(save_dir)


def _verifies_without_lock(verify) -> bool:
    source = _source_of(verify)
    return "dummy" in source and "flock" not in source and "folder_lock" not in source


_FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY = checkpoint_utils.verify_checkpoint_directory
# fairseq_cli/train.py calls it as ``checkpoint_utils.verify_checkpoint_directory`` at call time;
# --user-dir imports the plugin while the arguments are parsed, before train's ``main`` runs.
if getattr(_FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY, "__module__", "") != __name__ and _verifies_without_lock(
        _FAIRSEQ_VERIFY_CHECKPOINT_DIRECTORY):
    checkpoint_utils.verify_checkpoint_directory = verify_checkpoint_directory_locked
    _install_one_line_excepthook()


# ------------------------------------------------------------------ 13. atomic checkpoint saves
def _is_local_file_name(path) -> bool:
    """Whether PATH names a file of the local filesystem (not an iopath URL such as s3://, which
    fairseq's own code keeps handling)."""
    return isinstance(path, (str, os.PathLike)) and not file_io.PathManager.path_requires_pathmanager(str(path))


def _remove_checkpoint_temporaries(path):
    """Before a checkpoint is written: the temporaries a killed save left beside it (ours,
    ``.NAME.tmp-PID``, and fairseq's own ``NAME.tmp``), which also hold disk space."""
    remove_stale_temporaries(path)
    fairseq_temporary = Path(f"{path}.tmp")
    if fairseq_temporary.is_file():
        fairseq_temporary.unlink()


def checkpoint_disk_full_message(error: DiskFullError, path) -> str:
    """DiskFullError's line about the checkpoint PATH, and what state its folder is left in."""
    last = Path(path).parent / "checkpoint_last.pt"
    if last.is_file() and last != Path(path):
        state = f"{last} is intact; rerunning the same command once there is room resumes from it"
    elif last.is_file():
        state = f"{last} is intact (the previous one); rerunning the same command once there is room resumes from it"
    else:  # the first save of the run: what fix 7 would offer to restore from, if anything
        intact = [c for c in restore_candidates(last) if c.name != "checkpoint_best.pt"]
        state = "no checkpoint_last.pt was saved yet: a rerun starts from the beginning"
        if intact:
            state += f", or resumes from the complete {intact[0].name} after: cp {intact[0]} {last}"
    return f"{error}; {state}"


def copy_checkpoint_atomically(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
    """fairseq's ``PathManager.copy`` as ``checkpoint_utils.save_checkpoint`` uses it (fix 13):
    a local copy is written aside and renamed, so ``checkpoint_last.pt`` / ``checkpoint_best.pt``
    are the old file or the whole new one; a full disk raises a one-line DiskFullError."""
    if not (_is_local_file_name(src_path) and _is_local_file_name(dst_path)):
        return _FAIRSEQ_PATH_MANAGER.copy(src_path, dst_path, overwrite=overwrite)
    if not overwrite and os.path.exists(dst_path):
        return False  # iopath's answer; fairseq's save_checkpoint always overwrites
    _remove_checkpoint_temporaries(dst_path)
    try:
        atomic_copy(src_path, dst_path, durable=True)
    except DiskFullError as e:
        raise DiskFullError(checkpoint_disk_full_message(e, dst_path)) from e
    return True


class AtomicCopyPathManager(file_io.PathManager):
    """fairseq's ``PathManager`` for ``checkpoint_utils`` alone, with an atomic ``copy``."""

    copy = staticmethod(copy_checkpoint_atomically)


def torch_persistent_save_atomically(obj, filename, async_write: bool = False):
    """fairseq's ``checkpoint_utils.torch_persistent_save`` (fix 13): the checkpoint is written to
    a temporary beside FILENAME, fsync'ed and renamed, and a failed write removes its temporary.
    A full disk raises DiskFullError at once (one line: the folder, the bytes the checkpoint needs,
    the bytes free); any other failure is retried twice 2.5 s apart, as fairseq does, each time
    into a fresh temporary (fairseq retried into the same, half-written file object)."""
    if async_write or not _is_local_file_name(filename):
        return _FAIRSEQ_TORCH_PERSISTENT_SAVE(obj, filename, async_write=async_write)

    def write(tmp_name):
        with open(tmp_name, "wb") as f:  # a file object: its ENOSPC OSError reaches the error's chain
            torch.save(obj, f)

    _remove_checkpoint_temporaries(filename)
    needed = tensor_bytes(obj)
    for attempt in range(3):
        try:
            atomic_write(filename, write, expected_size=needed, durable=True)
            return None
        except DiskFullError as e:
            raise DiskFullError(checkpoint_disk_full_message(e, filename)) from e
        except Exception:
            if attempt == 2:
                raise
            logger.warning("saving checkpoint %s failed, retrying in 2.5 s", filename, exc_info=True)
            time.sleep(2.5)


def _copies_in_place(save_checkpoint, path_manager) -> bool:
    """fairseq 0.12 ``save_checkpoint`` copies its first checkpoint with ``PathManager.copy``,
    whose local copy (``shutil.copyfile`` or iopath's) writes into the destination itself."""
    return "PathManager.copy(" in _source_of(save_checkpoint) and \
        getattr(path_manager.copy, "__module__", "") != __name__


def _leaves_temporary_on_failure(torch_persistent_save) -> bool:
    """fairseq 0.12 writes ``FILENAME.tmp`` and renames it, with nothing that removes it when the
    write fails."""
    source = _source_of(torch_persistent_save)
    return '".tmp"' in source and "finally" not in source and "DiskFullError" not in source


_FAIRSEQ_PATH_MANAGER = checkpoint_utils.PathManager
_FAIRSEQ_TORCH_PERSISTENT_SAVE = checkpoint_utils.torch_persistent_save
# save_checkpoint looks PathManager up as a module global of checkpoint_utils, and
# Trainer.save_checkpoint calls checkpoint_utils.torch_persistent_save, both at call time; only
# checkpoint_utils' name is replaced, fairseq.file_io.PathManager stays as it is for everything else.
if getattr(_FAIRSEQ_PATH_MANAGER, "copy", None) is not None and _copies_in_place(
        checkpoint_utils.save_checkpoint, _FAIRSEQ_PATH_MANAGER):
    checkpoint_utils.PathManager = AtomicCopyPathManager
    _install_one_line_excepthook()
if getattr(_FAIRSEQ_TORCH_PERSISTENT_SAVE, "__module__", "") != __name__ and _leaves_temporary_on_failure(
        _FAIRSEQ_TORCH_PERSISTENT_SAVE):
    checkpoint_utils.torch_persistent_save = torch_persistent_save_atomically
    _install_one_line_excepthook()


# ------------------------------------------------------------------ 14. dictionaries of another data-bin
from .dictionaries import DictionaryMismatchError  # noqa: E402  (raised by the models' load_state_dict)

_TRAINER_LOAD_MESSAGE = "Cannot load model parameters from checkpoint"


def _trainer_hides_load_errors() -> bool:
    """Whether the installed fairseq's ``Trainer.load_checkpoint`` replaces the errors of the
    model's ``load_state_dict`` by its generic exception (fix 14)."""
    from fairseq.trainer import Trainer

    return _TRAINER_LOAD_MESSAGE in _source_of(Trainer.load_checkpoint)


_TRAINER_HIDES_LOAD_ERRORS = _trainer_hides_load_errors()
# The error comes from this package's own models, so the hook is wanted whatever fairseq is
# installed: it is put in place here, whether or not fixes 7 and 10 applied.
_install_one_line_excepthook()
