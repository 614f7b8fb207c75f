"""Fix 3: every iterator keeps its last batch.

fairseq main since Dec 2022 (so ``fairseq-fixed`` 0.12.3.x), ``data_utils.batch_by_size``:
``if bsz_mult > 1 and len(b[-1]) % bsz_mult != 0: b = b[:-1]`` silently drops the last batch of
every iterator whose size is not a multiple of ``--required-batch-size-multiple`` (upstream
issue #5036). Batches are sorted by length, so that batch holds the LONGEST sentences:
``fairseq-generate`` translated 296 of 300 test sentences, and validation and ``--eval-bleu``
lose sentences the same way. v0.12.2 kept every batch; ``batch_by_size_keeping_all`` restores
that. ``fairseq-modattn evaluate`` also checks that no sentence went missing.

When it can go: ``apply`` replaces fairseq's function only where its source holds
``b = b[:-1]``; once upstream drops that line (or #5036 is closed), the fix is a no-op and
tests/test_compat.py skips its check of fairseq's behaviour.
"""

import numpy as np
from fairseq.data import data_utils

from ._fairseq_source import source_of


def _drops_last_batch(batch_by_size) -> bool:
    return "b = b[:-1]" in source_of(batch_by_size)


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


def apply() -> None:
    """Callers go through the module attribute (``data_utils.batch_by_size(...)`` in
    FairseqDataset.batch_by_size), so replacing it reaches every dataset."""
    if data_utils.batch_by_size is _FAIRSEQ_BATCH_BY_SIZE and \
            getattr(_FAIRSEQ_BATCH_BY_SIZE, "__module__", "") != __name__ and \
            _drops_last_batch(_FAIRSEQ_BATCH_BY_SIZE):
        data_utils.batch_by_size = batch_by_size_keeping_all
