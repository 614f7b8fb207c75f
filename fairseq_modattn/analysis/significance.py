"""Paired bootstrap resampling of corpus BLEU: is system B better than system A on this test set?

Koehn (2004), "Statistical significance tests for machine translation evaluation", as sacreBLEU
implements it (``sacrebleu.significance``, ``--paired-bs``): draw N resamples of the test
set's sentence indices with replacement, recompute both systems' corpus BLEU on each resample
from their per-sentence sufficient statistics, and compare. sacreBLEU reports a p-value and
each system's own interval; a comparison table needs the interval of the *difference*, so
:func:`paired_bootstrap` keeps the N paired differences and reports their 2.5 and 97.5
percentiles next to sacreBLEU's p-value, from the very same resamples (same generator, same
seed, so the p-value equals what ``sacrebleu.significance.PairedTest`` prints).

Several training seeds per system are pooled the way a reader would pool them: each seed's
translation of sentence i stays tied to sentence i, so a resample that draws sentence i draws it
for every seed, and the score of a resample is the corpus BLEU of all seeds' translations of the
drawn sentences together. The interval then covers the test set's sampling variation for
the seed-averaged systems; the spread over seeds themselves is reported separately (mean and
standard deviation of each seed's BLEU).
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from . import AnalysisError

#: sacreBLEU's default seed for its resampling (``SACREBLEU_SEED``), so the resamples are its own
SACREBLEU_SEED = 12345


@dataclass
class PairedComparison:
    """System minus baseline, in BLEU points, on the full test set and over the resamples."""

    baseline_bleu: float
    system_bleu: float
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    samples: int
    seeds: int

    @property
    def verdict(self) -> str:
        """'better' / 'worse' when the difference's 95 % interval excludes 0, else 'no difference'."""
        if self.ci_low > 0:
            return "better"
        if self.ci_high < 0:
            return "worse"
        return "no difference"

    def as_dict(self) -> Dict:
        return {"baseline_bleu": self.baseline_bleu, "system_bleu": self.system_bleu, "delta": self.delta,
                "ci95": [self.ci_low, self.ci_high], "p_value": self.p_value, "samples": self.samples,
                "seeds": self.seeds, "verdict": self.verdict}


def _sentence_stats(metric, runs: Sequence[Sequence[str]], references: Sequence[str]) -> np.ndarray:
    """Per-sentence BLEU sufficient statistics summed over RUNS (seeds): shape (sentences, stats)."""
    total = None
    for hyps in runs:
        if len(hyps) != len(references):
            raise AnalysisError(f"{len(hyps)} hypotheses but {len(references)} references: every run must "
                                "translate the whole test set")
        stats = np.asarray(metric._extract_corpus_statistics(list(hyps), [list(references)]), dtype=np.float64)
        total = stats if total is None else total + stats
    assert total is not None, "no runs to pool"
    return total


def _scores(metric, stats: np.ndarray) -> np.ndarray:
    return np.array([metric._compute_score_from_stats(list(row)).score for row in stats])


def paired_bootstrap(baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]], references: Sequence[str],
                     *, samples: int = 1000, seed: int = SACREBLEU_SEED, tokenize: str = "13a",
                     lowercase: bool = False) -> PairedComparison:
    """Compare SYSTEM with BASELINE, each a list of runs (one hypothesis list per training seed,
    aligned with REFERENCES; the two may have different numbers of runs), by paired bootstrap
    resampling of the test sentences (SAMPLES resamples; sacreBLEU's BLEU with TOKENIZE and
    LOWERCASE). With one run each, the p-value is sacreBLEU's ``paired_bs`` p-value.

    The p-value is sacreBLEU's: the share of resamples whose centred absolute difference exceeds
    the observed one, with the +1 correction. The interval is the percentile interval of the
    resampled differences system - baseline.
    """
    from sacrebleu.metrics import BLEU

    if not baseline or not system:
        raise AnalysisError("paired bootstrap needs at least one run of each system")
    if samples < 1:
        raise AnalysisError("paired bootstrap needs at least one resample")
    metric = BLEU(tokenize=tokenize, lowercase=lowercase)
    base_stats = _sentence_stats(metric, baseline, references)
    sys_stats = _sentence_stats(metric, system, references)
    base_bleu = metric._compute_score_from_stats(list(base_stats.sum(0))).score
    sys_bleu = metric._compute_score_from_stats(list(sys_stats.sum(0))).score

    # the same draw as sacreBLEU's paired_bs: one (samples x sentences) index matrix
    indices = np.random.default_rng(seed).choice(len(references), size=(samples, len(references)), replace=True)
    base_resampled = _scores(metric, base_stats[indices].sum(1))
    sys_resampled = _scores(metric, sys_stats[indices].sum(1))

    differences = sys_resampled - base_resampled
    absolute = np.abs(differences)
    centred = absolute - absolute.mean()
    observed = abs(sys_bleu - base_bleu)
    p_value = float((np.sum(centred > observed) + 1) / (samples + 1))
    low, high = np.percentile(differences, [2.5, 97.5])
    return PairedComparison(baseline_bleu=float(base_bleu), system_bleu=float(sys_bleu),
                            delta=float(sys_bleu - base_bleu), ci_low=float(low), ci_high=float(high),
                            p_value=p_value, samples=samples, seeds=len(system))


def seed_pairs(baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]], references: Sequence[str],
               **kwargs) -> List[PairedComparison]:
    """:func:`paired_bootstrap` of each seed against the baseline's run of the same index (seed
    1 against seed 1, ...): how much one pair of training runs alone can say."""
    return [paired_bootstrap([b], [s], references, **kwargs) for b, s in zip(baseline, system)]
