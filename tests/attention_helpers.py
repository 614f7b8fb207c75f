"""Small builders shared by the attention tests (DMA, talking heads, TIM): fairseq's masks, a
randomised DMA module and a small DMA model, the naive GMM posterior, inputs of the MI bounds,
and step-by-step decoding with a beam reorder, checked against the full forward.

Like ``cli_checks.py`` and ``beam_search_checks.py`` this is no test file; the tests import it
as they import ``conftest`` (tests/ has no ``__init__.py``, so pytest puts it on ``sys.path``).
"""

import math
from types import SimpleNamespace

import torch

from fairseq_modattn.modules import DisentangledMaskAttention

DOUBLE = torch.float64  # the naive references compute in float64


# ----------------------------------------------------------------------------- masks
def causal_mask(length, dtype=torch.float32):
    """fairseq's decoder future mask (``buffered_future_mask``): -inf above the diagonal."""
    return torch.triu(torch.full((length, length), float("-inf"), dtype=dtype), 1)


def padding(lengths, max_len):
    """(B, N) bool key-padding mask, True on right padding."""
    return torch.arange(max_len).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)


# ----------------------------------------------------------------------------- modules
def randomise_biases(m, std=0.1):
    """Non-zero q/k/v/out projection biases (fairseq initialises them to 0, which would hide a
    bias that is dropped or applied twice)."""
    for p in (m.q_proj.bias, m.k_proj.bias, m.v_proj.bias, m.out_proj.bias):
        p.normal_(0, std)


def _randomise_token_gmm(m):
    m.token_gmm.logits.normal_()
    m.token_gmm.log_vars.uniform_(-0.5, 0.5)


def _randomise_query_gmm(m):
    m.query_gmm.logits.normal_()


_RANDOMISERS = {"biases": randomise_biases, "token_gmm": _randomise_token_gmm, "query_gmm": _randomise_query_gmm}


def make_dma(seed=0, *, embed_dim=16, heads=2, clusters=3, num_updates=0,
             randomise=("biases", "token_gmm", "query_gmm"), **kwargs):
    """A small DisentangledMaskAttention (``kwargs`` go to its constructor) after
    ``torch.manual_seed(seed)``, with ``set_num_updates(num_updates)``, in train mode.

    ``randomise`` names the parameters drawn at random on top of the module's initialisation
    (uniform mixture weights and unit variances would hide errors in them), in the order they
    are drawn: "biases" (the projections'), "token_gmm" (mixture logits and log-variances),
    "query_gmm" (mixture logits). The order decides which random numbers each part gets, so
    every test keeps the module its tolerances were set against.
    """
    torch.manual_seed(seed)
    m = DisentangledMaskAttention(embed_dim, heads, num_clusters=clusters, **kwargs)
    with torch.no_grad():
        for part in randomise:
            _RANDOMISERS[part](m)
    m.set_num_updates(num_updates)
    return m


#: a 2 + 2-layer dma_transformer of make_dma's width (16) and heads (2) with 3 clusters and dropout
SMALL_DMA_MODEL = [
    "--source-lang", "de", "--target-lang", "en", "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "16", "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32",
    "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--dma-clusters", "3", "--dropout", "0.1", "--attention-dropout", "0.1",
]


def small_dma_model(tiny_model, *flags, seed=0):
    """``tiny_model`` (conftest's fixture) of SMALL_DMA_MODEL and FLAGS, its mixture weights
    drawn at random (uniform ones would hide errors in them): (model, dictionary, task, args)."""
    built = tiny_model("dma_transformer", *SMALL_DMA_MODEL, *flags, seed=seed)
    with torch.no_grad():
        for m in built.model.dma_modules():
            m.token_gmm.logits.normal_()
            m.query_gmm.logits.normal_()
    return built


