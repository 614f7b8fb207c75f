"""GroupLinear / GroupLayerNorm against per-group references, nn.Linear, and finite differences."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_modattn.modules import GroupLayerNorm, GroupLinear


def naive_group_linear(x, weight, bias):
    """Loop over groups: group g's input slice through its own matrix into its output slice."""
    groups, width_in, _ = weight.shape
    outs = []
    for g in range(groups):
        y = x[..., g * width_in:(g + 1) * width_in] @ weight[g]
        if bias is not None:
            y = y + bias[g]
        outs.append(y)
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("groups, width_in, width_out", [(1, 8, 5), (2, 6, 4), (4, 3, 7), (3, 5, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_group_linear_equals_per_group_loop(groups, width_in, width_out, bias):
    torch.manual_seed(0)
    layer = GroupLinear(groups, width_in, width_out, bias=bias)
    if bias:
        nn.init.normal_(layer.bias)  # reset_parameters zeroes it; make it count
    x = torch.randn(5, 3, groups * width_in)
    out = layer(x)
    assert out.shape == (5, 3, groups * width_out)
    torch.testing.assert_close(out, naive_group_linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-6)


def test_group_linear_accepts_non_contiguous_input_and_any_leading_shape():
    torch.manual_seed(0)
    layer = GroupLinear(2, 4, 3)
    nn.init.normal_(layer.bias)
    x = torch.randn(3, 6, 8).transpose(0, 1)  # (6, 3, 8), not contiguous
    torch.testing.assert_close(layer(x), naive_group_linear(x, layer.weight, layer.bias))
    flat = torch.randn(8)
    assert layer(flat).shape == (6,)
    with pytest.raises(ValueError, match="2 x 4"):
        layer(torch.randn(3, 7))


def test_one_group_is_nn_linear_with_the_same_weights():
    torch.manual_seed(0)
    linear = nn.Linear(12, 7)
    group = GroupLinear(1, 12, 7)
    with torch.no_grad():
        group.weight[0].copy_(linear.weight.t())
        group.bias[0].copy_(linear.bias)
    x = torch.randn(4, 2, 12)
    torch.testing.assert_close(group(x), linear(x), rtol=1e-6, atol=1e-6)


def test_group_is_block_diagonal():
    """The Jacobian of output group g w.r.t. input group h is zero for g != h."""
    torch.manual_seed(0)
    layer = GroupLinear(3, 4, 2)
    jac = torch.autograd.functional.jacobian(layer, torch.randn(12))  # (6, 12)
    for g in range(3):
        for h in range(3):
            block = jac[2 * g:2 * g + 2, 4 * h:4 * h + 4]
            if g == h:
                torch.testing.assert_close(block, layer.weight[g].t())
            else:
                assert torch.count_nonzero(block) == 0


def test_xavier_init_statistics_per_group():
    torch.manual_seed(0)
    width_in, width_out, gain = 96, 160, 2 ** -0.5
    layer = GroupLinear(4, width_in, width_out)
    layer.reset_parameters(gain)
    bound = gain * math.sqrt(6.0 / (width_in + width_out))
    w = layer.weight.detach()
    assert w.abs().max() <= bound
    for g in range(4):  # U(-b, b): std b / sqrt(3), every group drawn (no shared block)
        assert w[g].std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)
        assert abs(w[g].mean().item()) < 0.02 * bound
    assert not torch.equal(w[0], w[1])
    assert torch.count_nonzero(layer.bias) == 0
    # G = 1 has the statistics of nn.init.xavier_uniform_ on nn.Linear(in, out)
    linear = nn.Linear(width_in, width_out)
    nn.init.xavier_uniform_(linear.weight, gain=gain)
    one = GroupLinear(1, width_in, width_out)
    one.reset_parameters(gain)
    assert one.weight.std().item() == pytest.approx(linear.weight.std().item(), rel=0.03)
    assert one.weight.abs().max() <= bound and linear.weight.abs().max() <= bound


def test_like_linear_init_bound():
    torch.manual_seed(0)
    layer = GroupLinear(2, 64, 32)
    layer.reset_parameters_like_linear()
    bound = 1 / math.sqrt(64)
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
    assert layer.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    assert torch.count_nonzero(layer.bias) > 0


@pytest.mark.parametrize("groups, dim", [(1, 8), (2, 5), (4, 3)])
def test_group_layer_norm_equals_per_slice_layer_norm(groups, dim):
    torch.manual_seed(0)
    norm = GroupLayerNorm(groups, dim)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(4, 3, groups * dim) * 3 + 1
    expected = torch.cat(
        [F.layer_norm(x[..., g * dim:(g + 1) * dim], (dim,), norm.weight[g], norm.bias[g], eps=1e-5)
         for g in range(groups)], dim=-1)
    torch.testing.assert_close(norm(x), expected, rtol=1e-5, atol=1e-5)


def test_one_group_layer_norm_is_fairseq_layer_norm():
    from fairseq.modules import LayerNorm

    torch.manual_seed(0)
    ref = LayerNorm(16)
    nn.init.normal_(ref.weight)
    nn.init.normal_(ref.bias)
    norm = GroupLayerNorm(1, 16)
    with torch.no_grad():
        norm.weight[0].copy_(ref.weight)
        norm.bias[0].copy_(ref.bias)
    x = torch.randn(5, 2, 16)
    torch.testing.assert_close(norm(x), ref(x), rtol=1e-5, atol=1e-5)


def test_gradcheck_in_double():
    """Gradients w.r.t. the input and every parameter of GroupLinear -> GroupLayerNorm."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(GroupLinear(3, 2, 4), GroupLayerNorm(3, 4)).double()
    for p in model.parameters():
        nn.init.normal_(p)
    names = [name for name, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in model.parameters())
    x = torch.randn(2, 3, 6, dtype=torch.double, requires_grad=True)

    def f(x, *params):
        return functional_call(model, dict(zip(names, params)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params))
