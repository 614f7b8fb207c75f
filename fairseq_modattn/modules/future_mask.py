"""Recognising fairseq's causal future mask, so that a kernel can apply it as a rule
(key j visible to query i iff j <= i) instead of reading a T x T table.

fairseq's decoder passes its self-attention a slice of one cached buffer,
``torch.triu(fill_with_neg_inf(zeros(n, n)), 1)[:T, :T]`` (``TransformerDecoderBase
.buffered_future_mask``, fairseq 0.12). ``is_future_mask`` compares a mask with that rule once
and remembers the answer for the tensor: the same slice of the same buffer, unmodified (its
version counter unchanged), is not compared again. The memo keeps the tensors it answered for,
so that their memory cannot be freed and handed to another tensor at the same address while
the answer is remembered; it holds a few entries, the most recent.
"""

from collections import OrderedDict
from typing import Tuple

import torch
from torch import Tensor

#: how many (tensor, answer) pairs ``is_future_mask`` remembers
MEMO_SIZE = 16
_memo: "OrderedDict[Tuple, Tuple[Tensor, bool]]" = OrderedDict()


def is_future_mask(mask: Tensor) -> bool:
    """Whether ``mask`` is a square additive mask with 0 on and below the diagonal and -inf
    above it (module docstring)."""
    if mask.dim() != 2 or mask.size(0) != mask.size(1) or not mask.is_floating_point():
        return False
    key = (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, mask.device, mask._version)
    remembered = _memo.get(key)
    if remembered is not None:
        _memo.move_to_end(key)
        return remembered[1]
    rule = torch.full(mask.shape, float("-inf"), dtype=mask.dtype, device=mask.device).triu_(1)
    answer = bool(torch.equal(mask, rule))
    _memo[key] = (mask, answer)
    while len(_memo) > MEMO_SIZE:
        _memo.popitem(last=False)
    return answer
