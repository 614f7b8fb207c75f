"""What ``fairseq-modattn evaluate`` writes beside its results JSON, without running it: where
the scored text goes, which existing files it may replace, and how an evaluation recorded before
chrF and TER existed is completed from its kept fairseq-generate output (``cli/runs.py`` reuses
such evaluations). The end-to-end checks of the files are in test_evaluate_cli.py."""

import json
from pathlib import Path

import pytest
import sacrebleu
from sacremoses import MosesDetokenizer

from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.cli.evaluate import (
    _check_transcripts_writable,
    _write_transcripts,
    complete_recorded_scores,
    transcript_paths,
)

# fairseq-generate's stdout for a 3-sentence split, lines out of id order as fairseq prints them
GENERATED = """\
S-2\tein hund läuft .
T-2\ta dog runs .
H-2\t-0.9\ta dog is running .
D-2\t-0.9\ta dog is running .
S-0\tein mann &apos;s hut .
T-0\ta man &apos;s hat .
H-0\t-0.5\ta man &apos;s hat .
D-0\t-0.5\ta man &apos;s hat .
S-1\tzwei frauen , die reden .
T-1\ttwo women talking .
H-1\t-1.2\ttwo women , who talk .
D-1\t-1.2\ttwo women , who talk .
Generate test with beam=5: BLEU4 = 40.00, 80.0/50.0/40.0/30.0 (BP=1.000, ratio=1.0, syslen=14, reflen=13)
"""


def detokenized(kind: str):
    detok = MosesDetokenizer(lang="en")
    lines = dict(line.split("\t", 1) for line in GENERATED.splitlines() if line.startswith(f"{kind}-"))
    return [detok.detokenize(lines[f"{kind}-{i}"].split("\t")[-1].split()) for i in range(3)]


def test_transcripts_lie_beside_the_results_json(tmp_path):
    assert transcript_paths(tmp_path / "results.json") == (tmp_path / "hyp.txt", tmp_path / "ref.txt")
    assert transcript_paths(tmp_path / "dma.json") == (tmp_path / "dma.hyp.txt", tmp_path / "dma.ref.txt")


def test_only_the_transcripts_the_results_json_names_are_replaced(tmp_path):
    output = tmp_path / "results.json"
    _check_transcripts_writable(output)  # nothing there yet
    hyp, ref = transcript_paths(output)
    hyp.write_text("a file someone else wrote\n")
    with pytest.raises(AnalysisError, match=f"{hyp} exists and {output} does not name it"):
        _check_transcripts_writable(output)
    output.write_text(json.dumps({"bleu": 1.0}))  # a results file of a version without transcripts
    with pytest.raises(AnalysisError, match="is not this command's to replace"):
        _check_transcripts_writable(output)
    recorded = _write_transcripts(output, ["x"], ["y"])
    assert recorded == {"hypotheses_file": str(hyp.resolve()), "references_file": str(ref.resolve())}
    output.write_text(json.dumps(recorded))  # what evaluate writes: now both are its own
    _check_transcripts_writable(output)
    output.write_text(json.dumps({"hypotheses_file": recorded["hypotheses_file"]}))
    with pytest.raises(AnalysisError, match=f"{ref} exists"):
        _check_transcripts_writable(output)
    ref.unlink()
    ref.mkdir()
    with pytest.raises(AnalysisError, match="is a directory"):
        _check_transcripts_writable(output)
    assert hyp.read_text() == "x\n"


def test_a_recorded_evaluation_gains_chrf_ter_and_its_scored_text(tmp_path):
    work = tmp_path / "evaluation"
    work.mkdir()
    (work / "generate-test.txt").write_text(GENERATED, encoding="utf-8")
    hyps, refs = detokenized("H"), detokenized("T")
    assert hyps[0] == "a man's hat." and refs[2] == "a dog runs."
    old = {"sentences": 3, "subset": "test", "target_lang": "en", "generate_output": str(work / "generate-test.txt"),
           "sacrebleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "sacrebleu_tokenize": "13a",
           "sacrebleu_references": "moses-detokenized T- lines of fairseq-generate", "lowercase": False,
           "lowercase_reason": None}
    results = dict(old)
    assert complete_recorded_scores(results, work / "results.json")
    assert results["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert results["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [refs]).score, abs=1e-9)
    assert "nc:6" in results["chrf_signature"] and "tok:tercom" in results["ter_signature"]
    assert {k: results[k] for k in old} == old  # what was recorded stays
    assert Path(results["hypotheses_file"]).read_text(encoding="utf-8").splitlines() == hyps
    assert Path(results["references_file"]).read_text(encoding="utf-8").splitlines() == refs
    assert not complete_recorded_scores(results, work / "results.json")  # nothing missing any more

    wrong = dict(old, sacrebleu=old["sacrebleu"] + 1)
    with pytest.raises(AnalysisError, match="the kept output is not what was scored"):
        complete_recorded_scores(wrong, tmp_path / "other.json")
    gone = dict(old, generate_output=str(tmp_path / "missing.txt"))
    with pytest.raises(AnalysisError, match="cannot be scored again"):
        complete_recorded_scores(gone, tmp_path / "other.json")
