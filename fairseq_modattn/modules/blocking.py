"""Blocks of sentences for the kernels that build T x S tables (DMA's interpolated attention,
the InfoNCE critic).

Like a flash kernel's tiles: the tables of one block of sentences stay in the cache, and the
allocator reuses one block's buffers for the next, where tables for the whole batch are fresh
memory on every call (on the CPU, page faults on first touch). At L = 512 with 4 heads and
8 sentences, the interpolated attention's forward and backward took 296 ms block by block
against 508 ms for the whole batch at once (one thread); at L = 128 a block is 16 sentences.
The blocks split the batch axis only, so every sentence's arithmetic is unchanged.

The gain is a CPU one (its caches and first-touch page faults). On a GPU every block repeats
each of the kernel's operator calls, and each call is at least one kernel launch (about 10 µs,
more than the arithmetic of these small tables), so there the whole batch is one block and the
number of launches does not grow with the sentence length.
"""

from typing import List, Optional, Union

import torch

#: about how many elements the T x S tables of one block hold (4 MiB in fp32)
BLOCK_ELEMENTS = 1 << 20


def sentence_blocks(bsz: int, per_sentence: int, device: Optional[Union[torch.device, str]] = None) -> List[slice]:
    """Slices of a batch of ``bsz`` sentences whose tables, ``per_sentence`` elements for each
    sentence, hold about ``BLOCK_ELEMENTS`` values (at least one sentence per block).

    ``device``: where the tables live. Off the CPU the batch is one block, ``[slice(None)]`` (see
    the module doc); without it (or on the CPU) the blocks are as above."""
    if device is not None and torch.device(device).type != "cpu":
        return [slice(None)]
    size = max(1, BLOCK_ELEMENTS // max(per_sentence, 1))
    return [slice(start, min(start + size, bsz)) for start in range(0, bsz, size)]
