"""Recurrent Independent Mechanisms (RIMs; Goyal et al., ICLR 2021, arXiv 1909.10893, section 2).

The state of the recurrent layer is split into n RIMs of width d_r, RIM k owning (h_{t,k}, c_{t,k}).
One time step with input x_t (``RIMCell``):

    Input attention (section 2.2). The RIMs read from X_t = [0; x_t], the input with a null row
    (a zero vector) prepended; keys and values are shared by all RIMs, queries are per RIM:

        K = X_t W^k + b^k,   V = X_t W^v + b^v,   Q_k = h_{t-1,k} W^q_k + b^q_k
        A_k = softmax(Q_k K^T / sqrt(d_k)) V            (per head; heads concatenated)

    The null row is projected like any input, so its key is b^k and its value b^v: learned
    vectors (zero at initialisation) that a RIM's query can learn to prefer when it should not
    read the input. Without the bias the null logit would be pinned at 0.

    Selection. The top_k RIMs with the *least* attention probability on the null row (mean over
    heads, before dropout) are active, S_t; ties go to the lower RIM index (stable sort).

    Independent dynamics (section 2.3). Every RIM has its own LSTM (or GRU) on its read A_k,
    all n in one batched matmul (``GroupLSTMCell`` of group_recurrent_cells.py); inactive RIMs
    keep their state exactly:

        h~_{t,k}, c_{t,k} = LSTM_k(A_k, (h_{t-1,k}, c_{t-1,k}))    if k in S_t
        h~_{t,k}, c_{t,k} = h_{t-1,k}, c_{t-1,k}                     otherwise

    Communication (section 2.4). Active RIMs read all RIMs' h~ with multi-head attention
    (per-RIM query/key/value/output maps) and add the result as a residual:

        h_{t,k} = h~_{t,k} + W^o_k [softmax(Q~_k K~^T / sqrt(d_c)) V~]    if k in S_t
        h_{t,k} = h~_{t,k}                                               otherwise
        with Q~_k, K~_k, V~_k = h~_{t,k} W^{q~}_k, h~_{t,k} W^{k~}_k, h~_{t,k} W^{v~}_k.

    The paper adds the attention output to h~ directly; W^o_k (our addition) maps the
    comm_value_size-wide read back to d_r, so the value width is free.

"Keep exactly" is ``torch.where`` with the active mask, not a multiplication by it: an inactive
RIM's state is bit-identical to the previous one and no gradient reaches the update it did not
use. A padded time step (``step_mask`` False) leaves every state unchanged.

Sizes and defaults. ``input_key_size``, ``input_value_size``, ``comm_key_size`` and
``comm_value_size`` are totals over the heads (each head gets size / heads, fairseq's
convention), so the cell input width is ``input_value_size`` whatever the head count. The
defaults follow the paper's appendix hyperparameter table: input keys (= queries) 64, input
values 400 (4 d_r at d_r = 100), communication keys (= queries) 32, communication values 32, 4
communication heads, and attention dropout 0.1 on both attentions; except the input heads. The
table gives 4 input heads; the reference code (anirudh9119/RIMs, ``n_head=1`` for the input
attention in both event_based/blocks_core.py and blocks_atari) and the copying-task setup use
1, and so does this default: the single head is what produced the published results, and
``input_heads=4`` (``--rim-input-heads 4``) gives the table's value. The dropouts default to 0
here (the plain module computes the equations exactly); the model sets the paper's 0.1 through
its flags. The reference code differs in details: 4 communication heads of key and value
width 16 each, a gated tanh communication output, and the update computed for all RIMs with
gradients blocked for inactive ones, so communication there reads the inactive RIMs' discarded
update where we (and the paper's prose) read their kept state; we follow the paper's equations
above. docs/fidelity.md lists every difference from the paper and the reference code, with
its reason.

``RIMLayer`` runs the recurrence over a sequence (the only Python loop is over time) and,
bidirectionally, a second cell over the reversed sequence, in one of two ways
(``recurrence``, the model's ``--rim-recurrence``):

* "stepwise": a ``RIMCell`` step per time step under autograd. What does not depend on the
  state is computed for all T steps before the loop: the input keys, and the cell's input term
  of the values (the cell's input map is linear, so it commutes with the attention average;
  see ``RIMCell.project_input``). Per step there remain one batched matmul of the previous h
  (cell hidden part and input query fused), the two-way input attention, the gate
  nonlinearities and the communication: ~34 kernel calls forward and ~70 backward in the
  model's configuration.
* "fused" (``rim_recurrence.py``): the same equations as one autograd function whose
  backward loop is written by hand, ~55 calls a step in all (~16 compiled,
  ``compile_recurrence``). On a GPU the launches are the cost; on the 2-core CPU the
  step-by-step loop is faster (autograd's per-op backward there beats the fused loop's
  larger precomputed tensors). "auto" (the default) takes "fused" off the CPU.

Measured on this project's 2-core CPU (torch 2.13, forward + backward, input 256, n = 6 RIMs of
100, top_k 4, attention dropout 0.1, min of 7 interleaved runs), against ``torch.nn.LSTM(256,
600)``: "stepwise" 1.09-1.12x (T = 32, B = 128) and 1.40-1.59x (T = 128, B = 32); "fused"
1.48-1.81x and 1.47-1.94x (two sessions of the same day; benchmarks/README.md has the encoder
benchmark).
"""

