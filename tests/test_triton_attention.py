"""DMA's interpolated attention as Triton kernels (``--dma-backend triton``,
modules/interpolated_attention_triton.py), proven without a GPU.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py before anything imports triton), which executes the kernel code itself on CPU
tensors; with
``--torch-device cuda`` on a GPU machine the same tests run the compiled kernels.

* The kernels against the equations written out naively here (fp64: forward and all five
  gradients), against ``torch.autograd.gradcheck`` (fp64), with poisoned padded keys (huge
  finite keys, values and posteriors where the padding is), left and right padding, the causal
  mask, a generic 2-D mask, rows without any visible key, dropout (its keep mask read back from
  the kernels' Philox stream) and gamma 0, between and 1; fp16 inputs against fp64.
* The DMA module with backend "triton" against the eager module (the oracle): output, every
  regulariser and every parameter gradient in fp32, for each attention type, both objectives,
  both query-GMM inputs, dropout on and off (the eager module's dropout made equal to the
  kernels'), gamma 0 and > 0; and a whole model's loss and gradients through fairseq's criterion.
  The backend's forward is ``dma_compiled``'s graph with the kernels as operators
  (``triton_ops``); here the graph runs uncompiled (``dma_compiled.BACKEND = None``: the same
  operators, without inductor's minute of compiling), and once compiled by inductor (e2e tier).
  Where compiling fails the module runs its eager forward with all three kernel sets
  (``eager_glue``), which is tested too.
* What the path keeps and launches: no T x S tensor saved for backward, one kernel forward and
  two backward (counted, not timed), the flags and their errors.

Tolerances: fp64 1e-9 relative in the interpreter (which passes Python floats at full
precision) and 1e-6 on a GPU (whose kernels take gamma, the scale and p as fp32 arguments);
fp32 module comparisons as tests/test_dma_compiled.py's ``assert_matches`` (1e-5 of the
largest value, with its floors for differences of large terms).
"""

import contextlib
import sys

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

if sys.platform != "linux":
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")

import fairseq_modattn  # noqa: E402,F401  (registers the plugin)
from attention_helpers import causal_mask  # noqa: E402
from fairseq_modattn.modules import (  # noqa: E402
    dma_compiled,
    interpolated_attention,
    interpolated_attention_triton,
)
from fairseq_modattn.modules.interpolated_attention_triton import (  # noqa: E402
    KERNEL_EVENT_PREFIX,
    dropout_keep_mask,
    triton_interpolated_attention,
)
from fairseq_modattn.modules.triton_support import interpreting  # noqa: E402
from test_dma_compiled import KINDS, assert_matches, build, inputs, needs_inductor, require_inductor, step  # noqa: E402

FP64_RTOL = 1e-9 if interpreting() else 1e-6


# ----------------------------------------------------------------------------- the naive equations
def reference(q, k, v, post_q, post_k, pad=None, attn_mask=None, causal=False, gamma=0.5, keep=None, p=0.0):
    """out = drop((1 - gamma) softmax(S) + gamma softmax(S + log max(M, tiny))) V, written out;
    a query without any visible key gets 0 (the kernels' convention)."""
    s = q @ k.transpose(-1, -2) * q.size(-1) ** -0.5
    if attn_mask is not None:
        s = s + attn_mask
    if causal:
        s = s + causal_mask(q.size(2), s.dtype)
    if pad is not None:
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    m = post_q @ post_k.transpose(-1, -2)
    tiny = torch.finfo(torch.promote_types(q.dtype, torch.float32)).tiny
    seen = torch.isfinite(s).any(-1, keepdim=True)
    s = torch.where(seen, s, 0.0)  # rows without keys: any finite logits, zeroed below
    mixed = (1 - gamma) * s.softmax(-1) + gamma * (s + m.clamp_min(tiny).log()).softmax(-1)
    mixed = torch.where(seen, mixed, 0.0)
    if keep is not None:
        mixed = mixed * keep / (1 - p)
    return mixed @ v