# ----------------------------------------------------------------------------- references
def naive_posterior(z, gmm):
    """p(c | z) by explicit broadcasting over (..., G, N, C, d) and explicit exp / sum
    normalisation in float64 (no code path shared with ``DiagonalGMM``):
    z (B, G, N, d) -> (B, G, N, C)."""
    z = z.to(DOUBLE)
    means = gmm.means.detach().to(DOUBLE)  # (G, C, d)
    log_vars = gmm.log_vars.detach().to(DOUBLE)
    pi = torch.exp(gmm.logits.detach().to(DOUBLE))
    pi = pi / pi.sum(-1, keepdim=True)  # (G, C)
    diff = z.unsqueeze(-2) - means.unsqueeze(-3)  # (B, G, N, C, d)
    log_density = (-0.5 * (math.log(2 * math.pi) + log_vars.unsqueeze(-3)
                           + diff**2 / log_vars.exp().unsqueeze(-3))).sum(-1)
    joint = pi.unsqueeze(-2) * torch.exp(log_density)
    return joint / joint.sum(-1, keepdim=True)


def loss_inputs(seed, lengths, heads=3, max_len=5, num_c=4):
    """(log p(q, c), log Q, valid) for the MI bounds: float64 random joints of ``len(lengths)``
    right-padded sentences, and a posterior drawn independently of them (so that neither bound
    is trivially 0)."""
    torch.manual_seed(seed)
    log_joint = 2.0 * torch.randn(len(lengths), heads, max_len, num_c, dtype=DOUBLE) - 3.0
    log_post = torch.log_softmax(log_joint + torch.randn_like(log_joint), -1)
    return log_joint, log_post, ~padding(lengths, max_len)


def real_tokens(valid, b):
    """Positions of sentence ``b``'s real (not padding) tokens."""
    return [i for i in range(valid.size(1)) if valid[b, i]]


# ----------------------------------------------------------------------------- decoding
def decode_incrementally(model, encoder_out, prev_ref, prev_first, t0, new_order):
    """Step-by-step decoder outputs and alignments of a fairseq encoder-decoder model; the steps
    up to ``t0`` read ``prev_first``, the later ones ``prev_ref``, and after step ``t0`` the beams
    are reordered with ``new_order`` (encoder output and incremental state alike)."""
    inc, outs, attns = {}, [], []
    for t in range(prev_ref.size(1)):
        tokens = prev_first if t <= t0 else prev_ref
        logits, extra = model.decoder(tokens[:, : t + 1], encoder_out=encoder_out, incremental_state=inc)
        outs.append(logits)
        attns.append(extra["attn"][0])
        if t == t0:
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
            model.decoder.reorder_incremental_state_scripting(inc, new_order)
    return outs, attns


def check_incremental_decoding(model, dictionary):
    """A fairseq encoder-decoder MODEL (in eval mode) decodes step by step as in one full forward,
    outputs and alignments alike, through a beam reorder after step 2 (with a duplicated beam).

    Two left-padded sentences of 6 random tokens, 2 beams each (the encoder output expanded to
    the beams as fairseq's SequenceGenerator does), 5 decoder steps; ``decode_incrementally``
    reads the tokens before the reorder in the beams' old order. Returns the
    ``SimpleNamespace(encoder_out, prev, prev_ref, t0, full)`` of the check, for more checks on it.
    """
    n_sent, beam, steps, t0 = 2, 2, 5, 2
    torch.manual_seed(1)
    src = torch.randint(4, len(dictionary), (n_sent, 6))
    src[1, :2] = dictionary.pad()  # left-padded source (fairseq's default)
    prev = torch.randint(4, len(dictionary), (n_sent * beam, steps))
    prev[:, 0] = dictionary.eos()
    new_order = torch.tensor([1, 1, 3, 2])  # within each sentence's beams, with a duplicate
    prev_ref = prev.clone()
    prev_ref[:, : t0 + 1] = prev[new_order, : t0 + 1]
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=torch.tensor([6, 4]))
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, torch.arange(n_sent).repeat_interleave(beam))
        full, full_extra = model.decoder(prev_ref, encoder_out=encoder_out)
        outs, attns = decode_incrementally(model, encoder_out, prev_ref, prev, t0, new_order)
    assert full_extra["attn"][0] is not None
    for t in range(steps):
        got = outs[t][new_order] if t <= t0 else outs[t]
        attn = attns[t][new_order] if t <= t0 else attns[t]
        torch.testing.assert_close(got, full[:, t : t + 1], rtol=1e-4, atol=1e-5, msg=f"step {t}")
        torch.testing.assert_close(attn, full_extra["attn"][0][:, t : t + 1], rtol=1e-4, atol=1e-5)
    return SimpleNamespace(encoder_out=encoder_out, prev=prev, prev_ref=prev_ref, t0=t0, full=full)