from typing import List, Mapping, Optional, Tuple, Union, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .device_paths import path_device
from .group_linear import GroupLinear
from .group_recurrent_cells import GroupGRUCell, GroupLSTMCell, gru_update, lstm_update
from .parameter_names import parameter_names
from .precision import at_least_fp32
from .rim_recurrence import run_rim_layer

#: (h, c), each (B, n, d_r); c is None for GRU cells
RIMState = Tuple[Tensor, Optional[Tensor]]

#: the recurrent cell of each RIM (``RIMCell``'s ``cell``)
CELL_TYPES = ("lstm", "gru")

#: how ``RIMLayer`` runs its time loop (``RIMLayer.uses_fused_recurrence``)
RECURRENCES = ("auto", "fused", "stepwise")


def check_rim_cell(input_size: int, num_rims: int, rim_size: int, top_k: int, *, cell: str = "lstm",
                   input_key_size: int = 64, input_value_size: int = 400, input_heads: int = 1,
                   comm_key_size: int = 32, comm_value_size: int = 32, comm_heads: int = 4,
                   communication: bool = True, input_dropout: float = 0.0, comm_dropout: float = 0.0,
                   names: Optional[Mapping[str, str]] = None):
    """ValueError unless ``RIMCell``'s parameters describe a cell that can be built: positive
    sizes, 1 <= k <= n, a known cell type, key and value widths that split evenly over their
    heads (the communication's only when there is communication), dropout in [0, 1).
    ``names``: what the caller calls each parameter (``parameter_names``)."""
    name = parameter_names(names)
    sizes = {"input_size": input_size, "num_rims": num_rims, "rim_size": rim_size,
             "input_heads": input_heads, "input_key_size": input_key_size, "input_value_size": input_value_size}
    if communication:
        sizes.update(comm_heads=comm_heads, comm_key_size=comm_key_size, comm_value_size=comm_value_size)
    for parameter, size in sizes.items():
        if size < 1:
            raise ValueError(f"{name[parameter]} must be >= 1, got {size}")
    if not 1 <= top_k <= num_rims:
        raise ValueError(f"{name['top_k']} ({top_k}) must be >= 1 and <= {name['num_rims']} ({num_rims})")
    if cell not in CELL_TYPES:
        raise ValueError(f"{name['cell']} must be one of {', '.join(CELL_TYPES)}, got {cell!r}")
    # each head owns width / heads units of the total key or value width
    divisible = [("input_key_size", "input_heads"), ("input_value_size", "input_heads")]
    if communication:
        divisible += [("comm_key_size", "comm_heads"), ("comm_value_size", "comm_heads")]
    for width, heads in divisible:
        if sizes[width] % sizes[heads] != 0:
            raise ValueError(f"{name[width]} ({sizes[width]}) must be divisible by {name[heads]} ({sizes[heads]})")
    for parameter, p in (("input_dropout", input_dropout), ("comm_dropout", comm_dropout)):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name[parameter]} must be in [0, 1), got {p}")


