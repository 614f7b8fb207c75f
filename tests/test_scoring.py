"""BLEU helpers (fairseq_modattn.analysis.scoring) against hand computations, sacrebleu and the
real fairseq-score command."""

import math
import re

import pytest

from conftest import fairseq_cli, run_cli
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.scoring import (
    compound_split,
    detok_sacrebleu,
    detokenize,
    parse_generate_output,
    sacrebleu_scores,
    tokenized_bleu,
)


@pytest.mark.parametrize("line, expected", [
    ("a well-known man", "a well ##AT##-##AT## known man"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # matches do not overlap: 'b' was consumed by the first
    ("a-b-c-d", "a ##AT##-##AT## b-c ##AT##-##AT## d"),
    ("well @-@ known", "well @ ##AT##-##AT## @ known"),  # Moses' @-@ is wrapped in non-spaces
    ("a - b", "a - b"),
    ("-a b-", "-a b-"),
    ("x--y", "x ##AT##-##AT## -y"),
    ("no hyphen here", "no hyphen here"),
])
def test_compound_split_follows_the_perl_rule(line, expected):
    assert compound_split(line) == expected


def test_bleu_of_a_hand_checkable_pair():
    """hyp 'the cat sat on the mat' vs ref 'the cat sat on a mat': clipped n-gram precisions
    5/6, 3/5, 2/4, 1/3, equal lengths (BP = 1), so BLEU = 100 * (1/12) ** (1/4)."""
    hyp, ref = ["the cat sat on the mat"], ["the cat sat on a mat"]
    expected = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert expected == pytest.approx(100 * 12 ** -0.25)
    assert tokenized_bleu(hyp, ref) == pytest.approx(expected, abs=1e-9)
    score, signature = detok_sacrebleu(hyp, ref, tokenize="none")
    assert score == pytest.approx(expected, abs=1e-9)
    assert "tok:none" in signature and "nrefs:1" in signature and "version:" in signature


def test_brevity_penalty_matches_sacrebleu():
    hyps = ["the cat sat on the mat", "a dog runs"]
    refs = ["the cat sat on a mat today", "a dog runs fast in the park"]
    score, _ = detok_sacrebleu(hyps, refs, tokenize="none")
    assert tokenized_bleu(hyps, refs) == pytest.approx(score, abs=1e-9)
    assert 0 < score < 100 * 12 ** -0.25  # 9 hypothesis words for 13 reference words


def test_compound_split_bleu_equals_fairseq_score(tmp_path):
    """fairseq's compound_split_bleu.sh: split both sides, then fairseq-score."""
    hyps = ["a well-known man sells ice-cream on the street .", "the state-of-the-art system works ."]
    refs = ["a well-known man sells ice cream on the street .", "the state-of-the-art system works well ."]
    split_h, split_r = [compound_split(h) for h in hyps], [compound_split(r) for r in refs]
    assert split_h[0] == "a well ##AT##-##AT## known man sells ice ##AT##-##AT## cream on the street ."
    assert split_r[1] == "the state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art system works well ."
    (tmp_path / "hyp").write_text("".join(h + "\n" for h in split_h))
    (tmp_path / "ref").write_text("".join(r + "\n" for r in split_r))
    _, out = run_cli([fairseq_cli("fairseq-score"), "--sys", tmp_path / "hyp", "--ref", tmp_path / "ref"])
    printed = float(re.search(r"BLEU4 = ([\d.]+)", out).group(1))
    ours = tokenized_bleu(split_h, split_r)
    assert round(ours, 2) == printed
    assert ours != pytest.approx(tokenized_bleu(hyps, refs))  # splitting changes the score


def test_detokenize_undoes_moses():
    assert detokenize(["a man &apos;s hat , he said .", "( yes ) !"], "en") == ["a man's hat, he said.", "(yes)!"]


def test_bleu_input_errors():
    with pytest.raises(AnalysisError, match="2 hypotheses but 1 references"):
        tokenized_bleu(["a", "b"], ["a"])
    with pytest.raises(AnalysisError, match="no sentences"):
        detok_sacrebleu([], [])
    with pytest.raises(AnalysisError, match="tokenize='nonsense'"):
        detok_sacrebleu(["a"], ["a"], tokenize="nonsense")


# Captured from fairseq-generate (fairseq-fixed 0.12.3.1, --remove-bpe, beam 5) on this
# package's tiny DMA model; sentence 5 given an empty hypothesis.
GENERATE_STDOUT = """\
S-12\teine frau , die in einer küche eine schale mit essen hält .
T-12\ta woman holding a bowl of food in a kitchen .
H-12\t-5.310786724090576\tand a a a a a a a a a a a a a a a a kjumping
D-12\t-5.310786724090576\tand a a a a a a a a a a a a a a a a kjumping
P-12\t-6.4241 -3.7002 -4.1578 -4.5321 -4.8062 -4.9099 -4.9619 -5.0268 -5.1655 -5.3680
S-219\tzwei arbeiter streichen zement auf einen ziegelbau .
T-219\ttwo workers spread cement onto a brick building .
H-219\t-5.176860332489014\ta a a a a tea a tea tea tea a a a tea te
D-219\t-5.176860332489014\ta a a a a tea a tea tea tea a a a tea te
P-219\t-3.4812 -4.1432 -4.4456 -4.7602 -4.9997 -5.6151 -5.0470 -5.1255 -5.3045 -5.2492
S-5\tein hund .
T-5\ta dog .
H-5\t-0.5\t
D-5\t-0.5\t
2026-11-23 13:13:22 | INFO | fairseq_cli.generate | Translated 3 sentences (40 tokens) in 2.5s
Generate test with beam=5: BLEU4 = 0.00, 10.4/0.4/0.0/0.0 (BP=1.000, ratio=1.411, syslen=5284, reflen=3745)
"""


def test_parse_generate_output():
    result = parse_generate_output(GENERATE_STDOUT)
    assert sorted(result.hypotheses) == [5, 12, 219]
    assert result.sources[219] == "zwei arbeiter streichen zement auf einen ziegelbau ."
    assert result.targets[12] == "a woman holding a bowl of food in a kitchen ."
    assert result.hypotheses[12] == "and a a a a a a a a a a a a a a a a kjumping"
    assert result.scores[219] == pytest.approx(-5.176860332489014)
    assert result.detokenized[219] == result.hypotheses[219]
    assert result.hypotheses[5] == "" and result.targets[5] == "a dog ."
    assert result.bleu == 0.0 and not math.isnan(result.bleu)
    assert result.bleu_line.startswith("Generate test with beam=5: BLEU4 = 0.00, 10.4/0.4")


def test_parse_generate_output_bleu_value_and_absence():
    line = "Generate valid with beam=4: BLEU4 = 27.35, 60.1/33.5/20.9/13.4 (BP=1.000, ratio=1.01, syslen=10, reflen=10)"
    parsed = parse_generate_output("H-0\t-1.0\tx\n" + line + "\n")
    assert parsed.bleu == 27.35 and parsed.beam == 4
    empty = parse_generate_output("H-0\t-1.0\tx\n")
    assert empty.bleu is None and empty.bleu_line is None and empty.beam is None


def test_case_insensitive_sacrebleu_matches_sacrebleu():
    import sacrebleu

    hyps, refs = ["a man rides a horse .", "two dogs play in the snow ."], ["A man rides a horse .", "Two Dogs play ."]
    score, signature = detok_sacrebleu(hyps, refs, lowercase=True)
    assert score == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score, abs=1e-9)
    assert "case:lc" in signature and score > detok_sacrebleu(hyps, refs)[0]
    scores = sacrebleu_scores(hyps, refs)
    assert scores["lowercase"] and scores["sacrebleu"] == score
    assert scores["sacrebleu_case_sensitive"] == detok_sacrebleu(hyps, refs)[0]
    forced = sacrebleu_scores(hyps, refs, case_sensitive=True)
    assert not forced["lowercase"] and forced["sacrebleu"] == forced["sacrebleu_case_sensitive"]
    assert "--case-sensitive" in forced["lowercase_reason"]
    cased = sacrebleu_scores(["A man rides a horse ."], ["a Man rides a horse ."])
    assert not cased["lowercase"] and cased["lowercase_reason"] is None and "case:mixed" in cased["sacrebleu_signature"]


@pytest.mark.parametrize("duplicate", ["H-12\t-1.0\tagain", "T-219\tanother reference", "S-5\tnoch einmal"])
def test_duplicated_ids_are_an_error(duplicate):
    with pytest.raises(AnalysisError, match=r"line 15: [HTS]-\d+ appears twice"):
        parse_generate_output(GENERATE_STDOUT.replace("2026-11-23", duplicate + "\n2026-11-23", 1))


def test_malformed_hypothesis_line_is_an_error():
    with pytest.raises(AnalysisError, match="H-ID<tab>SCORE<tab>TEXT"):
        parse_generate_output("H-3\tnot-a-score\ttext\n")
