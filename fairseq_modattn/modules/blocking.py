"""Blocks of sentences for the kernels that build T x S tables (DMA's interpolated attention,
the InfoNCE critic), and blocks of points for the GMMs' passes over (points x d) tensors.

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

The GMMs (``gmm.py``) read their points, one (points x d) activation as large as a layer's input,
in several passes each way: squares, matmuls with the (clusters x d) parameters, and in backward
the gradient's terms and the parameters' sums. Whole, every pass streams the tensor from memory,
which bounds them on the CPU (about 10 GB/s on the project's 2-core VM: 1.5 ms a pass over
4096 tokens x 512). ``point_blocks`` cuts them into blocks whose passes read the cache after the
first: the six point passes of a GMM's forward (4 heads, 4096 tokens, d = 128, 8 clusters)
took 4.7 ms block by block against 10.7 ms whole, from a cold cache. As above, a GPU takes one block.
"""

from typing import List, Optional, Union

import torch

#: about how many elements the T x S tables of one block hold (4 MiB in fp32)
BLOCK_ELEMENTS = 1 << 20
#: about how many elements one block of points holds in each (points x d) tensor (2 MiB in fp32):
#: a GMM's backward touches four or five of them a block, which the 32 MiB L3 cache holds
POINT_BLOCK_ELEMENTS = 1 << 19


def _blocks(count: int, per_item: int, elements: int, device) -> List[slice]:
    if device is not None and torch.device(device).type != "cpu":
        return [slice(None)]
    size = max(1, elements // max(per_item, 1))
    return [slice(start, min(start + size, count)) for start in range(0, count, size)]


def sentence_blocks(bsz: int, per_sentence: int, device: Optional[Union[torch.device, str]] = None) -> List[slice]:
    """Slices of a batch of ``bsz`` sentences whose tables, ``per_sentence`` elements for each
    sentence, hold about ``BLOCK_ELEMENTS`` values (at least one sentence per block).

    ``device``: where the tables live. Off the CPU the batch is one block, ``[slice(None)]`` (see
    the module doc); without it (or on the CPU) the blocks are as above."""
    return _blocks(bsz, per_sentence, BLOCK_ELEMENTS, device)


def point_blocks(num_points: int, per_point: int, device: Optional[Union[torch.device, str]] = None) -> List[slice]:
    """Slices of ``num_points`` points, ``per_point`` values each (all groups' d values), of about
    ``POINT_BLOCK_ELEMENTS`` values a block; one block off the CPU, as ``sentence_blocks``."""
    return _blocks(num_points, per_point, POINT_BLOCK_ELEMENTS, device)
