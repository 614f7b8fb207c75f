"""The compiled DMA path (``--dma-compile``, modules/dma_compiled.py) against the eager module.

Every comparison runs a training forward and backward of the same module twice from the same
seed, eagerly and through the compiled path (whose random draws are made in the eager order,
outside the graph on the CPU path, inside it on the GPU path where it can; attention dropout and
those draws inside it draw through ATen with ``torch._inductor.config.fallback_random``), and
compares the output, every regulariser of ``aux_losses`` and the gradient of every parameter
and input.

Tolerances. fp64 (``dma_math`` uncompiled): 1e-10 relative, the restated math is the eager
module's. fp32: |compiled - eager| <= 1e-5 max(max |eager|, floor) per tensor, with two floors
for values that are small differences of large terms, whose fp32 rounding is of the terms'
size: a gradient's floor is 1e-2 of the largest gradient of the module; a regulariser's floor is
1 (L_Dxq = log n + mean_i (f_ii - log sum_j exp f_ij) is a difference of terms of size log n).
The k projection's bias has the exact gradient 0 (softmax ignores a shift of a row of logits):
each side must be 0 within 1e-5 of the largest gradient, as the two sides' rounding need not
agree (on an H200 the memory-efficient SDPA kernel's and the graph's differed by 1.1e-5 of the
floor).

Compiling takes time on a small CPU (on 2 cores: dynamo and AOTAutograd about 20 s per module
configuration, inductor's C++ kernels a minute or two more), so the default suite compiles with
the "aot_eager_decomp_partition" backend (the graphs and the backward that AOTAutograd derives,
with inductor's decompositions and its split of forward and backward, run by ATen: one compile
per configuration checks both the numbers and what is kept for backward; the recompile check uses
plain "aot_eager") and the inductor comparisons are marked slow (``-m slow``).

The comparisons run on ``--torch-device`` (default cpu; ``--torch-device cuda`` on a GPU machine,
where inductor writes Triton kernels). On CUDA the eager module's default attention is two SDPA
calls whose dropout is drawn inside the kernel, on A and A~ separately; the graph drops A^ as the
fused CPU form does, so a comparison with dropout builds the eager module with that form there.
"""

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch

import fairseq_modattn  # noqa: F401  (registers the plugin)
from attention_helpers import causal_mask, make_dma, padding
from fairseq_modattn.modules import device_paths, dma_compiled
from fairseq_modattn.modules.dma_attention import AUX_LOSS_NAMES

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: the objective's settings: the authors' code ("attention" sampling, scaled query GMM, bounded
#: L_Dqq, entrywise L_dv, per-sentence values) and the paper's text (the module's defaults)
OBJECTIVES = {
    "authors": dict(sample_inputs="attention", query_gmm_input="scaled", qq_form="bounded",
                    div_form="entrywise", per_sentence_losses=True),
    "paper": {},
}
CPU = torch.device("cpu")
KINDS = {"enc_self": dict(self_attention=True), "dec_self": dict(self_attention=True),
         "enc_dec": dict(encoder_decoder_attention=True)}

compile_works = hasattr(torch, "compile") and torch._dynamo.is_dynamo_supported()
_skip_without_compile = pytest.mark.skipif(
    not compile_works, reason="torch.compile is not supported on this Python/torch")
_has_cxx = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
_skip_without_cxx = pytest.mark.skipif(
    not compile_works or not _has_cxx, reason="inductor needs a C++ compiler on the CPU")


def require_inductor(device):
    """Skip where inductor cannot build kernels for ``device``: C++ on the CPU, Triton on CUDA."""
    if not compile_works:
        pytest.skip("torch.compile is not supported on this Python/torch")
    if device.type == "cpu" and not _has_cxx:
        pytest.skip("inductor needs a C++ compiler on the CPU")


# Compiling takes seconds to a minute a graph, and inductor compiles in worker processes: the
# tests that compile belong to the e2e tier (tests/tiers.py).
def needs_compile(test):
    return pytest.mark.e2e(_skip_without_compile(test))


def needs_cxx(test):
    return pytest.mark.e2e(_skip_without_cxx(test))


def needs_inductor(test):  # the test calls require_inductor(torch_device)
    return pytest.mark.e2e(_skip_without_compile(test))


@pytest.fixture
def backend(request):
    """Compile ``dma_math`` with the backend the test names (``indirect`` parameter); dynamo's
    cache is cleared when the backend changes, as its entries of one backend count against the
    recompile limit of the others."""
    name = request.param
    previous = dma_compiled.BACKEND
    if name != previous:
        torch._dynamo.reset()
    dma_compiled.BACKEND = name
    dma_compiled.reset()
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fallback_random=True):
        yield name
    dma_compiled.BACKEND = previous
    dma_compiled.reset()


