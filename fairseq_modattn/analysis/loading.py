"""Any checkpoint this package can read -> (model, task) in eval mode, and the batches of a split.

Works for this package's models and for plain fairseq checkpoints (``transformer``, ``lstm``,
...), so the analysis of a DMA model can be set against the user's own baseline. Loading goes
through fairseq's ``checkpoint_utils`` with torch's safe loader (``compat/checkpoint_globals.py``,
fix 4); a damaged file or a refused class is one line of AnalysisError (fix 9). So is a data-bin
whose dictionaries are not the checkpoint's (``fairseq_modattn/dictionaries.py``): this package's
models refuse it themselves, and for other checkpoints the data-bin is compared with the one they
recorded.
"""

import logging
import pickle
from pathlib import Path
from typing import Iterator, Optional

import torch

from . import AnalysisError

logger = logging.getLogger(__name__)


def path_problem(path, data=None) -> Optional[str]:
    """What is wrong with a checkpoint PATH and a data-bin folder DATA (None: not given), said
    before anything is loaded (``serve`` asks before it starts Flask), or None."""
    path = Path(path)
    if path.is_dir():
        return (f"checkpoint {path} is a folder: pass the .pt file in it that fairseq-train saved "
                f"(e.g. {path / 'checkpoint_best.pt'})")
    if not path.is_file():
        return f"checkpoint {path} does not exist (pass the .pt file fairseq-train saved)"
    if data is not None and not Path(data).is_dir():
        what = "is a file, not a folder" if Path(data).exists() else "does not exist"
        return f"data-bin {data} {what} (pass the folder fairseq-preprocess wrote)"
    return None


def load_model(path, data: Optional[str] = None, cpu: bool = True):
    """(model, task, cfg) of the checkpoint ``path``; ``data`` replaces the data-bin recorded in
    it (checkpoints remember the folder they were trained on, which may be elsewhere now)."""
    from fairseq import checkpoint_utils

    import fairseq_modattn  # noqa: F401  (registers the models; applies the loading fixes of compat/)
    from fairseq_modattn.compat.damaged_checkpoints import DamagedCheckpointError, describe_load_failure
    from fairseq_modattn.dictionaries import DictionaryMismatchError, check_checkpoint_dictionaries

    path = Path(path)
    problem = path_problem(path, data)
    if problem is not None:
        raise AnalysisError(problem)
    if data is not None and not any(Path(data).glob("dict.*.txt")):
        # fairseq would say "Could not infer language pair, please provide it explicitly" deep in
        # a traceback (the language pair is inferred from these files' names)
        raise AnalysisError(f"data-bin {data} holds no dictionaries (dict.SRC.txt and dict.TGT.txt, which "
                            "fairseq-preprocess writes): pass the data-bin folder the model was trained on")
    overrides = {"data": str(data)} if data is not None else {}
    try:
        # the data-bin's dictionaries against those the checkpoint records, or, where it records
        # none, against those of the data-bin it was trained on
        cannot_tell = check_checkpoint_dictionaries(path, data)
        if cannot_tell:
            logger.warning(cannot_tell)
        models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([str(path)], arg_overrides=overrides)
    except DictionaryMismatchError as e:
        raise AnalysisError(str(e)) from e
    except (DamagedCheckpointError, pickle.UnpicklingError) as e:
        # one line: the damaged file and the intact checkpoints beside it (compat fix 9), or the
        # class torch's safe loader refused (fix 4), instead of torch's paragraphs
        raise AnalysisError(describe_load_failure(path, e)) from e
    except (RuntimeError, KeyError, OSError, EOFError) as e:
        raise AnalysisError(f"cannot load checkpoint {path}: {e}") from e
    model = models[0]
    model.eval()
    if not cpu and torch.cuda.is_available():
        model.cuda()
    return model, task, cfg


def split_size(task, subset: str) -> int:
    """Load ``subset`` of the task's data-bin (once) and return its number of sentences (> 0)."""
    data_dir = Path(str(getattr(task.cfg, "data", "")).split(":")[0])
    binaries = list(data_dir.glob(f"{subset}.*.bin")) if data_dir.is_dir() else []
    if binaries and all(b.stat().st_size == 0 for b in binaries):
        # checked before fairseq opens them: its MMapIndexedDataset cannot mmap an empty file
        raise AnalysisError(
            f"split {subset!r} of the data-bin is empty ({binaries[0]} holds no data): nothing to analyse")
    try:
        if subset not in task.datasets:
            task.load_dataset(subset)
    except FileNotFoundError as e:
        raise AnalysisError(f"split {subset!r} not found in the data-bin: {e}") from e
    size = len(task.dataset(subset))
    if size == 0:
        raise AnalysisError(f"split {subset!r} of the data-bin is empty: nothing to analyse")
    return size


def iterate_batches(
    task, model, subset: str, max_tokens: int = 4000, max_sentences: Optional[int] = None,
    max_batches: Optional[int] = None,
) -> Iterator[dict]:
    """The split's fairseq samples in a fixed order (no shuffling, every sentence kept), on the
    model's device; at most ``max_batches`` of them."""
    from fairseq import utils

    split_size(task, subset)
    itr = task.get_batch_iterator(
        dataset=task.dataset(subset),
        max_tokens=max_tokens,
        max_sentences=max_sentences,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=False,
        required_batch_size_multiple=1,
        seed=1,
        num_workers=0,
    ).next_epoch_itr(shuffle=False)
    device = next(model.parameters()).device
    for index, sample in enumerate(itr):
        if max_batches is not None and index >= max_batches:
            return
        yield utils.move_to_cuda(sample) if device.type == "cuda" else sample


def model_name(model) -> str:
    """The registered fairseq model name of ``model`` (e.g. 'dma_transformer', 'transformer')."""
    from fairseq.models import MODEL_REGISTRY

    for name, cls in MODEL_REGISTRY.items():
        if type(model) is cls:
            return name
    return type(model).__name__