class RIMCell(nn.Module):
    """One time step of n RIMs of width ``rim_size`` (module docstring for the equations).

    Parameters: ``input_query`` GroupLinear(n, d_r -> input_key_size) (per RIM),
    ``input_key`` / ``input_value`` nn.Linear(input_size -> input_key_size / input_value_size)
    (shared, the null row's key/value are their biases), ``cell`` GroupLSTMCell or GroupGRUCell
    (n, input_value_size -> d_r), and with communication ``comm_qkv``
    GroupLinear(n, d_r -> 2 comm_key_size + comm_value_size) and ``comm_out``
    GroupLinear(n, comm_value_size -> d_r). ``learned_initial_state`` adds ``initial_h`` (and
    ``initial_c`` for LSTM), (n, d_r), initialised at zero.
    """

    def __init__(
        self,
        input_size: int,
        num_rims: int,
        rim_size: int,
        top_k: int,
        *,
        cell: str = "lstm",
        input_key_size: int = 64,
        input_value_size: int = 400,
        input_heads: int = 1,
        comm_key_size: int = 32,
        comm_value_size: int = 32,
        comm_heads: int = 4,
        communication: bool = True,
        input_dropout: float = 0.0,
        comm_dropout: float = 0.0,
        learned_initial_state: bool = False,
    ):
        super().__init__()
        check_rim_cell(input_size, num_rims, rim_size, top_k, cell=cell, input_key_size=input_key_size,
                       input_value_size=input_value_size, input_heads=input_heads, comm_key_size=comm_key_size,
                       comm_value_size=comm_value_size, comm_heads=comm_heads, communication=communication,
                       input_dropout=input_dropout, comm_dropout=comm_dropout)

        self.input_size = input_size
        self.num_rims = num_rims
        self.rim_size = rim_size
        self.top_k = top_k
        self.cell_type = cell
        self.input_key_size = input_key_size
        self.input_value_size = input_value_size
        self.input_heads = input_heads
        self.comm_key_size = comm_key_size
        self.comm_value_size = comm_value_size
        self.comm_heads = comm_heads
        self.communication = communication
        self.input_dropout = input_dropout
        self.comm_dropout = comm_dropout

        self.input_query = GroupLinear(num_rims, rim_size, input_key_size)
        self.input_key = nn.Linear(input_size, input_key_size)
        self.input_value = nn.Linear(input_size, input_value_size)
        for proj in (self.input_key, self.input_value):
            # Xavier as GroupLinear's; a zero bias makes the null key and value start at zero
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)
        self.cell: Union[GroupLSTMCell, GroupGRUCell]
        if cell == "lstm":
            self.cell = GroupLSTMCell(num_rims, input_value_size, rim_size)
        else:
            self.cell = GroupGRUCell(num_rims, input_value_size, rim_size)
        if communication:
            self.comm_qkv = GroupLinear(num_rims, rim_size, 2 * comm_key_size + comm_value_size)
            self.comm_out = GroupLinear(num_rims, comm_value_size, rim_size)
        self.initial_h: Optional[nn.Parameter]
        self.initial_c: Optional[nn.Parameter]
        if learned_initial_state:
            self.initial_h = nn.Parameter(torch.zeros(num_rims, rim_size))
            self.initial_c = nn.Parameter(torch.zeros(num_rims, rim_size)) if cell == "lstm" else None
        else:
            self.initial_h = None
            self.initial_c = None

    def initial_state(self, batch_size: int, device=None, dtype=None) -> RIMState:
        """Zeros, or the learned (n, d_r) state broadcast over the batch; never random."""
        ref = self.input_query.weight
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        shape = (batch_size, self.num_rims, self.rim_size)
        if self.initial_h is not None:
            h = self.initial_h.to(device=device, dtype=dtype).expand(shape)
            c = None if self.initial_c is None else self.initial_c.to(device=device, dtype=dtype).expand(shape)
            return h, c
        h = torch.zeros(shape, device=device, dtype=dtype)
        return h, (torch.zeros(shape, device=device, dtype=dtype) if self.cell_type == "lstm" else None)

    def project_input(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The state-independent part of a step, for inputs x (..., input_size); ``RIMLayer``
        calls it once for all T steps.

        Returns the keys (..., H, d_k, 2) of [null, x] and the cell's input-side
        pre-activations of the values: gate_x (..., n, H, G) of x's value and gate_null
        (n, H, G) of the null row's (G = 4 d_r for LSTM, 3 d_r for GRU). The cell's input map is
        linear, so mapping each value row before the attention average,

            A_k W^x_k = sum_h sum_{j in null, x} p_{k,h,j} (V_{j,h} W^x_{k,h}),

        is exactly the cell's input term; it moves the widest matmul of the step (input_value_size
        rows per RIM) out of the time loop into one large one. The null row goes through the
        same maps as a zero input: its key and value are the biases.
        """
        heads, n = self.input_heads, self.num_rims
        lead = x.shape[:-1]
        null = x.new_zeros(1, self.input_size)
        k_null = self.input_key(null).view(heads, -1)
        k_x = self.input_key(x).view(*lead, heads, -1)
        keys = torch.stack([k_null.expand_as(k_x), k_x], dim=-1)
        # (n, H, d_v, G): RIM k's input rows, split by the head whose value they read
        w_cell = self.cell.input_weight.reshape(n, heads, self.input_value_size // heads, -1)
        # the null value is the value bias b^v, so V_x = x W^v + V_null
        gate_null = torch.einsum("hv,khvg->khg", self.input_value(null).view(heads, -1), w_cell)
        rows = x.numel() // self.input_size
        gate_width = n * heads * w_cell.size(-1)
        value_size = self.input_value_size
        if rows * value_size * (self.input_size + gate_width) > (value_size + rows) * self.input_size * gate_width:
            # many rows (a whole sequence): compose W^v with the cell's input rows first, one
            # (input_size x n H G) map, narrower than going through the input_value_size values
            w_value = self.input_value.weight.t().reshape(self.input_size, heads, -1)  # (in, H, d_v)
            composed = torch.einsum("ihv,khvg->ikhg", w_value, w_cell).reshape(self.input_size, gate_width)
            gate_x = torch.matmul(x, composed)
            gate_x = gate_x.view(*lead, n, heads, -1) + gate_null
        else:
            values = self.input_value(x).view(*lead, heads, -1)
            gate_x = torch.einsum("...hv,khvg->...khg", values, w_cell)
        return keys, gate_x, gate_null

    def recurrent_weights(self) -> Tuple[Tensor, Optional[Tensor]]:
        """The maps of the previous h, fused: (n, d_r, G_h + input_key_size) weights and
        (n, G_h + input_key_size) bias, [cell hidden part | input query], so one batched matmul
        per step serves both. Built once per sequence by ``RIMLayer``."""
        weight = torch.cat([self.cell.hidden_weight, self.input_query.weight], dim=-1)
        biases = [self.cell.hidden_bias, self.input_query.bias]
        if biases[0] is None and biases[1] is None:
            return weight, None
        widths = (self.cell.hidden_weight.size(-1), self.input_key_size)
        bias = torch.cat([b if b is not None else weight.new_zeros(self.num_rims, w)
                          for b, w in zip(biases, widths)], -1)
        return weight, bias

    def forward(self, x: Tensor, state: RIMState, step_mask: Optional[Tensor] = None) -> Tuple[RIMState, Tensor]:
        """One step: x (B, input_size), state (h, c) each (B, n, d_r), step_mask (B,) bool (True =
        a real token) -> (new state, active (B, n) bool). On a padding step the state is returned
        unchanged and no RIM is active."""
        keys, gate_x, gate_null = self.project_input(x)
        return self.step(keys, gate_x, gate_null, self.recurrent_weights(), state, step_mask)

    def step(
        self,
        keys: Tensor,
        gate_x: Tensor,
        gate_null: Tensor,
        recurrent: Tuple[Tensor, Optional[Tensor]],
        state: RIMState,
        step_mask: Optional[Tensor] = None,
    ) -> Tuple[RIMState, Tensor]:
        """``forward`` from one step's ``project_input`` (keys (B, H, d_k, 2), gate_x
        (B, n, H, G), gate_null (n, H, G)) and ``recurrent_weights()``."""
        h, c = state
        batch, n, heads = h.size(0), self.num_rims, self.input_heads
        weight, bias = recurrent

        # previous h through [cell hidden part | query], all RIMs in one batched matmul
        h_groups = h.transpose(0, 1)  # (n, B, d_r), a view
        if bias is None:
            proj = torch.bmm(h_groups, weight)
        else:
            proj = torch.baddbmm(bias.unsqueeze(1), h_groups, weight)
        gate_h, q = proj.transpose(0, 1).split([weight.size(-1) - self.input_key_size, self.input_key_size], -1)

        # input attention: (B, H, n, d_k) @ (B, H, d_k, 2) -> logits of [null, x] per RIM and head
        q = q.reshape(batch, n, heads, -1).transpose(1, 2)
        logits = torch.matmul(q, keys.to(q.dtype)) * (q.size(-1) ** -0.5)
        probs = torch.softmax(logits.to(at_least_fp32(logits)), dim=-1)
        active = self._select(probs[..., 0].mean(dim=1))
        p = F.dropout(probs, self.input_dropout, self.training).transpose(1, 2)  # (B, n, H, 2)
        gates_in = p[..., 0:1] * gate_null + p[..., 1:2] * gate_x  # (B, n, H, G)
        gates_in = gates_in.sum(dim=2) if heads > 1 else gates_in.squeeze(2)

        # independent dynamics; where (not a multiplication by the mask) keeps inactive RIMs
        # bit-exact and sends no gradient into the update they discard
        keep = active.unsqueeze(-1)
        if c is not None:
            h_upd, c_upd = lstm_update(gates_in + gate_h, c)
            c_new: Optional[Tensor] = torch.where(keep, c_upd.to(c.dtype), c)
        else:
            input_bias = self.cell.input_bias
            if input_bias is not None:
                gates_in = gates_in + input_bias
            h_upd = gru_update(gates_in, gate_h, h)
            c_new = None
        h_new = torch.where(keep, h_upd.to(h.dtype), h)

        if self.communication:
            h_new = torch.where(keep, h_new + self._communicate(h_new).to(h.dtype), h_new)

        if step_mask is not None:
            real = step_mask.view(batch, 1, 1)
            h_new = torch.where(real, h_new, h)
            if c is not None and c_new is not None:
                c_new = torch.where(real, c_new, c)
            active = active & real.view(batch, 1)
        return (h_new, c_new), active

    def _select(self, null_prob: Tensor) -> Tensor:
        """(B, n) null-attention probabilities -> (B, n) bool, True for the top_k smallest."""
        if self.top_k == self.num_rims:
            return torch.ones_like(null_prob, dtype=torch.bool)
        # a stable sort breaks ties by RIM index (torch.topk does not promise an order)
        chosen = torch.argsort(null_prob, dim=-1, stable=True)[:, : self.top_k]
        return torch.zeros_like(null_prob, dtype=torch.bool).scatter_(-1, chosen, True)

    def _communicate(self, h: Tensor) -> Tensor:
        """Multi-head attention of every RIM over all RIMs: h (B, n, d_r) -> W^o_k read (B, n, d_r)."""
        batch, n, heads = h.size(0), self.num_rims, self.comm_heads
        qkv = self.comm_qkv(h.reshape(batch, -1)).view(batch, n, -1)
        q, k, v = qkv.split([self.comm_key_size, self.comm_key_size, self.comm_value_size], dim=-1)
        q = q.reshape(batch, n, heads, -1).transpose(1, 2)  # (B, H_c, n, d)
        k = k.reshape(batch, n, heads, -1).transpose(1, 2)
        v = v.reshape(batch, n, heads, -1).transpose(1, 2)
        logits = torch.matmul(q, k.transpose(-1, -2)) * (q.size(-1) ** -0.5)  # (B, H_c, n, n)
        weights = torch.softmax(logits.to(at_least_fp32(logits)), dim=-1)
        weights = F.dropout(weights, self.comm_dropout, self.training).to(v.dtype)
        read = torch.matmul(weights, v).transpose(1, 2).reshape(batch, n * self.comm_value_size)
        return self.comm_out(read).view(batch, n, self.rim_size)

    def extra_repr(self) -> str:
        return (
            f"input_size={self.input_size}, num_rims={self.num_rims}, rim_size={self.rim_size}, "
            f"top_k={self.top_k}, cell={self.cell_type}, input_heads={self.input_heads}, "
            f"communication={self.communication}, comm_heads={self.comm_heads}"
        )


class RIMLayer(nn.Module):
    """One RIM layer run over a sequence (the time loop), optionally bidirectional (two RIMCells).

    ``forward(x (T, B, input_size), padding_mask (B, T) bool, True = pad)`` returns

    * outputs (T, B, output_size): the concatenated RIM h after each step, [forward, backward]
      directions concatenated; zero at padded positions;
    * final_h, final_c (B, output_size) (final_c None for GRU): each direction's state after its
      last real token (for the backward direction the first real token in time);
    * active (T, B, num_directions, n) bool, False at padded positions.

    Padded steps leave the state unchanged, so any padding pattern (fairseq pads sources on the
    left) gives the same outputs at the real positions as the unpadded sentence.

    ``recurrence``: "stepwise", "fused" or "auto" (module docstring; ``uses_fused_recurrence``);
    ``compile_recurrence``: the fused loop's steps through ``torch.compile``. Neither changes
    the results, only how many kernels compute them.
    """

    def __init__(self, input_size: int, num_rims: int, rim_size: int, top_k: int, *,
                 bidirectional: bool = False, recurrence: str = "auto", compile_recurrence: bool = False,
                 **rim_cell_kwargs):
        super().__init__()
        if recurrence not in RECURRENCES:
            raise ValueError(f"recurrence must be one of {', '.join(RECURRENCES)}, got {recurrence!r}")
        self.recurrence = recurrence
        self.compile_recurrence = compile_recurrence
        self.input_size = input_size
        self.num_rims = num_rims
        self.rim_size = rim_size
        self.bidirectional = bidirectional
        self.num_directions = 2 if bidirectional else 1
        self.cells = nn.ModuleList(
            RIMCell(input_size, num_rims, rim_size, top_k, **rim_cell_kwargs) for _ in range(self.num_directions)
        )
        self.output_size = num_rims * rim_size * self.num_directions

    def forward(
        self, x: Tensor, padding_mask: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
        seq_len, batch, _ = x.shape
        steps_real: Optional[Tensor] = None
        if padding_mask is not None and bool(padding_mask.any()):
            steps_real = ~padding_mask.t()  # (T, B), True = real token
        if self.uses_fused_recurrence(x):
            out, final_h, final_c, active = run_rim_layer(self.cells, x, steps_real, self.compile_recurrence)
            if steps_real is not None:
                out = out.masked_fill(~steps_real.unsqueeze(-1), 0.0)
            return out, final_h, final_c, active
        width = self.num_rims * self.rim_size
        state_dtype = x.dtype if x.is_floating_point() else None

        outputs: List[Tensor] = []
        finals_h: List[Tensor] = []
        finals_c: List[Tensor] = []
        actives: List[Tensor] = []
        for direction, module in enumerate(self.cells):
            cell = cast(RIMCell, module)  # what __init__ put in the ModuleList
            # all T at once: they do not depend on the state. unbind, not keys[t]: the backward of
            # T selections would zero-fill and accumulate a (T, ...) gradient per step
            keys, gate_x, gate_null = cell.project_input(x)
            keys_t, gate_x_t = keys.unbind(0), gate_x.unbind(0)
            recurrent = cell.recurrent_weights()
            state = cell.initial_state(batch, device=x.device, dtype=state_dtype)
            order = range(seq_len) if direction == 0 else range(seq_len - 1, -1, -1)
            hs: List[Tensor] = [x] * seq_len  # placeholders, every index is filled below
            act: List[Tensor] = [x] * seq_len
            for t in order:
                real_t = None if steps_real is None else steps_real[t]
                state, act[t] = cell.step(keys_t[t], gate_x_t[t], gate_null, recurrent, state, real_t)
                hs[t] = state[0]
            outputs.append(torch.stack(hs).view(seq_len, batch, width))
            actives.append(torch.stack(act))
            finals_h.append(state[0].reshape(batch, width))
            if state[1] is not None:
                finals_c.append(state[1].reshape(batch, width))

        out = torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]
        if steps_real is not None:
            out = out.masked_fill(~steps_real.unsqueeze(-1), 0.0)
        final_h = torch.cat(finals_h, dim=-1) if len(finals_h) > 1 else finals_h[0]
        final_c = None
        if finals_c:
            final_c = torch.cat(finals_c, dim=-1) if len(finals_c) > 1 else finals_c[0]
        return out, final_h, final_c, torch.stack(actives, dim=2)

    def uses_fused_recurrence(self, x: Tensor) -> bool:
        """Whether ``forward(x)`` runs ``rim_recurrence.RIMRecurrence``: always with
        ``recurrence="fused"``, never with "stepwise", and with "auto" off the CPU
        (``device_paths.path_device``), where a step's kernel launches are its cost; on the CPU
        the step-by-step loop, whose autograd backward is faster there, runs."""
        if self.recurrence == "stepwise":
            return False
        return self.recurrence == "fused" or path_device(x) != "cpu"

    def extra_repr(self) -> str:
        return (f"output_size={self.output_size}, bidirectional={self.bidirectional}, "
                f"recurrence={self.recurrence}, compile_recurrence={self.compile_recurrence}")
