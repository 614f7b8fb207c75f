"""Fix 4: torch's safe loader (``weights_only=True``) reads fairseq checkpoints.

torch >= 2.6 defaults ``torch.load(weights_only=True)``; fairseq 0.12's
``checkpoint_utils.load_checkpoint_to_cpu`` calls ``torch.load`` without ``weights_only``, and
fairseq checkpoints hold ``argparse.Namespace`` (legacy model args), so ``fairseq-generate``,
``fairseq-interactive``, ``--restore-file`` and checkpoint averaging fail on every checkpoint.
Rather than turning the safe loader off, exactly the classes fairseq itself writes into
checkpoints are allow-listed (``FAIRSEQ_CHECKPOINT_GLOBALS``); any other class in a file is still
refused by torch. fairseq 0.12 ``TranslationTask`` with ``--eval-bleu`` also logs numpy int64
arrays (``_bleu_counts``, ``_bleu_totals``) into the metrics every checkpoint stores (upstream
issue #5603), so each checkpoint of such a run was refused (``Unsupported global:
numpy._core.multiarray._reconstruct``): the names a numeric numpy array or scalar is pickled with
map to guards that build only numeric arrays (``FAIRSEQ_NUMPY_GLOBALS``); object, string and
structured arrays, numpy subclasses and direct calls of ``numpy.ndarray`` stay refused.

When it can go: ``apply`` registers the allow-list only where torch has
``torch.serialization.add_safe_globals`` (torch >= 2.4); it is needed as long as fairseq writes
``argparse.Namespace`` and numpy arrays into checkpoints, i.e. until fairseq loads them with
``weights_only=False`` itself or stops pickling those objects.
"""

import argparse
import pickle

import numpy as np
import torch

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


def apply() -> None:
    """Adds the allow-list to torch's safe globals (a set: adding it again changes nothing)."""
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS + FAIRSEQ_NUMPY_GLOBALS)
