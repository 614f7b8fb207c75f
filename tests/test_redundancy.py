"""LR and HR (fairseq_modattn.analysis.redundancy) against hand values and a naive reference."""

import itertools
import math

import pytest
import torch

from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.redundancy import RedundancyAccumulator, entropy_bits, pairwise_similarity_sum


def naive_entropy(p):
    return -sum(x * math.log2(x) for x in p if x > 0)


def naive_metrics(batches):
    """LR and HR by the definitions, one query row and one head pair at a time.

    ``batches``: list of (list of per-layer (B, H, T, S) tensors, (B, T) bool mask)."""
    lr_terms, pair_terms = [], {}
    for layers, mask in batches:
        bsz, heads, length, _ = layers[0].shape
        for b, t in itertools.product(range(bsz), range(length)):
            if not mask[b, t]:
                continue
            rows = []
            for w in layers:
                dists = [w[b, h, t].tolist() for h in range(heads)]
                mean = [sum(col) / heads for col in zip(*dists)]
                gjs = naive_entropy(mean) - sum(naive_entropy(d) for d in dists) / heads
                lr_terms.append((math.log2(heads) - gjs) / math.log2(heads))
                rows.extend(dists)
            for a, c in itertools.combinations(range(len(rows)), 2):
                mix = [(x + y) / 2 for x, y in zip(rows[a], rows[c])]
                js = naive_entropy(mix) - (naive_entropy(rows[a]) + naive_entropy(rows[c])) / 2
                pair_terms.setdefault((a, c), []).append(1 - js)
    hr = sum(sum(v) / len(v) for v in pair_terms.values()) / len(pair_terms)
    return sum(lr_terms) / len(lr_terms), hr


def measure(batches, **kwargs):
    acc = RedundancyAccumulator()
    for layers, mask in batches:
        acc.add(layers, mask)
    return acc.result()


def test_identical_heads_are_maximally_redundant():
    row = torch.tensor([0.1, 0.2, 0.3, 0.4])
    w = row.expand(1, 4, 3, 4).clone()  # 4 identical heads, 3 queries
    r = measure([([w, w], torch.ones(1, 3, dtype=torch.bool))])
    assert r.lr == pytest.approx(1.0, abs=1e-12)
    assert r.hr == pytest.approx(1.0, abs=1e-12)  # also across the two layers


def test_disjoint_one_hot_heads_are_minimally_redundant():
    w = torch.eye(4).view(1, 4, 1, 4)  # head h attends key h only
    r = measure([([w], torch.ones(1, 1, dtype=torch.bool))])
    assert r.lr == pytest.approx(0.0, abs=1e-12)
    assert r.hr == pytest.approx(0.0, abs=1e-12)
    assert torch.tensor(r.matrix).diagonal().tolist() == pytest.approx([1.0] * 4)


def test_hand_computed_two_heads():
    # p = (1, 0), q = (1/2, 1/2): mixture (3/4, 1/4), H = 0.811278 bits; H(p) = 0, H(q) = 1;
    # GJS = JS = 0.811278 - 0.5 = 0.311278, so LR = HR = 1 - 0.311278.
    w = torch.tensor([[1.0, 0.0], [0.5, 0.5]]).view(1, 2, 1, 2)
    r = measure([([w], torch.ones(1, 1, dtype=torch.bool))])
    expected = 1 - (-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)) - 0.5)
    assert r.lr == pytest.approx(expected, abs=1e-12)
    assert r.hr == pytest.approx(expected, abs=1e-12)
    assert r.lr == pytest.approx(0.688722, abs=1e-6)


def random_batch(generator, bsz, heads, length, keys, layers=2):
    ws = [torch.softmax(3 * torch.randn(bsz, heads, length, keys, generator=generator), dim=-1) for _ in range(layers)]
    mask = torch.rand(bsz, length, generator=generator) > 0.3
    mask[0, 0] = True
    return ws, mask


def test_matches_naive_reference_over_batches_with_padding():
    g = torch.Generator().manual_seed(0)
    batches = [random_batch(g, 2, 3, 4, 5), random_batch(g, 3, 3, 2, 6)]  # lengths differ by batch
    r = measure(batches)
    lr, hr = naive_metrics(batches)
    assert r.lr == pytest.approx(lr, abs=1e-9)
    assert r.hr == pytest.approx(hr, abs=1e-9)
    assert r.rows == sum(int(m.sum()) for _, m in batches)
    assert len(r.labels) == 6 and r.labels[:4] == ["L1H1", "L1H2", "L1H3", "L2H1"]


def test_padded_query_rows_do_not_count():
    g = torch.Generator().manual_seed(1)
    (w1, w2), mask = random_batch(g, 2, 4, 5, 5)
    reference = measure([([w1, w2], mask)])
    garbage = [w.clone() for w in (w1, w2)]
    for w in garbage:  # (B, H, T, S): replace every head's row at padded (b, t)
        rows = w.permute(0, 2, 1, 3)
        rows[~mask] = torch.softmax(torch.randn(int((~mask).sum()), 4, 5, generator=g), dim=-1)
    changed = measure([(garbage, mask)])
    assert changed.lr == pytest.approx(reference.lr, abs=1e-12)
    assert changed.hr == pytest.approx(reference.hr, abs=1e-12)


def test_chunked_pairwise_sum_equals_one_block():
    g = torch.Generator().manual_seed(2)
    rows = torch.softmax(torch.randn(37, 6, 7, generator=g, dtype=torch.float64), dim=-1)
    whole = pairwise_similarity_sum(rows)
    chunked = pairwise_similarity_sum(rows, max_elements=6 * 6 * 7 * 5)  # 5 rows per chunk
    assert torch.allclose(whole, chunked, atol=1e-12)
    assert torch.allclose(whole, whole.T)


def test_entropy_treats_zero_probability_as_zero():
    assert entropy_bits(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0
    assert entropy_bits(torch.tensor([0.25] * 4)).item() == pytest.approx(2.0)


def test_bad_input_errors():
    with pytest.raises(AnalysisError, match="at least 2 heads"):
        RedundancyAccumulator().add([torch.ones(1, 1, 2, 1)], None)
    with pytest.raises(AnalysisError, match="one shape"):
        RedundancyAccumulator().add([torch.ones(1, 2, 2, 3) / 3, torch.ones(1, 2, 2, 4) / 4], None)
    with pytest.raises(AnalysisError, match="no query rows"):
        acc = RedundancyAccumulator()
        acc.add([torch.ones(1, 2, 2, 3) / 3], torch.zeros(1, 2, dtype=torch.bool))
        acc.result()
    with pytest.raises(AnalysisError, match="no attention layers"):
        RedundancyAccumulator().add([], None)
