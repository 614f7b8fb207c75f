"""fairseq_modattn/compat/: each fix does what its docstring says, and is applied only where needed."""

import numpy as np
import pytest
import torch
from fairseq.data import data_utils

from fairseq_modattn.compat import distributed_resume, keep_last_batch, torchrun_without_cuda


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
    """The behaviour fix 3 corrects (fairseq issue #5036); skipped once fairseq fixes it."""
    if not keep_last_batch._drops_last_batch(keep_last_batch._FAIRSEQ_BATCH_BY_SIZE):
        pytest.skip("the installed fairseq keeps every batch")
    assert data_utils.batch_by_size is keep_last_batch.batch_by_size_keeping_all
    kept = np.concatenate(batches(keep_last_batch._FAIRSEQ_BATCH_BY_SIZE, 300)).size
    assert kept < 300


# ------------------------------------------------------------------ 6. torchrun
TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3"}


@pytest.fixture
def torchrun_env(monkeypatch):
    for key in ("LOCAL_RANK", *TORCHRUN):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize("gpus, local_rank, expected", [
    (0, "1", 0),     # CPU: no device to pick, and fairseq would divide by zero
    (4, "1", 1),     # torchrun's LOCAL_RANK, not rank % gpus (= 3)
    (4, None, 3),    # no LOCAL_RANK: fairseq's formula
])
def test_torchrun_device_id(torchrun_env, gpus, local_rank, expected):
    torchrun_env.setattr(torch.cuda, "device_count", lambda: gpus)
    if local_rank is not None:
        torchrun_env.setenv("LOCAL_RANK", local_rank)
    assert torchrun_without_cuda.torchrun_device_id(3) == expected


def test_torchrun_environment_sets_up_a_distributed_job_on_cpu(torchrun_env):
    """The world size flag at its CPU default of 1 no longer hides torchrun's environment."""
    from fairseq.dataclass.configs import DistributedTrainingConfig
    from fairseq.distributed import utils as distributed_utils

    for key, value in {**TORCHRUN, "LOCAL_RANK": "1"}.items():
        torchrun_env.setenv(key, value)
    torchrun_env.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = DistributedTrainingConfig(distributed_world_size=1, tpu=False)  # tpu: "${common.tpu}" unresolved
    distributed_utils.infer_init_method(cfg)
    assert (cfg.distributed_init_method, cfg.distributed_world_size, cfg.distributed_rank) == ("env://", 4, 3)
    assert cfg.device_id == 0 and cfg.distributed_no_spawn


def test_without_torchrun_a_world_of_one_stays_single_process(torchrun_env):
    from fairseq.dataclass.configs import DistributedTrainingConfig
    from fairseq.distributed import utils as distributed_utils

    cfg = DistributedTrainingConfig(distributed_world_size=1, tpu=False)  # tpu: "${common.tpu}" unresolved
    distributed_utils.infer_init_method(cfg)
    assert cfg.distributed_init_method is None and cfg.distributed_world_size == 1


def test_upstream_torchrun_path_divides_by_the_gpu_count(torchrun_env):
    """The behaviour fix 6 corrects; skipped once fairseq reads LOCAL_RANK itself."""
    from fairseq.dataclass.configs import DistributedTrainingConfig

    if not torchrun_without_cuda._divides_by_cuda_count(torchrun_without_cuda._FAIRSEQ_LAUNCH_INIT):
        pytest.skip("the installed fairseq does not divide by the CUDA device count")
    for key, value in TORCHRUN.items():
        torchrun_env.setenv(key, value)
    torchrun_env.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ZeroDivisionError):
        torchrun_without_cuda._FAIRSEQ_LAUNCH_INIT(DistributedTrainingConfig(distributed_world_size=4))


