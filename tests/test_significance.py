"""Paired bootstrap resampling (analysis/significance.py) against sacreBLEU and a naive loop."""

import random

import numpy as np
import pytest
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.significance import SACREBLEU_SEED, paired_bootstrap, seed_pairs

WORDS = "a man in a blue shirt is riding the red bike down street two dogs play on grass near water".split()


def corpus(rng: random.Random, n: int):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def noisy(rng: random.Random, refs, p: float):
    """Each reference word kept with probability 1 - P, else replaced by a random word."""
    return [" ".join(w if rng.random() > p else rng.choice(WORDS) for w in r.split()) for r in refs]


@pytest.fixture(scope="module")
def data():
    rng = random.Random(0)
    refs = corpus(rng, 60)
    return refs, [noisy(rng, refs, 0.5) for _ in range(3)], [noisy(rng, refs, 0.3) for _ in range(3)]


def naive_resampled_differences(baseline_runs, system_runs, refs, samples, seed):
    """Each resample scored from scratch: all runs' translations of the drawn sentences as one
    corpus, the references repeated once per run."""
    metric = BLEU()
    indices = np.random.default_rng(seed).choice(len(refs), size=(samples, len(refs)), replace=True)
    out = []
    for row in indices:
        def score(runs):
            hyps = [run[i] for run in runs for i in row]
            return metric.corpus_score(hyps, [[refs[i] for _ in runs for i in row]]).score
        out.append(score(system_runs) - score(baseline_runs))
    return np.array(out)


def test_one_run_each_gives_sacrebleus_p_value_and_the_naive_interval(data, monkeypatch):
    refs, base, system = data
    monkeypatch.setenv("SACREBLEU_SEED", str(SACREBLEU_SEED))
    result = paired_bootstrap([base[0]], [system[0]], refs, samples=200)

    _, scores = PairedTest([("base", base[0]), ("sys", system[0])], {"BLEU": BLEU()}, [refs], test_type="bs",
                           n_samples=200)()
    sacre = scores["BLEU"][1]
    assert result.system_bleu == pytest.approx(sacre.score, abs=1e-9)
    assert result.baseline_bleu == pytest.approx(scores["BLEU"][0].score, abs=1e-9)
    assert result.p_value == pytest.approx(sacre.p_value, abs=1e-12)

    diffs = naive_resampled_differences([base[0]], [system[0]], refs, 200, SACREBLEU_SEED)
    assert [result.ci_low, result.ci_high] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=1e-9)
    assert result.delta > 0 and result.verdict == "better"


def test_pooled_seeds_keep_each_sentence_together(data):
    refs, base, system = data
    result = paired_bootstrap(base, system[:2], refs, samples=100, seed=7)
    metric = BLEU()
    def full(runs):
        return metric.corpus_score([h for run in runs for h in run], [[r for _ in runs for r in refs]]).score

    assert result.baseline_bleu == pytest.approx(full(base), abs=1e-9)
    assert result.system_bleu == pytest.approx(full(system[:2]), abs=1e-9)
    diffs = naive_resampled_differences(base, system[:2], refs, 100, 7)
    assert [result.ci_low, result.ci_high] == pytest.approx(list(np.percentile(diffs, [2.5, 97.5])), abs=1e-9)
    assert result.seeds == 2 and result.as_dict()["ci95"] == [result.ci_low, result.ci_high]


def test_verdicts(data):
    refs, base, system = data
    same = paired_bootstrap(base, base, refs, samples=50)
    assert (same.delta, same.ci_low, same.ci_high, same.verdict) == (0.0, 0.0, 0.0, "no difference")
    # sacreBLEU's test counts resamples whose centred difference strictly exceeds the observed
    # one: for identical systems none does, so p is its floor 1 / (N + 1), not 1
    assert same.p_value == pytest.approx(1 / 51)
    assert paired_bootstrap(system, base, refs, samples=50).verdict == "worse"
    assert [c.verdict for c in seed_pairs(base, system, refs, samples=50)] == ["better"] * 3


def test_refuses_misaligned_runs(data):
    refs, base, system = data
    with pytest.raises(AnalysisError, match="59 hypotheses but 60 references"):
        paired_bootstrap(base, [system[0][:-1]], refs, samples=10)
    with pytest.raises(AnalysisError, match="at least one run"):
        paired_bootstrap([], system, refs)
