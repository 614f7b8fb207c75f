"""Fix 6: torchrun jobs on CPU, and with fewer processes per node than GPUs.

fairseq 0.12 ``distributed.utils``, the torchrun / ``torch.distributed.launch`` path
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` in the environment):
(a) ``_infer_torch_distributed_launch_init`` sets ``device_id = rank %
torch.cuda.device_count()``, a ZeroDivisionError on a machine without CUDA (CPU training with
gloo) and the wrong device whenever a node runs fewer processes than it has GPUs;
``torchrun_launch_init`` uses ``LOCAL_RANK``, which torchrun sets, falling back to fairseq's
formula, and 0 without CUDA. (b) ``infer_init_method`` returns before looking at the environment
when ``--distributed-world-size`` is 1, its default on a machine with one GPU or none, so
``torchrun --nnodes 2`` of one-GPU machines (or any CPU run) silently trains independent models
that overwrite each other's checkpoints; when torchrun says ``WORLD_SIZE`` > 1 and the flag was
left at 1, ``infer_init_method_from_torchrun`` takes the world size from torchrun (fairseq's
torchrun path takes it from ``WORLD_SIZE`` anyway once it is reached).

When it can go: (a) is applied only where fairseq's source divides by
``torch.cuda.device_count()``, (b) only where ``infer_init_method`` tests
``distributed_world_size == 1`` before it reads ``"WORLD_SIZE"``; once neither is true of the
installed fairseq, both are no-ops (tests/test_compat.py skips its check of (a) then).
"""

import logging
import os

import torch
from fairseq.distributed import utils as distributed_utils

from ._fairseq_source import source_of

logger = logging.getLogger(__name__)

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
    return "% torch.cuda.device_count()" in source_of(launch_init)


def _returns_before_torchrun(infer_init_method) -> bool:
    source = source_of(infer_init_method)
    early, torchrun = source.find("distributed_world_size == 1"), source.find('"WORLD_SIZE"')
    return 0 <= early < torchrun


_FAIRSEQ_LAUNCH_INIT = getattr(distributed_utils, "_infer_torch_distributed_launch_init", None)
_FAIRSEQ_INFER_INIT_METHOD = distributed_utils.infer_init_method


def apply() -> None:
    """call_main looks both functions up as module globals of fairseq.distributed.utils at call
    time, and the plugin is imported (while parsing --user-dir) before call_main runs."""
    if _FAIRSEQ_LAUNCH_INIT is not None and \
            getattr(distributed_utils, "_infer_torch_distributed_launch_init", None) is _FAIRSEQ_LAUNCH_INIT and \
            _divides_by_cuda_count(_FAIRSEQ_LAUNCH_INIT):
        distributed_utils._infer_torch_distributed_launch_init = torchrun_launch_init
    if distributed_utils.infer_init_method is _FAIRSEQ_INFER_INIT_METHOD and \
            getattr(_FAIRSEQ_INFER_INIT_METHOD, "__module__", "") != __name__ and \
            _returns_before_torchrun(_FAIRSEQ_INFER_INIT_METHOD):
        distributed_utils.infer_init_method = infer_init_method_from_torchrun
