"""BLEU the way the paper reports it (docs/design.md, "Evaluation definitions").

* tokenized BLEU as fairseq prints it: ``fairseq-generate``'s ``BLEU4 = ...`` line, or
  :func:`tokenized_bleu`, which runs fairseq's own scorer exactly as ``fairseq-score`` does;
* compound-split BLEU (WMT14 en-de): :func:`compound_split` on hypotheses and references, then
  :func:`tokenized_bleu`; this is fairseq's ``scripts/compound_split_bleu.sh``, which the pip
  package does not ship;
* detokenized sacreBLEU with its signature: :func:`detokenize` (sacremoses) on the
  hypotheses, then :func:`detok_sacrebleu`; :func:`sacrebleu_scores` scores a lower-cased
  system against true-case references case-insensitively (:func:`lowercased_system`);
* chrF and TER beside it, sacreBLEU's ``CHRF()`` and ``TER()`` with their defaults, each with its
  signature: :func:`detok_chrf`, :func:`detok_ter`; :func:`translation_scores` computes all three
  metrics from the same detokenized lines, the one place every command's scores come from.
* :func:`scored_text_sha256`: the checksum ``evaluate`` records of each text file it scored, and
  ``compare`` checks before it scores the file again.

:func:`parse_generate_output` reads ``fairseq-generate``'s stdout into a :class:`GenerateResult`.
"""

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import AnalysisError

_COMPOUND = re.compile(r"(\S)-(\S)")
_ID_LINE = re.compile(r"^([STHD])-(\d+)\t(.*)$")
_BLEU_LINE = re.compile(r"^Generate (\S+) with beam=(\d+): .*?BLEU\d* = (-?[\d.]+)")


def compound_split(line: str) -> str:
    """Split hyphenated compounds as fairseq's ``compound_split_bleu.sh`` does before scoring
    WMT14 en-de: Perl ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``.

    The substitution scans left to right and matches do not overlap (Python's ``re.sub`` has the
    same semantics), so the character after a hyphen, once consumed, cannot start the next
    match: ``a-b-c`` becomes ``a ##AT##-##AT## b-c``, not a full split (the Perl script gives
    the same string); only one-character pieces between two hyphens are affected, so
    ``state-of-the-art`` is split at every hyphen. A hyphen already Moses-split as ``@-@`` is
    surrounded by ``@``, which is non-space, so ``well @-@ known`` becomes
    ``well @ ##AT##-##AT## @ known``. A hyphen next to a space or the line's ends (``- a``,
    ``a -``) is left alone.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


@dataclass
class GenerateResult:
    """What ``fairseq-generate`` printed, keyed by sentence id (its index in the data-bin split).

    ``hypotheses`` and ``detokenized`` hold the text of the ``H-`` and ``D-`` lines,
    ``scores`` the ``H-`` line's score; ``bleu``/``bleu_line``/``beam`` come from the final
    ``Generate SUBSET with beam=N: BLEU4 = ...`` line (None when it is absent, e.g. a split
    without targets).
    """

    sources: Dict[int, str] = field(default_factory=dict)
    targets: Dict[int, str] = field(default_factory=dict)
    hypotheses: Dict[int, str] = field(default_factory=dict)
    scores: Dict[int, float] = field(default_factory=dict)
    detokenized: Dict[int, str] = field(default_factory=dict)
    bleu: Optional[float] = None
    bleu_line: Optional[str] = None
    beam: Optional[int] = None


def _store(table: Dict[int, str], kind: str, sentence_id: int, text: str, number: int):
    if sentence_id in table:
        raise AnalysisError(f"fairseq-generate output line {number}: {kind}-{sentence_id} appears twice "
                            "(one hypothesis per sentence expected: was --nbest > 1 or were outputs concatenated?)")
    table[sentence_id] = text


def parse_generate_output(text: str) -> GenerateResult:
    """Parse ``fairseq-generate``'s stdout (``S-``, ``T-``, ``H-``, ``D-`` lines and the BLEU line).

    Other lines (``P-`` scores, log lines) are ignored. An id seen twice for the same kind of
    line is an AnalysisError: it would silently make one sentence count twice in BLEU.
    """
    result = GenerateResult()
    for number, line in enumerate(text.splitlines(), 1):
        match = _ID_LINE.match(line)
        if match:
            kind, sentence_id, rest = match.group(1), int(match.group(2)), match.group(3)
            if kind in "HD":
                score, _, rest = rest.partition("\t")
                try:
                    value = float(score)
                except ValueError:
                    raise AnalysisError(f"fairseq-generate output line {number}: expected "
                                        f"'{kind}-ID<tab>SCORE<tab>TEXT', got {line[:200]!r}") from None
                if kind == "H":
                    result.scores[sentence_id] = value
            table = {"S": result.sources, "T": result.targets, "H": result.hypotheses,
                     "D": result.detokenized}[kind]
            _store(table, kind, sentence_id, rest, number)
            continue
        match = _BLEU_LINE.match(line)
        if match:
            result.bleu, result.bleu_line, result.beam = float(match.group(3)), line.strip(), int(match.group(2))
    return result


def _check_pairs(hyps: Sequence[str], refs: Sequence[str]):
    if len(hyps) != len(refs):
        raise AnalysisError(
            f"{len(hyps)} hypotheses but {len(refs)} references: BLEU needs one reference per hypothesis")
    if not hyps:
        raise AnalysisError("no sentences to score")


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus BLEU-4 of whitespace-tokenized lines with fairseq's scorer, as ``fairseq-score``
    computes it (a fresh ``Dictionary``, ``encode_line`` on both sides, ``bleu.Scorer``), so
    the value equals what ``fairseq-score --sys H --ref R`` prints, before its rounding to 2
    decimals. Used for compound-split BLEU, which fairseq computes this way."""
    from fairseq.data.dictionary import Dictionary
    from fairseq.scoring import bleu

    _check_pairs(hyps, refs)
    vocab = Dictionary()
    scorer = bleu.Scorer(bleu.BleuConfig(pad=vocab.pad(), eos=vocab.eos(), unk=vocab.unk()))
    for hyp, ref in zip(hyps, refs):
        scorer.add(vocab.encode_line(ref), vocab.encode_line(hyp))
    return float(scorer.score(order=4))


