"""n independent LSTM or GRU cells computed together: the block-diagonal recurrent cells of
independent mechanisms (RIMs, Goyal et al., ICLR 2021, section 2.3: "each RIM has its own LSTM").

The hidden state is read as n groups of width ``hidden_size``; group g has its own weights and
sees only its own input x_g and state h_g, with the equations of ``torch.nn.LSTMCell`` /
``torch.nn.GRUCell``. Stacking the groups' weights as the blocks of one ``GroupLinear`` turns
the n small matmuls into one batched matmul per step:

    LSTM:  [i f g o] = [x_g, h_g] W_g + b_g
           c'_g = sigmoid(f) * c_g + sigmoid(i) * tanh(g),   h'_g = sigmoid(o) * tanh(c'_g)
    GRU:   r = sigmoid(x_g W^r_g + h_g U^r_g + b^r),  z = sigmoid(x_g W^z_g + h_g U^z_g + b^z)
           n = tanh(x_g W^n_g + b^n_i + r * (h_g U^n_g + b^n_h)),   h'_g = (1 - z) * n + z * h_g

Initialisation and weight loading follow the torch cells, so n torch cells can be copied into a
group cell (``load_from_lstm_cells`` / ``load_from_gru_cells``) and compared one to one.
``lstm_update`` and ``gru_update`` are the state updates from pre-activations, shared with
callers that compute the pre-activations themselves (``RIMCell`` maps the input side of all
time steps before its loop).
"""

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from .group_linear import GroupLinear


def _init_like_rnn_cell(linear: GroupLinear, hidden_size: int, num_biases: int):
    """torch.nn.LSTMCell / GRUCell initialisation: every weight ~ U(+-1/sqrt(hidden)).

    Where our single bias stands for the sum b_ih + b_hh of the torch cell's two biases it is
    drawn as the sum of ``num_biases`` such uniforms, the initial distribution of that sum.
    """
    bound = 1.0 / math.sqrt(hidden_size)
    with torch.no_grad():
        linear.weight.uniform_(-bound, bound)
        if linear.bias is not None:
            linear.bias.zero_()
            for _ in range(num_biases):
                linear.bias.add_(torch.empty_like(linear.bias).uniform_(-bound, bound))


def lstm_update(gates: Tensor, c: Tensor) -> Tuple[Tensor, Tensor]:
    """LSTM state update from pre-activations (..., 4 hidden) in gate order i, f, g, o."""
    gates = gates.view(*gates.shape[:-1], 4, -1)
    # one sigmoid over all four gates (g's is wasted) costs less than three slices' worth of ops
    act = torch.sigmoid(gates)
    i, f, _, o = act.unbind(-2)
    c_new = f * c + i * torch.tanh(gates[..., 2, :])
    return o * torch.tanh(c_new), c_new


