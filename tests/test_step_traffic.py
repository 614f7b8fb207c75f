"""benchmarks/step_traffic.py, the FLOPs and bytes counter of ``bench_dma.py --traffic``, on
work whose traffic is known by hand: operators (each operand read once, a broadcast axis once,
results written once, an overwritten output not read, views nothing) and the Triton kernels'
reports derived from their tiles (the interpolated attention's passes, a GMM pass, L_Dxq's
critic), written out here from the kernels' loops."""

import sys

import pytest
import torch

from conftest import REPO
from test_dma_compiled import needs_cxx

if sys.platform != "linux":
    pytest.importorskip("triton", reason="triton ships wheels for Linux only")


@pytest.fixture(scope="module")
def step_traffic():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import step_traffic
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return step_traffic


def test_operators_read_their_operands_and_write_their_results_once(step_traffic):
    a, b = torch.ones(6, 5), torch.ones(5, 7)
    row = torch.ones(7)
    out = torch.empty(6, 7)

    def work():
        product = a @ b                    # mm: reads 30 + 35, writes 42 values; 2 * 6 * 5 * 7 FLOPs
        product.t()                        # a view: nothing
        total = product + row              # a broadcast operand counts its 7 values once: 42 + 7 + 42
        out.copy_(total)                   # overwrites out without reading it: 42 + 42
        torch.mul(a, a)                    # one operand given twice is read once: 30 + 30

    counted = step_traffic.count_traffic(work)
    assert counted.flops == 2 * 6 * 5 * 7
    assert counted.bytes == 4 * ((30 + 35 + 42) + (42 + 7 + 42) + (42 + 42) + (30 + 30))
    assert counted.by_op == {"aten::mm": 4 * 107, "aten::add": 4 * 91, "aten::copy_": 4 * 84, "aten::mul": 4 * 60}


def kernel_traffic(step_traffic, fn):
    """{kernel: bytes} of ``fn()``'s Triton launches, and the total FLOPs."""
    from fairseq_modattn.modules.triton_support import KERNEL_EVENT_PREFIX

    counted = step_traffic.count_traffic(fn)
    return {name[len(KERNEL_EVENT_PREFIX):]: n for name, n in counted.by_op.items()
            if name.startswith(KERNEL_EVENT_PREFIX)}, counted


@pytest.mark.parametrize("causal", [False, True])
def test_the_attention_kernels_report_the_tiles_they_visit(step_traffic, causal):
    from fairseq_modattn.modules import interpolated_attention_triton as attention

    bsz, heads, length, dim, clusters = 2, 3, 40, 16, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(bsz, heads, length, dim, generator=g, requires_grad=True) for _ in range(3))
    post = torch.softmax(torch.randn(bsz, heads, length, clusters, generator=g), -1).requires_grad_()
    pad = torch.zeros(bsz, length, dtype=torch.bool)

    def work():
        out = attention.triton_interpolated_attention(q, k, v, post, post, pad, None, causal, 0.5)
        out.sum().backward()

    kernels, counted = kernel_traffic(step_traffic, work)
    # blocks of 32 queries and 32 keys: 40 tokens are blocks of 32 and 8
    assert attention.FORWARD_CONFIGS[16] == attention.BACKWARD_CONFIGS[16] == (32, 32, 4, 2)
    # keys each query block reads: all 40, or under the causal mask 32 and 40
    keys = [(32, 32 if causal else 40), (8, 40)]
    queries_per_key_block = [(32, 40), (8, 40 - 32 if causal else 40)]  # (keys, queries) of each key block
    key_row = dim * 4 * 2 + clusters * 4 + 1  # k, v, P^k, padding byte
    heads_total = bsz * heads
    forward_read = sum(rows * (dim * 4 + clusters * 4) + n * key_row for rows, n in keys)
    assert kernels["interpolated_attention_forward"] == heads_total * (
        forward_read + length * (dim * 4 * 2 + 2 * 4))  # stores out, diff, lse
    queries_read = sum(rows * (dim * 4 + clusters * 4 + dim * 4 * 3 + 2 * 4) + n * key_row for rows, n in keys)
    assert kernels["interpolated_attention_backward_queries"] == heads_total * (
        queries_read + length * (dim * 4 + clusters * 4 + 2 * 4))  # stores dq, dP^q, (r, r~)
    keys_read = sum(n * key_row + m * (dim * 4 * 2 + clusters * 4 + 4 * 4) for n, m in queries_per_key_block)
    assert kernels["interpolated_attention_backward_keys"] == heads_total * (
        keys_read + length * (dim * 4 * 2 + clusters * 4))  # stores dk, dv, dP^k
    # dots: q k^T and two value products forward; q k^T, dO v^T, dS k over the query blocks; q k^T,
    # dO v^T, dv and dk over the key blocks
    pairs = sum(rows * n for rows, n in keys)
    key_pairs = sum(n * m for n, m in queries_per_key_block)
    assert counted.flops == heads_total * 2 * dim * (3 * pairs + 3 * pairs + 4 * key_pairs)
    # read once, each kernel moves its operands and results: the query side's rows, every key's
    # row, the stores; the tiles' count re-reads the other side's rows for every block but one
    query_row = dim * 4 * 2 + clusters * 4 + 4 * 4  # q, dO, P^q, lse, (r, r~)
    once = heads_total * length * (
        (dim * 4 + clusters * 4) + key_row + (dim * 4 * 2 + 2 * 4)
        + (dim * 4 + clusters * 4 + dim * 4 * 3 + 2 * 4) + key_row + (dim * 4 + clusters * 4 + 2 * 4)
        + key_row + query_row + (dim * 4 * 2 + clusters * 4))
    assert sum(kernels.values()) - counted.reread == once
    again = [sum(n for _, n in blocks) - max(n for _, n in blocks) for blocks in (keys, queries_per_key_block)]
    assert counted.reread == heads_total * (2 * again[0] * key_row + again[1] * query_row)


