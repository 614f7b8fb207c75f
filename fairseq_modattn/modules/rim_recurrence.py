"""A whole RIM layer's recurrence as one autograd function: a forward loop and a hand-written
backward loop of a few batched kernels per time step (``RIMRecurrence``), for LSTM and GRU
cells.

``RIMCell.step`` (rim.py) computes one step with ~34 ATen calls, and autograd adds ~70 more
in backward (the model's configuration): on a GPU, where each call is a kernel launch of
~10 µs, the step runs at the speed of its launches. This module computes the same equations
(rim.py's docstring) with ~24 calls forward and ~31 backward, by three exact rewrites and one
change of where work happens:

1. Two-way input attention is a sigmoid. RIM k attends over [null, x_t] only, so with
   s = q_k . (k_x - k_null) / sqrt(d_k) its probabilities are p_null = sigmoid(-s) and
   p_x = sigmoid(s). k_x - k_null = x W^k (the null key is the bias b^k), and q_k = h W^q_k +
   b^q_k, so s = h . u_t + c_t with u_t = W^q_k (x_t W^k) / sqrt(d_k) and c_t = b^q_k .
   (x_t W^k) / sqrt(d_k): both are state-independent and are computed for all T steps before
   the loop. Per step, s is one batched (1 x d_r) @ (d_r x H) product for all RIMs.
2. The cell input is affine in p_x. The cell's input map is linear (``RIMCell.project_input``),
   so RIM k's input pre-activation (the LSTM's gates, a GRU's input side) is
   p_null g_null + p_x g_x = g_null + p_x (g_x - g_null);
   with input-attention dropout masks m (drawn for all steps at once),
   m_null p_null g_null + m_x p_x g_x = m_null g_null + p_x (m_x g_x - m_null g_null).
   The addend (with the cell's bias) and the difference are precomputed; per step the
   pre-activations are one baddbmm of the previous h plus one addcmul (or a batched product
   over heads) of p_x.
3. Selection ranks by the heads' summed p_x, descending, where rim.py ranks by their mean
   p_null, ascending: the same order (mean p_null = 1 - sum p_x / H); a stable sort keeps the
   lower RIM index first on ties, as there.
4. The backward loop carries only what depends on the next step (dh, dc) through the
   recurrence; the parameter gradients (the cell's hidden weights, the communication maps)
   and the input-side gradients (of u, c, the addend, the difference) are formed after the
   loop from the saved per-step tensors, each in one large batched product over all T steps.

Both directions of a bidirectional layer run in the same loop: their RIMs are the groups
[direction 0's n RIMs, direction 1's n RIMs] of every batched product, and direction 1 reads
the time-reversed inputs. Tensors inside the loop are RIM-major, (m, B, ...) with m = D n
RIMs in all, so each group's batched matmul reads its rows without a copy.

Numerics: the loop computes in fp32 (fp64 for fp64 inputs) whatever the input dtype, with
autocast off (a recurrence accumulates rounding over T steps; rim.py's softmaxes were fp32
already). Inactive RIMs keep their state with ``torch.where``: bit-exact, and their discarded
update gets no gradient.

Compiled (``compiled=True``, the model's ``--rim-compile``): the two step functions,
``_forward_step`` and ``_backward_step``, go through ``torch.compile(fullgraph=True,
dynamic=True)``; each becomes a few fused kernels around its matmuls, ~16 calls a step in all.
Being functions of tensors without autograd (the backward is the hand-written one), they
compile as plain inference graphs, with no backward derived by AOTAutograd (torch 2.13's CPU
inductor has produced wrong gradients on such a derived backward of RIM-like gate code). A
failure to compile is logged once and the steps run eagerly.
"""

import inspect
import logging
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

logger = logging.getLogger(__name__)


class RecurrenceShape(NamedTuple):
    """What the loop needs to know besides tensors (static for a layer)."""

    cell: str  # "lstm" or "gru"
    num_directions: int
    num_rims: int  # n, per direction
    top_k: int
    communication: bool
    comm_heads: int
    comm_key_size: int  # totals over the heads
    comm_value_size: int