def gru_update(gi: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    """GRU state update from the input and hidden pre-activations (..., 3 hidden), order r, z, n."""
    hid = h.size(-1)
    rz = torch.sigmoid(gi[..., : 2 * hid] + gh[..., : 2 * hid])
    r, z = rz[..., :hid], rz[..., hid:]
    n = torch.tanh(gi[..., 2 * hid:] + r * gh[..., 2 * hid:])
    return n + z * (h - n)  # = (1 - z) * n + z * h


class GroupLSTMCell(nn.Module):
    """n independent LSTM cells, one batched matmul (GroupLinear over [x_g, h_g]).

    Group g computes, with gate order i, f, g, o as ``torch.nn.LSTMCell``,

        [i f g o] = [x_g, h_g] W_g + b_g,      W_g in R^{(in + hidden) x 4 hidden}
        c'_g = sigmoid(f) * c_g + sigmoid(i) * tanh(g),   h'_g = sigmoid(o) * tanh(c'_g).

    W_g stacks nn.LSTMCell's (W_ih, W_hh) transposed and b_g = b_ih + b_hh (one bias: the two
    are only ever summed).
    """

    def __init__(self, num_groups: int, input_size: int, hidden_size: int, bias: bool = True):
        super().__init__()
        self.num_groups = num_groups
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.linear = GroupLinear(num_groups, input_size + hidden_size, 4 * hidden_size, bias=bias)
        _init_like_rnn_cell(self.linear, hidden_size, num_biases=2)

    def forward(self, x: Tensor, state: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        """x (B, G, input_size), state h, c (B, G, hidden) -> new (h, c), each (B, G, hidden)."""
        h, c = state
        batch = x.size(0)
        xh = torch.cat([x, h.to(x.dtype)], dim=-1)
        gates = self.linear(xh.reshape(batch, -1)).view(batch, self.num_groups, 4 * self.hidden_size)
        return lstm_update(gates, c)

    # The weight split into its input rows and its hidden rows, for callers that compute the two
    # parts separately (``RIMCell`` maps the input side before its time loop); views, no copies.
    @property
    def input_weight(self) -> Tensor:
        return self.linear.weight[:, : self.input_size]

    @property
    def hidden_weight(self) -> Tensor:
        return self.linear.weight[:, self.input_size:]

    @property
    def input_bias(self) -> Optional[Tensor]:
        return None  # the summed bias is all on the hidden side

    @property
    def hidden_bias(self) -> Optional[Tensor]:
        return self.linear.bias

    def load_from_lstm_cells(self, cells: Sequence[nn.LSTMCell]) -> None:
        """Copy the weights of ``num_groups`` torch.nn.LSTMCell (group g <- cells[g])."""
        _check_cells(self, cells, nn.LSTMCell)
        with torch.no_grad():
            for g, cell in enumerate(cells):
                self.linear.weight[g].copy_(torch.cat([cell.weight_ih, cell.weight_hh], dim=1).t())
                if self.linear.bias is not None:
                    self.linear.bias[g].copy_(_summed_bias(cell))

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, input_size={self.input_size}, hidden_size={self.hidden_size}"


class GroupGRUCell(nn.Module):
    """n independent GRU cells, gate order r, z, n and equations as ``torch.nn.GRUCell``:

        r = sigmoid(x W^r_g + h U^r_g + b^r),  z = sigmoid(x W^z_g + h U^z_g + b^z)
        n = tanh(x W^n_g + b^n_i + r * (h U^n_g + b^n_h)),   h' = (1 - z) * n + z * h.

    r multiplies the hidden part of n only, so the input and hidden maps are two
    ``GroupLinear`` (in -> 3 hidden, hidden -> 3 hidden), each one batched matmul.
    """

    def __init__(self, num_groups: int, input_size: int, hidden_size: int, bias: bool = True):
        super().__init__()
        self.num_groups = num_groups
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.input_linear = GroupLinear(num_groups, input_size, 3 * hidden_size, bias=bias)
        self.hidden_linear = GroupLinear(num_groups, hidden_size, 3 * hidden_size, bias=bias)
        _init_like_rnn_cell(self.input_linear, hidden_size, num_biases=1)
        _init_like_rnn_cell(self.hidden_linear, hidden_size, num_biases=1)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        """x (B, G, input_size), h (B, G, hidden) -> new h (B, G, hidden)."""
        batch = x.size(0)
        gi = self.input_linear(x.reshape(batch, -1)).view(batch, self.num_groups, -1)
        gh = self.hidden_linear(h.to(x.dtype).reshape(batch, -1)).view(batch, self.num_groups, -1)
        return gru_update(gi, gh, h)

    @property
    def input_weight(self) -> Tensor:
        return self.input_linear.weight

    @property
    def hidden_weight(self) -> Tensor:
        return self.hidden_linear.weight

    @property
    def input_bias(self) -> Optional[Tensor]:
        return self.input_linear.bias

    @property
    def hidden_bias(self) -> Optional[Tensor]:
        return self.hidden_linear.bias

    def load_from_gru_cells(self, cells: Sequence[nn.GRUCell]) -> None:
        """Copy the weights of ``num_groups`` torch.nn.GRUCell (group g <- cells[g])."""
        _check_cells(self, cells, nn.GRUCell)
        with torch.no_grad():
            for g, cell in enumerate(cells):
                self.input_linear.weight[g].copy_(cell.weight_ih.t())
                self.hidden_linear.weight[g].copy_(cell.weight_hh.t())
                for linear, name in ((self.input_linear, "bias_ih"), (self.hidden_linear, "bias_hh")):
                    if linear.bias is not None:
                        bias = getattr(cell, name)
                        linear.bias[g].copy_(bias if bias is not None else torch.zeros_like(linear.bias[g]))

    def extra_repr(self) -> str:
        return f"num_groups={self.num_groups}, input_size={self.input_size}, hidden_size={self.hidden_size}"


def _check_cells(group_cell: nn.Module, cells: Sequence[nn.Module], kind: type):
    if len(cells) != group_cell.num_groups:
        raise ValueError(f"expected {group_cell.num_groups} {kind.__name__}s, got {len(cells)}")
    for cell in cells:
        if not isinstance(cell, kind):
            raise ValueError(f"expected {kind.__name__}, got {type(cell).__name__}")
        if cell.input_size != group_cell.input_size or cell.hidden_size != group_cell.hidden_size:
            raise ValueError(
                f"cell sizes ({cell.input_size}, {cell.hidden_size}) differ from the group cell's "
                f"({group_cell.input_size}, {group_cell.hidden_size})"
            )
        if cell.bias and not _has_bias(group_cell):
            raise ValueError("the torch cells have biases but this group cell was built with bias=False")


def _has_bias(group_cell: nn.Module) -> bool:
    return any(m.bias is not None for m in group_cell.modules() if isinstance(m, GroupLinear))


def _summed_bias(cell: nn.LSTMCell) -> Tensor:
    if cell.bias_ih is None:
        return torch.zeros(4 * cell.hidden_size, dtype=cell.weight_ih.dtype, device=cell.weight_ih.device)
    return cell.bias_ih + cell.bias_hh