def operands(bsz=2, heads=2, tgt_len=9, src_len=11, head_dim=16, clusters=4, dtype=torch.float64, device="cpu",
             pad=None, seed=0):
    """q, k, v and posteriors (requiring gradients); where ``pad`` (B, S) is True the keys,
    values and key posteriors are poisoned: huge but finite, as a real pad's never matter."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, tgt_len, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, heads, src_len, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, heads, src_len, head_dim, generator=g, dtype=torch.float64)
    post_q = torch.randn(bsz, heads, tgt_len, clusters, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    post_k = torch.randn(bsz, heads, src_len, clusters, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    if pad is not None:
        poisoned = pad[:, None, :, None]
        k, v = k.masked_fill(poisoned, 3e4), v.masked_fill(poisoned, -5e4)
        post_k = post_k.masked_fill(poisoned, 7.0)
    tensors = [t.to(device) for t in (q, k, v)] + [t.to(device) for t in (post_q, post_k)]
    tensors = [t.to(dtype) for t in tensors[:3]] + [t.to(torch.promote_types(dtype, torch.float32))
                                                    for t in tensors[3:]]
    return [t.requires_grad_() for t in tensors]


def mixed_padding(bsz, src_len):
    """Sentence 0 right-padded by 3, sentence 1 left-padded by 2 (fairseq pads sources left)."""
    pad = torch.zeros(bsz, src_len, dtype=torch.bool)
    pad[0, -3:] = True
    pad[1, :2] = True
    return pad


MASKS = {
    "none": dict(),
    "padding": dict(pad=True),
    "causal and padding": dict(pad=True, causal=True),
    "2-D mask": dict(attn_mask=True),
}


def mask_arguments(kind, bsz, tgt_len, src_len, device):
    spec = MASKS[kind]
    pad = mixed_padding(bsz, src_len) if spec.get("pad") else None
    attn_mask = None
    if spec.get("attn_mask"):
        g = torch.Generator().manual_seed(3)
        attn_mask = torch.randn(tgt_len, src_len, generator=g, dtype=torch.float64)
        attn_mask = attn_mask.masked_fill(torch.rand(tgt_len, src_len, generator=g) < 0.3, float("-inf"))
    return pad, attn_mask, spec.get("causal", False)


def gradients(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    return torch.autograd.grad((out * weights).sum(), tensors)


def assert_close(actual, expected, rtol, what):
    scale = max(expected.abs().max().item(), 1e-30)
    err = (actual.to(expected.dtype) - expected).abs().max().item()
    assert err <= rtol * scale, f"{what}: max error {err:.2e} = {err / scale:.1e} of {scale:.2e}"


@pytest.mark.parametrize("gamma", [0.0, 0.375, 1.0])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("masks", sorted(MASKS))
def test_kernels_compute_the_equations_in_fp64(masks, dropout_p, gamma, torch_device):
    bsz, tgt_len = 2, 9
    src_len = tgt_len if MASKS[masks].get("causal") else 11
    pad, attn_mask, causal = mask_arguments(masks, bsz, tgt_len, src_len, torch_device)
    tensors = operands(bsz, tgt_len=tgt_len, src_len=src_len, head_dim=12, device=torch_device, pad=pad)
    pad, attn_mask = (None if t is None else t.to(torch_device) for t in (pad, attn_mask))
    keep = None
    if dropout_p:
        keep = dropout_keep_mask(bsz, 2, tgt_len, src_len, dropout_p, 1234, torch_device)
        assert 0.6 < keep.float().mean().item() < 0.9  # the mask draws keep with probability 0.75
    out = triton_interpolated_attention(*tensors, pad, attn_mask, causal, gamma, dropout_p, seed=1234)
    expected = reference(*tensors, pad, attn_mask, causal, gamma, keep, dropout_p)
    assert_close(out, expected, FP64_RTOL, "output")
    for name, got, want in zip(("q", "k", "v", "P^q", "P^k"), gradients(out, tensors), gradients(expected, tensors)):
        assert torch.isfinite(got).all(), name
        assert_close(got, want, FP64_RTOL, f"gradient of {name}")


@pytest.mark.parametrize("masks, tgt_len, src_len, head_dim", [
    ("causal and padding", 70, 70, 16),  # three query and key blocks: the causal loops' bounds
    ("2-D mask", 40, 75, 16),
    ("padding", 37, 45, 100),  # heads padded to 128: that width's tiles (16 x 32 and 32 x 16)
])
def test_kernels_over_several_tiles_in_fp64(masks, tgt_len, src_len, head_dim, torch_device):
    bsz = 2
    pad, attn_mask, causal = mask_arguments(masks, bsz, tgt_len, src_len, torch_device)
    tensors = operands(bsz, tgt_len=tgt_len, src_len=src_len, head_dim=head_dim, device=torch_device, pad=pad)
    pad, attn_mask = (None if t is None else t.to(torch_device) for t in (pad, attn_mask))
    keep = dropout_keep_mask(bsz, 2, tgt_len, src_len, 0.25, 5, torch_device)
    out = triton_interpolated_attention(*tensors, pad, attn_mask, causal, 0.375, 0.25, seed=5)
    expected = reference(*tensors, pad, attn_mask, causal, 0.375, keep, 0.25)
    assert_close(out, expected, FP64_RTOL, "output")
    for name, got, want in zip(("q", "k", "v", "P^q", "P^k"), gradients(out, tensors), gradients(expected, tensors)):
        assert_close(got, want, FP64_RTOL, f"gradient of {name}")


@pytest.mark.parametrize("masks, dropout_p", [("causal and padding", 0.25), ("2-D mask", 0.0), ("padding", 0.0)])
def test_gradcheck_in_fp64(masks, dropout_p, torch_device):
    bsz, tgt_len = 2, 5
    src_len = tgt_len if MASKS[masks].get("causal") else 7
    pad, attn_mask, causal = mask_arguments(masks, bsz, tgt_len, src_len, torch_device)
    pad, attn_mask = (None if t is None else t.to(torch_device) for t in (pad, attn_mask))
    tensors = operands(bsz, tgt_len=tgt_len, src_len=src_len, head_dim=16, clusters=3, device=torch_device)

    def attention(*inputs):
        return triton_interpolated_attention(*inputs, pad, attn_mask, causal, 0.375, dropout_p, seed=77)

    assert torch.autograd.gradcheck(attention, tensors, fast_mode=True, atol=1e-8, rtol=1e-6)


def test_gradcheck_fails_a_wrong_backward(monkeypatch, torch_device):
    # the proof above can fail: a backward 0.1 % off in dP^k is caught
    q, k, v, post_q, post_k = operands(1, 1, 2, 3, 16, 2, device=torch_device)
    real_backward = interpolated_attention_triton.backward

    def skewed(*args):
        grads = list(real_backward(*args))
        grads[4] = grads[4] * 1.001
        return tuple(grads)

    monkeypatch.setattr(interpolated_attention_triton, "backward", skewed)
    with pytest.raises(GradcheckError):
        # with respect to P^k alone: a failing check computes the whole Jacobian for its message
        torch.autograd.gradcheck(lambda pk: triton_interpolated_attention(q, k, v, post_q, pk, None, None, False, 0.5),
                                 (post_k,), fast_mode=True, atol=1e-8, rtol=1e-6)


def test_queries_without_visible_keys_get_zero_and_finite_gradients(torch_device):
    # left padding under the causal mask: the first two queries of sentence 1 see no key
    pad = mixed_padding(2, 6).to(torch_device)
    tensors = operands(2, 2, 6, 6, 16, 3, device=torch_device, pad=pad.cpu())
    out = triton_interpolated_attention(*tensors, pad, None, True, 0.375)
    assert out[1, :, :2].abs().max().item() == 0.0
    grads = gradients(out, tensors)
    assert all(torch.isfinite(g).all() for g in grads)
    expected = reference(*tensors, pad, None, True, 0.375)
    assert_close(out, expected, FP64_RTOL, "output")


def test_half_precision_inputs_accumulate_in_fp32(torch_device):
    pad = mixed_padding(2, 11)
    exact = operands(2, 2, 9, 11, 32, 4, device=torch_device, pad=pad)
    half = [t.detach().to(torch.float16 if i < 3 else torch.float32).requires_grad_() for i, t in enumerate(exact)]
    pad = pad.to(torch_device)
    out = triton_interpolated_attention(*half, pad, None, False, 0.375)
    assert out.dtype == torch.float16
    # against fp64 of the same (rounded) inputs: what is left is the kernels' own rounding
    rounded = [t.detach().double().requires_grad_() for t in half]
    expected = reference(*rounded, pad, None, False, 0.375)
    assert_close(out.double(), expected, 2e-3, "fp16 output")
    got = gradients(out.float(), half)
    assert [g.dtype for g in got] == [torch.float16] * 3 + [torch.float32] * 2
    for name, g, w in zip(("q", "k", "v", "P^q", "P^k"), got, gradients(expected, rounded)):
        assert_close(g.double(), w, 5e-3, f"fp16 gradient of {name}")


def test_dropout_keeps_with_probability_one_minus_p_and_is_seeded(torch_device):
    first = dropout_keep_mask(2, 3, 40, 50, 0.3, 99, torch_device)
    assert abs(first.float().mean().item() - 0.7) < 0.02
    assert torch.equal(first, dropout_keep_mask(2, 3, 40, 50, 0.3, 99, torch_device))
    assert not torch.equal(first, dropout_keep_mask(2, 3, 40, 50, 0.3, 100, torch_device))
    # heads and sentences draw different masks
    assert not torch.equal(first[0, 0], first[0, 1]) and not torch.equal(first[0, 0], first[1, 0])


# ----------------------------------------------------------------------------- the module against eager
#: (objective, module kwargs): both objectives, and both query-GMM inputs (the authors' objective
#: clusters q / sqrt(d), the paper's q; the third case crosses them)
SETTINGS = [("authors", {}), ("paper", {}), ("paper", {"query_gmm_input": "scaled"})]


@pytest.fixture(autouse=True)
def uncompiled_graph():
    """The backend's graph (``dma_compiled.dma_math`` with the kernels' operators) run as it is,
    not compiled: every test here but those that ask inductor themselves."""
    previous = dma_compiled.BACKEND
    dma_compiled.BACKEND = None
    dma_compiled.reset()
    yield
    dma_compiled.BACKEND = previous
    dma_compiled.reset()


@pytest.fixture(params=["graph", "eager"])
def glue(request):
    """Around the kernels: the backend's graph ("graph"), or the eager module with all three
    kernel sets ("eager": what the backend runs where compiling failed)."""
    with dma_compiled.eager_forwards() if request.param == "eager" else contextlib.nullcontext():
        yield request.param


@pytest.fixture
def eager_glue():
    with dma_compiled.eager_forwards():
        yield


@pytest.fixture
def equal_dropout(monkeypatch):
    """The eager module's attention dropout drawn from the kernels' Philox stream with one key,
    so that the eager module (the oracle) and the kernels drop the same entries of A^."""
    seed = 4321
    for module in (interpolated_attention_triton, dma_compiled):  # the eager glue's key, the graph's
        monkeypatch.setattr(module, "draw_seed", lambda: seed)

    def drop(mixed, keep, dropout_p):
        bsz, heads, tgt_len, src_len = mixed.shape
        keep.copy_(dropout_keep_mask(bsz, heads, tgt_len, src_len, dropout_p, seed, mixed.device))
        return mixed.mul_(keep).mul_(1.0 / (1.0 - dropout_p))

    monkeypatch.setattr(interpolated_attention, "_drop_", drop)


def compare_with_eager(m, kind, device, num_updates=3000):
    m.set_num_updates(num_updates)
    # left padding under the causal mask leaves queries without keys, where the eager module
    # returns NaN and the kernels 0 (their own test above); fairseq pads targets on the right
    for padding in ("right",) if kind == "dec_self" else ("right", "left"):
        x, key, kpm, qpm, mask = inputs(kind, True, device=device)
        if padding == "left":
            kpm = kpm.flip(1)
            qpm = None if qpm is None else qpm.flip(1)
        args = (x, key, kpm, qpm, mask)
        assert_matches(step(m, False, kind, *args, backend="triton"), step(m, False, kind, *args), 1e-5)


@pytest.mark.parametrize("objective, settings", SETTINGS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_module_matches_the_eager_module(kind, objective, settings, torch_device):
    compare_with_eager(build(kind, objective, device=torch_device, **settings), kind, torch_device)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_module_with_eager_glue_matches_the_eager_module(kind, eager_glue, torch_device):
    compare_with_eager(build(kind, "authors", device=torch_device), kind, torch_device)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_module_with_dropout_matches_the_eager_module(kind, glue, equal_dropout, torch_device):
    # the eager module's fused CPU form drops A^, as the kernels do (on CUDA its default form
    # would be two SDPA calls dropping A and A~ apart)
    m = build(kind, "authors", device=torch_device, dropout=0.2, attention_impl="fused")
    compare_with_eager(m, kind, torch_device)


def test_module_at_gamma_zero_is_plain_attention_on_both_paths(glue, torch_device):
    m = build("dec_self", "paper", device=torch_device)
    compare_with_eager(m, "dec_self", torch_device, num_updates=0)
    assert m.gamma == 0.0


def test_whole_model_loss_and_gradients_equal_eager_through_the_criterion(tiny_model, glue, equal_dropout):
    from fairseq_modattn.criterions.label_smoothed_cross_entropy_with_aux import (
        LabelSmoothedCrossEntropyWithAuxCriterion,
    )
    from test_architectures import SMALL

    # Attention dropout with the eager glue only: fairseq's last decoder layer asks its
    # encoder-decoder attention for weights in training, which the graph then computes without
    # the kernels, drawing its dropout from torch's generator, not from the kernels' Philox
    # stream (the graph's dropout with the kernels: test_module_with_dropout_matches_...[graph-*])
    dropout = "0.1" if glue == "eager" else "0.0"
    model, d, task, _ = tiny_model("dma_transformer_iwslt_de_en_tiny", *SMALL, "--attention-dropout", dropout)
    model.train()
    model.set_num_updates(1500)
    pad, eos = d.pad(), d.eos()
    sample = {
        "net_input": {"src_tokens": torch.tensor([[5, 6, 7, 8, eos], [pad, pad, 9, 10, eos]]),
                      "src_lengths": torch.tensor([5, 3]),
                      "prev_output_tokens": torch.tensor([[eos, 11, 12, 13], [eos, 14, pad, pad]])},
        "target": torch.tensor([[11, 12, 13, eos], [14, eos, pad, pad]]),
        "ntokens": 6,
    }
    criterion = LabelSmoothedCrossEntropyWithAuxCriterion(task, sentence_avg=False, label_smoothing=0.1)
    # the model's other dropouts draw from torch's generator in the same order on both paths;
    # the attention dropout is the kernels' Philox with one key on both (``equal_dropout``)
    results = {}
    for backend in ("triton", "eager"):
        for m in model.dma_modules():
            m.backend = backend
        model.zero_grad(set_to_none=True)
        torch.manual_seed(11)
        loss, _, logging = criterion(model, sample)
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (loss, grads), (loss_e, grads_e) = results["triton"], results["eager"]
    torch.testing.assert_close(loss, loss_e, rtol=1e-6, atol=0.0)
    scale = max(g.abs().max().item() for g in grads_e.values())
    for name, g in grads_e.items():
        assert (grads[name] - g).abs().max().item() <= 1e-5 * scale, name


# ----------------------------------------------------------------------------- what the path runs and keeps
def triton_step_and_events(kernel_calls, m, kind, backend, device):
    """The kernel calls (``benchmarks/kernel_calls.py``) of one training step of ``m``."""
    args = inputs(kind, True, device=device)
    return kernel_calls.count_kernel_calls(lambda: step(m, False, kind, *args, backend=backend))


#: the kernel launches of one training step of one module: the attention and L_Dxq's critic
#: (infonce_triton) in both glues, and the token and query GMMs' passes (mixture_triton): in the
#: eager glue forward and backward, both sides' inputs of encoder-decoder attention clustered in
#: one token-GMM call; in the graph the backward only (inductor fuses the forward), a call a side
KERNEL_LAUNCHES = {"interpolated_attention_forward": 1, "interpolated_attention_backward_queries": 1,
                   "interpolated_attention_backward_keys": 1, "infonce_forward": 1, "infonce_backward": 1}


def expected_launches(kind, glue):
    if glue == "eager":
        return {**KERNEL_LAUNCHES, "gmm_forward": 2, "gmm_backward": 2}
    return {**KERNEL_LAUNCHES, "gmm_backward": 3 if kind == "enc_dec" else 2}
#: none of the eager attention's operators: no dropout draw, no T x S product, no (B, 1, T, S)
#: mask assembled from the padding (the regularisers have softmaxes of their own)
EAGER_ATTENTION_OPS = ("aten::rand", "aten::bmm", "aten::masked_fill",
                       "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention")


def kernel_events(counts):
    return {name[len(KERNEL_EVENT_PREFIX):]: n for name, n in counts.items() if name.startswith(KERNEL_EVENT_PREFIX)}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_step_launches_the_kernels_once_each(kind, glue, kernel_calls, torch_device):
    m = build(kind, "authors", device=torch_device, dropout=0.1)
    counts = triton_step_and_events(kernel_calls, m, kind, "triton", torch_device)
    assert kernel_events(counts) == expected_launches(kind, glue), counts
    assert not [name for name in EAGER_ATTENTION_OPS if counts.get(name)], counts
    if glue == "eager":  # the graph's count is the compiled graph's (test_compiled_graph_with_the_kernels_...)
        eager = triton_step_and_events(kernel_calls, m, kind, "eager", torch_device)
        assert sum(counts.values()) < sum(eager.values())


@needs_inductor
def test_compiled_graph_with_the_kernels_matches_eager_and_launches_less(kernel_calls, equal_dropout, torch_device):
    # the backend as it trains: dma_math compiled by inductor around the kernels' operators; the
    # decoder's self-attention (causal mask as a rule, padding, dropout) is its fullest graph
    require_inductor(torch_device)
    dma_compiled.BACKEND = "inductor"
    dma_compiled.reset()
    import torch._inductor.config as inductor_config

    m = build("dec_self", "authors", device=torch_device, dropout=0.1, attention_impl="fused")
    with inductor_config.patch(fallback_random=True):
        compare_with_eager(m, "dec_self", torch_device)
        assert not dma_compiled.compile_failed()
        counts = triton_step_and_events(kernel_calls, m, "dec_self", "triton", torch_device)
    assert kernel_events(counts) == expected_launches("dec_self", "graph"), counts
    assert not [name for name in EAGER_ATTENTION_OPS if counts.get(name)], counts
    with dma_compiled.eager_forwards():  # the eager glue, for comparison
        eager_glue = triton_step_and_events(kernel_calls, m, "dec_self", "triton", torch_device)
    assert sum(counts.values()) < sum(eager_glue.values()) / 2, (counts, eager_glue)


def test_no_token_pair_table_is_kept_for_backward(glue, torch_device):
    # the decoder's self-attention with dropout and padding: the eager module keeps the (B, H, T,
    # S) keep mask (and the fused form's inputs); the kernels keep per-token tensors only
    m = build("dec_self", "authors", device=torch_device, dropout=0.2, attention_impl="fused")
    x, key, kpm, qpm, mask = inputs("dec_self", True, tgt_len=11, device=torch_device)
    tables = {}
    for backend in ("triton", "eager"):
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(m, False, "dec_self", x, key, kpm, qpm, mask, backend=backend)
        tables[backend] = [s for s in shapes if len(s) >= 2 and s[-2:] == (11, 11)]
    assert tables["triton"] == []
    assert tables["eager"], "the eager module keeps its dropout mask: the check can see a table"


@pytest.fixture
def kernel_runs(monkeypatch):
    """How many times the kernels' forward ran since the fixture was set up."""
    runs = []
    real = interpolated_attention_triton.forward

    def counted(*args):
        runs.append(1)
        return real(*args)

    monkeypatch.setattr(interpolated_attention_triton, "forward", counted)
    return runs


