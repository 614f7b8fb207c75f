"""Paired bootstrap resampling (analysis/significance.py) against sacreBLEU's PairedTest and a naive
loop, for BLEU, chrF and TER, with one run per system and with seeds pooled."""

import random

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest

from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.significance import (
    METRICS,
    SACREBLEU_SEED,
    compare_systems,
    paired_bootstrap,
    resample_counts,
    seed_pairs,
)

WORDS = "a man in a blue shirt is riding the red bike down street two dogs play on grass near water".split()
SAMPLES = 200
#: sacreBLEU's scorers with the defaults compare_systems uses, and PairedTest's names of them
SCORERS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}
PAIRED_TEST_NAMES = {"bleu": "BLEU", "chrf": "chrF2", "ter": "TER"}


def corpus(rng: random.Random, n: int):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def noisy(rng: random.Random, refs, p: float):
    """Each reference word kept with probability 1 - P, else replaced by a random word."""
    return [" ".join(w if rng.random() > p else rng.choice(WORDS) for w in r.split()) for r in refs]


@pytest.fixture(scope="module")
def data():
    """30 references; a baseline (half the words wrong), a better system (15 % wrong) and a close
    one (45 % wrong), three seeds each."""
    rng = random.Random(0)
    refs = corpus(rng, 30)
    return (refs, [noisy(rng, refs, 0.5) for _ in range(3)], [noisy(rng, refs, 0.15) for _ in range(3)],
            [noisy(rng, refs, 0.45) for _ in range(3)])


def naive_resampled_scores(metric, runs, refs, samples, seed):
    """Each resample scored from scratch with sacreBLEU's corpus_score: all RUNS' translations of
    the drawn sentences as one corpus, the references repeated once per run."""
    scorer = SCORERS[metric]()
    indices = np.random.default_rng(seed).choice(len(refs), size=(samples, len(refs)), replace=True)
    return np.array([scorer.corpus_score([run[i] for run in runs for i in row],
                                         [[refs[i] for _ in runs for i in row]]).score for row in indices])


def naive_p_value(differences, observed):
    """sacreBLEU's definition, written out: centred absolute differences above the observed one."""
    centred = np.abs(differences) - np.abs(differences).mean()
    return (sum(1 for c in centred if c > abs(observed)) + 1) / (len(differences) + 1)


def paired_test(metric, systems, refs, samples, monkeypatch):
    monkeypatch.setenv("SACREBLEU_SEED", str(SACREBLEU_SEED))
    _, scores = PairedTest(systems, {PAIRED_TEST_NAMES[metric]: SCORERS[metric]()}, [refs], test_type="bs",
                           n_samples=samples)()
    return scores[PAIRED_TEST_NAMES[metric]]


@pytest.mark.parametrize("metric", METRICS)
def test_one_run_each_gives_paired_tests_scores_and_p_values_and_the_naive_interval(data, metric, monkeypatch):
    refs, base, better, close = data
    result = compare_systems([("base", [base[0]]), ("better", [better[0]]), ("close", [close[0]])], refs,
                             metrics=[metric], samples=SAMPLES)[metric]
    sacre = paired_test(metric, [("base", base[0]), ("better", better[0]), ("close", close[0])], refs, SAMPLES,
                        monkeypatch)
    assert [result.scores[n] for n in ("base", "better", "close")] == pytest.approx([r.score for r in sacre], abs=1e-9)
    assert [result.comparisons[n].p_value for n in ("better", "close")] == [sacre[1].p_value, sacre[2].p_value]

    naive_base = naive_resampled_scores(metric, [base[0]], refs, SAMPLES, SACREBLEU_SEED)
    for name, runs in (("better", better), ("close", close)):
        c = result.comparisons[name]
        diffs = naive_resampled_scores(metric, [runs[0]], refs, SAMPLES, SACREBLEU_SEED) - naive_base
        assert [c.ci_low, c.ci_high] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=1e-9)
        assert c.p_value == naive_p_value(diffs, c.delta)
    # the fixture's better system is better on every metric: TER lower, BLEU and chrF higher
    c = result.comparisons["better"]
    assert (c.delta < 0) == (metric == "ter") and c.verdict == "better"
    assert c.higher_is_better == (metric != "ter")
    assert "bs:200" in result.signature and "seed:12345" in result.signature


@pytest.mark.parametrize("metric", METRICS)
def test_pooled_seeds_keep_each_sentence_together(data, metric):
    refs, base, better, _ = data
    result = compare_systems([("base", base), ("better", better[:2])], refs, metrics=[metric], samples=100,
                             seed=7)[metric]
    scorer = SCORERS[metric]()

    def full(runs):
        return scorer.corpus_score([h for run in runs for h in run], [[r for _ in runs for r in refs]]).score

    assert result.scores["base"] == pytest.approx(full(base), abs=1e-9)
    assert result.scores["better"] == pytest.approx(full(better[:2]), abs=1e-9)
    assert result.seed_scores["better"] == pytest.approx([scorer.corpus_score(r, [refs]).score for r in better[:2]],
                                                         abs=1e-9)
    c = result.comparisons["better"]
    diffs = (naive_resampled_scores(metric, better[:2], refs, 100, 7)
             - naive_resampled_scores(metric, base, refs, 100, 7))
    assert [c.ci_low, c.ci_high] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=1e-9)
    assert c.p_value == naive_p_value(diffs, c.delta)
    assert c.seeds == 2 and c.as_dict()["ci95"] == [c.ci_low, c.ci_high]


