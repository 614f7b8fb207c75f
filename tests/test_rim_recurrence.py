"""The fused RIM recurrence (modules/rim_recurrence.py), LSTM and GRU cells, against the step-by-step RIMLayer
(``recurrence="stepwise"``, each step a ``RIMCell`` under autograd, itself checked against the
paper's equations in test_rim.py) as the oracle: outputs, final states, active sets and every
gradient, in fp64 to 1e-12 and fp32 to 1e-6 relative; gradcheck; padding, ties, the null input;
the kernel calls per time step; the compiled steps."""

import copy
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from fairseq_modattn.modules import RIMLayer, device_paths, rim_recurrence
from test_dma_compiled import needs_compile, needs_cxx

SMALL = dict(input_key_size=6, input_value_size=10, comm_key_size=8, comm_value_size=12, comm_heads=2)
KERNEL_CALLS = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_calls.py"


def make_layer(dtype=torch.float64, heads=1, **kwargs):
    sizes = dict(SMALL, input_value_size=10 if heads == 1 else 12, input_key_size=6 if heads == 1 else 8)
    args = dict(input_size=7, num_rims=4, rim_size=5, top_k=2)
    args.update(kwargs)
    layer = RIMLayer(args.pop("input_size"), args.pop("num_rims"), args.pop("rim_size"), args.pop("top_k"),
                     input_heads=heads, recurrence="fused", **sizes, **args).to(dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name.startswith("cells.0.initial") or ".initial" in name:
                p.normal_(0.0, 0.5)
    return layer


def stepwise(layer):
    ref = copy.deepcopy(layer)
    ref.recurrence = "stepwise"
    return ref


def run(layer, x, padding_mask=None):
    """outputs, final h, final c, active, and the gradients of x and of every parameter of a
    loss that weighs each output differently."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, h, c, active = layer(x, padding_mask)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    loss = (out * weights).sum() + (h ** 2).sum()
    if c is not None:
        loss = loss + c.cos().sum()
    loss.backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out.detach(), h.detach(), None if c is None else c.detach(), active, x.grad, grads


def assert_same(fused, ref, atol, rtol=0.0):
    assert torch.equal(fused[3], ref[3]), "the active sets differ"
    for name, a, b in zip(("outputs", "final h", "final c", "x grad"), fused[:3] + fused[4:5], ref[:3] + ref[4:5]):
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    assert fused[5].keys() == ref[5].keys()
    # relative to the size of the whole gradient: some entries are zero in exact arithmetic
    # (the input keys' bias cancels in k_x - k_null) and both loops leave rounding noise there
    scale = max(g.abs().max() for g in ref[5].values() if g is not None).clamp_min(1.0)
    for name in ref[5]:
        a, b = fused[5][name], ref[5][name]
        assert (a is None) == (b is None), name
        if b is not None:
            torch.testing.assert_close(a / scale, b / scale, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def padding_mask(batch, length):
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[0, :2] = True  # left padding, fairseq's
    mask[1, length - 2:] = True  # right
    return mask


CASES = [
    dict(cell=cell, bidirectional=bidirectional, heads=heads, communication=communication, top_k=top_k)
    for cell, bidirectional, heads, communication, top_k in itertools.product(
        ("lstm", "gru"), (False, True), (1, 2), (True, False), (2, 4))
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("padded", [False, True])
def test_fused_equals_stepwise_fp64(case, padded):
    torch.manual_seed(0)
    layer = make_layer(**case)
    x = torch.randn(6, 3, 7, dtype=torch.float64)
    mask = padding_mask(3, 6) if padded else None
    assert_same(run(layer, x, mask), run(stepwise(layer), x, mask), atol=1e-12)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_equals_stepwise_fp32(bidirectional, cell):
    torch.manual_seed(1)
    layer = make_layer(torch.float32, bidirectional=bidirectional, learned_initial_state=True, cell=cell)
    x = torch.randn(9, 4, 7)
    mask = padding_mask(4, 9)
    assert_same(run(layer, x, mask), run(stepwise(layer), x, mask), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_learned_initial_state_gets_its_gradient(cell):
    torch.manual_seed(2)
    layer = make_layer(learned_initial_state=True, bidirectional=True, cell=cell)
    x = torch.randn(5, 2, 7, dtype=torch.float64)
    fused, ref = run(layer, x), run(stepwise(layer), x)
    assert_same(fused, ref, atol=1e-12)
    assert fused[5]["cells.1.initial_h"].abs().sum() > 0
    if cell == "lstm":
        assert fused[5]["cells.1.initial_c"].abs().sum() > 0


def test_ties_and_the_null_input():
    """Equal queries tie every RIM (the lower indices win); a zero input row has the null row's
    key, so p_x = 1/2 for every RIM: a tie too."""
    torch.manual_seed(3)
    layer = make_layer(num_rims=5, top_k=2)
    with torch.no_grad():
        for cell in layer.cells:
            cell.input_query.weight.zero_()
            cell.input_query.bias.zero_()
    x = torch.randn(4, 3, 7, dtype=torch.float64)
    x[1] = 0.0  # a null input at step 1
    fused, ref = run(layer, x), run(stepwise(layer), x)
    assert_same(fused, ref, atol=1e-12)
    assert fused[3][:, :, 0].tolist() == [[[True, True, False, False, False]] * 3] * 4

    layer = make_layer(num_rims=5, top_k=3)
    x = torch.randn(4, 3, 7, dtype=torch.float64)
    x[2] = 0.0
    fused, ref = run(layer, x), run(stepwise(layer), x)
    assert_same(fused, ref, atol=1e-12)
    assert fused[3][2, :, 0].tolist() == [[True, True, True, False, False]] * 3


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_inference_without_gradients_equals_training_forward(cell):
    """Without autograd the loop keeps one step's buffers (c alternating between two)."""
    torch.manual_seed(4)
    layer = make_layer(bidirectional=True, cell=cell).eval()
    x = torch.randn(7, 3, 7, dtype=torch.float64)
    mask = padding_mask(3, 7)
    with torch.no_grad():
        plain = layer(x, mask)
        ref = stepwise(layer)(x, mask)
    for a, b in zip(plain, ref):
        if a is None:
            assert b is None
        elif a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    for steps in (1, 2, 3):  # the final c is read from the right one of the two buffers
        with torch.no_grad():
            _, h_plain, c_plain, _ = layer(x[:steps])
        _, h_grad, c_grad, _ = layer(x[:steps].requires_grad_(True))
        torch.testing.assert_close(h_plain, h_grad.detach(), atol=1e-12, rtol=0)
        if cell == "lstm":
            torch.testing.assert_close(c_plain, c_grad.detach(), atol=1e-12, rtol=0)


def test_gradcheck():
    torch.manual_seed(5)
    layer = make_layer(num_rims=3, rim_size=3, top_k=2, heads=2, bidirectional=True)
    x = torch.randn(3, 2, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, False], [False, False, False]])

    def fn(x):
        out, h, c, _ = layer(x, mask)
        return out, h, c

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7)


