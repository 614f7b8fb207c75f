"""What DMA's SDPA path (the CUDA default, here forced on the CPU) keeps for backward: of the
B x H x T x S tables, only what its biased SDPA call keeps itself; the log mask keeps none
(``interpolated_attention._LogMask`` recomputes M from the posteriors)."""

import torch
import torch.nn.functional as F

import fairseq_modattn  # noqa: F401
from fairseq_modattn.modules import DisentangledMaskAttention

T, B, E, H = 6, 3, 16, 2


def saved_tables(fn, numel):
    """How many distinct storages of ``numel`` elements autograd saves while ``fn`` runs."""
    storages = set()

    def pack(t):
        if t.numel() == numel:
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, len(storages)


def test_log_mask_keeps_no_table_beyond_the_sdpa_call():
    torch.manual_seed(0)
    table = B * H * T * T
    q, k, v = (torch.randn(B, H, T, E // H, requires_grad=True) for _ in range(3))
    bias = torch.randn(B, H, T, T, requires_grad=True)
    _, sdpa_alone = saved_tables(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), table)

    m = DisentangledMaskAttention(E, H, num_clusters=3, self_attention=True, attention_impl="sdpa").train()
    m.set_num_updates(3000)  # gamma > 0: the masked call runs
    x = torch.randn(T, B, E, requires_grad=True)
    out, module = saved_tables(lambda: m(x, x, x, need_weights=False)[0], table)
    assert module == sdpa_alone
    out.sum().backward()  # and backward recomputes what it needs
    assert torch.isfinite(x.grad).all() and m.token_gmm.means.grad.abs().max() > 0
