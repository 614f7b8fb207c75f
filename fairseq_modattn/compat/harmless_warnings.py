"""Fix 16: fairseq's commands and the Python API print no warnings that fairseq itself causes
and that say nothing about the run.

A first ``fairseq-train --user-dir fairseq_modattn`` on a CPU printed up to nine warnings before
and during its first epoch, and ``fairseq_modattn.from_pretrained(...).translate`` one per call.
None of them is about the user's data, flags or model, the user can change none of them, and
each reads like a problem:

* hydra-core 1.3's deprecations of the hydra 1.0 API (six of them). fairseq 0.12's
  ``dataclass/utils.py`` ``convert_namespace_to_omegaconf``, which every fairseq command calls
  to turn its flags into a config, composes that config with ``hydra.experimental.initialize``
  and ``compose(..., strict=False)``, from config files with ``# @package _group_`` headers and a
  schema of the same name, ``config``; ``fairseq-fixed`` 0.12.3.1 pins hydra-core 1.3.2, which
  still does all of that and warns about each.
* torch's FutureWarning "`torch.cuda.amp.autocast(args...)` is deprecated" (torch >= 2.4):
  fairseq 0.12's ``FairseqTask.train_step`` / ``valid_step`` enter
  ``torch.cuda.amp.autocast(enabled=...)`` on every step, on a CPU too, where it does nothing.
* torch's "Support for mismatched key_padding_mask and attn_mask is deprecated", on the first
  training step of fairseq's own transformer: fairseq 0.12's ``MultiheadAttention`` hands
  torch's ``multi_head_attention_forward`` the decoder's float future mask (``-inf`` above the
  diagonal) with a bool padding mask, which torch converts to the float mask meant.
* torch's "'pin_memory' argument is set as true but no accelerator is found": fairseq 0.12's
  ``EpochBatchIterator`` always builds its ``DataLoader`` with ``pin_memory=True``; without an
  accelerator torch skips the pinning, which is what a CPU run wants.

Each filter matches the message AND the module the warning is attributed to, which is where
fairseq, or hydra and torch on fairseq's behalf, emit it, so that a warning with the same words
from the user's own code still shows (``tests/test_compat.py``). Two limits, accepted: the
user's own code in the same process loses these notices too where it calls hydra's 1.0 API,
gives torch's attention mixed mask types or builds a ``DataLoader(pin_memory=True)`` on a CPU
(each a notice, none an error); and hydra attributes its "'config' is validated against
ConfigStore schema" warning to the frame eleven levels above its own code, which in fairseq's
console scripts is past the top of the stack ("sys", ``fairseq-train``) or the script itself
("__main__", ``fairseq-generate``), so that filter names those two. The filters are appended to
the warning filters: the user's own ``-W`` and ``PYTHONWARNINGS`` settings come first, so
``python -W default`` or ``-W error`` still sees every one.

Order: the filters must be in place before fairseq converts its flags, which every command does
after ``--user-dir`` has loaded this package; they act on warnings only, raise nothing and so need
no place before fix 15.

When it can go: ``apply`` installs each group of filters only where the installed fairseq still
makes the call that causes it (its source is read: hydra's ``experimental`` API in
``convert_namespace_to_omegaconf``, ``torch.cuda.amp.autocast`` in ``train_step``, torch's
attention with a float future mask in the transformer, ``pin_memory=True`` in the batch
iterator); once no supported fairseq does, the fix installs nothing and can be deleted.
"""

import warnings
from typing import NamedTuple, Tuple

from ._fairseq_source import source_of


class HarmlessWarning(NamedTuple):
    """One filter: the message's start (a regular expression, as ``warnings.filterwarnings``
    takes it), its category, the module it is attributed to (a regular expression for the whole
    name), and why it is harmless."""

    message: str
    category: type
    module: str
    reason: str


