"""Gaussian noise that backward draws again instead of keeping it (DMA's training samples).

DMA samples its attention inputs and queries, z~ = z + s eps (paper, 4.3; ``sample_inputs``).
The sample is kept for backward by the layers that read it, and the GMM clusters it; its KL is
taken at the mean z = z~ - s eps, which backward needs too. Keeping eps (or z) would cost one
more activation per module, as large as the layer's input; ``ReplayableNoise`` keeps the random
generator's state instead, as activation checkpointing does, and draws eps again when backward
asks for it: the same values, one more launch.

Every DMA training draw goes through ``standard_normal_``, which on the CPU fills large tensors
on several threads (its docstring): torch's CPU generator is serial, and the draws were about a
tenth of a DMA training step on two cores.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .device_paths import path_device

#: CPU draws of at least this many values are filled chunk by chunk on several threads
PARALLEL_DRAW_MIN = 1 << 21
#: values of one chunk, each drawn by its own generator
CHUNK = 1 << 20

_pool: Optional[ThreadPoolExecutor] = None
_pool_owner: Tuple[int, int] = (0, 0)  # (process id, workers) the pool was made for


def _draw_threads(workers: int) -> Optional[ThreadPoolExecutor]:
    """A pool of ``workers`` threads of this process (a fork starts without the parent's), made
    again when ``torch.set_num_threads`` changed the number."""
    global _pool, _pool_owner
    if workers < 1:
        return None
    if _pool is None or _pool_owner != (os.getpid(), workers):
        if _pool is not None and _pool_owner[0] == os.getpid():
            _pool.shutdown(wait=False)
        _pool, _pool_owner = ThreadPoolExecutor(workers, thread_name_prefix="modattn-noise"), (os.getpid(), workers)
    return _pool


def _in_memory_order(t: Tensor) -> Optional[Tensor]:
    """t's axes permuted into the order of its strides, when that view is contiguous (t's
    elements fill one block of memory); else None."""
    strides = t.stride()
    ordered = t.permute(sorted(range(t.dim()), key=lambda axis: -strides[axis]))
    return ordered if ordered.is_contiguous() else None


def standard_normal_(t: Tensor) -> Tensor:
    """Fill ``t`` with N(0, 1) draws fixed by torch's global generator (``torch.manual_seed``
    reproduces them) and return it.

    On a GPU, and for small or non-dense tensors, this is ``t.normal_()``. On the CPU torch's
    generator is one Mersenne twister that a single thread runs (about 15 ms for the 4096 x 512
    values of one DMA draw on the project's 2-core machine, 72 draws a training step), so a
    large tensor is filled ``CHUNK`` values at a time in memory order, each chunk by a generator
    of its own seeded from one draw of the global one, the chunks shared among
    ``torch.get_num_threads()`` threads (torch releases the GIL while it fills). The values
    depend on the global generator's state alone, not on the number of threads; they are not
    those ``t.normal_()`` would give.
    """
    numel = t.numel()
    on_cpu = path_device(t) == "cpu" and t.device.type == "cpu"
    ordered = _in_memory_order(t) if on_cpu and numel >= PARALLEL_DRAW_MIN else None
    if ordered is None:
        return t.normal_()
    flat = ordered.view(-1)
    starts = range(0, numel, CHUNK)
    # torch seeds a CPU generator's Mersenne twister with 32 bits: wider seeds would only alias
    seeds = torch.randint(0, 2**32, (len(starts),), dtype=torch.int64).tolist()
    threads = min(torch.get_num_threads(), len(starts))

    def fill(first: int) -> None:
        for index in range(first, len(starts), threads):
            start = starts[index]
            generator = torch.Generator().manual_seed(seeds[index])
            flat[start:start + CHUNK].normal_(generator=generator)

    pool = _draw_threads(torch.get_num_threads() - 1)
    others = [] if pool is None else [pool.submit(fill, first) for first in range(1, threads)]
    fill(0)
    for other in others:
        other.result()
    return t


def standard_normal(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.randn(shape)`` drawn by ``standard_normal_``."""
    return standard_normal_(torch.empty(shape, dtype=dtype, device=device))


def standard_normal_like(t: Tensor) -> Tensor:
    """``torch.randn_like(t)`` (t's shape, strides, dtype and device) drawn by ``standard_normal_``."""
    return standard_normal_(torch.empty_like(t))


def _generator_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class ReplayableNoise:
    """Standard normal draws shaped like given tensors, from torch's global generator, that
    ``replay`` reproduces exactly later without touching the generator's current state.

    ``draw(*like)`` returns one tensor per entry of ``like``, drawn one after the other by
    ``standard_normal_``: for a tensor, laid out as ``torch.randn_like`` lays it out (its shape,
    strides, dtype and device); for a (shape, dtype, device) triple, as ``torch.randn`` does.
    Call it once.
    """

    def __init__(self):
        self._layouts: List[Tuple[torch.Size, Tuple[int, ...], torch.dtype, torch.device]] = []
        self._state: Optional[Tensor] = None

    def draw(self, *like: Union[Tensor, Tuple[Sequence[int], torch.dtype, torch.device]]) -> List[Tensor]:
        if self._state is not None:
            raise RuntimeError("ReplayableNoise.draw is called once; replay() repeats it")
        for t in like:
            if torch.is_tensor(t):
                self._layouts.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                shape, dtype, device = t
                self._layouts.append((torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype, device))
        self._state = _generator_state(self._layouts[0][3])
        return self._sample()

    def _sample(self) -> List[Tensor]:
        return [standard_normal_(torch.empty_strided(shape, stride, dtype=dtype, device=device))
                for shape, stride, dtype, device in self._layouts]

    def replay(self) -> List[Tensor]:
        """The tensors ``draw`` returned, drawn again; the generator's state is left as it was."""
        if self._state is None:
            raise RuntimeError("ReplayableNoise.replay repeats a draw: call draw() first")
        device = self._layouts[0][3]
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=device.type):
            if device.type == "cuda":
                torch.cuda.set_rng_state(self._state, device)
            else:
                torch.set_rng_state(self._state)
            return self._sample()
