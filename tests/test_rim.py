"""RIMs (Goyal et al. 2021): group cells against torch's cells, one RIMCell step against an
explicit per-RIM loop of the paper's equations, selection, exact keeping of inactive RIMs,
padding invariance, initial states, gradcheck, configuration errors, bf16 autocast."""

import math

import pytest
import torch
import torch.nn as nn

from fairseq_modattn.modules import GroupGRUCell, GroupLSTMCell, RIMCell, RIMLayer

SMALL = dict(input_key_size=6, input_value_size=10, comm_key_size=8, comm_value_size=12, comm_heads=2)


def make_cell(cell="lstm", input_heads=1, communication=True, num_rims=4, rim_size=5, top_k=2,
              input_size=7, **kwargs):
    """A tiny float64 RIMCell with every bias non-zero (the null key/value are the biases)."""
    sizes = dict(SMALL, input_value_size=10 if input_heads == 1 else 12)
    sizes.update(kwargs)
    rim = RIMCell(input_size, num_rims, rim_size, top_k, cell=cell, input_heads=input_heads,
                  communication=communication, **sizes).double()
    with torch.no_grad():
        for name, p in rim.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return rim


# ---------------------------------------------------------------- the equations, loop by loop


def reference_input_attention(rim, x, h):
    """Per RIM k and head: softmax over [null, x] of q_k . key / sqrt(d_k); returns the reads
    (B, n, input_value_size) and the null probability averaged over heads (B, n)."""
    batch, n, _ = h.shape
    heads = rim.input_heads
    dk, dv = rim.input_key_size // heads, rim.input_value_size // heads
    rows = torch.stack([torch.zeros_like(x), x], dim=1)  # (B, 2, in): the null row is a zero input
    keys = rows @ rim.input_key.weight.t() + rim.input_key.bias
    values = rows @ rim.input_value.weight.t() + rim.input_value.bias
    reads, nulls = [], []
    for k in range(n):
        q = h[:, k] @ rim.input_query.weight[k] + rim.input_query.bias[k]
        head_reads, head_nulls = [], []
        for j in range(heads):
            qj = q[:, j * dk:(j + 1) * dk]
            kj = keys[:, :, j * dk:(j + 1) * dk]
            vj = values[:, :, j * dv:(j + 1) * dv]
            att = torch.softmax((kj @ qj.unsqueeze(-1)).squeeze(-1) / math.sqrt(dk), dim=-1)  # (B, 2)
            head_reads.append((att.unsqueeze(-1) * vj).sum(1))
            head_nulls.append(att[:, 0])
        reads.append(torch.cat(head_reads, dim=-1))
        nulls.append(torch.stack(head_nulls, dim=-1).mean(-1))
    return torch.stack(reads, dim=1), torch.stack(nulls, dim=1)


def reference_select(null, top_k):
    active = torch.zeros(null.shape, dtype=torch.bool)
    for b in range(null.size(0)):
        order = sorted(range(null.size(1)), key=lambda k: (null[b, k].item(), k))
        active[b, order[:top_k]] = True
    return active


def reference_cell(rim, k, read, h, c):
    """RIM k's own LSTM / GRU, written out (torch gate orders)."""
    hid = rim.rim_size
    if rim.cell_type == "lstm":
        w, b = rim.cell.linear.weight[k], rim.cell.linear.bias[k]
        gates = torch.cat([read, h], dim=-1) @ w + b
        i, f, g, o = (gates[:, j * hid:(j + 1) * hid] for j in range(4))
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new
    gi = read @ rim.cell.input_linear.weight[k] + rim.cell.input_linear.bias[k]
    gh = h @ rim.cell.hidden_linear.weight[k] + rim.cell.hidden_linear.bias[k]
    r = torch.sigmoid(gi[:, :hid] + gh[:, :hid])
    z = torch.sigmoid(gi[:, hid:2 * hid] + gh[:, hid:2 * hid])
    n = torch.tanh(gi[:, 2 * hid:] + r * gh[:, 2 * hid:])
    return (1 - z) * n + z * h, None


