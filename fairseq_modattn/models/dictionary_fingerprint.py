"""The model knows its dictionaries: a fingerprint of them in its state dict, checked on load.

``RecordsDictionaries`` comes first among the bases of every model of this package
(``TransformerVariantModel``, hence DMA, talking heads and TIM, and ``RIMLSTMModel``):

* its ``__init__`` registers the persistent buffer ``dictionary_fingerprint``, (2, 9) int64,
  the fingerprints of the encoder's and the decoder's dictionaries (``fairseq_modattn.
  dictionaries.fingerprint``). It is computed from the dictionaries the model is built with,
  so it is saved with every checkpoint, kept by averaging, and is not a parameter;
* its ``load_state_dict`` compares the state dict's fingerprint with the model's own before
  fairseq copies anything. fairseq loads weights through this method on every path: the
  trainer's resume (``--restore-file``, ``checkpoint_last.pt``), ``load_model_ensemble_and_task``
  (``fairseq-generate``, ``fairseq-interactive``, this package's loader behind ``evaluate``,
  ``serve`` and the analysis commands). A difference raises ``DictionaryMismatchError``, one
  line naming both; a state dict without the key (a checkpoint saved before the fingerprint
  existed) loads with a one-line warning, once per process, that nothing could be checked.

The model's build also records, in its args (``cfg.model``, saved in the checkpoint), the
data-bin it was first built on (``dictionaries_data``), so that the message can name the
folder the model was trained on; ``fairseq-generate --path`` loads ``cfg.model`` from the
checkpoint, where this is the training data-bin (``cfg.task.data`` is replaced by the folder
given now). Only the buffer decides; the path is for the message.
"""

import logging
import os

from ..dictionaries import (
    FINGERPRINT_KEY,
    DictionaryMismatchError,
    dictionaries_fingerprint,
    dictionary_files,
    mismatch_message,
    same_fingerprints,
)

logger = logging.getLogger(__name__)

#: the model arg (saved in the checkpoint's cfg.model) naming the data-bin the model was first built on
TRAINED_ON_ARG = "dictionaries_data"

_warned_unchecked = False  # the warning for checkpoints without a fingerprint, once per process


class RecordsDictionaries:
    """Mixin before a fairseq encoder-decoder model class (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # int64 stays int64 under .half() / --fp16 and moves with .cuda(); persistent, so
        # state_dict() holds it and fairseq's checkpoints save it
        self.register_buffer(FINGERPRINT_KEY, dictionaries_fingerprint(self.encoder.dictionary,
                                                                       self.decoder.dictionary))
        self.dictionary_files = None  # (dict.SRC.txt, dict.TGT.txt) of the data-bin, set by record_data_bin
        self.trained_on = None

    def record_data_bin(self, args, task):
        """Called by the model's ``build_model``: where the dictionaries come from (the task's
        data-bin), and the data-bin the model was first built on, kept in ARGS (set once: a
        checkpoint's args already hold it)."""
        cfg = getattr(task, "cfg", None)
        data = getattr(cfg, "data", None)
        self.dictionary_files = dictionary_files(data, getattr(cfg, "source_lang", None),
                                                 getattr(cfg, "target_lang", None))
        if not getattr(args, TRAINED_ON_ARG, None) and data:
            try:
                setattr(args, TRAINED_ON_ARG, os.path.abspath(str(data).split(os.pathsep)[0]))
            except Exception:  # a structured config that takes no new key: the message omits the path
                pass
        self.trained_on = getattr(args, TRAINED_ON_ARG, None)

    def load_state_dict(self, state_dict, strict=True, model_cfg=None, args=None):
        own = getattr(self, FINGERPRINT_KEY)
        saved = state_dict.get(FINGERPRINT_KEY)
        if saved is None:
            global _warned_unchecked
            if not _warned_unchecked:
                _warned_unchecked = True
                logger.warning("the checkpoint records no fingerprint of its dictionaries (saved before "
                               "fairseq_modattn recorded them), so the model cannot check that the data-bin's "
                               "dictionaries are the ones it was trained with")
            state_dict[FINGERPRINT_KEY] = own.detach().clone()  # fairseq's upgrades also edit in place
        elif not same_fingerprints(saved, own):
            here = self.dictionary_files[0].parent if self.dictionary_files else None
            trained_on = self.trained_on if self.trained_on and str(here) != self.trained_on else None
            raise DictionaryMismatchError(mismatch_message(saved, trained_on, own, self.dictionary_files))
        return super().load_state_dict(state_dict, strict=strict, model_cfg=model_cfg, args=args)
