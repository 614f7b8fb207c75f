"""Fix 5: per-head attention weights from fairseq's ``MultiheadAttention`` for the analysis.

fairseq 0.12 ``MultiheadAttention.forward`` hands the whole computation to
``F.multi_head_attention_forward`` whenever there is no incremental state and no ``static_kv``;
that path returns head-AVERAGED weights even with ``need_head_weights=True`` and applies
``q_proj`` by its weight, not as a module. The analysis code (per-head redundancy, queries) needs
fairseq's own per-head path for the duration of one analysis forward:
``fairseq_attention_per_head_path`` turns the fast path off for one module by setting the
instance flag fairseq checks (``skip_embed_dim_check``, whose only other effect is to skip an
input-width assert) and restores it afterwards. Nothing global is changed, so ``apply`` does
nothing; the fix is listed in ``compat.FIXES`` to keep all fixes in one numbered list.

When it can go: the context manager leaves a module alone that is not a fairseq
``MultiheadAttention`` or has no ``skip_embed_dim_check`` (the flag it relies on); it is needed
as long as fairseq's fast path returns head-averaged weights under ``need_head_weights=True``.
"""

from contextlib import contextmanager


@contextmanager
def fairseq_attention_per_head_path(module):
    """Within the block, ``module`` (a fairseq ``MultiheadAttention``) takes fairseq's own
    implementation, which honours ``need_head_weights``."""
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


def apply() -> None:
    """Nothing to install: the path is switched per module, inside the analysis forward."""