def reference_communication(rim, h):
    """Every RIM k reads all RIMs: per head softmax_j(q_k . k_j / sqrt(d)) v_j, then W^o_k."""
    batch, n, _ = h.shape
    ck, cv, heads = rim.comm_key_size, rim.comm_value_size, rim.comm_heads
    dk, dv = ck // heads, cv // heads
    qkv = [h[:, j] @ rim.comm_qkv.weight[j] + rim.comm_qkv.bias[j] for j in range(n)]
    out = []
    for k in range(n):
        head_reads = []
        for a in range(heads):
            q = qkv[k][:, a * dk:(a + 1) * dk]
            scores = torch.stack([(q * qkv[j][:, ck + a * dk:ck + (a + 1) * dk]).sum(-1) for j in range(n)], -1)
            att = torch.softmax(scores / math.sqrt(dk), dim=-1)  # (B, n)
            vals = torch.stack([qkv[j][:, 2 * ck + a * dv:2 * ck + (a + 1) * dv] for j in range(n)], 1)
            head_reads.append((att.unsqueeze(-1) * vals).sum(1))
        out.append(torch.cat(head_reads, -1) @ rim.comm_out.weight[k] + rim.comm_out.bias[k])
    return torch.stack(out, dim=1)


def reference_step(rim, x, h, c):
    reads, null = reference_input_attention(rim, x, h)
    active = reference_select(null, rim.top_k)
    h_new, c_new = h.clone(), (None if c is None else c.clone())
    for k in range(rim.num_rims):
        hk, ck = reference_cell(rim, k, reads[:, k], h[:, k], None if c is None else c[:, k])
        for b in range(h.size(0)):
            if active[b, k]:
                h_new[b, k] = hk[b]
                if c is not None:
                    c_new[b, k] = ck[b]
    if rim.communication:
        comm = reference_communication(rim, h_new)
        h_new = torch.where(active.unsqueeze(-1), h_new + comm, h_new)
    return h_new, c_new, active, null


# ---------------------------------------------------------------- group cells


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("bias", [True, False])
def test_group_cell_equals_separate_torch_cells(kind, bias):
    torch.manual_seed(0)
    groups, width_in, hid, batch = 3, 5, 4, 6
    torch_cell, group_cell = (nn.LSTMCell, GroupLSTMCell) if kind == "lstm" else (nn.GRUCell, GroupGRUCell)
    cells = [torch_cell(width_in, hid, bias=bias).double() for _ in range(groups)]
    group = group_cell(groups, width_in, hid, bias=bias).double()
    getattr(group, f"load_from_{kind}_cells")(cells)
    x = torch.randn(batch, groups, width_in, dtype=torch.float64)
    h = torch.randn(batch, groups, hid, dtype=torch.float64)
    c = torch.randn(batch, groups, hid, dtype=torch.float64)
    new = group(x, (h, c)) if kind == "lstm" else (group(x, h),)
    for g, cell in enumerate(cells):
        ref = cell(x[:, g], (h[:, g], c[:, g])) if kind == "lstm" else (cell(x[:, g], h[:, g]),)
        for ours, theirs in zip(new, ref):
            torch.testing.assert_close(ours[:, g], theirs, rtol=0, atol=1e-6)


def test_group_cell_loading_checks_count_and_sizes():
    group = GroupLSTMCell(2, 3, 4)
    with pytest.raises(ValueError, match="expected 2"):
        group.load_from_lstm_cells([nn.LSTMCell(3, 4)])
    with pytest.raises(ValueError, match="sizes"):
        group.load_from_lstm_cells([nn.LSTMCell(3, 5), nn.LSTMCell(3, 5)])


# ---------------------------------------------------------------- one step against the equations


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("communication", [True, False])
@pytest.mark.parametrize("input_heads", [1, 2])
def test_rim_cell_step_equals_equation_reference(cell, communication, input_heads):
    torch.manual_seed(1)
    rim = make_cell(cell, input_heads, communication)
    batch = 5
    x = torch.randn(batch, rim.input_size, dtype=torch.float64)
    h = torch.randn(batch, rim.num_rims, rim.rim_size, dtype=torch.float64)
    c = torch.randn_like(h) if cell == "lstm" else None
    (h_new, c_new), active = rim(x, (h, c))
    h_ref, c_ref, active_ref, _ = reference_step(rim, x, h, c)
    assert torch.equal(active, active_ref)
    torch.testing.assert_close(h_new, h_ref, rtol=0, atol=1e-10)
    if cell == "lstm":
        torch.testing.assert_close(c_new, c_ref, rtol=0, atol=1e-10)
    else:
        assert c_new is None


