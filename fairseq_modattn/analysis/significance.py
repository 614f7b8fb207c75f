"""Paired bootstrap resampling of corpus BLEU, chrF and TER: is system B better than system A on this test set?

Koehn (2004), "Statistical significance tests for machine translation evaluation", as sacreBLEU
implements it (``sacrebleu.significance.PairedTest`` with ``test_type="bs"``, ``--paired-bs``):
draw N resamples of the test set's sentence indices with replacement, recompute every system's
corpus score on each resample from its per-sentence sufficient statistics, and compare with the
first system, the baseline. sacreBLEU reports a p-value and each system's own interval; a
comparison table needs the interval of the *difference*, so :func:`compare_systems` keeps the N
paired differences and reports their 2.5 and 97.5 percentiles next to sacreBLEU's p-value, from
the very same resamples (same generator, same seed, so the p-value equals what
``PairedTest`` prints for one run per system).

Several training seeds per system are pooled the way a reader would pool them: each seed's
translation of sentence i stays tied to sentence i, so a resample that draws sentence i draws it
for every seed, and the score of a resample is the corpus score of all seeds' translations of the
drawn sentences together (each seed against the same reference). The interval then covers the
test set's sampling variation for the seed-averaged systems; the spread over seeds themselves is
reported separately (each seed's own score). ``PairedTest`` cannot pool seeds that way (it would
resample each seed's copy of a sentence independently), hence this module.

sacreBLEU's public API scores the full test set (``corpus_score``); the resamples are scored
from the per-sentence statistics through two private methods of its metrics,
``_extract_corpus_statistics`` and ``_compute_score_from_stats``, the ones ``PairedTest`` uses
itself. They exist unchanged from sacreBLEU 2.0.0 to 2.6.0 (checked in its repository), hence
the ``sacrebleu>=2.0,<3`` pin; tests/test_significance.py checks the scores and p-values against
``PairedTest`` and against a loop that rescores every resample with ``corpus_score``.

One p-value differs from ``PairedTest``'s on purpose: two systems that score the same on the test
set and on every resample (identical translations, say) get p = 1, flagged ``identical``, where
sacreBLEU's count of resamples that strictly exceed the observed difference finds none and so
prints its floor 1 / (N + 1), the strongest evidence it can give, beside "no difference"
(:func:`_p_value`).

Limits the ``compare`` command enforces from here: at least :data:`MIN_SAMPLES` resamples, lines
of at most :data:`MAX_LINE_CHARS` characters, and resample counts that fit in the memory available
(:func:`check_resample_memory`).
"""

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import AnalysisError
from .scoring import metric_scorer

#: sacreBLEU's default seed for its resampling (``SACREBLEU_SEED``), so the resamples are its own
SACREBLEU_SEED = 12345

