"""The one place where this package adjusts fairseq / torch behaviour: one module per fix.

``fairseq_modattn/__init__.py`` calls :func:`apply` before it imports anything else, so loading
the plugin (``--user-dir`` or ``import fairseq_modattn``) applies every fix. Each fix module says
in its docstring which fairseq / torch behaviour forces it, and each ``apply`` first checks
(by reading the installed code) that the behaviour it corrects is present and does nothing
otherwise, so an installed fairseq that already behaves is untouched. docs/design.md, "fairseq
pitfalls", lists them in short.

The fixes are numbered in the order :data:`FIXES` applies them. The order matters for the first
two: fix 1 must act before fairseq is first imported, and fix 2 performs that import. That is why
:func:`apply` imports each fix module only when its turn comes (the others import fairseq at
their top) and why this module imports nothing of fairseq.
"""

import importlib

FIXES = (
    "tensorboardx_notice",         # 1, before fairseq's first import
    "root_logger_level",           # 2, performs fairseq's first import
    "keep_last_batch",             # 3
    "checkpoint_globals",          # 4
    "per_head_attention_weights",  # 5
    "torchrun_without_cuda",       # 6
    "distributed_resume",          # 7
    "process_group_teardown",      # 8
    "damaged_checkpoints",         # 9
    "fairseq_score",               # 10
    "unknown_architecture",        # 11
    "one_training_per_save_dir",   # 12
    "atomic_checkpoint_saves",     # 13
    "dictionaries_in_every_checkpoint",  # 14
    "one_line_errors",             # 15, after every fix that raises: prints the errors they raise
    "harmless_warnings",           # 16, raises nothing: warning filters
)


def apply() -> None:
    """Applies every fix in the order of FIXES. Idempotent: each fix installs itself only where
    fairseq's own code is still in place, so a second call changes nothing."""
    for name in FIXES:
        importlib.import_module(f"{__name__}.{name}").apply()