@pytest.mark.parametrize("input_heads", [1, 2])
def test_project_input_both_paths_equal_the_values_through_the_cell(input_heads):
    """The cell's input term from the values, mapped row by row (few rows) or through the
    composed input_value x cell map (many rows): both equal values @ W^x per head."""
    torch.manual_seed(2)
    rim = make_cell("lstm", input_heads, input_size=4, input_value_size=24)
    n, heads = rim.num_rims, input_heads
    dv = rim.input_value_size // heads
    w = rim.cell.input_weight.reshape(n, heads, dv, -1)
    for rows in (1, 300):
        x = torch.randn(rows, rim.input_size, dtype=torch.float64)
        _, gate_x, gate_null = rim.project_input(x)
        values = rim.input_value(x).view(rows, heads, dv)
        null = rim.input_value.bias.view(heads, dv)
        for k in range(n):
            for j in range(heads):
                torch.testing.assert_close(gate_x[:, k, j], values[:, j] @ w[k, j], rtol=0, atol=1e-10)
                torch.testing.assert_close(gate_null[k, j], null[j] @ w[k, j], rtol=0, atol=1e-10)


def test_exactly_top_k_active_and_they_attend_least_to_the_null_input():
    torch.manual_seed(3)
    rim = make_cell("lstm", 2, num_rims=6, top_k=3)
    x = torch.randn(40, rim.input_size, dtype=torch.float64)
    h = torch.randn(40, 6, rim.rim_size, dtype=torch.float64)
    (_, _), active = rim(x, (h, torch.randn_like(h)))
    assert active.dtype == torch.bool
    assert (active.sum(-1) == 3).all()
    _, null = reference_input_attention(rim, x, h)
    most_active = null.masked_fill(~active, -1.0).max(-1).values
    least_inactive = null.masked_fill(active, 2.0).min(-1).values
    assert (most_active <= least_inactive).all()


def test_ties_in_null_attention_go_to_the_lower_rim_index():
    rim = make_cell("lstm", num_rims=5, top_k=2)
    with torch.no_grad():
        rim.input_query.weight.zero_()
        rim.input_query.bias.zero_()  # every RIM sends the same query: all null probabilities tie
    x = torch.randn(3, rim.input_size, dtype=torch.float64)
    h = torch.randn(3, 5, rim.rim_size, dtype=torch.float64)
    _, active = rim(x, (h, torch.randn_like(h)))
    assert active.tolist() == [[True, True, False, False, False]] * 3


def test_inactive_rims_keep_their_state_bit_exactly_and_get_no_gradient_from_the_update():
    torch.manual_seed(4)
    rim = make_cell("lstm", num_rims=5, top_k=2)
    x = torch.randn(1, rim.input_size, dtype=torch.float64, requires_grad=True)
    h = torch.randn(1, 5, rim.rim_size, dtype=torch.float64)
    c = torch.randn_like(h)
    (h_new, c_new), active = rim(x, (h, c))
    inactive = ~active[0]
    assert torch.equal(h_new[0, inactive], h[0, inactive])
    assert torch.equal(c_new[0, inactive], c[0, inactive])
    # nothing reaches x through an inactive RIM (its cell update is discarded by where)
    (grad_x,) = torch.autograd.grad(
        h_new[0, inactive].sum() + c_new[0, inactive].sum(), x, allow_unused=True, retain_graph=True
    )
    assert grad_x is None or torch.equal(grad_x, torch.zeros_like(grad_x))
    # and the cell weights of an inactive RIM get exactly zero gradient from everything,
    # the active RIMs' communication included (they read its kept state, not its update)
    (h_new.sum() + c_new.sum()).backward()
    grad = rim.cell.linear.weight.grad
    assert torch.equal(grad[inactive], torch.zeros_like(grad[inactive]))
    assert grad[active[0]].abs().sum() > 0