# ------------------------------------------------------------------ 7. resume on several ranks
def test_fairseq_state_needs_the_full_unpickler():
    """What rank 0 broadcasts when resuming holds omegaconf configs, which torch's default
    (weights_only) loader refuses; fix 7 is installed where fairseq uses that loader.
    tests/test_distributed.py resumes a real 2-rank run through it."""
    import io

    from fairseq.distributed import utils as distributed_utils
    from omegaconf import OmegaConf

    pickled = io.BytesIO()
    torch.save({"cfg": OmegaConf.create({"lr": [0.1]})}, pickled)
    with pytest.raises(Exception, match="DictConfig"):
        torch.load(io.BytesIO(pickled.getvalue()))
    if distributed_resume._unpickles_with_default_loader(distributed_resume._FAIRSEQ_BROADCAST_OBJECT_SLOW):
        assert distributed_utils._broadcast_object_slow is distributed_resume.broadcast_pickled_object


# ------------------------------------------------------------------ 8. destroy the process group
def test_a_rank_leaves_no_process_group_behind():
    """fairseq's distributed_main, as call_main runs it, on a one-rank gloo group: training
    (here a stand-in ``main``) runs inside the group, and the group is gone afterwards, so the
    interpreter never tears gloo's threads down itself (the abort fix 8 prevents)."""
    import pickle
    import socket

    from fairseq.dataclass.configs import FairseqConfig
    from fairseq.distributed import utils as distributed_utils

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = FairseqConfig()
    cfg.common.cpu = True
    cfg.distributed_training.distributed_backend = "gloo"
    cfg.distributed_training.distributed_init_method = f"tcp://127.0.0.1:{port}"
    cfg.distributed_training.distributed_world_size = 1
    cfg.distributed_training.distributed_rank = 0
    seen = []

    def main(cfg):
        seen.append((torch.distributed.is_initialized(), torch.distributed.get_world_size()))

    assert not torch.distributed.is_initialized()
    try:
        distributed_utils.distributed_main(0, main, cfg, {})
        assert seen == [(True, 1)]
        assert not torch.distributed.is_initialized()
    finally:  # a failure here must not leave the group to the tests that follow
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # torch.multiprocessing.spawn (fairseq's path on GPUs) pickles the function by name
    assert pickle.loads(pickle.dumps(distributed_utils.distributed_main)) is distributed_utils.distributed_main


# ------------------------------------------------------------------ 16. warnings fairseq causes
#: each warning fix 16 drops, as fairseq-train and fairseq-generate printed it on a CPU, with the
#: module it was attributed to (fairseq-fixed 0.12.3.1, hydra-core 1.3.2, torch 2.13)
FAIRSEQ_WARNINGS = [
    ("hydra.experimental.initialize() is no longer experimental. Use hydra.initialize()", UserWarning,
     "hydra.experimental.initialize"),
    ("\nThe version_base parameter is not specified.\nPlease specify a compatability version level, or None.\n"
     "Will assume defaults for version 1.1", UserWarning, "hydra.experimental.initialize"),
    ("hydra.experimental.compose() is no longer experimental. Use hydra.compose()", UserWarning,
     "hydra.experimental.compose"),
    ("In 'config': Usage of deprecated keyword in package header '# @package _group_'.\nSee "
     "https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/changes_to_package_header for more information", UserWarning,
     "hydra.core.default_element"),
    *[("\n'config' is validated against ConfigStore schema with the same name.\nThis behavior is deprecated in "
       "Hydra 1.1 and will be removed in Hydra 1.2.\nSee https://hydra.cc/docs/1.2/upgrades/1.0_to_1.1/"
       "automatic_schema_matching for migration instructions.", UserWarning, module)
      for module in ("sys", "__main__")],  # fairseq-train's, fairseq-generate's
    ("\nThe strict flag in the compose API is deprecated.\nSee https://hydra.cc/docs/1.2/upgrades/0.11_to_1.0/"
     "strict_mode_flag_deprecated for more info.\n", UserWarning, "hydra.compose"),
    ("`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)` instead.",
     FutureWarning, "fairseq.tasks.fairseq_task"),
    ("Support for mismatched key_padding_mask and attn_mask is deprecated. Use same type for both instead.",
     UserWarning, "torch.nn.functional"),
    ("'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used.",
     UserWarning, "torch.utils.data.dataloader"),
]