def build(kind, objective, dtype=torch.float32, device=CPU, **kwargs):
    if device.type == "cuda" and kwargs.get("dropout", 0.0) > 0.0:
        kwargs.setdefault("attention_impl", "fused")  # the graph's dropout (module docstring)
    m = make_dma(1, embed_dim=32, heads=4, clusters=4, num_updates=3000, centroid_grad_mult=3.0,
                 **KINDS[kind], **{**OBJECTIVES[objective], **kwargs}).to(device=device, dtype=dtype)
    return m


def inputs(kind, padded, dtype=torch.float32, bsz=3, tgt_len=7, src_len=9, seed=0, batch_major=False,
           device=CPU):
    """query input, key input, key padding, query padding (encoder-decoder) and attn_mask, drawn
    on the CPU and moved to ``device``; ``batch_major``: the query input a (T, B, E) view of a
    (B, T, E) tensor, as fairseq's first encoder and decoder layers read it."""
    g = torch.Generator().manual_seed(seed)
    src_len = tgt_len if kind != "enc_dec" else src_len
    if batch_major:
        x = torch.randn(bsz, tgt_len, 32, generator=g, dtype=dtype).to(device).transpose(0, 1)
    else:
        x = torch.randn(tgt_len, bsz, 32, generator=g, dtype=dtype).to(device)
    key = x if kind != "enc_dec" else torch.randn(src_len, bsz, 32, generator=g, dtype=dtype).to(device)
    kpm = padding([src_len] + [src_len - 2 - i for i in range(bsz - 1)], src_len) if padded else None
    qpm = padding([tgt_len, 2] + [tgt_len - 1] * (bsz - 2), tgt_len) if padded and kind == "enc_dec" else None
    mask = causal_mask(tgt_len, dtype) if kind == "dec_self" else None
    kpm, qpm, mask = (None if t is None else t.to(device) for t in (kpm, qpm, mask))
    return x, key, kpm, qpm, mask


def step(m, compiled, kind, x, key, kpm, qpm, mask, seed=5, backend=None, **forward_kwargs):
    """One training forward and backward from ``seed``: (output, weights, aux_losses, gradients);
    ``backend``: the module's backend instead of "compile" or "eager" by ``compiled``."""
    m.backend = backend or ("compile" if compiled else "eager")
    m.train()
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()  # clone keeps the layout
    key = x if kind != "enc_dec" else key.detach().clone().requires_grad_()
    m.collect_aux, m.query_padding_mask = True, qpm
    torch.manual_seed(seed)
    forward_kwargs = {"need_weights": False, **forward_kwargs}
    out, weights = m(x, key, key, key_padding_mask=kpm, attn_mask=mask, **forward_kwargs)
    aux = dict(m.aux_losses)
    m.collect_aux, m.query_padding_mask, m.aux_losses = False, None, None
    g = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).sum()
    loss = loss + sum((i + 1.0) * v.sum() for i, v in enumerate(aux.values()))
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=g, dtype=weights.dtype).to(weights.device)).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    grads["input"] = x.grad.clone()
    if kind == "enc_dec":
        grads["key input"] = key.grad.clone()
    return out.detach(), None if weights is None else weights.detach(), aux, grads