def test_padding_step_returns_the_state_unchanged():
    torch.manual_seed(5)
    for cell in ("lstm", "gru"):
        rim = make_cell(cell)
        x = torch.randn(4, rim.input_size, dtype=torch.float64)
        h = torch.randn(4, rim.num_rims, rim.rim_size, dtype=torch.float64)
        c = torch.randn_like(h) if cell == "lstm" else None
        step_mask = torch.tensor([True, False, True, False])
        (h_new, c_new), active = rim(x, (h, c), step_mask)
        assert torch.equal(h_new[~step_mask], h[~step_mask])
        if c is not None:
            assert torch.equal(c_new[~step_mask], c[~step_mask])
        assert not active[~step_mask].any()
        assert (active[step_mask].sum(-1) == rim.top_k).all()
        (h_ref, c_ref), _ = rim(x[step_mask], (h[step_mask], None if c is None else c[step_mask]))
        torch.testing.assert_close(h_new[step_mask], h_ref, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- sequences


def test_all_active_without_communication_is_n_independent_lstms():
    """top_k = n, no communication: RIM k is an nn.LSTMCell fed its attention read (computed
    here by the explicit reference), over a whole sequence."""
    torch.manual_seed(6)
    n, d, seq_len, batch = 3, 5, 6, 4
    layer = RIMLayer(7, n, d, n, communication=False, **SMALL).double()
    rim = layer.cells[0]
    cells = [nn.LSTMCell(rim.input_value_size, d).double() for _ in range(n)]
    rim.cell.load_from_lstm_cells(cells)
    x = torch.randn(seq_len, batch, 7, dtype=torch.float64)
    out, final_h, final_c, active = layer(x)
    assert active.all()
    h = torch.zeros(batch, n, d, dtype=torch.float64)
    c = torch.zeros_like(h)
    for t in range(seq_len):
        reads, _ = reference_input_attention(rim, x[t], h)
        states = [cells[k](reads[:, k], (h[:, k], c[:, k])) for k in range(n)]
        h = torch.stack([s[0] for s in states], 1)
        c = torch.stack([s[1] for s in states], 1)
        torch.testing.assert_close(out[t], h.reshape(batch, -1), rtol=0, atol=1e-10)
    torch.testing.assert_close(final_h, h.reshape(batch, -1), rtol=0, atol=1e-10)
    torch.testing.assert_close(final_c, c.reshape(batch, -1), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_layer_equals_the_cell_stepped_by_hand(cell):
    torch.manual_seed(7)
    layer = RIMLayer(7, 4, 5, 2, cell=cell, bidirectional=True, input_heads=2,
                     **dict(SMALL, input_value_size=12)).double()
    x = torch.randn(6, 3, 7, dtype=torch.float64)
    out, final_h, final_c, active = layer(x)
    assert out.shape == (6, 3, layer.output_size) and layer.output_size == 2 * 4 * 5
    assert active.shape == (6, 3, 2, 4)
    for direction, steps in ((0, range(6)), (1, range(5, -1, -1))):
        rim = layer.cells[direction]
        state = rim.initial_state(3, dtype=torch.float64)
        for t in steps:
            state, act = rim(x[t], state)
            assert torch.equal(act, active[t, :, direction])
            torch.testing.assert_close(out[t, :, direction * 20:(direction + 1) * 20], state[0].reshape(3, -1),
                                       rtol=0, atol=1e-12)
        torch.testing.assert_close(final_h[:, direction * 20:(direction + 1) * 20], state[0].reshape(3, -1))
        if cell == "lstm":
            torch.testing.assert_close(final_c[:, direction * 20:(direction + 1) * 20], state[1].reshape(3, -1))
        else:
            assert final_c is None


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_padding_anywhere_does_not_change_the_sentence(bidirectional, cell):
    torch.manual_seed(8)
    layer = RIMLayer(7, 4, 5, 2, cell=cell, bidirectional=bidirectional, **SMALL).double().eval()
    sent = torch.randn(5, 1, 7, dtype=torch.float64)
    out_ref, h_ref, c_ref, act_ref = layer(sent)
    for pattern in ("left", "right", "middle"):
        pad = torch.randn(3, 1, 7, dtype=torch.float64)  # garbage in the padded positions
        if pattern == "left":
            x, real = torch.cat([pad, sent]), torch.arange(3, 8)
        elif pattern == "right":
            x, real = torch.cat([sent, pad]), torch.arange(0, 5)
        else:
            x, real = torch.cat([sent[:2], pad, sent[2:]]), torch.tensor([0, 1, 5, 6, 7])
        # batch it with an unpadded sentence of 8 tokens, so the padded row shares every step
        x = torch.cat([x, torch.randn(8, 1, 7, dtype=torch.float64)], dim=1)
        padding_mask = torch.ones(2, 8, dtype=torch.bool)
        padding_mask[0, real] = False
        padding_mask[1] = False
        out, h, c, act = layer(x, padding_mask)
        torch.testing.assert_close(out[real, :1], out_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(h[:1], h_ref, rtol=0, atol=1e-12)
        if cell == "lstm":
            torch.testing.assert_close(c[:1], c_ref, rtol=0, atol=1e-12)
        assert torch.equal(act[real, :1], act_ref)
        padded = padding_mask[0]
        assert not act[padded, 0].any()
        assert (out[padded, 0] == 0).all()


def test_initial_state_is_deterministic_and_can_be_learned():
    torch.manual_seed(9)
    layer = RIMLayer(7, 4, 5, 2, **SMALL).eval()
    x = torch.randn(4, 2, 7)
    first, second = layer(x), layer(x)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    h0, c0 = layer.cells[0].initial_state(2)
    assert torch.equal(h0, torch.zeros(2, 4, 5)) and torch.equal(c0, torch.zeros(2, 4, 5))

    learned = RIMLayer(7, 4, 5, 2, learned_initial_state=True, **SMALL)
    rim = learned.cells[0]
    with torch.no_grad():
        rim.initial_h.normal_()
        rim.initial_c.normal_()
    h0, c0 = rim.initial_state(3)
    assert torch.equal(h0, rim.initial_h.expand(3, 4, 5)) and torch.equal(c0, rim.initial_c.expand(3, 4, 5))
    out, *_ = learned(x)
    out.sum().backward()
    assert rim.initial_h.grad.abs().sum() > 0 and rim.initial_c.grad.abs().sum() > 0
    gru = RIMCell(7, 4, 5, 2, cell="gru", learned_initial_state=True, **SMALL)
    h0, c0 = gru.initial_state(2)
    assert c0 is None and h0.shape == (2, 4, 5)


def test_dropout_only_in_training():
    torch.manual_seed(10)
    layer = RIMLayer(7, 4, 5, 2, input_dropout=0.5, comm_dropout=0.5, **SMALL)
    x = torch.randn(4, 3, 7)
    assert not torch.equal(layer(x)[0], layer(x)[0])
    layer.eval()
    assert torch.equal(layer(x)[0], layer(x)[0])


def test_gradcheck_rim_cell():
    torch.manual_seed(11)
    rim = make_cell("lstm", 2, num_rims=3, rim_size=3, top_k=2, input_size=4)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)

    def fn(x, h, c):
        (h_new, c_new), _ = rim(x, (h, c))
        return h_new, c_new

    assert torch.autograd.gradcheck(fn, (x, h, c), eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------- configuration and dtypes


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(num_rims=0, top_k=1), "num_rims"),
        (dict(cell="rnn"), "cell"),
        (dict(input_key_size=7, input_heads=2), "input_key_size"),
        (dict(input_value_size=9, input_heads=2), "input_value_size"),
        (dict(comm_key_size=6, comm_heads=4), "comm_key_size"),
        (dict(comm_value_size=10, comm_heads=4), "comm_value_size"),
        (dict(input_dropout=1.0), "input_dropout"),
    ],
)
def test_bad_configurations_name_the_parameter(kwargs, name):
    args = dict(input_size=8, num_rims=4, rim_size=6, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        RIMCell(args.pop("input_size"), args.pop("num_rims"), args.pop("rim_size"), args.pop("top_k"), **args)


def test_bf16_autocast_forward_is_finite():
    torch.manual_seed(12)
    layer = RIMLayer(16, 4, 8, 2, bidirectional=True, input_heads=2, input_key_size=8, input_value_size=16)
    x = torch.randn(5, 3, 16)
    padding_mask = torch.zeros(3, 5, dtype=torch.bool)
    padding_mask[0, :2] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, final_h, final_c, active = layer(x, padding_mask)
    assert torch.isfinite(out.float()).all() and torch.isfinite(final_h.float()).all()
    assert torch.isfinite(final_c.float()).all()
    assert (active[2:].sum(-1) == 2).all()
