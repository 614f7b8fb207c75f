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

4. fairseq 0.12 ``distributed.utils``, the torchrun / ``torch.distributed.launch`` path
   (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` in the environment):
   (a) ``_infer_torch_distributed_launch_init`` sets ``device_id = rank %
   torch.cuda.device_count()``, a ZeroDivisionError on a machine without CUDA (CPU training
   with gloo) and the wrong device whenever a node runs fewer processes than it has GPUs;
   we use ``LOCAL_RANK``, which torchrun sets, falling back to fairseq's formula, and 0
   without CUDA. (b) ``infer_init_method`` returns before looking at the environment when
   ``--distributed-world-size`` is 1, its default on a machine with one GPU or none, so
   ``torchrun --nnodes 2`` of one-GPU machines (or any CPU run) silently trains independent
   models that overwrite each other's checkpoints; when torchrun says ``WORLD_SIZE`` > 1 and
   the flag was left at 1, we take the world size from torchrun (fairseq's torchrun path
   takes it from ``WORLD_SIZE`` anyway once it is reached).

5. fairseq 0.12 resumes a distributed run by loading the checkpoint on rank 0 and sending it
   to the other ranks (``Trainer.load_checkpoint`` -> ``distributed_utils.broadcast_object``
   -> ``_broadcast_object_slow``), which pickles the state with ``torch.save`` and unpickles it
   with a bare ``torch.load``. Under torch >= 2.6 that load is ``weights_only=True`` and
   refuses the omegaconf ``DictConfig`` in the state, so every rank but 0 crashes and no
   multi-GPU or multi-node run can be resumed. The bytes are not a file: rank 0 of the same
   job produced them a moment earlier from a checkpoint it has already loaded with the safe
   loader (fix 2), so the receiving side unpickles them with ``weights_only=False``.

6. fairseq 0.12 ``distributed_utils.distributed_main`` ends every rank with a barrier and returns
   without ``torch.distributed.destroy_process_group()``, so the gloo process groups (CPU
   training) are torn down by the interpreter's own exit, and a rank can then abort with
   "terminate called without an active exception" (SIGABRT, exit status 134) after training
   has finished and its checkpoints are written: the job looks failed to its launcher. It
   happened to rank 1 of a 2-rank ``fairseq-train`` in this package's CI (torch 2.13); two gloo
   ranks that all-reduce and exit without destroying the group abort in about one job in ten
   here (12 of 100), none of 40 when the group is destroyed first (torch's documented rule for a
   normal exit; pytorch/pytorch PR #179291 describes the teardown). Once fairseq's closing
   barrier has returned, no collective is pending on any rank, and we destroy the groups
   there; a rank that raises is left as fairseq leaves it, since destroying a group with work
   in flight can block.
"""

import argparse
import inspect
import io
import logging
import os
from contextlib import contextmanager

import numpy as np
import torch
from fairseq.data import data_utils
from fairseq.distributed import utils as distributed_utils

logger = logging.getLogger(__name__)


def _source_of(function) -> str:
    """The installed fairseq function's source, which each fix reads to see whether the
    behaviour it corrects is there; "" where it cannot be read (no fix is applied then)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


# ------------------------------------------------------------------ 1. keep the last batch
def _drops_last_batch(batch_by_size) -> bool:
    return "b = b[:-1]" in _source_of(batch_by_size)


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


# ------------------------------------------------------------------ 4. torchrun without CUDA
TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in TORCHRUN_ENV)


def torchrun_device_id(rank: int) -> int:
    """The CUDA device of this process: torchrun's LOCAL_RANK; 0 when there is no CUDA."""
    if "LOCAL_RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
    else:
        local_rank = rank % max(torch.cuda.device_count(), 1)
    return local_rank if torch.cuda.device_count() > 0 else 0


def torchrun_launch_init(cfg):
    """fairseq's ``_infer_torch_distributed_launch_init`` with the device from LOCAL_RANK."""
    cfg.distributed_init_method = "env://"
    cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    cfg.distributed_rank = int(os.environ["RANK"])
    cfg.device_id = torchrun_device_id(cfg.distributed_rank)
    cfg.distributed_no_spawn = True  # torchrun started the processes


def infer_init_method_from_torchrun(cfg, force_distributed=False):
    """fairseq's ``infer_init_method``, which also sees torchrun when the world size flag is 1."""
    if (cfg.distributed_init_method is None and launched_by_torchrun()
            and cfg.distributed_world_size == 1 and int(os.environ["WORLD_SIZE"]) > 1):
        logger.info("launched by torchrun: distributed world size %s from WORLD_SIZE", os.environ["WORLD_SIZE"])
        cfg.distributed_world_size = int(os.environ["WORLD_SIZE"])
    return _FAIRSEQ_INFER_INIT_METHOD(cfg, force_distributed)


def _divides_by_cuda_count(launch_init) -> bool:
    return "% torch.cuda.device_count()" in _source_of(launch_init)


def _returns_before_torchrun(infer_init_method) -> bool:
    source = _source_of(infer_init_method)
    early, torchrun = source.find("distributed_world_size == 1"), source.find('"WORLD_SIZE"')
    return 0 <= early < torchrun


_FAIRSEQ_LAUNCH_INIT = getattr(distributed_utils, "_infer_torch_distributed_launch_init", None)
_FAIRSEQ_INFER_INIT_METHOD = distributed_utils.infer_init_method
# call_main looks both functions up as module globals of fairseq.distributed.utils at call
# time, and the plugin is imported (while parsing --user-dir) before call_main runs.
if _FAIRSEQ_LAUNCH_INIT is not None and _divides_by_cuda_count(_FAIRSEQ_LAUNCH_INIT):
    distributed_utils._infer_torch_distributed_launch_init = torchrun_launch_init
if getattr(_FAIRSEQ_INFER_INIT_METHOD, "__module__", "") != __name__ and _returns_before_torchrun(
        _FAIRSEQ_INFER_INIT_METHOD):
    distributed_utils.infer_init_method = infer_init_method_from_torchrun


# ------------------------------------------------------------------ 5. resume on several ranks
def broadcast_pickled_object(obj, src_rank, group, dist_device):
    """fairseq's ``_broadcast_object_slow`` (fix 5): rank ``src_rank`` pickles ``obj`` and
    broadcasts length and bytes; every other rank unpickles them without the file loader's
    ``weights_only`` restriction, as they come from this job's own rank."""
    if distributed_utils.get_rank(group) == src_rank:
        pickled = io.BytesIO()
        torch.save(obj, pickled)
        payload = torch.ByteTensor(pickled.getbuffer()).to(dist_device)
        distributed_utils.broadcast(torch.LongTensor([payload.numel()]).to(dist_device), src=src_rank, group=group)
        distributed_utils.broadcast(payload, src=src_rank, group=group)
        return obj
    length = torch.LongTensor([0]).to(dist_device)
    distributed_utils.broadcast(length, src=src_rank, group=group)
    payload = torch.ByteTensor(int(length.item())).to(dist_device)
    distributed_utils.broadcast(payload, src=src_rank, group=group)
    return torch.load(io.BytesIO(payload.cpu().numpy()), map_location="cpu", weights_only=False)


def _unpickles_with_default_loader(broadcast_slow) -> bool:
    source = _source_of(broadcast_slow)
    return "torch.load(" in source and "weights_only" not in source


_FAIRSEQ_BROADCAST_OBJECT_SLOW = getattr(distributed_utils, "_broadcast_object_slow", None)
# broadcast_object and broadcast_tensors look it up as a module global at call time.
if _FAIRSEQ_BROADCAST_OBJECT_SLOW is not None and _unpickles_with_default_loader(_FAIRSEQ_BROADCAST_OBJECT_SLOW):
    distributed_utils._broadcast_object_slow = broadcast_pickled_object


# ------------------------------------------------------------------ 6. destroy the process group
def distributed_main_destroying_group(i, main, cfg, kwargs):
    """fairseq's ``distributed_main`` (fix 6), then ``destroy_process_group`` once it returned
    past its closing barrier. Module-level so ``torch.multiprocessing.spawn`` can pickle it."""
    _FAIRSEQ_DISTRIBUTED_MAIN(i, main, cfg, kwargs)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _leaves_group_alive(distributed_main) -> bool:
    source = _source_of(distributed_main)  # this module's wrapper says destroy_process_group
    return bool(source) and "destroy_process_group" not in source


_FAIRSEQ_DISTRIBUTED_MAIN = distributed_utils.distributed_main
# call_main calls (or spawns) it through its module global at call time.
if _leaves_group_alive(_FAIRSEQ_DISTRIBUTED_MAIN):
    distributed_utils.distributed_main = distributed_main_destroying_group
