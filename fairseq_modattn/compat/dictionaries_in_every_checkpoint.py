"""Fix 14: every checkpoint fairseq-train saves knows its dictionaries, and every load checks them.

fairseq 0.12 saves a checkpoint's weights and configuration, and of the data only the data-bin's
path (``cfg.task.data``): nothing says which word each token id meant. A data-bin with the same
dictionary sizes in another order (two symbols swapped, a re-run of ``fairseq-preprocess`` on
other text) loads silently in ``fairseq-generate``, ``fairseq-interactive``, ``from_pretrained``
and a resumed training, and the model translates garbage. This package's own models carry a
fingerprint of their dictionaries as a buffer (``models/dictionary_fingerprint.py``); a plain
``--arch transformer`` trained with ``--user-dir fairseq_modattn`` had none.

* ``Trainer.state_dict`` (what ``Trainer.save_checkpoint`` writes) adds
  ``extra_state["dictionary_fingerprint"]``, the (2, 9) int64 fingerprint of the task's source
  and target dictionaries (``dictionaries.dictionaries_fingerprint``), whatever the model. The
  extra state is what fairseq keeps beside the model and ignores when it does not know a key, so
  the checkpoint still loads in fairseq without the plugin, and the model's weights and its
  strict ``load_state_dict`` are untouched.
* ``Trainer.load_checkpoint`` (resume from ``checkpoint_last.pt``, ``--restore-file``,
  ``--finetune-from-model``) and ``checkpoint_utils.load_model_ensemble_and_task``
  (``fairseq-generate``, ``fairseq-interactive``, ``fairseq-validate``, ``from_pretrained``, this
  package's loader) compare each file's record with the task's dictionaries
  (``dictionaries.check_task_dictionaries``) and raise ``DictionaryMismatchError``: one line
  naming both, printed as that line by fix 15. The trainer checks before it reads the file; the
  ensemble loader after fairseq has set up the task (which reads the data-bin's dictionaries) and
  loaded the models, before anything is returned.

A checkpoint that records nothing (saved without the plugin, or before this fix) loads as before.

When it can go: each wrapper is installed only where fairseq's function still mentions no
dictionary fingerprint (``_records_no_dictionaries``); once fairseq records them, a no-op.
"""

import os

from fairseq import checkpoint_utils
from fairseq.trainer import Trainer

from ..dictionaries import FINGERPRINT_KEY, check_task_dictionaries, dictionaries_fingerprint
from ._fairseq_source import source_of


def state_dict_recording_dictionaries(self) -> dict:
    """fairseq's ``Trainer.state_dict`` with the fingerprint of the task's dictionaries in its
    extra state (a task without a source and a target dictionary records nothing)."""
    state = _FAIRSEQ_STATE_DICT(self)
    source = getattr(self.task, "source_dictionary", None)
    target = getattr(self.task, "target_dictionary", None)
    if source is not None and target is not None:
        state["extra_state"][FINGERPRINT_KEY] = dictionaries_fingerprint(source, target)
    return state


def load_checkpoint_checking_dictionaries(self, filename, *args, **kwargs):
    """fairseq's ``Trainer.load_checkpoint``, after comparing what FILENAME records with the
    task's dictionaries (a file that does not exist is fairseq's to report: it starts afresh)."""
    if filename and os.path.isfile(filename):
        check_task_dictionaries(filename, self.task)
    return _FAIRSEQ_LOAD_CHECKPOINT(self, filename, *args, **kwargs)


def load_model_ensemble_and_task_checking_dictionaries(filenames, *args, **kwargs):
    """fairseq's ``load_model_ensemble_and_task``; then each file of FILENAMES that records a
    fingerprint is compared with the dictionaries of the task the models were loaded for."""
    ensemble, cfg, task = _FAIRSEQ_LOAD_ENSEMBLE(filenames, *args, **kwargs)
    for filename in filenames:
        if os.path.isfile(filename):  # model-parallel shards carry a suffix fairseq adds itself
            check_task_dictionaries(filename, task)
    return ensemble, cfg, task


def _records_no_dictionaries(function) -> bool:
    source = source_of(function)
    return "fingerprint" not in source and "dictionaries" not in source


_FAIRSEQ_STATE_DICT = Trainer.state_dict
_FAIRSEQ_LOAD_CHECKPOINT = Trainer.load_checkpoint
_FAIRSEQ_LOAD_ENSEMBLE = checkpoint_utils.load_model_ensemble_and_task
# inspect.getsource follows __wrapped__: the fixes that read fairseq's source after this one
# (fix 15 reads Trainer.load_checkpoint's) still read fairseq's, not the wrapper's
state_dict_recording_dictionaries.__wrapped__ = _FAIRSEQ_STATE_DICT  # type: ignore[attr-defined]
load_checkpoint_checking_dictionaries.__wrapped__ = _FAIRSEQ_LOAD_CHECKPOINT  # type: ignore[attr-defined]
load_model_ensemble_and_task_checking_dictionaries.__wrapped__ = _FAIRSEQ_LOAD_ENSEMBLE  # type: ignore[attr-defined]


def apply() -> None:
    """The trainer's methods are looked up on the class at call time; fairseq-generate,
    -interactive, hub_utils and this package call ``checkpoint_utils.load_model_ensemble_and_task``
    (or ``load_model_ensemble``, which calls it as a module global) at call time."""
    if Trainer.state_dict is _FAIRSEQ_STATE_DICT and _records_no_dictionaries(_FAIRSEQ_STATE_DICT):
        Trainer.state_dict = state_dict_recording_dictionaries
    if Trainer.load_checkpoint is _FAIRSEQ_LOAD_CHECKPOINT and _records_no_dictionaries(_FAIRSEQ_LOAD_CHECKPOINT):
        Trainer.load_checkpoint = load_checkpoint_checking_dictionaries
    if checkpoint_utils.load_model_ensemble_and_task is _FAIRSEQ_LOAD_ENSEMBLE and \
            _records_no_dictionaries(_FAIRSEQ_LOAD_ENSEMBLE):
        checkpoint_utils.load_model_ensemble_and_task = load_model_ensemble_and_task_checking_dictionaries