#: the metrics this module compares, by the names the ``compare`` command takes
METRICS = ("bleu", "chrf", "ter")
#: how the tables name them
METRIC_LABELS = {"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}
#: TER counts edits: lower is better
HIGHER_IS_BETTER = {"bleu": True, "chrf": True, "ter": False}

#: one system: its name and its runs (one list of hypotheses per training seed)
System = Tuple[str, Sequence[Sequence[str]]]

#: the fewest resamples ``compare`` accepts. The interval's ends are the 2.5 and 97.5 percentiles
#: of the resampled differences, so with N resamples each end rests on the 0.025 N most extreme
#: ones: 100 leaves 2.5 a side, fewer leave one or none (with 1 resample the "interval" is one
#: resample's difference, which need not contain the test set's own), and p cannot go below
#: 1 / (N + 1), so under 100 it cannot reach 0.01. sacreBLEU's default is 1,000.
MIN_SAMPLES = 100

#: the longest line, in characters, ``compare`` scores. sacreBLEU's TER searches shifts over
#: every pair of word spans within a sentence, a cost that grows with the square of the line's
#: length and beyond: a hypothesis line of 10 MB (a binary file given by mistake) ran TER for
#: more than 150 s at 5.9 GB. Real sentences are far shorter: sentence-level test sets hold
#: lines of a few hundred characters, rarely a thousand (the longest of Multi30k's files holds
#: 257, of IWSLT16's dev files 986, XML tags included), and fairseq-generate stops a translation
#: at 200 tokens by default (``--max-len-b``) and at the model's 1,024 positions in any case.
#: At the limit TER stays bounded: about 2 s for a 10,000-character line and its translation,
#: about a minute, at 0.2 GB, for two unrelated ones (measured on one core).
MAX_LINE_CHARS = 10_000

#: bytes per (resample, sentence) at the peak of :func:`resample_counts`: the int64 draw and
#: the int64 counts (then the counts and their float64 copy)
RESAMPLE_BYTES_PER_CELL = 16


@dataclass
class PairedComparison:
    """System minus baseline, in the metric's points, on the full test set and over the resamples.

    For TER a negative difference is an improvement (``higher_is_better`` is False)."""

    metric: str
    baseline_score: float
    system_score: float
    delta: float
    ci_low: float
    ci_high: float
    p_value: float
    samples: int
    seeds: int
    higher_is_better: bool = True
    #: system and baseline score the same on the test set and on every resample: nothing in the
    #: test set tells them apart (then p = 1, see :func:`_p_value`)
    identical: bool = False

    @property
    def verdict(self) -> str:
        """'better' / 'worse' when the difference's 95 % interval excludes 0, else 'no difference'
        (the interval, not the p-value, decides: both come from the same resamples). Identical
        systems are 'no difference' too; ``identical`` says why."""
        if self.ci_low > 0:
            return "better" if self.higher_is_better else "worse"
        if self.ci_high < 0:
            return "worse" if self.higher_is_better else "better"
        return "no difference"

    def as_dict(self) -> Dict[str, Any]:
        return {"metric": self.metric, "baseline_score": self.baseline_score, "system_score": self.system_score,
                "delta": self.delta, "ci95": [self.ci_low, self.ci_high], "p_value": self.p_value,
                "samples": self.samples, "seeds": self.seeds, "higher_is_better": self.higher_is_better,
                "verdict": self.verdict, "identical": self.identical}


@dataclass
class MetricComparison:
    """One metric over all systems: each system's pooled corpus score, each seed's own score, and
    each system's :class:`PairedComparison` with the baseline (the first system)."""

    metric: str
    signature: str
    baseline: str
    scores: Dict[str, float] = field(default_factory=dict)
    seed_scores: Dict[str, List[float]] = field(default_factory=dict)
    comparisons: Dict[str, PairedComparison] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return {"metric": self.metric, "signature": self.signature, "baseline": self.baseline,
                "higher_is_better": HIGHER_IS_BETTER[self.metric], "scores": self.scores,
                "seed_scores": self.seed_scores,
                "comparisons": {name: c.as_dict() for name, c in self.comparisons.items()}}


def _sentence_stats(scorer, runs: Sequence[Sequence[str]], references: Sequence[str]) -> List[np.ndarray]:
    """Per-sentence sufficient statistics of each run (seed), each of shape (sentences, stats)."""
    out = []
    for hyps in runs:
        if len(hyps) != len(references):
            raise AnalysisError(f"{len(hyps)} hypotheses but {len(references)} references: every run must "
                                "translate the whole test set")
        out.append(np.asarray(scorer._extract_corpus_statistics(list(hyps), [list(references)]), dtype=np.float64))
    return out


def _score(scorer, stats: np.ndarray) -> float:
    return float(scorer._compute_score_from_stats(list(stats)).score)


def resample_counts(sentences: int, samples: int, seed: int) -> np.ndarray:
    """(SAMPLES, SENTENCES) matrix: how often each resample draws each sentence, from the same
    draw as sacreBLEU's ``paired_bs`` (one index matrix from ``default_rng(SEED)``). A resample's
    statistics are then ``counts @ per-sentence statistics``: sums of whole numbers, exact in
    float64, without the (samples, sentences, stats) array of indexing by the draw.

    Row r's draws are shifted by r * SENTENCES in place, so one ``bincount`` counts every row at
    once; the peak is :data:`RESAMPLE_BYTES_PER_CELL` bytes per cell (:func:`resample_memory`)."""
    indices = np.random.default_rng(seed).choice(sentences, size=(samples, sentences), replace=True)
    indices += (np.arange(samples, dtype=indices.dtype) * sentences)[:, None]
    counts = np.bincount(indices.ravel(), minlength=samples * sentences)
    del indices  # before the float64 copy, so the peak holds two matrices, not three
    return counts.reshape(samples, sentences).astype(np.float64)


def resample_memory(sentences: int, samples: int) -> int:
    """Bytes :func:`resample_counts` needs at its peak for SAMPLES resamples of SENTENCES."""
    return RESAMPLE_BYTES_PER_CELL * sentences * samples


def available_memory() -> Optional[int]:
    """Bytes of memory a new allocation can get now: Linux's ``MemAvailable`` (free memory plus
    the caches the kernel can drop), else the machine's physical memory, else None (unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB, meaning KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_resample_memory(sentences: int, samples: int, flag: str = "samples") -> None:
    """AnalysisError, before anything is allocated, when SAMPLES resamples of SENTENCES need
    more memory than is available (:func:`resample_memory` against :func:`available_memory`):
    numpy would otherwise stop with a traceback, or the machine would swap. FLAG names the
    setting to lower (``compare``'s ``--samples``)."""
    from ..disk_space import human_bytes

    need, available = resample_memory(sentences, samples), available_memory()
    if available is not None and need > available:
        raise AnalysisError(
            f"{flag} {samples} would need {human_bytes(need)} of memory ({samples:,} resamples x {sentences:,} "
            f"sentences x {RESAMPLE_BYTES_PER_CELL} bytes), more than the {human_bytes(available)} available: "
            f"give a smaller {flag} (sacreBLEU's default is 1000)")


def _p_value(differences: np.ndarray, observed: float) -> float:
    """sacreBLEU's p-value: the share of resamples whose centred absolute difference exceeds the
    observed absolute difference, with the +1 correction,
    p = (#{r : |d_r| - mean_s |d_s| > |observed|} + 1) / (N + 1).

    Except where every resample ties, observed difference included (identical systems): no
    resample can exceed a difference of 0, so the formula gives its floor 1 / (N + 1), the value
    of the strongest evidence, for systems the test set cannot tell apart at all. Their p is 1:
    every resample is at least as extreme as what was observed."""
    if observed == 0 and not np.any(differences):
        return 1.0
    absolute = np.abs(differences)
    centred = absolute - absolute.mean()
    return float((np.sum(centred > abs(observed)) + 1) / (len(differences) + 1))


def compare_systems(systems: Sequence[System], references: Sequence[str], *, metrics: Sequence[str] = METRICS,
                    samples: int = 1000, seed: int = SACREBLEU_SEED, tokenize: str = "13a",
                    lowercase: bool = False) -> Dict[str, MetricComparison]:
    """Compare each of SYSTEMS after the first (the baseline) with the first, for each of METRICS,
    by paired bootstrap resampling of the test sentences (SAMPLES resamples drawn with SEED, the
    same for every system and metric, as sacreBLEU draws them). A system is (name, runs): one
    hypothesis list per training seed, aligned with REFERENCES; systems may have different
    numbers of runs. Returns {metric: :class:`MetricComparison`}, in METRICS' order.

    Scores are sacreBLEU's ``corpus_score`` of all a system's runs together (each run against
    REFERENCES). The p-value is sacreBLEU's (:func:`_p_value`), so with one run each it equals
    ``PairedTest``'s but for identical systems (p = 1 here); the interval is the percentile
    interval of the resampled differences system - baseline. Resample counts that would not fit
    in the memory available are refused before they are drawn (:func:`check_resample_memory`).
    """
    if len(systems) < 2:
        raise AnalysisError("a comparison needs at least two systems (the first is the baseline)")
    names = [name for name, _ in systems]
    if len(set(names)) != len(names):
        raise AnalysisError(f"system names must differ: {', '.join(names)}")
    for name, runs in systems:
        if not runs:
            raise AnalysisError(f"system {name} has no run: paired bootstrap needs at least one run of each system")
    if samples < 1:
        raise AnalysisError("paired bootstrap needs at least one resample")
    if not references:
        raise AnalysisError("no sentences to compare: the references are empty")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown or not metrics:
        raise AnalysisError(f"unknown metric {', '.join(unknown) or '(none)'}; choose from: {', '.join(METRICS)}")

    check_resample_memory(len(references), samples)
    counts = resample_counts(len(references), samples, seed)
    out: Dict[str, MetricComparison] = {}
    for metric in metrics:
        scorer = metric_scorer(metric, tokenize, lowercase)
        baseline = names[0]
        result = MetricComparison(metric=metric, signature="", baseline=baseline)
        resampled: Dict[str, np.ndarray] = {}
        for name, runs in systems:
            per_seed = _sentence_stats(scorer, runs, references)
            pooled = np.sum(per_seed, axis=0)
            # the headline through the public API: all runs as one corpus, the references once per run
            full = scorer.corpus_score([h for run in runs for h in run], [[r for _ in runs for r in references]])
            result.scores[name] = float(full.score)
            result.seed_scores[name] = [_score(scorer, stats.sum(0)) for stats in per_seed]
            resampled[name] = np.array([_score(scorer, row) for row in counts @ pooled])
            if name == baseline:
                continue
            differences = resampled[name] - resampled[baseline]
            delta = result.scores[name] - result.scores[baseline]
            low, high = np.percentile(differences, [2.5, 97.5])
            result.comparisons[name] = PairedComparison(
                metric=metric, baseline_score=result.scores[baseline], system_score=result.scores[name],
                delta=delta, ci_low=float(low), ci_high=float(high), p_value=_p_value(differences, delta),
                samples=samples, seeds=len(runs), higher_is_better=HIGHER_IS_BETTER[metric],
                identical=delta == 0 and not np.any(differences))
        signature = scorer.get_signature()  # known once the scorer has seen the references
        signature.update("seed", str(seed))
        signature.update("bs", samples)
        result.signature = signature.format()
        out[metric] = result
    return out


def paired_bootstrap(baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]], references: Sequence[str],
                     *, metric: str = "bleu", samples: int = 1000, seed: int = SACREBLEU_SEED,
                     tokenize: str = "13a", lowercase: bool = False) -> PairedComparison:
    """Compare SYSTEM with BASELINE, each a list of runs (one hypothesis list per training seed,
    aligned with REFERENCES; the two may have different numbers of runs), on METRIC by paired
    bootstrap resampling of the test sentences (:func:`compare_systems` with these two systems).
    With one run each, the p-value is sacreBLEU's ``paired_bs`` p-value."""
    if not baseline or not system:
        raise AnalysisError("paired bootstrap needs at least one run of each system")
    result = compare_systems([("baseline", baseline), ("system", system)], references, metrics=[metric],
                             samples=samples, seed=seed, tokenize=tokenize, lowercase=lowercase)
    return result[metric].comparisons["system"]


def seed_pairs(baseline: Sequence[Sequence[str]], system: Sequence[Sequence[str]], references: Sequence[str],
               **kwargs) -> List[PairedComparison]:
    """:func:`paired_bootstrap` of each seed against the baseline's run of the same index (seed
    1 against seed 1, ...): how much one pair of training runs alone can say."""
    return [paired_bootstrap([b], [s], references, **kwargs) for b, s in zip(baseline, system)]
