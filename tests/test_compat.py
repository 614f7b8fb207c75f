"""compat.py: fairseq batching keeps every sentence; the fix is applied only where needed."""

import numpy as np
import pytest
from fairseq.data import data_utils

from fairseq_modattn import compat


def batches(fn, n, max_sentences=64, mult=8, vec=True):
    lengths = np.random.RandomState(0).randint(3, 40, size=n)
    indices = np.argsort(lengths, kind="mergesort")
    kwargs = dict(max_sentences=max_sentences, required_batch_size_multiple=mult)
    if vec:
        return fn(indices, lambda i: lengths[i], num_tokens_vec=lengths[indices], **kwargs)
    return fn(indices, lambda i: int(lengths[i]), **kwargs)


@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("n", [300, 301, 8, 5, 1000])
def test_every_index_is_batched_exactly_once(n, vec):
    got = np.concatenate(batches(data_utils.batch_by_size, n, vec=vec))
    assert sorted(got.tolist()) == list(range(n))


def test_upstream_function_drops_the_longest_sentences():
    """The behaviour compat.py corrects (fairseq issue #5036); skipped once fairseq fixes it."""
    if not compat._drops_last_batch(compat._FAIRSEQ_BATCH_BY_SIZE):
        pytest.skip("the installed fairseq keeps every batch")
    assert data_utils.batch_by_size is compat.batch_by_size_keeping_all
    kept = np.concatenate(batches(compat._FAIRSEQ_BATCH_BY_SIZE, 300)).size
    assert kept < 300