HYDRA_1_0_API = (
    HarmlessWarning(r"hydra\.experimental\.initialize\(\) is no longer experimental", UserWarning,
                    r"hydra\.experimental\.initialize\Z",
                    "fairseq's convert_namespace_to_omegaconf uses hydra 1.0's initialize"),
    HarmlessWarning(r"\s*The version_base parameter is not specified", UserWarning,
                    r"hydra\.experimental\.initialize\Z",
                    "hydra 1.0's initialize has no version_base; hydra then assumes 1.1, what fairseq needs"),
    HarmlessWarning(r"hydra\.experimental\.compose\(\) is no longer experimental", UserWarning,
                    r"hydra\.experimental\.compose\Z",
                    "fairseq's convert_namespace_to_omegaconf uses hydra 1.0's compose"),
    HarmlessWarning(r"\s*The strict flag in the compose API is deprecated", UserWarning, r"hydra\.compose\Z",
                    "fairseq calls compose(..., strict=False)"),
    HarmlessWarning(r"In 'config': Usage of deprecated keyword in package header '# @package _group_'",
                    UserWarning, r"hydra\.core\.default_element\Z",
                    "fairseq's own config/config.yaml has that header"),
    HarmlessWarning(r"\s*'config' is validated against ConfigStore schema with the same name", UserWarning,
                    r"(sys|__main__)\Z",
                    "fairseq stores its FairseqConfig schema under its config file's name, 'config'; hydra "
                    "attributes the warning 11 frames up: past the stack's top (sys) in fairseq-train, the "
                    "console script (__main__) in fairseq-generate"),
)
AUTOCAST = (
    HarmlessWarning(r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated", FutureWarning,
                    r"fairseq\.tasks\.fairseq_task\Z",
                    "fairseq's train_step and valid_step enter torch.cuda.amp.autocast on every step"),
)
MIXED_MASKS = (
    HarmlessWarning(r"Support for mismatched key_padding_mask and attn_mask is deprecated", UserWarning,
                    r"torch\.nn\.functional\Z",
                    "fairseq's transformer decoder gives its self-attention a float future mask with a bool "
                    "padding mask; torch turns the bool mask into a float one, the same mask"),
)
PIN_MEMORY = (
    HarmlessWarning(r"'pin_memory' argument is set as true but no accelerator is found", UserWarning,
                    r"torch\.utils\.data\.dataloader\Z",
                    "fairseq's batch iterator always asks for pinned memory; without an accelerator torch "
                    "skips pinning, as a CPU run should"),
)


def _convert_uses_hydra_1_0_api() -> bool:
    from fairseq.dataclass import utils

    compose = getattr(utils, "compose", None)
    return (getattr(compose, "__module__", "").startswith("hydra.experimental")
            and "strict=False" in source_of(utils.convert_namespace_to_omegaconf))


def _train_step_enters_cuda_autocast() -> bool:
    from fairseq.tasks.fairseq_task import FairseqTask

    return "torch.cuda.amp.autocast" in source_of(FairseqTask.train_step)


def _transformer_mixes_mask_types() -> bool:
    from fairseq.models.transformer import TransformerDecoderBase
    from fairseq.modules.multihead_attention import MultiheadAttention

    return ("F.multi_head_attention_forward" in source_of(MultiheadAttention.forward)
            and "fill_with_neg_inf" in source_of(TransformerDecoderBase.buffered_future_mask))


def _batch_iterator_pins_memory() -> bool:
    from fairseq.data.iterators import EpochBatchIterator

    return "pin_memory=True" in source_of(EpochBatchIterator._get_iterator_for_epoch)


def needed() -> Tuple[HarmlessWarning, ...]:
    """The filters whose cause is in the installed fairseq."""
    groups = ((HYDRA_1_0_API, _convert_uses_hydra_1_0_api), (AUTOCAST, _train_step_enters_cuda_autocast),
              (MIXED_MASKS, _transformer_mixes_mask_types), (PIN_MEMORY, _batch_iterator_pins_memory))
    return tuple(f for filters, present in groups if present() for f in filters)


def install(filters: Tuple[HarmlessWarning, ...]) -> None:
    """Appends an "ignore" filter for each of FILTERS; ``filterwarnings(append=True)`` adds a
    filter only once, so calling this again changes nothing."""
    for f in filters:
        warnings.filterwarnings("ignore", message=f.message, category=f.category, module=f.module, append=True)


def apply() -> None:
    install(needed())