def metric_scorer(metric: str, tokenize: str = "13a", lowercase: bool = False) -> Any:
    """sacreBLEU's scorer of METRIC ('bleu', 'chrf' or 'ter'), with its defaults but for
    TOKENIZE (BLEU's tokenizer) and LOWERCASE (case-insensitive BLEU and chrF; sacreBLEU's
    TER is case-insensitive already): the one place the package makes them, for its scores and
    for the bootstrap of ``significance.py``."""
    from sacrebleu.metrics import BLEU, CHRF, TER

    if metric == "bleu":
        try:
            return BLEU(tokenize=tokenize, lowercase=lowercase)
        except Exception as e:  # sacreBLEU raises bare exceptions for an unknown tokenizer
            raise AnalysisError(f"sacrebleu rejects tokenize={tokenize!r}: {e}") from e
    if metric == "chrf":
        return CHRF(lowercase=lowercase)
    if metric == "ter":
        return TER()
    raise AnalysisError(f"unknown metric {metric!r}; choose from: bleu, chrf, ter")


def _detok_score(scorer: Any, hyps: Sequence[str], refs: Sequence[str]) -> Tuple[float, str]:
    """(corpus score, signature) of SCORER on detokenized hypotheses against one reference each."""
    _check_pairs(hyps, refs)
    score = scorer.corpus_score(list(hyps), [list(refs)])
    return float(score.score), str(scorer.get_signature())


def detok_sacrebleu(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a",
                    lowercase: bool = False) -> Tuple[float, str]:
    """(corpus sacreBLEU, its signature) of detokenized hypotheses against one reference each;
    case-insensitive (sacreBLEU's ``lowercase=True``, ``case:lc`` in the signature) with LOWERCASE.

    The signature (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:...``) is what
    makes a sacreBLEU number comparable, so it is always returned with the score.
    """
    return _detok_score(metric_scorer("bleu", tokenize, lowercase), hyps, refs)


def detok_chrf(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False) -> Tuple[float, str]:
    """(corpus chrF, its signature) of detokenized hypotheses against one reference each:
    sacreBLEU's ``CHRF()`` defaults (character 6-grams, no word n-grams, beta 2), case-insensitive
    (``case:lc``) with LOWERCASE."""
    return _detok_score(metric_scorer("chrf", lowercase=lowercase), hyps, refs)


def detok_ter(hyps: Sequence[str], refs: Sequence[str]) -> Tuple[float, str]:
    """(corpus TER, its signature) of detokenized hypotheses against one reference each:
    sacreBLEU's ``TER()`` defaults, which are case-insensitive (``case:lc``) already. Lower is
    better: edits per reference word, in percent (can exceed 100)."""
    return _detok_score(metric_scorer("ter"), hyps, refs)


def _has_upper(line: str) -> bool:
    return line != line.lower()


def lowercased_system(hyps: Sequence[str], refs: Sequence[str]) -> bool:
    """True when the hypotheses are all lower case (and hold at least one letter that has a
    case) while some reference is not: a system trained on lower-cased data (the Multi30k and
    IWSLT recipes lower-case) scored against true-case references, which case-sensitive BLEU
    would penalise for every capital letter it cannot produce."""
    if any(_has_upper(h) for h in hyps):
        return False
    if not any(ch.lower() != ch.upper() for h in hyps for ch in h):
        return False  # nothing cased (digits, punctuation, Chinese): case cannot matter
    return any(_has_upper(r) for r in refs)