def test_dropout_draws_in_training_only():
    torch.manual_seed(6)
    layer = make_layer(torch.float32, input_dropout=0.5, comm_dropout=0.5)
    x = torch.randn(4, 3, 7)
    assert not torch.equal(layer(x)[0], layer(x)[0])
    layer.eval()
    assert torch.equal(layer(x)[0], layer(x)[0])


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_dropout_masks_are_those_of_the_stepwise_probabilities(monkeypatch, cell):
    """The fused loop draws every step's masks at once and folds them into the precomputed
    gate terms; with the same masks it computes what the step-by-step loop computes."""
    torch.manual_seed(7)
    layer = make_layer(input_dropout=0.3, comm_dropout=0.3, bidirectional=True, cell=cell)
    x = torch.randn(5, 3, 7, dtype=torch.float64)
    drawn = []
    real_dropout = torch.nn.functional.dropout

    def recording_dropout(t, p=0.5, training=True, inplace=False):
        out = real_dropout(t, p, training, inplace)
        drawn.append(out)
        return out

    monkeypatch.setattr(torch.nn.functional, "dropout", recording_dropout)
    fused = run(layer, x)
    # per direction: the input mask (T, n, B, H, 2) then the communication mask (T, n, n, B, Hc)
    masks = [drawn[0], drawn[1], drawn[2], drawn[3]]
    replay = {0: [], 1: []}
    for direction in (0, 1):
        keep, comm = masks[2 * direction], masks[2 * direction + 1]
        for t in range(5):  # direction 1's loop runs over the reversed input: its step t is time T-1-t
            # rim.py drops probs (B, H, n, 2) and communication weights (B, Hc, n, n)
            replay[direction].append(keep[t].permute(1, 2, 0, 3))
            replay[direction].append(comm[t].permute(2, 3, 0, 1))
    queue = replay[0] + replay[1]

    def replaying_dropout(t, p=0.5, training=True, inplace=False):
        mask = queue.pop(0)
        assert mask.shape == t.shape
        return t * mask

    monkeypatch.setattr(torch.nn.functional, "dropout", replaying_dropout)
    ref = run(stepwise(layer), x)
    assert not queue
    assert_same(fused, ref, atol=1e-12)