def _tanh_backward(grad: Tensor, output: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """grad * (1 - output^2), the gradient through output = tanh(input)."""
    if out is None:
        return torch.ops.aten.tanh_backward(grad, output)
    return torch.ops.aten.tanh_backward.grad_input(grad, output, grad_input=out)


def _sigmoid_backward(grad: Tensor, output: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """grad * output * (1 - output), the gradient through output = sigmoid(input)."""
    if out is None:
        return torch.ops.aten.sigmoid_backward(grad, output)
    return torch.ops.aten.sigmoid_backward.grad_input(grad, output, grad_input=out)


def _into(out: Tensor, fn, *args, **kwargs) -> None:
    """``fn(*args, out=out)``: in eager mode the result is written into the (strided) view
    ``out`` directly; ``torch.compile`` takes no non-contiguous ``out=``, so there the result is
    copied into it, which inductor fuses with the computation."""
    if torch.compiler.is_compiling():
        out.copy_(fn(*args, **kwargs))
    elif fn is torch.softmax:  # torch.softmax takes no out=; its ATen op does
        torch.ops.aten._softmax.out(*args, kwargs["dim"], False, out=out)
    else:
        fn(*args, **kwargs, out=out)


def _select(shape: RecurrenceShape, p: Tensor, real: Tensor, active: Tensor) -> None:
    """Writes the active set of one step into ``active`` (m, B) bool: per direction and batch
    row, the top_k RIMs with the largest summed p_x (= least mean null attention), ties to the
    lower index; none where ``real`` (D, 1, B) is False."""
    heads = p.size(-1)
    key = p.squeeze(-1) if heads == 1 else p.sum(-1)  # (m, B)
    d, n, k = shape.num_directions, shape.num_rims, shape.top_k
    batch = key.size(1)
    if k == n:
        active.view(d, n, batch).copy_(real.expand(d, n, batch))
        return
    chosen = torch.argsort(key.view(d, n, batch), dim=1, descending=True, stable=True)[:, :k]
    active.view(d, n, batch).scatter_(1, chosen, real.expand(d, k, batch))


class _Buffers(NamedTuple):
    """What the forward loop writes, one (T, ...) tensor per quantity, for the backward loop.

    ============ =============================== ====================================
    field        LSTM                            GRU
    ============ =============================== ====================================
    sig          sigmoid of i, f, g, o (4 d)     sigmoid of r, z (2 d)
    cand         tanh(g)                         n = tanh(...)
    aux          tanh(c')                        h - n
    hidden       -                               h U + b_h, the hidden pre-activation (3 d)
    c            c before (T + 1 steps)          -
    ============ =============================== ====================================

    and for both: active (T, m, B) bool, h (T, m, B, d) the state after each step (the layer's
    outputs), p (T, m, B, H) the attention to x, and with communication h_next (before it),
    qkv, the softmax weights (T, D, n, n, B, Hc), their dropped-out form and the read.
    """

    active: Tensor
    h: Tensor
    c: Optional[Tensor]
    sig: Tensor
    cand: Tensor
    aux: Tensor
    hidden: Optional[Tensor]
    p: Tensor
    h_next: Optional[Tensor]
    qkv: Optional[Tensor]
    weights: Optional[Tensor]
    dropped: Optional[Tensor]
    read: Optional[Tensor]

    @classmethod
    def allocate(cls, shape: RecurrenceShape, steps: int, h: Tensor, heads: int, dropout: bool,
                 save: bool) -> "_Buffers":
        """With ``save``, room for every step; without (no backward will run), the outputs and
        one step's room for the rest (c alternates between two)."""
        m, batch, d = h.shape
        room = steps if save else 1
        new = h.new_empty
        lstm, comm = shape.cell == "lstm", shape.communication
        dirs, n, hc = shape.num_directions, shape.num_rims, shape.comm_heads
        return cls(
            active=torch.zeros(steps, m, batch, dtype=torch.bool, device=h.device),
            h=new(steps, m, batch, d),
            c=new(steps + 1 if save else 2, m, batch, d) if lstm else None,
            sig=new(room, m, batch, (4 if lstm else 2) * d),
            cand=new(room, m, batch, d),
            aux=new(room, m, batch, d),
            hidden=None if lstm else new(room, m, batch, 3 * d),
            p=new(room, m, batch, heads),
            h_next=new(room, m, batch, d) if comm else None,
            qkv=new(room, m, batch, 2 * shape.comm_key_size + shape.comm_value_size) if comm else None,
            weights=new(room, dirs, n, n, batch, hc) if comm else None,
            dropped=new(room, dirs, n, n, batch, hc) if comm and dropout else None,
            read=new(room, m, batch, shape.comm_value_size) if comm else None,
        )

    def at(self, t: int, save: bool) -> "_Buffers":
        """Step t's views (c: the state after step t)."""
        i = t if save else 0
        c = None if self.c is None else self.c[t + 1 if save else (t + 1) % 2]
        return _Buffers(self.active[t], self.h[t], c, *(None if b is None else b[i] for b in self[3:]))


def _forward_step(shape: RecurrenceShape, h, c, real_t, mask_t, addend_t, diff_t, u_t, c_u_t, w_h, b_h, w_qkv,
                  b_qkv, w_o, b_o, out: _Buffers):
    """One step from state (h, c) (m, B, d; c None for GRU): writes the active set, the new
    state and what backward needs into step t's views ``out`` (``_Buffers.at``)."""
    m, batch, d = h.shape
    heads = u_t.size(-1)

    # input attention: s = h . u_t + c_t for every RIM and head, p_x = sigmoid(s)
    s = torch.baddbmm(c_u_t.view(m * batch, 1, heads), h.reshape(m * batch, 1, d), u_t.view(m * batch, d, heads))
    p = torch.sigmoid(s.view(m, batch, heads), out=out.p)
    _select(shape, p, real_t, out.active)
    a = out.active.unsqueeze(-1)  # (m, B, 1)

    if shape.cell == "lstm":
        # gates = addend + h W_h + p_x diff (summed over heads)
        gates = torch.baddbmm(addend_t, h, w_h)  # (m, B, 4d)
        if heads == 1:
            gates.addcmul_(p, diff_t.view(m, batch, -1))
        else:
            width = gates.size(-1)
            gates = torch.baddbmm(gates.view(m * batch, 1, width), p.view(m * batch, 1, heads),
                                  diff_t.view(m * batch, heads, width)).view(m, batch, width)
        sig = torch.sigmoid(gates, out=out.sig)
        tanh_g = torch.tanh(gates[..., 2 * d:3 * d], out=out.cand)
        i, f, _, o = sig.view(m, batch, 4, d).unbind(2)
        c_upd = f * c
        c_upd.addcmul_(i, tanh_g)
        torch.where(a, c_upd, c, out=out.c)
        h_upd = o * torch.tanh(c_upd, out=out.aux)
    else:
        # input side gi = addend + p_x diff, hidden side gh = h U + b_h; torch.nn.GRUCell's update
        gh = torch.bmm(h, w_h, out=out.hidden) if b_h is None else torch.baddbmm(b_h, h, w_h, out=out.hidden)
        if heads == 1:
            gi = torch.addcmul(addend_t, p, diff_t.view(m, batch, -1))
        else:
            gi = torch.bmm(p.view(m * batch, 1, heads), diff_t.view(m * batch, heads, -1)).view(m, batch, -1)
            gi = gi.add_(addend_t)
        rz = torch.sigmoid(gi[..., :2 * d] + gh[..., :2 * d], out=out.sig)
        r, z = rz[..., :d], rz[..., d:]
        cand = torch.tanh(torch.addcmul(gi[..., 2 * d:], r, gh[..., 2 * d:]), out=out.cand)
        h_upd = torch.addcmul(cand, z, torch.sub(h, cand, out=out.aux))  # n + z (h - n)

    if not shape.communication:
        torch.where(a, h_upd, h, out=out.h)
        return
    # communication: h_t = h_next + [active] W_o read(h_next)
    dirs, n, hc, ck = shape.num_directions, shape.num_rims, shape.comm_heads, shape.comm_key_size
    h_next = torch.where(a, h_upd, h, out=out.h_next)
    qkv = torch.baddbmm(b_qkv, h_next, w_qkv, out=out.qkv)  # (m, B, 2ck + cv); q is pre-scaled
    q = qkv[..., :ck].view(dirs, n, 1, batch, hc, -1)
    k = qkv[..., ck:2 * ck].view(dirs, 1, n, batch, hc, -1)
    v = qkv[..., 2 * ck:].view(dirs, 1, n, batch, hc, -1)
    weights = out.weights  # (D, n_query, n_key, B, Hc)
    _into(weights, torch.softmax, (q * k).sum(-1), dim=2)
    dropped = weights if mask_t is None else torch.mul(weights, mask_t, out=out.dropped)
    _into(out.read.view(dirs, n, batch, hc, -1), torch.sum, dropped.unsqueeze(-1) * v, dim=2)
    torch.where(a, torch.baddbmm(b_o, out.read, w_o).add_(h_next), h_next, out=out.h)


def _backward_step(shape: RecurrenceShape, dh, dc, zero, grad_t, mask_t, diff_t, u_t, saved: _Buffers, c_prev_t,
                   d_in_t, d_hid_t, ds_t, dqkv_t, dout_t, w_h_t, w_qkv_t, w_o_t):
    """One step of the backward loop: from the gradients dh, dc of the state after step t to
    those of the state before it (dc None for GRU). Writes the step's gradients of the
    input-side pre-activations (``d_in_t``), of the hidden side (``d_hid_t``; None for LSTM,
    whose two sides are summed: ``d_in_t`` is both, and passing one buffer twice would alias
    two mutated inputs of a compiled step), of s (``ds_t``), of qkv (``dqkv_t``) and of the
    communication output (``dout_t``); the parameter gradients are formed from them after the
    loop. ``saved``: step t's ``_Buffers`` views. ``zero`` is a 0-dim zero of the gradients'
    dtype (``where`` with ``out=`` takes no Python scalar)."""
    m, batch, d = dh.shape
    heads = u_t.size(-1)
    a = saved.active.unsqueeze(-1)
    gh = dh + grad_t
    if shape.communication:
        dirs, n, hc, ck = shape.num_directions, shape.num_rims, shape.comm_heads, shape.comm_key_size
        torch.where(a, gh, zero, out=dout_t)
        d_read = torch.bmm(dout_t, w_o_t).view(dirs, n, 1, batch, hc, -1)
        qkv, weights = saved.qkv, saved.weights
        q = qkv[..., :ck].view(dirs, n, 1, batch, hc, -1)
        k = qkv[..., ck:2 * ck].view(dirs, 1, n, batch, hc, -1)
        v = qkv[..., 2 * ck:].view(dirs, 1, n, batch, hc, -1)
        dropped = weights if mask_t is None else saved.dropped
        d_dropped = (d_read * v).sum(-1)  # (D, n, n, B, Hc)
        _into(dqkv_t[..., 2 * ck:].view(dirs, n, batch, hc, -1), torch.sum, dropped.unsqueeze(-1) * d_read, dim=1)
        if mask_t is not None:
            d_dropped = d_dropped * mask_t
        d_logits = torch._softmax_backward_data(d_dropped, weights, 2, weights.dtype).unsqueeze(-1)
        _into(dqkv_t[..., :ck].view(dirs, n, batch, hc, -1), torch.sum, d_logits * k, dim=2)
        _into(dqkv_t[..., ck:2 * ck].view(dirs, n, batch, hc, -1), torch.sum, d_logits * q, dim=1)
        dh_next = torch.baddbmm(gh, dqkv_t, w_qkv_t)
    else:
        dh_next = gh

    # the cell update by hand; inactive RIMs get zero pre-activation gradients and pass dh
    # (and dc) through unchanged
    if shape.cell == "lstm":
        sig = saved.sig.view(m, batch, 4, d)
        i, f, _, o = sig.unbind(2)
        dc_upd = dc + _tanh_backward(dh_next * o, saved.aux)
        dg = d_in_t.view(m, batch, 4, d)
        _into(dg[:, :, 0], torch.mul, dc_upd, saved.cand)
        _into(dg[:, :, 1], torch.mul, dc_upd, c_prev_t)
        _into(dg[:, :, 3], torch.mul, dh_next, saved.aux)
        d_tanh_g = dc_upd * i
        _sigmoid_backward(dg, sig, out=dg)
        _into(dg[:, :, 2], _tanh_backward, d_tanh_g, saved.cand)
        torch.where(a, d_in_t, zero, out=d_in_t)
        dc = torch.where(a, dc_upd * f, dc)
        dh = torch.where(a, zero, dh_next)
        d_hid_t = d_in_t
    else:
        r, z = saved.sig[..., :d], saved.sig[..., d:]
        dh_z = dh_next * z
        _into(d_in_t[..., d:2 * d], torch.mul, dh_next, saved.aux)  # dz = dh (h - n)
        d_cand = d_in_t[..., 2 * d:]
        _into(d_cand, _tanh_backward, dh_next - dh_z, saved.cand)  # dn = dh (1 - z), through tanh
        _into(d_in_t[..., :d], torch.mul, d_cand, saved.hidden[..., 2 * d:])  # dr
        _into(d_in_t[..., :2 * d], _sigmoid_backward, d_in_t[..., :2 * d], saved.sig)
        _into(d_hid_t[..., 2 * d:], torch.mul, d_cand, r)
        d_hid_t[..., :2 * d].copy_(d_in_t[..., :2 * d])
        torch.where(a, d_in_t, zero, out=d_in_t)
        torch.where(a, d_hid_t, zero, out=d_hid_t)
        dh = torch.where(a, dh_z, dh_next)
    dh = torch.baddbmm(dh, d_hid_t, w_h_t)

    # the input attention: the pre-activations depend on h through p_x = sigmoid(h . u + c)
    dp = torch.bmm(diff_t.view(m * batch, heads, -1), d_in_t.view(m * batch, -1, 1))  # (m B, H, 1)
    _sigmoid_backward(dp.view(m, batch, heads), saved.p, out=ds_t)
    dh = torch.baddbmm(dh.view(m * batch, 1, d), ds_t.view(m * batch, 1, heads),
                       u_t.transpose(-1, -2).reshape(m * batch, heads, d)).view(m, batch, d)
    return dh, dc


def _forward_loop(shape: RecurrenceShape, real, comm_mask, addend, diff, u, c_u, w_h, b_h, w_qkv, b_qkv, w_o, b_o,
                  h, c, save: bool, step=_forward_step) -> _Buffers:
    """The recurrence from (h, c): the ``_Buffers`` it wrote (with ``save``, every step's)."""
    steps = diff.size(0)
    buffers = _Buffers.allocate(shape, steps, h, u.size(-1), comm_mask is not None, save)
    if c is not None:
        buffers.c[0].copy_(c)
        c = buffers.c[0]
    for t in range(steps):
        addend_t = addend[0] if addend.size(0) == 1 else addend[t]
        mask_t = None if comm_mask is None else comm_mask[t]
        out = buffers.at(t, save)
        step(shape, h, c, real[t], mask_t, addend_t, diff[t], u[t], c_u[t], w_h, b_h, w_qkv, b_qkv, w_o, b_o, out)
        h, c = out.h, out.c
    return buffers


#: the ``torch.compile`` backend of ``compiled=True`` (a test may choose another)
COMPILE_BACKEND = "inductor"
#: graphs each compiled step function may hold (``_step_functions``)
RECOMPILE_LIMIT = 64


class _Compiled:
    """The compiled step functions (built at first use) and whether compiling failed."""

    steps: Optional[Tuple] = None
    failed = False


def compile_failed() -> bool:
    """Whether compiling the step functions failed in this process (they then run eagerly)."""
    return _Compiled.failed


def reset_compiled() -> None:
    """Forget the compiled functions and a failure (a test that changes ``COMPILE_BACKEND``)."""
    _Compiled.steps, _Compiled.failed = None, False


def _with_fallback(compiled_fn, eager_fn):
    """``compiled_fn``, or, from its first failure on (no C++ compiler, an unsupported torch),
    ``eager_fn`` with one log line. A failure happens while compiling, before the step has
    written anything, so the eager call redoes the same step."""

    def step(*args):
        if not _Compiled.failed:
            try:
                return compiled_fn(*args)
            except Exception as error:  # noqa: BLE001 - any failure of the compiler: run eagerly
                _Compiled.failed = True
                summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
                logger.warning("RIM recurrence: torch.compile failed (%s: %s); the steps run eagerly",
                               type(error).__name__, summary[:300])
        return eager_fn(*args)

    return step


def _step_functions(compiled: bool):
    """(forward step, backward step): the eager functions, or both through
    ``torch.compile(fullgraph=True, dynamic=True)``: each becomes a few fused kernels around
    its matmuls, compiled once per configuration (``RecurrenceShape`` is a constant of the
    graph; sizes are symbolic)."""
    if not compiled:
        return _forward_step, _backward_step
    if _Compiled.steps is None:
        # dynamo specialises the storage offsets 0 and 1 of the step views (x[t] at t = 0, 1)
        # and compiles them apart: three graphs a configuration, more than its default
        # recompile limit allows once a model has several; each function gets its own limit
        limits: Dict[str, Any] = {}  # torch.compile keywords of newer torch releases
        if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
            limits = dict(isolate_recompiles=True, recompile_limit=RECOMPILE_LIMIT)
        _Compiled.steps = tuple(
            _with_fallback(torch.compile(fn, fullgraph=True, dynamic=True, backend=COMPILE_BACKEND, **limits), fn)
            for fn in (_forward_step, _backward_step)
        )
    return _Compiled.steps


class RIMRecurrence(torch.autograd.Function):
    """(shape, compiled, real, comm_mask, addend, diff, u, c_u, w_h, b_h, w_qkv, b_qkv, w_o, b_o,
    h0, c0) -> (hs (T, m, B, d), c_last (m, B, d) or None, active (T, m, B) bool).

    real (T, D, 1, B) bool; comm_mask (T, D, n, n, B, Hc) or None; addend (T or 1, m, B or 1,
    G) the input-side pre-activation's constant part (LSTM: with the cell's bias); diff (T, m,
    B, H, G); u (T, m, B, d, H); c_u (T, m, B, H); w_h (m, d, G_h) and b_h (m, 1, G_h) or None
    the hidden side (LSTM: G_h = G = 4d, b_h None; GRU: G = G_h = 3d); w_qkv (m, d, 2ck + cv)
    with the query columns scaled by the communication's 1 / sqrt(d_c); b_qkv (m, 1, 2ck +
    cv); w_o (m, cv, d); b_o (m, 1, d) (the four None without communication); h0, c0 (m, B,
    d) (c0 None for GRU). The module docstring gives the equations; all floating tensors share
    one dtype (fp32 or fp64). ``compiled``: the step functions through ``torch.compile``.
    """

    @staticmethod
    def forward(ctx, shape, compiled, real, comm_mask, addend, diff, u, c_u, w_h, b_h, w_qkv, b_qkv, w_o, b_o, h0, c0):
        save = any(ctx.needs_input_grad)
        buffers = _forward_loop(shape, real, comm_mask, addend, diff, u, c_u, w_h, b_h, w_qkv, b_qkv, w_o, b_o,
                                h0, c0, save, _step_functions(compiled)[0])
        c_last = None
        if buffers.c is not None:
            c_last = buffers.c[-1 if save else diff.size(0) % 2].clone()
        ctx.mark_non_differentiable(buffers.active)
        ctx.shape, ctx.compiled = shape, compiled
        if save:
            ctx.save_for_backward(comm_mask, addend, diff, u, w_h, w_qkv, w_o, h0, *buffers)
        return buffers.h, c_last, buffers.active

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hs, grad_c_last, _grad_active):
        shape = ctx.shape
        comm_mask, addend, diff, u, w_h, w_qkv, w_o, h0, *rest = ctx.saved_tensors
        saved = _Buffers(*rest)
        hs = saved.h
        steps, m, batch, d = hs.shape
        lstm, comm = shape.cell == "lstm", shape.communication
        if grad_hs is None:
            grad_hs = torch.zeros_like(hs)
        dh = torch.zeros_like(hs[0])
        dc = None
        if lstm:
            dc = torch.zeros_like(hs[0]) if grad_c_last is None else grad_c_last
        zero = hs.new_zeros(())
        d_in = hs.new_empty(steps, m, batch, diff.size(-1))
        d_hid = None if lstm else torch.empty_like(d_in)
        ds = hs.new_empty(steps, m, batch, u.size(-1))
        w_h_t = w_h.transpose(1, 2)
        w_qkv_t = w_o_t = dqkv = dout = None
        if comm:
            w_qkv_t, w_o_t = w_qkv.transpose(1, 2), w_o.transpose(1, 2)
            dqkv = hs.new_empty(steps, m, batch, w_qkv.size(-1))
            dout = torch.empty_like(hs)
        step = _step_functions(ctx.compiled)[1]
        for t in range(steps - 1, -1, -1):
            dh, dc = step(shape, dh, dc, zero, grad_hs[t], None if comm_mask is None else comm_mask[t], diff[t], u[t],
                          saved.at(t, True), None if saved.c is None else saved.c[t], d_in[t],
                          None if d_hid is None else d_hid[t], ds[t], None if dqkv is None else dqkv[t],
                          None if dout is None else dout[t], w_h_t, w_qkv_t, w_o_t)

        # everything that does not feed the recurrence, over all steps at once
        h_prev = torch.cat([h0.unsqueeze(0), hs[:-1]])
        needs = dict(zip(("addend", "diff", "u", "c_u", "w_h", "b_h", "w_qkv", "b_qkv", "w_o", "b_o"),
                         ctx.needs_input_grad[4:14]))
        grads = dict.fromkeys(needs)
        if needs["addend"]:
            grads["addend"] = d_in.sum_to_size(addend.shape)
        if needs["diff"]:
            grads["diff"] = saved.p.unsqueeze(-1) * d_in.unsqueeze(-2)
        if needs["u"]:
            grads["u"] = h_prev.unsqueeze(-1) * ds.unsqueeze(-2)
        if needs["c_u"]:
            grads["c_u"] = ds
        d_hid = d_in if d_hid is None else d_hid
        if needs["w_h"]:
            grads["w_h"] = _group_outer(h_prev, d_hid)
        if needs["b_h"]:
            grads["b_h"] = d_hid.sum((0, 2)).unsqueeze(1)
        if comm:
            if needs["w_qkv"]:
                grads["w_qkv"] = _group_outer(saved.h_next, dqkv)
            if needs["b_qkv"]:
                grads["b_qkv"] = dqkv.sum((0, 2)).unsqueeze(1)
            if needs["w_o"]:
                grads["w_o"] = _group_outer(saved.read, dout)
            if needs["b_o"]:
                grads["b_o"] = dout.sum((0, 2)).unsqueeze(1)
        return (None, None, None, None, *grads.values(), dh, dc)


def _group_outer(inputs: Tensor, grads: Tensor) -> Tensor:
    """sum over (t, b) of inputs[t, k, b]^T grads[t, k, b]: (T, m, B, i), (T, m, B, o) -> (m, i, o)."""
    steps, m, batch, width = inputs.shape
    left = inputs.permute(1, 3, 0, 2).reshape(m, width, steps * batch)
    right = grads.permute(1, 0, 2, 3).reshape(m, steps * batch, -1)
    return torch.bmm(left, right)


def _directions(cells, x: Tensor):
    """(cell, x in that cell's time order) per direction: direction 1 reads x reversed."""
    return [(cell, x if r == 0 else x.flip(0)) for r, cell in enumerate(cells)]


def _by_rim(per_direction: List[Tensor], rim_dim: int) -> Tensor:
    """Per-direction tensors with n RIMs at ``rim_dim`` -> one tensor with D n RIMs there."""
    stacked = torch.stack(per_direction, dim=rim_dim)
    return stacked.flatten(rim_dim, rim_dim + 1).contiguous()


def _recurrence_inputs(cell, x: Tensor, dtype: torch.dtype):
    """One direction's state-independent tensors (module docstring, points 1 and 2):
    u (T, n, B, d, H), c_u (T, n, B, H), addend (T or 1, n, B or 1, G), diff (T, n, B, H, G)
    (G = 4d for LSTM, 3d for GRU) and the communication dropout mask (T, n, n, B, Hc) or None."""
    steps, batch, _ = x.shape
    heads, n = cell.input_heads, cell.num_rims
    x = x.to(dtype)
    key_width = cell.input_key_size // heads
    # k_x - k_null, scaled as the logits are. It equals x W^k (the null key is the bias b^k); the
    # difference is taken literally so that b^k stays in the graph with its (zero) gradient, as
    # in rim.py: distributed data parallel expects a gradient for every parameter
    w_key, b_key = cell.input_key.weight.to(dtype), cell.input_key.bias.to(dtype)
    delta = (torch.nn.functional.linear(x, w_key, b_key) - b_key).mul_(key_width ** -0.5)
    delta = delta.view(steps, batch, heads, key_width)
    w_query = cell.input_query.weight.to(dtype).view(n, cell.rim_size, heads, key_width)
    u = torch.einsum("kdhe,tbhe->tkbdh", w_query, delta)
    if cell.input_query.bias is not None:
        c_u = torch.einsum("khe,tbhe->tkbh", cell.input_query.bias.to(dtype).view(n, heads, key_width), delta)
    else:
        c_u = delta.new_zeros(steps, n, batch, heads)

    # the cell's input pre-activation of the null row and of (x's value - the null value)
    value_width = cell.input_value_size // heads
    w_cell = cell.cell.input_weight.to(dtype).view(n, heads, value_width, -1)  # (n, H, d_v, G)
    gate_null = torch.einsum("hv,khvg->khg", cell.input_value.bias.to(dtype).view(heads, value_width), w_cell)
    w_value = cell.input_value.weight.to(dtype).t().reshape(cell.input_size, heads, value_width)
    rows, width = steps * batch, n * heads * w_cell.size(-1)
    # the cheaper order (``RIMCell.project_input``): compose W^v with the cell's input rows first
    # when there are many rows, else go through the values
    value_size, input_size = cell.input_value_size, cell.input_size
    if rows * value_size * (input_size + width) > (value_size + rows) * input_size * width:
        composed = torch.einsum("ihv,khvg->ikhg", w_value, w_cell).reshape(cell.input_size, width)
        diff = torch.matmul(x, composed).view(steps, batch, n, heads, -1).transpose(1, 2)
    else:
        values = torch.einsum("tbi,ihv->tbhv", x, w_value)
        diff = torch.einsum("tbhv,khvg->tkbhg", values, w_cell)

    # the constant part of the input-side pre-activation: the input bias, and for LSTM also the
    # hidden one (its two sides are summed); a GRU's hidden bias stays with U h (b_h)
    bias = torch.zeros_like(gate_null[:, 0])  # (n, G)
    for part in (cell.cell.input_bias, cell.cell.hidden_bias if cell.cell_type == "lstm" else None):
        if part is not None:
            bias = bias + part.to(dtype)
    if cell.training and cell.input_dropout > 0:
        # dropout of [p_null, p_x] per step, RIM and head, as F.dropout on the probabilities
        keep = torch.nn.functional.dropout(x.new_ones(steps, n, batch, heads, 2), cell.input_dropout, True)
        keep_null, keep_x = keep.unbind(-1)
        addend = torch.einsum("tkbh,khg->tkbg", keep_null, gate_null) + bias.unsqueeze(1)
        # m_x g_x - m_null g_null = m_x diff + (m_x - m_null) g_null: two passes over the
        # (T, n, B, H, G) tensor, forward and backward
        diff = torch.addcmul(keep_x.unsqueeze(-1) * diff, (keep_x - keep_null).unsqueeze(-1), gate_null.unsqueeze(1))
    else:
        addend = (gate_null.sum(1) + bias).view(1, n, 1, -1)
    comm_mask = None
    if cell.communication and cell.training and cell.comm_dropout > 0:
        comm_mask = torch.nn.functional.dropout(x.new_ones(steps, n, n, batch, cell.comm_heads), cell.comm_dropout,
                                                True)
    return u, c_u, addend, diff, comm_mask


def _communication_weights(cell, dtype: torch.dtype):
    """w_qkv (n, d, W) and b_qkv (n, 1, W) with the query columns scaled by 1 / sqrt(d_c), w_o
    (n, cv, d), b_o (n, 1, d)."""
    ck = cell.comm_key_size
    scale = (ck // cell.comm_heads) ** -0.5
    w, b = cell.comm_qkv.weight.to(dtype), cell.comm_qkv.bias
    w = torch.cat([w[..., :ck] * scale, w[..., ck:]], dim=-1)
    b = w.new_zeros(w.size(0), w.size(-1)) if b is None else b.to(dtype)
    b = torch.cat([b[..., :ck] * scale, b[..., ck:]], dim=-1)
    w_o, b_o = cell.comm_out.weight.to(dtype), cell.comm_out.bias
    b_o = w_o.new_zeros(w_o.size(0), w_o.size(-1)) if b_o is None else b_o.to(dtype)
    return w, b.unsqueeze(1), w_o, b_o.unsqueeze(1)


def run_rim_layer(cells, x: Tensor, steps_real: Optional[Tensor], compiled: bool = False):
    """``RIMLayer.forward``'s result through ``RIMRecurrence``: x (T, B, in),
    steps_real (T, B) bool or None -> outputs (T, B, D n d) (not yet zeroed at padding),
    final h and c (B, D n d; c None for GRU), active (T, B, D, n)."""
    steps, batch, _ = x.shape
    first = cells[0]
    dirs, n, d = len(cells), first.num_rims, first.rim_size
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    with torch.autocast(x.device.type, enabled=False):
        parts = [_recurrence_inputs(cell, xr, dtype) for cell, xr in _directions(cells, x)]
        u, c_u, addend, diff = (_by_rim([p[i] for p in parts], 1) for i in range(4))
        comm_mask = None
        if parts[0][4] is not None:
            comm_mask = torch.stack([p[4] for p in parts], dim=1)  # (T, D, n, n, B, Hc)
        if steps_real is None:
            real = torch.ones(steps, dirs, 1, batch, dtype=torch.bool, device=x.device)
        else:
            real = torch.stack([steps_real, steps_real.flip(0)][:dirs], dim=1).unsqueeze(2)
        w_h = torch.cat([cell.cell.hidden_weight.to(dtype) for cell in cells])
        b_h = None
        if first.cell_type == "gru" and first.cell.hidden_bias is not None:
            b_h = torch.cat([cell.cell.hidden_bias.to(dtype) for cell in cells]).unsqueeze(1)
        if first.communication:
            comm = [_communication_weights(cell, dtype) for cell in cells]
            w_qkv, b_qkv, w_o, b_o = (torch.cat([c[i] for c in comm]) for i in range(4))
        else:
            w_qkv = b_qkv = w_o = b_o = None
        initial = [cell.initial_state(batch, device=x.device, dtype=dtype) for cell in cells]
        h0 = torch.cat([h.transpose(0, 1) for h, _ in initial])
        c0 = None if first.cell_type == "gru" else torch.cat([c.transpose(0, 1) for _, c in initial])
        shape = RecurrenceShape(first.cell_type, dirs, n, first.top_k, first.communication, first.comm_heads,
                                first.comm_key_size, first.comm_value_size)
        hs, c_last, active = RIMRecurrence.apply(shape, compiled, real, comm_mask, addend, diff, u, c_u, w_h, b_h,
                                                 w_qkv, b_qkv, w_o, b_o, h0, c0)
    hs = hs.view(steps, dirs, n, batch, d)
    if dirs == 2:
        hs = torch.stack([hs[:, 0], hs[:, 1].flip(0)], dim=1)
    outputs = hs.permute(0, 3, 1, 2, 4).reshape(steps, batch, dirs * n * d).to(x.dtype)
    last = torch.stack([hs[-1, 0]] + ([hs[0, 1]] if dirs == 2 else []))  # each direction's last step
    final_h = last.permute(2, 0, 1, 3).reshape(batch, dirs * n * d).to(x.dtype)
    final_c = None
    if c_last is not None:
        final_c = c_last.view(dirs, n, batch, d).permute(2, 0, 1, 3).reshape(batch, dirs * n * d).to(x.dtype)
    active = active.view(steps, dirs, n, batch)
    if dirs == 2:
        active = torch.stack([active[:, 0], active[:, 1].flip(0)], dim=1)
    return outputs, final_h, final_c, active.permute(0, 3, 1, 2)