def test_warnings_fairseq_causes_are_dropped_and_the_same_words_from_user_code_still_show():
    """Fix 16 drops each warning where fairseq, or hydra and torch on its behalf, emit it, and
    nothing else: the same text from the user's own module is shown, and so is any other warning
    of those modules. The real runs are checked in tests/test_quickstart.py (fairseq-train's
    output holds no warning)."""
    import warnings

    from fairseq_modattn.compat import harmless_warnings

    installed = harmless_warnings.needed()
    assert installed == (harmless_warnings.HYDRA_1_0_API + harmless_warnings.AUTOCAST + harmless_warnings.MIXED_MASKS
                         + harmless_warnings.PIN_MEMORY), "the installed fairseq no longer causes one of them"
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()  # the filters of this test run (pyproject's ignore FutureWarning) aside
        harmless_warnings.install(installed)
        warnings.simplefilter("always", append=True)  # whatever the fix lets through is recorded
        for text, category, module in FAIRSEQ_WARNINGS:
            warnings.warn_explicit(text, category, f"/site-packages/{module.replace('.', '/')}.py", 1, module=module)
        assert [str(w.message) for w in shown] == []
        for text, category, _ in FAIRSEQ_WARNINGS:
            warnings.warn_explicit(text, category, "/home/user/translate.py", 7, module="translate")
        warnings.warn_explicit("'pin_memory' is not supported here", UserWarning, "dataloader.py", 1,
                               module="torch.utils.data.dataloader")
        assert [(str(w.message), w.category) for w in shown] == (
            [(text, category) for text, category, _ in FAIRSEQ_WARNINGS]
            + [("'pin_memory' is not supported here", UserWarning)])

        # torch's own warning, raised for real by a DataLoader as fairseq builds it
        if not torch.accelerator.is_available():
            shown.clear()
            loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, pin_memory=True)
            assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
            assert [str(w.message) for w in shown] == []


# ------------------------------------------------------------------ the package of fixes
def test_the_apply_order_names_every_fix_module_once_with_its_number():
    """A fix module left out of compat.FIXES would never be applied; the number in each module's
    docstring ("Fix N:") is its place in that order, the number messages and docs refer to."""
    import importlib
    import pkgutil

    from fairseq_modattn import compat

    modules = {m.name for m in pkgutil.iter_modules(compat.__path__) if not m.name.startswith("_")}
    assert sorted(compat.FIXES) == sorted(modules) and len(set(compat.FIXES)) == len(compat.FIXES)
    for number, name in enumerate(compat.FIXES, start=1):
        fix = importlib.import_module(f"{compat.__name__}.{name}")
        assert callable(fix.apply), name
        assert fix.__doc__.startswith(f"Fix {number}: "), (name, fix.__doc__.splitlines()[0])


def test_applying_the_fixes_again_installs_nothing_twice():
    """``import fairseq_modattn`` applied them once; a second apply() leaves every patched name,
    the excepthook, the log filter, torch's allow-list and the warning filters as they are (no wrapper
    of a wrapper, no filter twice)."""
    import logging
    import sys
    import warnings

    from fairseq import checkpoint_utils, models
    from fairseq.distributed import utils as distributed_utils

    from fairseq_modattn import compat

    def state():
        patched = [(module, name) for module in (data_utils, checkpoint_utils, models, distributed_utils)
                   for name in ("batch_by_size", "load_checkpoint_to_cpu", "PathManager", "torch_persistent_save",
                                "verify_checkpoint_directory", "build_model", "distributed_main",
                                "_broadcast_object_slow", "infer_init_method", "_infer_torch_distributed_launch_init")
                   if hasattr(module, name)]
        return ([getattr(module, name) for module, name in patched], sys.excepthook,
                list(logging.getLogger("fairseq.tasks.text_to_speech").filters),
                set(torch.serialization.get_safe_globals()), logging.getLogger().level,
                list(logging.getLogger().handlers), list(warnings.filters))

    before = state()
    compat.apply()
    assert state() == before
