"""The one place where this package adjusts fairseq / torch behaviour, each fix with its reason.

Imported first by ``fairseq_modattn/__init__.py``, so loading the plugin (``--user-dir`` or
``import fairseq_modattn``) applies all of them. Each fix checks that the behaviour it corrects is
present and does nothing otherwise, so an installed fairseq that already behaves is untouched.

1. fairseq main since Dec 2022 (so ``fairseq-fixed`` 0.12.3.x), ``data_utils.batch_by_size``:
   ``if bsz_mult > 1 and len(b[-1]) % bsz_mult != 0: b = b[:-1]`` silently drops the last batch
   of every iterator whose size is not a multiple of ``--required-batch-size-multiple``
   (upstream issue #5036). Batches are sorted by length, so that batch holds the LONGEST
   sentences: ``fairseq-generate`` translated 296 of 300 test sentences, and validation and
   ``--eval-bleu`` lose sentences the same way. v0.12.2 kept every batch; we restore that.

2. torch >= 2.6 defaults ``torch.load(weights_only=True)``; fairseq's
   ``checkpoint_utils.load_checkpoint_to_cpu`` calls ``torch.load`` without ``weights_only``,
   and fairseq checkpoints hold ``argparse.Namespace`` (legacy model args), so
   ``fairseq-generate``, ``fairseq-interactive``, ``--restore-file`` and checkpoint averaging
   fail on every checkpoint. Rather than turning the safe loader off, we allow-list
   exactly the classes fairseq itself writes into checkpoints (``FAIRSEQ_CHECKPOINT_GLOBALS``);
   any other class in a file is still refused by torch.

3. fairseq 0.12 ``MultiheadAttention.forward`` hands the whole computation to
   ``F.multi_head_attention_forward`` whenever there is no incremental state and no
   ``static_kv``; that path returns head-AVERAGED weights even with ``need_head_weights=True``
   and applies ``q_proj`` by its weight, not as a module. The analysis code (per-head
   redundancy, queries) needs fairseq's own per-head path for the duration of one analysis
   forward: ``fairseq_attention_per_head_path`` turns the fast path off for a module by setting
   the instance flag fairseq checks (``skip_embed_dim_check``, whose only other effect is to
   skip an input-width assert) and restores it afterwards. Nothing global is changed.
"""

import argparse
import inspect
import logging
from contextlib import contextmanager

import numpy as np
import torch
from fairseq.data import data_utils

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ 1. keep the last batch
def _drops_last_batch(batch_by_size) -> bool:
    try:
        return "b = b[:-1]" in inspect.getsource(batch_by_size)
    except (OSError, TypeError):
        return False


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
if getattr(_FAIRSEQ_BATCH_BY_SIZE, "__module__", "") != __name__ and _drops_last_batch(_FAIRSEQ_BATCH_BY_SIZE):
    # Callers go through the module attribute (``data_utils.batch_by_size(...)`` in
    # FairseqDataset.batch_by_size), so replacing it reaches every dataset.
    data_utils.batch_by_size = batch_by_size_keeping_all


# ------------------------------------------------------------------ 2. load fairseq checkpoints
# The only non-tensor class that fairseq writes into its checkpoints (legacy model args), as
# reported by torch.serialization.get_unsafe_globals_in_checkpoint on checkpoint_best.pt and
# checkpoint_last.pt of this package's models; tests/test_cli.py loads one with weights_only.
FAIRSEQ_CHECKPOINT_GLOBALS = [argparse.Namespace]
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals(FAIRSEQ_CHECKPOINT_GLOBALS)


# ------------------------------------------------------------------ 3. per-head attention weights
@contextmanager
def fairseq_attention_per_head_path(module):
    """Within the block, ``module`` (a fairseq ``MultiheadAttention``) takes fairseq's own
    implementation, which honours ``need_head_weights`` (fix 3 in the module docstring)."""
    from fairseq.modules import MultiheadAttention

    if not isinstance(module, MultiheadAttention) or not hasattr(module, "skip_embed_dim_check"):
        yield module
        return
    saved = module.skip_embed_dim_check
    module.skip_embed_dim_check = True
    try:
        yield module
    finally:
        module.skip_embed_dim_check = saved
