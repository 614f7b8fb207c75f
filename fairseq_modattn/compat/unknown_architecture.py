"""Fix 11: a model type that nothing registers is one line naming it, not an IndexError.

fairseq 0.12 ``models.build_model``, given a model type that nothing registers (a checkpoint of
another plugin loaded without that plugin's ``--user-dir``, or any architecture name no loaded
code defines), fails on its own assertion: the message is an f-string holding the model config,
joined to ``"Available models: {}"`` and then ``.format``-ted, and the braces in the config's text
(every fairseq config holds ``eval_bleu_args='{}'``) break that formatting, so the command ends,
deep in a traceback, with ``IndexError: Replacement index 1 out of range for positional args
tuple`` instead of the model's name. ``build_model_naming_unknown_architecture`` looks the model
type up first and raises ``UnknownArchitectureError``, one line naming it and saying which
``--user-dir`` is missing (printed as that line alone by fix 15's ``sys.excepthook``; the
package's loaders report it as their one-line error). A checkpoint of THIS plugin loaded without
``--user-dir`` never imports this module: README.md, "Troubleshooting", quotes what fairseq
prints then.

When it can go: ``apply`` wraps ``build_model`` only where its source holds both ``from {cfg}``
and ``"Available models: {}".format(``, the unformattable message; once fairseq formats it
properly, the fix is a no-op (fairseq's own message then names the model type).
"""

import difflib

from fairseq import models as fairseq_models

from ._fairseq_source import source_of


class UnknownArchitectureError(RuntimeError):
    """A checkpoint (or ``--arch``) names a model architecture that nothing loaded registers; the
    message is one line saying so and what to load."""


def unknown_architecture_message(model_type: str) -> str:
    """One line: MODEL_TYPE is registered by neither fairseq nor any loaded plugin, and why that
    happens (a model of another plugin, whose ``--user-dir`` is missing)."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

    known = sorted(set(ARCH_MODEL_REGISTRY) | set(MODEL_DATACLASS_REGISTRY))
    close = difflib.get_close_matches(model_type, known, n=3)
    message = (f"unknown model architecture {model_type!r}: neither fairseq nor the plugins loaded (fairseq_modattn) "
               "register it; a checkpoint trained with another fairseq plugin needs that plugin's --user-dir too")
    return message + (f" (similar registered names: {', '.join(close)})" if close else "")


def build_model_naming_unknown_architecture(cfg, task, *args, **kwargs):
    """fairseq's ``models.build_model``: a model type nothing registers raises
    UnknownArchitectureError instead of fairseq's IndexError."""
    from fairseq.models import ARCH_MODEL_REGISTRY, MODEL_DATACLASS_REGISTRY

    model_type = getattr(cfg, "_name", None) or getattr(cfg, "arch", None)  # as fairseq reads it
    if isinstance(model_type, str) and model_type not in ARCH_MODEL_REGISTRY \
            and model_type not in MODEL_DATACLASS_REGISTRY:
        raise UnknownArchitectureError(unknown_architecture_message(model_type))
    return _FAIRSEQ_BUILD_MODEL(cfg, task, *args, **kwargs)


def _unknown_model_message_breaks(build_model) -> bool:
    """fairseq 0.12's assertion message: an f-string with the config joined to a plain string
    that is then ``.format``-ted, so the braces of the config's text break the formatting."""
    source = source_of(build_model)
    return "from {cfg}" in source and '"Available models: {}".format(' in source


_FAIRSEQ_BUILD_MODEL = fairseq_models.build_model


def apply() -> None:
    """Every task builds its model through the module attribute (``from fairseq import models;
    models.build_model(...)``, FairseqTask.build_model and the others), looked up at call time."""
    if fairseq_models.build_model is _FAIRSEQ_BUILD_MODEL and \
            getattr(_FAIRSEQ_BUILD_MODEL, "__module__", "") != __name__ and \
            _unknown_model_message_breaks(_FAIRSEQ_BUILD_MODEL):
        fairseq_models.build_model = build_model_naming_unknown_architecture