def test_a_gmm_pass_reads_each_point_once_and_the_parameters_once_a_program(step_traffic):
    from fairseq_modattn.modules import mixture_triton
    from fairseq_modattn.modules.gmm import DiagonalGMM

    groups, points, dim, clusters = 2, 70, 16, 4
    gmm = DiagonalGMM(clusters, dim, groups)
    x = torch.randn(1, groups, points, dim)
    kernels, counted = kernel_traffic(step_traffic, lambda: gmm(x, 0.1, sample=False, need_kl=False, triton=True))
    programs = -(-points // mixture_triton.block_shape(dim)[0])  # 3 blocks of 32 points a group
    parameters = 2 * clusters * dim * 4 + clusters * 4  # sigma^-2, mu sigma^-2, log N_c of one group
    # no KL: the point is the mean, read once; J, LP and P stored
    assert kernels == {"gmm_forward": groups * points * dim * 4 + groups * programs * parameters
                       + 3 * groups * points * clusters * 4}
    assert counted.reread == groups * (programs - 1) * parameters


def test_the_critic_reads_each_token_once_a_query_block(step_traffic):
    from fairseq_modattn.modules import infonce_triton

    bsz, heads, length, clusters = 2, 2, 40, 4
    post = torch.softmax(torch.randn(bsz, heads, length, clusters), -1)
    valid = torch.ones(bsz, length, dtype=torch.bool)
    kernels, counted = kernel_traffic(step_traffic, lambda: infonce_triton.scores(post, valid))
    reads = 1 + 2  # as a query, and as a key for each of the 2 query blocks
    assert kernels == {"infonce_forward": bsz * heads * length * ((clusters * 4 + 1) * reads + 2 * 4)}
    assert counted.reread == bsz * heads * length * (clusters * 4 + 1) * (reads - 1)


def test_counts_at_two_batches_extrapolate_to_a_third_exactly(step_traffic):
    weight = torch.ones(16, 16)

    def step(batch):
        x = torch.ones(batch, 8, 16)

        def work():  # the weight's bytes are the constant, the rest grows with the batch
            scores = torch.softmax(x @ weight @ x.transpose(1, 2), -1)  # a T x T table per sentence
            return (scores @ x).sum()

        return work

    direct = step_traffic.count_traffic(step(32))
    assert direct.flops > 0 and direct.bytes > 0
    extrapolated = step_traffic.extrapolate(*(step_traffic.count_traffic(step(n)) for n in (2, 5)), 2, 5, 32)
    assert extrapolated == direct


@needs_cxx
def test_a_compiled_graph_reports_its_generated_kernels_and_the_operators_it_calls(step_traffic):
    a, b = torch.randn(6, 5), torch.randn(5, 7)

    def f(a, b):
        return torch.relu(a @ b) * 2.0 + 1.0

    with step_traffic.compiled_graph_counting():
        compiled = torch.compile(f, backend=step_traffic.counting_inductor, dynamic=False)
        compiled(a, b)  # compiles
        counted = step_traffic.count_traffic(lambda: compiled(a, b))
        # run compiled under the counter, not eagerly: the mm is called with an out= argument
        # (written, not read) and the rest is one generated kernel (reads the product, writes the result)
        assert counted.by_op == {"aten::mm": 4 * (30 + 35 + 42), "inductor::generated_forward": 4 * (42 + 42)}
        assert counted.flops == 2 * 6 * 5 * 7

        a.requires_grad_()
        compiled(a, b).sum().backward()
        counted = step_traffic.count_traffic(lambda: compiled(a, b).sum().backward())
        assert set(counted.by_op) >= {"inductor::generated_forward", "inductor::generated_backward"}
        assert counted.flops == 2 * 2 * 6 * 5 * 7  # the forward product and a's gradient
    assert step_traffic.GRAPH_COUNTERS == []
