"""The CPU's noise generator: ``philox_normal.c``, built with the system's C compiler on first use.

DMA draws as many Gaussian noise values as its layers have activations. torch's CPU generator
draws them one at a time (~3.4 ns a value, ~7 ms for 4096 x 512); ``philox_normal.c`` computes
Philox4x32-10 and Box-Muller in vector registers (~4 ms with AVX-512, docs/design.md, "Noise").
It is plain C with no Python or torch headers, built where it runs on first use and loaded
with ctypes (``native_build``).

Where no compiler or cache directory is usable, or ``FAIRSEQ_MODATTN_NATIVE_NOISE=0`` is set,
``library()`` is None and ``noise`` draws with torch's generator instead (one log line says
why): the same distribution, other values for a given seed.
"""

import ctypes
import logging
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from . import native_build
from .native_build import CACHE_VARIABLE, cache_dir, compiler  # noqa: F401 (this module's interface)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("philox_normal.c")
#: -ffp-contract=off: no fused multiply-adds, so every kernel width rounds alike (the C file's
#: comment); -fno-math-errno: sqrtf without errno, which lets it vectorise
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi")
#: set to 0 to draw DMA's noise with torch's generator on the CPU too
DISABLE_VARIABLE = "FAIRSEQ_MODATTN_NATIVE_NOISE"
#: the narrowest kernel worth taking over torch's generator: 8 lanes (AVX2) draw 4096 x 512
#: values in ~6.3 ms against torch's ~7.1 ms, 16 (AVX-512) in ~3.0 ms; 4 lanes take ~13 ms
MIN_LANES = 8

#: values a part draws at least: below, waking a thread costs more than its share
MIN_PART = 1 << 16

_looked_for = False
_library: Optional[ctypes.CDLL] = None


def build(directory: Path, cc: list) -> Path:
    """The compiled generator in ``directory`` (``native_build.build``), its blocks drawn in
    parts on torch's OpenMP threads where they can be (``native_build.openmp_flags``)."""
    return native_build.build(SOURCE, FLAGS + native_build.openmp_flags(cc), directory, cc)


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.modattn_normal.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
                                   ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.modattn_normal.restype = ctypes.c_int
    lib.modattn_normal_lanes.argtypes = [ctypes.c_int]
    lib.modattn_normal_lanes.restype = ctypes.c_int
    return lib


def library() -> Optional[ctypes.CDLL]:
    """The loaded library, built on the first call; None where it cannot be (module docstring)."""
    global _library, _looked_for
    if not _looked_for:
        _library, _looked_for = _open(), True
    return _library


def _open() -> Optional[ctypes.CDLL]:
    lib = native_build.open_library(SOURCE, build, load, DISABLE_VARIABLE, logger,
                                    "DMA's noise is drawn with torch's CPU generator, which is slower "
                                    "(docs/design.md, \"Noise\")")
    if lib is None:
        return None
    if lib.modattn_normal_lanes(0) < MIN_LANES:
        logger.info("this CPU has no AVX2: DMA's noise is drawn with torch's CPU generator, as fast here")
        return None
    return lib


def draw_parts(count: int) -> int:
    """How many threads draw ``count`` values at once: torch's number, fewer for small draws."""
    return max(1, min(torch.get_num_threads(), count // MIN_PART))


def fill(out: Tensor, key: int, scale: float = 1.0, base: Optional[Tensor] = None, lanes: int = 0,
         parts: Optional[int] = None) -> Tensor:
    """out = base + scale * N (base None: scale * N), N the first ``out.numel()`` values of the
    stream of ``key`` (0 <= key < 2^64) in memory order; ``out`` and ``base`` contiguous fp32 CPU
    tensors of one size (``base`` may be ``out``). ``lanes``: the kernel's width (0: the widest
    this CPU runs); ``parts``: how many threads draw at once (None: ``draw_parts``; the values
    do not depend on it). Needs ``library()``."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"{SOURCE.name} is not available (see the log)")
    for name, t in (("out", out), ("base", base)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} {t.device} "
                             f"strides {t.stride()}")
    if base is not None and base.numel() != out.numel():
        raise ValueError(f"base has {base.numel()} values for out's {out.numel()}")
    with torch.profiler.record_function("fairseq_modattn::philox_normal"):
        used = lib.modattn_normal(out.data_ptr(), None if base is None else base.data_ptr(), out.numel(), key,
                                  scale, lanes, draw_parts(out.numel()) if parts is None else parts)
    if used == 0:
        raise ValueError(f"this CPU has no {lanes}-lane kernel")
    return out
