"""Building the package's C files (``philox_normal.c``, ``mixture_kernels.c``) where they run.

The C files have no Python or torch headers, so each compiles in well under a second with the
system's C compiler, on first use, into ``$FAIRSEQ_MODATTN_CACHE`` or
``$XDG_CACHE_HOME/fairseq_modattn`` (``~/.cache/fairseq_modattn``). A library is named by a hash
of its source, the compiler's version and the flags, written to a temporary name and renamed
into place, so processes that build it at once each get a whole file. Callers load it with
ctypes, which releases the GIL during a call.
"""

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import torch

#: set to a directory to build the libraries there instead of the user's cache
CACHE_VARIABLE = "FAIRSEQ_MODATTN_CACHE"


def compiler() -> Optional[list]:
    """The C compiler's command: $CC, else the one Python was built with, else cc; None if none
    is on PATH."""
    for command in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        if command:
            words = shlex.split(command)
            if words and shutil.which(words[0]):
                return words
    return None


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "fairseq_modattn"


def build(source: Path, flags: Sequence[str], directory: Path, cc: list) -> Path:
    """The library of ``source`` in ``directory``, built unless it is there (module docstring).
    OSError or CalledProcessError on failure."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = directory / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=directory)
    os.close(handle)
    try:
        subprocess.run([*cc, *flags, "-o", partial, str(source)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def openmp_flags(cc: list) -> Tuple[str, ...]:
    """-fopenmp where torch's CPU operators run on GCC's OpenMP runtime (libgomp, torch's Linux
    builds) and ``cc`` is GCC, else -fopenmp-simd (``omp simd`` loops only, no runtime).

    With -fopenmp a library's ``omp parallel`` regions run on the runtime already in the process:
    the library needs libgomp.so.1, which the loader finds loaded under that soname, so its
    parallel parts go to torch's own worker threads. Those threads spin for several milliseconds
    after each torch operator, waiting for the next parallel region; threads of our own, or of
    another runtime, would share the cores with them and gain nothing (docs/design.md, "The GMMs
    on the CPU")."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    shared = "parallel backend: OpenMP" in torch.__config__.parallel_info() and "Free Software Foundation" in version
    return ("-fopenmp",) if shared else ("-fopenmp-simd",)


def failure(error: Exception) -> str:
    """The last line of a failed build's message, for a one-line log."""
    detail = str(getattr(error, "stderr", None) or error).strip()
    return detail.splitlines()[-1] if detail else type(error).__name__


def open_library(source: Path, build_into: Callable[[Path, list], Path], load: Callable[[Path], ctypes.CDLL],
                 disable_variable: str, logger: logging.Logger, without: str) -> Optional[ctypes.CDLL]:
    """The library of ``source``, built into the cache with ``build_into(directory, cc)`` and
    loaded with ``load``; None with ``disable_variable=0`` set, or, with one log line ending in
    ``without`` (what the package does instead), without a compiler or where the build fails."""
    if os.environ.get(disable_variable, "1") == "0":
        return None
    cc = compiler()
    if cc is None:
        logger.info("no C compiler on PATH (CC, cc): %s", without)
        return None
    try:
        return load(build_into(cache_dir(), cc))
    except (OSError, subprocess.SubprocessError) as error:
        logger.info("could not build %s (%s): %s", source.name, failure(error), without)
        return None