def test_bf16_autocast_is_finite_and_fp32_inside():
    torch.manual_seed(8)
    layer = make_layer(torch.float32, bidirectional=True, heads=2)
    x = torch.randn(5, 3, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, h, c, active = layer(x, padding_mask(3, 5))
    assert all(torch.isfinite(t.float()).all() for t in (out, h, c))
    reference = layer(x, padding_mask(3, 5))[0]
    assert (out.float() - reference).abs().max() < 0.1  # bf16 projections, fp32 recurrence


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_half_precision_model_computes_the_loop_in_fp32(cell):
    """fairseq's --fp16 turns the model to fp16: the loop still runs in fp32, and the fp16
    parameters get finite fp16 gradients."""
    torch.manual_seed(12)
    layer = make_layer(torch.float32, bidirectional=True, cell=cell)
    half = copy.deepcopy(layer).half()
    x = torch.randn(6, 3, 7)
    mask = padding_mask(3, 6)
    out, h, _, active = half(x.half(), mask)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    reference, _, _, _ = layer(x.half().float(), mask)
    assert (out.float() - reference).abs().max() < 2e-2  # fp16 weights and outputs, fp32 loop
    out.float().pow(2).sum().backward()
    grads = [p.grad for p in half.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float16 and torch.isfinite(g).all() for g in grads)


def test_auto_takes_the_fused_path_off_the_cpu_only():
    layer = make_layer()
    layer.recurrence = "auto"
    x = torch.randn(3, 2, 7, dtype=torch.float64)
    assert not layer.uses_fused_recurrence(x)
    with device_paths.emulate("cuda"):
        assert layer.uses_fused_recurrence(x)
    gru = RIMLayer(7, 4, 5, 2, cell="gru", recurrence="stepwise", **SMALL)
    with device_paths.emulate("cuda"):
        assert not gru.uses_fused_recurrence(x.float())
    with pytest.raises(ValueError, match="recurrence"):
        RIMLayer(7, 4, 5, 2, recurrence="fast", **SMALL)


# ---------------------------------------------------------------- kernel calls per time step


def kernel_calls():
    spec = importlib.util.spec_from_file_location("kernel_calls", KERNEL_CALLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calls_per_step(layer, counter, lengths=(4, 8), batch=3):
    """Kernel calls of forward + backward per time step: the difference between two lengths."""
    totals = []
    for length in lengths:
        x = torch.randn(length, batch, layer.input_size, requires_grad=True)
        mask = torch.zeros(batch, length, dtype=torch.bool)
        mask[0, 0] = True

        def step():
            out, h, c, _ = layer(x, mask)
            (out.pow(2).mean() + h.pow(2).mean() + (0.0 if c is None else c.pow(2).mean())).backward()

        step()  # warm-up: a first call may take other paths
        totals.append(counter.total(counter.count_kernel_calls(step)))
    return (totals[1] - totals[0]) / (lengths[1] - lengths[0])


#: forward + backward kernel calls per time step of the fused loop, as counted when it was
#: written (the model's configuration: one input head, communication, attention dropout)
FUSED_CALLS_PER_STEP = {"lstm": 55, "gru": 56}


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_fused_recurrence_calls_per_step(cell):
    counter = kernel_calls()
    torch.manual_seed(9)
    layer = make_layer(torch.float32, num_rims=6, top_k=4, input_dropout=0.1, comm_dropout=0.1, cell=cell).train()
    fused = calls_per_step(layer, counter)
    before = calls_per_step(stepwise(layer), counter)
    print(f"{cell}: fused {fused}, stepwise {before} calls per step")
    assert fused <= FUSED_CALLS_PER_STEP[cell], fused
    assert before >= 2 * fused, (before, fused)


# ---------------------------------------------------------------- compiled steps


@pytest.fixture
def compile_backend(request):
    previous = rim_recurrence.COMPILE_BACKEND
    if request.param != previous:
        torch._dynamo.reset()
    rim_recurrence.COMPILE_BACKEND = request.param
    rim_recurrence.reset_compiled()
    yield request.param
    rim_recurrence.COMPILE_BACKEND = previous
    rim_recurrence.reset_compiled()


def compare_compiled(configurations=((True, True, "lstm"),), shapes=((5, 3),)):
    torch.manual_seed(10)
    for bidirectional, communication, cell in configurations:
        layer = make_layer(torch.float32, bidirectional=bidirectional, communication=communication, heads=2,
                           cell=cell)
        compiled = copy.deepcopy(layer)
        compiled.compile_recurrence = True
        for length, batch in shapes:
            x = torch.randn(length, batch, 7)
            mask = padding_mask(batch, length)
            assert_same(run(compiled, x, mask), run(layer, x, mask), atol=1e-6, rtol=1e-6)
    assert not rim_recurrence.compile_failed()


@needs_compile  # dynamo's tracing of the two step functions takes a minute or two
@pytest.mark.parametrize("compile_backend", ["aot_eager"], indirect=True)
def test_compiled_steps_equal_eager(compile_backend):
    compare_compiled()


@pytest.mark.slow
@needs_compile
@pytest.mark.parametrize("compile_backend", ["aot_eager"], indirect=True)
def test_compiled_steps_equal_eager_across_cells_and_shapes(compile_backend):
    compare_compiled(((False, True, "lstm"), (True, True, "gru")), shapes=((5, 3), (7, 4), (9, 6)))


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("compile_backend", ["inductor"], indirect=True)
def test_inductor_steps_equal_eager_and_cut_the_calls(compile_backend):
    # the second and third shapes: the graphs become dynamic in the batch and then hold
    compare_compiled(((False, True, "lstm"), (True, False, "lstm"), (True, True, "gru")),
                     shapes=((5, 3), (7, 4), (9, 6)))
    counter = kernel_calls()
    torch.manual_seed(11)
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # compiled kernels record events
        layer = make_layer(torch.float32, num_rims=6, top_k=4, input_dropout=0.1, comm_dropout=0.1).train()
        layer.compile_recurrence = True
        compiled = calls_per_step(layer, counter)
    layer.compile_recurrence = False
    before = calls_per_step(stepwise(layer), counter)
    assert compiled * 4 <= before, (compiled, before)