#: gradients that are 0 in exact arithmetic: the keys' bias b adds q_i . b to every logit of row i,
#: which the softmax ignores (the token GMM clusters the layer's input, not the keys), so each
#: side holds only the rounding of its own kernel's cancelling terms
EXACT_ZERO_GRADIENTS = ("k_proj.bias",)


def assert_matches(compiled, eager, rtol, floors=True, grad_floor=1e-2):
    """Every tensor of ``compiled`` within ``rtol`` of ``eager`` (floors: module docstring); the
    gradients of EXACT_ZERO_GRADIENTS each within ``rtol`` of 0 on the gradients' scale. All the
    mismatches are reported at once."""
    out, weights, aux, grads = compiled
    out_e, weights_e, aux_e, grads_e = eager
    errors = []

    def close(name, a, b, floor=0.0):
        scale = max(b.abs().max().item(), floor)
        err = (a - b).abs().max().item()
        if not err <= rtol * scale:
            errors.append(f"{name}: max error {err:.2e}, {err / scale:.1e} of {scale:.2e}")

    close("output", out, out_e)
    if weights_e is not None:
        close("weights", weights, weights_e)
    assert set(aux) == set(aux_e) == set(AUX_LOSS_NAMES)
    for name in AUX_LOSS_NAMES:
        close(f"aux {name}", aux[name], aux_e[name], 1.0 if floors else 0.0)
    assert set(grads) == set(grads_e)
    grad_scale = max(g.abs().max().item() for g in grads_e.values())
    for name in grads_e:
        if floors and name in EXACT_ZERO_GRADIENTS:
            for side, g in (("compiled", grads[name]), ("eager", grads_e[name])):
                size = g.abs().max().item()
                if not size <= rtol * grad_scale:
                    errors.append(f"gradient of {name} ({side}): {size:.2e}, not 0 within {rtol:.0e} of "
                                  f"{grad_scale:.2e}")
        else:
            close(f"gradient of {name}", grads[name], grads_e[name], grad_floor * grad_scale if floors else 0.0)
    assert not errors, "\n".join(errors)


# ----------------------------------------------------------------------------- the math itself, fp64
@pytest.mark.parametrize("backend", [None], indirect=True)
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_restated_math_equals_the_module_in_fp64(backend, kind, objective, torch_device):
    m = build(kind, objective, torch.float64, torch_device)
    for padded, batch_major in ((False, False), (True, False), (True, True)):
        args = inputs(kind, padded, torch.float64, batch_major=batch_major, device=torch_device)
        assert_matches(step(m, True, kind, *args), step(m, False, kind, *args), 1e-10)


@pytest.mark.parametrize("backend", [None], indirect=True)
def test_restated_math_with_dropout_weights_and_gamma_zero_in_fp64(backend, torch_device):
    # attention dropout draws in the graph, as the fused kernel draws (one block of sentences)
    m = build("dec_self", "authors", torch.float64, torch_device, dropout=0.2)
    args = inputs("dec_self", True, torch.float64, device=torch_device)
    assert_matches(step(m, True, "dec_self", *args), step(m, False, "dec_self", *args), 1e-10)
    # the per-head weights and their mean, which fairseq's alignment layer asks for
    m = build("enc_dec", "paper", torch.float64, torch_device)
    args = inputs("enc_dec", True, torch.float64, device=torch_device)
    for weights in ({"need_head_weights": True}, {"need_weights": True}):
        assert_matches(step(m, True, "enc_dec", *args, **weights), step(m, False, "enc_dec", *args, **weights),
                       1e-10)
    # gamma = 0 (the first update): the graph mixes in the mask with weight 0, the eager module
    # runs plain attention
    m.set_num_updates(0)
    assert m.gamma == 0.0
    assert_matches(step(m, True, "enc_dec", *args), step(m, False, "enc_dec", *args), 1e-10)


#: (objective, module kwargs, whether the graph draws the noise on the GPU path): the authors'
#: "attention" sampling; the same with CLUB's negatives, drawn after the noise; the paper's
#: "gmm" sampling, whose draws are the token GMM's own
GPU_PATH_DRAWS = [("authors", {}, True), ("authors", {"qq_form": "club"}, False), ("paper", {}, False)]