LOWERCASE_REASON = ("the hypotheses are all lower case and the references are not (a system trained on "
                    "lower-cased data): case-sensitive sacreBLEU would count every capital letter of the "
                    "references as an error")


def sacrebleu_scores(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a",
                     case_sensitive: bool = False) -> Dict[str, object]:
    """Detokenized sacreBLEU, case-insensitive when :func:`lowercased_system` (unless
    CASE_SENSITIVE), as a dict: ``sacrebleu`` and ``sacrebleu_signature`` (the headline),
    ``lowercase`` (whether the headline is case-insensitive), ``lowercase_reason`` (None when
    hypotheses and references agree on case; else why the headline is, or with CASE_SENSITIVE
    is not, case-insensitive), and ``sacrebleu_case_sensitive`` with its signature, always."""
    cased, cased_signature = detok_sacrebleu(hyps, refs, tokenize)
    scores = {"sacrebleu": cased, "sacrebleu_signature": cased_signature, "lowercase": False,
              "lowercase_reason": None, "sacrebleu_case_sensitive": cased,
              "sacrebleu_case_sensitive_signature": cased_signature}
    if lowercased_system(hyps, refs):
        if case_sensitive:
            scores["lowercase_reason"] = f"not lower-cased (--case-sensitive) although {LOWERCASE_REASON}"
        else:
            scores["sacrebleu"], scores["sacrebleu_signature"] = detok_sacrebleu(hyps, refs, tokenize, lowercase=True)
            scores["lowercase"], scores["lowercase_reason"] = True, LOWERCASE_REASON
    return scores


def translation_scores(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "13a",
                       case_sensitive: bool = False) -> Dict[str, object]:
    """sacreBLEU, chrF and TER of the same detokenized HYPS against REFS, each with its signature:
    :func:`sacrebleu_scores`'s keys, plus ``chrf``/``chrf_signature`` (case-insensitive exactly
    when the sacreBLEU headline is: a lower-cased system against true-case references), the
    case-sensitive ``chrf_case_sensitive``/``chrf_case_sensitive_signature``, always, and
    ``ter``/``ter_signature`` (sacreBLEU's TER is case-insensitive by default)."""
    scores = sacrebleu_scores(hyps, refs, tokenize, case_sensitive=case_sensitive)
    cased, cased_signature = detok_chrf(hyps, refs)
    scores["chrf"], scores["chrf_signature"] = (detok_chrf(hyps, refs, lowercase=True) if scores["lowercase"]
                                                else (cased, cased_signature))
    scores["chrf_case_sensitive"], scores["chrf_case_sensitive_signature"] = cased, cased_signature
    scores["ter"], scores["ter_signature"] = detok_ter(hyps, refs)
    return scores


#: the metrics of :func:`translation_scores` as tables name them, with their keys in its dict
METRICS = (("sacreBLEU", "sacrebleu"), ("chrF", "chrf"), ("TER", "ter"))


def signatures_text(records: Iterable[Mapping[str, object]]) -> str:
    """The signatures of sacreBLEU, chrF and TER that RECORDS (results of
    :func:`translation_scores`, or dicts with its ``*_signature`` keys) were scored with, for a
    table's caption: ``sacreBLEU `SIG`; chrF `SIG`; TER `SIG```, each distinct signature once (a
    metric scored two ways lists both, joined by ``or``)."""
    records = list(records)
    parts = []
    for name, key in METRICS:
        seen: List[str] = []
        for record in records:
            signature = record.get(f"{key}_signature")
            if signature is not None and str(signature) not in seen:
                seen.append(str(signature))
        if seen:
            parts.append(f"{name} " + " or ".join(f"`{s}`" for s in seen))
    return "; ".join(parts)


def detokenize(lines: Sequence[str], lang: str) -> List[str]:
    """Moses-detokenize tokenized lines (fairseq's ``H-``/``T-`` text after ``--remove-bpe``),
    undoing the ``sacremoses`` tokenization the data recipes apply, for sacreBLEU."""
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def scored_text_sha256(path) -> str:
    """SHA-256 (hex) of the bytes of PATH, a scored text file: what ``evaluate`` records of the
    ``hyp.txt`` and ``ref.txt`` it writes (``hypotheses_sha256``, ``references_sha256``), so that
    ``compare`` can tell the file it reads is still the text that was scored. Read in 1 MiB
    blocks, so a large file is never held whole."""
    digest = hashlib.sha256()
    with open(Path(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