def test_the_resample_counts_are_sacrebleus_draw():
    counts = resample_counts(7, 5, SACREBLEU_SEED)
    indices = np.random.default_rng(SACREBLEU_SEED).choice(7, size=(5, 7), replace=True)
    assert counts.shape == (5, 7) and (counts.sum(1) == 7).all()
    for row, drawn in zip(counts, indices):
        assert list(row) == [list(drawn).count(i) for i in range(7)]


@pytest.mark.parametrize("metric", METRICS)
def test_verdicts(data, metric):
    refs, base, better, _ = data
    same = paired_bootstrap(base, base, refs, metric=metric, samples=50)
    assert (same.delta, same.ci_low, same.ci_high, same.verdict) == (0.0, 0.0, 0.0, "no difference")
    # sacreBLEU's test counts resamples whose centred difference strictly exceeds the observed
    # one: for identical systems none does, and its p is its floor 1 / (N + 1); here p = 1
    assert same.p_value == 1.0 and same.identical and same.as_dict()["identical"] is True
    worse = paired_bootstrap(better, base, refs, metric=metric, samples=50)
    assert worse.verdict == "worse" and not worse.identical
    assert [c.verdict for c in seed_pairs(base, better, refs, metric=metric, samples=50)] == ["better"] * 3


def test_bleu_is_the_default_metric(data):
    refs, base, better, _ = data
    result = paired_bootstrap([base[0]], [better[0]], refs, samples=20)
    assert result.metric == "bleu" and result.system_score == pytest.approx(BLEU().corpus_score(better[0],
                                                                                                [refs]).score)


def test_refuses_misaligned_runs_and_bad_comparisons(data):
    refs, base, better, _ = data
    with pytest.raises(AnalysisError, match="29 hypotheses but 30 references"):
        paired_bootstrap(base, [better[0][:-1]], refs, samples=10)
    with pytest.raises(AnalysisError, match="at least one run"):
        paired_bootstrap([], better, refs)
    with pytest.raises(AnalysisError, match="at least two systems"):
        compare_systems([("base", base)], refs)
    with pytest.raises(AnalysisError, match="names must differ"):
        compare_systems([("x", base), ("x", better)], refs)
    with pytest.raises(AnalysisError, match="unknown metric meteor"):
        compare_systems([("base", base), ("better", better)], refs, metrics=["meteor"])


@pytest.mark.parametrize("metric", METRICS)
def test_identical_systems_get_p_1_others_sacrebleus_p(data, metric, monkeypatch):
    """Every resample ties for one run given as two systems: p = 1 where PairedTest prints
    1 / (N + 1); a system that differs keeps PairedTest's p."""
    refs, base, better, _ = data
    result = compare_systems([("base", [base[0]]), ("same", [list(base[0])]), ("better", [better[0]])], refs,
                             metrics=[metric], samples=SAMPLES)[metric]
    sacre = paired_test(metric, [("base", base[0]), ("same", base[0]), ("better", better[0])], refs, SAMPLES,
                        monkeypatch)
    assert sacre[1].p_value == pytest.approx(1 / (SAMPLES + 1))
    assert (result.comparisons["same"].p_value, result.comparisons["same"].identical) == (1.0, True)
    assert result.comparisons["better"].p_value == sacre[2].p_value
    assert not result.comparisons["better"].identical


def test_the_resample_counts_take_the_memory_they_are_said_to():
    """resample_memory is what check_resample_memory refuses by: it must bound the real peak."""
    import tracemalloc

    from fairseq_modattn.analysis import significance

    tracemalloc.start()  # numpy reports its array buffers to tracemalloc
    try:
        counts = resample_counts(500, 400, SACREBLEU_SEED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    need = significance.resample_memory(500, 400)
    assert counts.nbytes < peak <= need * 1.01, (peak, need)


def test_resamples_beyond_the_memory_available_are_refused_before_the_draw(data, monkeypatch):
    from fairseq_modattn.analysis import significance

    refs, base, better, _ = data
    assert significance.available_memory() > 0  # this machine's, read from the system
    monkeypatch.setattr(significance, "available_memory", lambda: 16 * 30 * 1000 - 1)

    def no_draw(*args):
        raise AssertionError("drawn before the memory was checked")

    monkeypatch.setattr(significance, "resample_counts", no_draw)
    with pytest.raises(AnalysisError, match=r"samples 1000 would need 480.0 KB of memory \(1,000 resamples x 30 "
                                            r"sentences x 16 bytes\), more than the 480.0 KB available"):
        compare_systems([("base", base), ("better", better)], refs, samples=1000)