def test_evaluation_and_incremental_decoding_take_the_eager_path(kernel_runs, torch_device):
    from fairseq_modattn.modules.attention_base import MultiheadAttentionBase  # noqa: F401

    m = build("dec_self", "authors", device=torch_device)
    x, key, kpm, qpm, mask = inputs("dec_self", False, device=torch_device)
    m.backend = "triton"
    m.eval()
    with torch.no_grad():
        out, _ = m(x, x, x, attn_mask=mask, need_weights=False)
        m.backend = "eager"
        out_e, _ = m(x, x, x, attn_mask=mask, need_weights=False)
        torch.testing.assert_close(out, out_e, rtol=0, atol=0)
        m.backend = "triton"
        state: dict = {}
        steps = [m(x[i:i + 1], x[i:i + 1], x[i:i + 1], incremental_state=state, need_weights=False)[0]
                 for i in range(x.size(0))]
    torch.testing.assert_close(torch.cat(steps), out_e, rtol=1e-5, atol=1e-6)
    m.train()
    step(m, False, "dec_self", *inputs("dec_self", True, device=torch_device), backend="triton")
    assert len(kernel_runs) == 1  # training only, and every training forward


def test_a_cpu_without_the_interpreter_trains_not_but_evaluates(monkeypatch):
    # a model trained with the kernels on a GPU is evaluated and decodes anywhere, eagerly
    m = build("enc_self", "paper")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, _, kpm, _, _ = inputs("enc_self", True)
    m.backend = "triton"
    m.eval()
    with torch.no_grad():
        out, _ = m(x, x, x, key_padding_mask=kpm, need_weights=False)
    assert torch.isfinite(out).all()
    with pytest.raises(RuntimeError, match=r"--dma-backend triton runs on CUDA devices; this model is on cpu"):
        step(m, False, "enc_self", *inputs("enc_self", True), backend="triton")


def test_the_backend_flag_reaches_every_module_and_dma_compile_stays_its_alias(tiny_model):
    from test_architectures import SMALL
    from tiny_models import model_args

    arch = "dma_transformer_iwslt_de_en_tiny"
    for flags, backend in (((), "auto"), (("--dma-backend", "triton"), "triton"), (("--dma-compile",), "compile"),
                           (("--dma-backend", "compile", "--dma-compile"), "compile"),
                           (("--dma-backend", "eager"), "eager")):
        model = tiny_model(arch, *SMALL, *flags).model
        assert {m.backend for m in model.dma_modules()} == {backend}, flags
    with pytest.raises(ValueError, match="--dma-compile is --dma-backend compile, which contradicts "
                                         "--dma-backend triton"):
        tiny_model(arch, *SMALL, "--dma-compile", "--dma-backend", "triton")
    with pytest.raises(SystemExit):  # argparse's own refusal of an unknown choice
        model_args(arch, *SMALL, "--dma-backend", "cuda")
