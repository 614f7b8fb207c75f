"""Standard normal noise for DMA's training samples, drawn on every CPU thread.

DMA draws eps ~ N(0, I) of the size of an activation several times per attention module and
step (the sampled inputs z~ = z + s eps and queries q~; section 4.3 of the paper). On the CPU
torch fills a tensor with normal values on one thread, from one Mersenne-Twister stream: about
6 ns a value, 12 ms for a (4096 tokens x 512) activation, 42 such draws in a training step of
the 6 + 6-layer model, while every other op of the step runs on all threads.

``standard_normal`` splits a large tensor into chunks of ``CHUNK`` values, each filled from
its own generator, and fills the chunks on a pool of ``torch.get_num_threads()`` threads
(torch releases the GIL inside ``normal_``). The chunk seeds are drawn from torch's default
generator, so ``torch.manual_seed`` (fairseq's ``--seed``) still fixes the noise, and the
values depend on the seed and the shape only, not on the number of threads. Small tensors,
and every tensor off the CPU (where torch's own kernels are parallel), are drawn with
``torch.randn`` as they are.
"""

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch
from torch import Tensor

#: values drawn from one generator (1 MiB of fp32)
CHUNK = 1 << 18
#: tensors with fewer values are drawn by torch.randn on the calling thread
PARALLEL_MIN = 4 * CHUNK

_pool: Optional[ThreadPoolExecutor] = None
_pool_key = None


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    """One pool per process and thread count (a forked child must not reuse its parent's)."""
    global _pool, _pool_key
    key = (os.getpid(), workers)
    if _pool_key != key:
        if _pool is not None and _pool_key[0] == key[0]:
            _pool.shutdown(wait=False)  # the thread count changed; a forked child owns no threads
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dma-noise")
        _pool_key = key
    return _pool


def standard_normal(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of independent N(0, 1) values (see the module docstring)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    numel = out.numel()
    if out.device.type != "cpu" or numel < PARALLEL_MIN:
        return out.normal_()
    flat = out.view(-1)
    chunks = [flat[start:start + CHUNK] for start in range(0, numel, CHUNK)]
    seeds = torch.randint(0, 2**62, (len(chunks),), dtype=torch.int64).tolist()

    def fill(i: int) -> None:
        chunks[i].normal_(generator=torch.Generator().manual_seed(seeds[i]))

    workers = min(torch.get_num_threads(), len(chunks))
    if workers <= 1:
        for i in range(len(chunks)):
            fill(i)
    else:
        list(_thread_pool(workers).map(fill, range(len(chunks))))
    return out