@pytest.mark.parametrize("backend", [None], indirect=True)
@pytest.mark.parametrize("objective, module_kwargs, in_graph", GPU_PATH_DRAWS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_restated_math_on_the_gpu_path_draws_the_eager_modules_noise_in_fp64(backend, kind, objective,
                                                                              module_kwargs, in_graph):
    # the CUDA path emulated on the CPU: the eager module draws with torch's generator, and the
    # graph draws the same values in the same order itself where it can (MathConfig.draws_noise)
    m = build(kind, objective, torch.float64, **module_kwargs)
    with device_paths.emulate("cuda"):
        for padded, batch_major in ((False, False), (True, False), (True, True)):
            args = inputs(kind, padded, torch.float64, batch_major=batch_major)
            assert_matches(step(m, True, kind, *args), step(m, False, kind, *args), 1e-10)
    assert [cfg.draws_noise for cfg in dma_compiled._State.compiled] == [in_graph]
    # on the CPU path the draws are the native generator's, outside the graph
    step(m, True, kind, *inputs(kind, True, torch.float64))
    assert [cfg.draws_noise for cfg in dma_compiled._State.compiled] == [in_graph, False][:1 + in_graph]


# ----------------------------------------------------------------------------- compiled, fp32
#: (kind, objective, forward kwargs, module kwargs): each attention type, both objectives, the
#: weights fairseq's alignment layer asks for and attention dropout, in four graphs
CASES = [
    ("enc_self", "authors", {}, {}),
    ("dec_self", "paper", {}, {"dropout": 0.1}),
    ("enc_dec", "authors", {}, {}),
    ("enc_dec", "paper", {"need_head_weights": True}, {}),
]


def compare_compiled(kind, objective, forward_kwargs, module_kwargs, device):
    m = build(kind, objective, device=device, **module_kwargs)
    for padded, batch_major in ((False, False), (True, False), (True, True)):
        args = inputs(kind, padded, batch_major=batch_major, device=device)
        assert_matches(step(m, True, kind, *args, **forward_kwargs), step(m, False, kind, *args, **forward_kwargs),
                       1e-5)


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
@pytest.mark.parametrize("kind, objective, forward_kwargs, module_kwargs", CASES)
def test_inductor_matches_eager(backend, kind, objective, forward_kwargs, module_kwargs, torch_device):
    require_inductor(torch_device)
    compare_compiled(kind, objective, forward_kwargs, module_kwargs, torch_device)


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
def test_inductor_draws_the_noise_in_its_kernels_on_the_gpu_path(backend, kernel_calls):
    # the CUDA path emulated on the CPU, where inductor's C++ code generator stands in for its
    # Triton one: with fallback_random the graph's draws are torch's generator's, in the eager
    # module's order; without, inductor generates them inside the kernels that read them
    import torch._inductor.config as inductor_config

    m = build("enc_dec", "authors")
    args = inputs("enc_dec", True)
    with device_paths.emulate("cuda"):
        assert_matches(step(m, True, "enc_dec", *args), step(m, False, "enc_dec", *args), 1e-5)
        assert [cfg.draws_noise for cfg in dma_compiled._State.compiled] == [True]
        torch._dynamo.reset()
        dma_compiled.reset()
        with inductor_config.patch({"fallback_random": False, "cpp.enable_kernel_profile": True}):
            step(m, True, "enc_dec", *args)
            counts = kernel_calls.count_kernel_calls(lambda: step(m, True, "enc_dec", *args))
    assert not dma_compiled.compile_failed()
    # ``step``'s own draw of its loss weights is the one randn call; inductor draws its seeds once
    assert counts.get("aten::randn") == 1 and counts.get("aten::randint") == 1, counts
    assert len([name for name in counts if "cpp_fused" in name and "randn" in name]) >= 1, counts


# ----------------------------------------------------------------------------- recompiles
def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def check_no_recompiles(kind, objective, device):
    """One graph for a module over batch shapes, padding, input layouts and gamma values.

    The first batch's sizes all equal the head dimension (8), which dynamo's duck sizing would
    make one symbol; the decoder's future mask is, as in fairseq's ``buffered_future_mask``, the
    top-left slice of a buffer as large as the longest batch so far, so that it is a view whose
    layout changes when a shorter batch follows a longer one (the third shape)."""
    torch._dynamo.reset()
    dma_compiled.reset()
    m = build(kind, objective, device=device)
    assert m.head_dim == 8
    before, gammas = compiled_graphs(), set()
    shapes = [dict(bsz=8, tgt_len=8, src_len=8), dict(bsz=5, tgt_len=11, src_len=6),
              dict(bsz=3, tgt_len=7, src_len=9)]
    future_mask = torch.empty(0, 0)
    for num_updates in (500, 900):  # gamma still rising (alpha = 0.5)
        m.set_num_updates(num_updates)
        gammas.add(m.gamma)
        for shape in shapes:
            for padded in (False, True):
                x, key, kpm, qpm, mask = inputs(kind, padded, batch_major=padded, device=device, **shape)
                if mask is not None:
                    if future_mask.size(0) < mask.size(0):
                        future_mask = mask
                    mask = future_mask[: mask.size(0), : mask.size(0)]
                step(m, True, kind, x, key, kpm, qpm, mask)
    assert len(gammas) == 2
    assert compiled_graphs() - before == 1


@needs_compile
@pytest.mark.parametrize("backend", ["aot_eager"], indirect=True)
def test_no_recompiles_across_shapes_padding_and_gamma(backend, torch_device):
    check_no_recompiles("dec_self", "paper", torch_device)  # the token GMM's own draws, laid out by the input


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
def test_inductor_no_recompiles_across_shapes_padding_and_gamma(backend, torch_device):
    require_inductor(torch_device)
    check_no_recompiles("enc_dec", "authors", torch_device)


# ----------------------------------------------------------------------------- memory
def kept_for_backward(m, compiled, kind, args, **forward_kwargs):
    """The shapes of the tensors a training step keeps for backward, and the bytes of their
    distinct storages (a view keeps its whole storage), both without the attention weights the
    step returns (the caller holds them anyway)."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        weights = step(m, compiled, kind, *args, **forward_kwargs)[1]
    returned = None if weights is None else weights.untyped_storage().data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    storages.pop(returned, None)
    return [tuple(t.shape) for t in kept if t.untyped_storage().data_ptr() != returned], sum(storages.values())


def check_keeps_no_token_pair_table(kind, objective, forward_kwargs, module_kwargs, device):
    """The graph's backward recomputes the T x S attention tables and the N x N InfoNCE critic,
    as the eager module's autograd functions do, instead of keeping them (which made the compiled
    path's peak memory 1.55-2.28 x the transformer's on an H200, against eager's 1.26-1.42 x).
    Attention dropout's mask is drawn again in backward from the saved generator state
    (AOTAutograd's functionalised random ops)."""
    m = build(kind, objective, device=device, **module_kwargs)
    tgt_len, src_len = 10, 13 if kind == "enc_dec" else 10
    args = inputs(kind, True, bsz=3, tgt_len=tgt_len, src_len=src_len, device=device)
    tables = {(tgt_len, src_len), (tgt_len, tgt_len), (src_len, src_len)}
    shapes, kept = kept_for_backward(m, True, kind, args, **forward_kwargs)
    _, eager_kept = kept_for_backward(m, False, kind, args, **forward_kwargs)
    # (the decoder's (T, T) future mask, the caller's own tensor, is kept as it is). A forward that
    # returns the per-head weights (alignment training) keeps one (H, B, T, S) table: the
    # partitioner saves it rather than recompute, since the weights are computed in forward anyway.
    allowed = 1 if forward_kwargs.get("need_head_weights") else 0
    assert len([s for s in shapes if len(s) > 2 and s[-2:] in tables]) <= allowed, shapes
    # no more than the eager module keeps, which holds per-token tensors and, for attention with
    # padding, a (B, 1, T, S) mask and the (B, H, T, S) dropout mask of bytes
    assert kept <= eager_kept, (kept, eager_kept)


@needs_compile
@pytest.mark.parametrize("backend", ["aot_eager_decomp_partition"], indirect=True)
@pytest.mark.parametrize("kind, objective, forward_kwargs, module_kwargs", CASES)
def test_compiled_graph_matches_eager_and_keeps_no_token_pair_table(backend, kind, objective, forward_kwargs,
                                                                    module_kwargs, torch_device):
    # this backend runs the graphs AOTAutograd derives through ATen after inductor's
    # decompositions, split into forward and backward as inductor splits them (min-cut
    # rematerialisation), without generating kernels: the one compile of a configuration (~20 s
    # here) serves both checks, the numbers and what is kept for backward
    compare_compiled(kind, objective, forward_kwargs, module_kwargs, torch_device)
    check_keeps_no_token_pair_table(kind, objective, forward_kwargs, module_kwargs, torch_device)


@pytest.mark.slow
@needs_inductor
@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
def test_inductor_keeps_no_token_pair_table_for_backward(backend, torch_device):
    require_inductor(torch_device)
    check_keeps_no_token_pair_table("dec_self", "paper", {}, {"dropout": 0.1}, torch_device)


# ----------------------------------------------------------------------------- when it does not compile
def failing_backend(graph, example_inputs):
    raise RuntimeError("no C++ compiler (a test's backend)")


@needs_compile
@pytest.mark.parametrize("backend", [failing_backend], indirect=True)
def test_failed_compile_falls_back_to_eager_with_one_log_line(backend, caplog):
    m = build("enc_self", "authors")
    args = inputs("enc_self", True)
    with caplog.at_level(logging.WARNING, logger=dma_compiled.__name__):
        first = step(m, True, "enc_self", *args)
        second = step(m, True, "enc_self", *args)
    records = [r for r in caplog.records if r.name == dma_compiled.__name__]
    assert len(records) == 1 and "runs eagerly" in records[0].getMessage()
    assert dma_compiled.compile_failed()
    assert all(torch.isfinite(t).all() for t in (first[0], *first[2].values()))
    # from then on the module is the eager one, draws included
    assert_matches(second, step(m, False, "enc_self", *args), 0.0, floors=False)


def test_evaluation_and_decoding_run_eagerly():
    m = build("dec_self", "authors", compile_math=True).eval()
    x, _, kpm, _, mask = inputs("dec_self", True)
    assert not dma_compiled.applies(m, x, x, None, mask, False)
    m.train()
    assert dma_compiled.applies(m, x, x, None, mask, False)
    assert not dma_compiled.applies(m, x, x, {}, mask, False)  # incremental decoding
    m.set_num_updates(0)  # gamma 0 and no regularisers: plain attention, nothing to compile
    assert not dma_compiled.applies(m, x, x, None, mask, False)


def test_aux_names_follow_the_module():
    assert dma_compiled.AUX_NAMES == AUX_LOSS_NAMES


# ----------------------------------------------------------------------------- the flag
def test_flag_is_off_by_default_and_reaches_every_module(tiny_model):
    from test_architectures import SMALL

    model, _, _, args = tiny_model("dma_transformer_iwslt_de_en_tiny", *SMALL)
    assert args.dma_compile is False
    assert not any(m.compile_math for m in model.dma_modules())
    model, _, _, args = tiny_model("dma_transformer_iwslt_de_en_tiny", *SMALL, "--dma-compile")
    assert args.dma_compile is True
    assert model.dma_modules() and all(m.compile_math for m in model.dma_modules())


# ----------------------------------------------------------------------------- launch counting
@pytest.fixture(scope="module")
def kernel_calls():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_calls

        yield kernel_calls
    finally:
        sys.path.remove(str(BENCHMARKS))


@needs_cxx
def test_kernel_calls_counts_inductors_kernels(kernel_calls):
    import torch._inductor.config as inductor_config

    def f(x, w):
        return torch.softmax(x @ w, -1).exp().sum()

    torch._dynamo.reset()
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        compiled = torch.compile(f, fullgraph=True, dynamic=True)
        x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
        compiled(x, w).backward()
    counts = kernel_calls.count_kernel_calls(lambda: compiled(x, w).backward())
    generated = [name for name in counts if "cpp_fused" in name]
    # one fused kernel forward, one backward; the matmul and its two gradients are ATen calls
    assert len(generated) == 2 and all(counts[name] == 1 for name in generated), counts
    assert counts["aten::mm"] == 3
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", [None], indirect=True)
@pytest.mark.parametrize("kind", ["dec_self", "enc_dec"])
def test_restated_math_under_bf16_autocast(backend, kind, torch_device):
    # the projections and the attention's products in bf16, the statistics in fp32, as eagerly
    m = build(kind, "authors", device=torch_device)
    args = inputs(kind, True, device=torch_device)
    with torch.autocast(torch_device.type, dtype=torch.bfloat16):
        compiled, eager = step(m, True, kind, *args), step(m, False, kind, *args)
    assert compiled[0].dtype == eager[0].dtype == torch.bfloat16
    # the gradient of the k projection's bias, 0 in exact arithmetic, is bf16 rounding of terms of
    # the gradients' size
    assert_matches(compiled, eager, 2e-2, grad_floor=0.1)


# ----------------------------------------------------------------------------- inductor's gradients
@needs_inductor
@pytest.mark.parametrize("kernels", [False, True])
def test_inductor_gradients_of_the_query_gmm(kernels, torch_device):
    """A fast guard on the spot where inductor once returned wrong parameter gradients for this
    code (relative errors 0.75-2.7 on the query GMM, an earlier formulation; not reproduced on
    torch 2.13, neither with the eager ``DiagonalGMM`` nor with this one): the query GMM's
    statistics, one mixture shared by the heads (G = 1) with c_grad, sampled, compiled alone;
    with ``kernels`` ("triton" backend) its backward is ``mixture_triton``'s kernel."""
    require_inductor(torch_device)
    if kernels:
        pytest.importorskip("triton")
        from fairseq_modattn.modules import triton_ops  # noqa: F401 - registers the kernels' operators
    torch.manual_seed(0)
    cfg = dma_compiled.MathConfig(num_heads=4, head_dim=16, self_attention=True, noise_scale=0.1 ** 0.5,
                                  centroid_grad_mult=10.0, query_gmm_scale=0.25, sample_attention=True,
                                  qq_form="bounded", div_form="entrywise", per_sentence=True, need_aux=True,
                                  dropout=0.0, weights="none", kernels=kernels)

    def leaf(t):  # drawn on the CPU, so that every device gets the same numbers
        return t.to(torch_device).requires_grad_()

    logits = leaf(torch.randn(1, 8))
    means = leaf(0.3 * torch.randn(1, 8, 16))
    log_vars = leaf(torch.empty(1, 8, 16).uniform_(-0.5, 0.5))
    # the queries as the module holds them: a head-split view of a token-major projection
    u = leaf(torch.randn(13, 3, 64).to(torch_device).view(13, 3, 4, 16).permute(1, 2, 0, 3))
    eps = torch.randn(3, 4, 13, 16).to(torch_device)
    weights = [t.to(torch_device) for t in [torch.randn(3, 4, 13, 8) for _ in range(3)] + [torch.randn(3, 4, 13)]]

    def loss(u, logits, means, log_vars):
        stats = dma_compiled.mixture_statistics(u, u + cfg.noise_scale * eps, logits, means, log_vars, cfg, True,
                                                head_axis=1)
        return sum((s * w).sum() for s, w in zip(stats, weights))

    def gradients(fn):
        return torch.autograd.grad(fn(u, logits, means, log_vars), (u, logits, means, log_vars))

    torch._dynamo.reset()
    compiled = gradients(torch.compile(loss, fullgraph=True, dynamic=True, backend="inductor"))
    for name, a, b in zip(("u", "logits", "means", "log_vars"), compiled, gradients(loss)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"inductor's gradient of {name}: relative error {err:.1e}"
    torch._dynamo.reset()
