"""Faults of ``fairseq-modattn evaluate``, end to end with the real
fairseq-generate on a tiny model:

6. generation options given after ``--`` (``--beam 4 --lenpen 0.6``, ``--beam=3``) must be the
   ones the JSON records, as must fairseq's defaults when none is given;
7. a lower-cased system scored against true-case ``--references`` must be scored
   case-insensitively, and say so, unless ``--case-sensitive``; a true-case system, or
   lower-cased references, are scored case-sensitively as before;

and of issue 57, item 2: the checksums evaluate records of the text it scored, which ``compare``
checks (compare's other refusals are in test_compare_cli.py, without evaluate).

The expected values are computed here directly: sacrebleu on the Moses-detokenized ``H-`` lines
of fairseq-generate's output, and fairseq's own GenerationConfig defaults.
"""

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest
import sacrebleu
from sacremoses import MosesDetokenizer

from conftest import MODATTN, fairseq_cli, run_cli, tiny_train_args
from fairseq_modattn.analysis import scoring

SHORT = ["--max-len-b", "20"]  # short hypotheses keep beam search on an untrained model fast


@pytest.fixture(scope="module")
def checkpoint(multi30k_bin, tmp_path_factory) -> Path:
    """A tiny transformer after 4 updates on the 100-sentence valid split (lower-cased data)."""
    save = tmp_path_factory.mktemp("faults_eval_ckpt")
    run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("transformer"), "--save-dir", save,
             "--train-subset", "valid", "--max-tokens", "4000", "--batch-size", "50", "--max-update", "4",
             "--disable-validation"])
    return save / "checkpoint_last.pt"


def generated(work: Path):
    """(Moses-detokenized H- texts, Moses-detokenized T- texts) of WORK/generate-valid.txt, in
    sentence-id order: the hypotheses and default references, computed here independently."""
    detok = MosesDetokenizer(lang="en")
    lines = {"H": {}, "T": {}}
    for line in (work / "generate-valid.txt").read_text(encoding="utf-8").splitlines():
        match = re.match(r"([HT])-(\d+)\t(.*)$", line)
        if match:
            text = match.group(3).split("\t")[-1] if match.group(1) == "H" else match.group(3)
            lines[match.group(1)][int(match.group(2))] = detok.detokenize(text.split())
    return [lines["H"][i] for i in range(100)], [lines["T"][i] for i in range(100)]


class Runs:
    """``fairseq-modattn evaluate`` on the valid split, each distinct command run once."""

    def __init__(self, data, checkpoint, root: Path):
        self.data, self.checkpoint, self.root, self.done = data, checkpoint, root, {}

    def __call__(self, name, *args):
        if name not in self.done:
            output = self.root / f"{name}.json"
            code, out = run_cli([MODATTN, "evaluate", self.data, "--path", self.checkpoint, "--subset", "valid",
                                 "--output", output, *args], check=False)
            assert code == 0, out[-4000:]
            work = self.root / f"{name}.work"
            self.done[name] = json.loads(output.read_text()), out, *generated(work)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(multi30k_bin, checkpoint, tmp_path_factory):
    return Runs(multi30k_bin, checkpoint, tmp_path_factory.mktemp("faults_eval"))


def capitalized(line: str) -> str:
    return line[:1].upper() + line[1:]


def title_cased(line: str) -> str:
    return " ".join(capitalized(word) for word in line.split(" "))


@pytest.fixture(scope="module")
def truecase_references(runs, tmp_path_factory) -> Path:
    """'References' that are the system's beam-4 output in title case: case-insensitive
    sacreBLEU of that output is 100, case-sensitive sacreBLEU is far lower."""
    _, _, hyps, _ = runs("beam4", "--", "--beam", "4", "--lenpen", "0.6", *SHORT)
    path = tmp_path_factory.mktemp("truecase") / "valid.en"
    path.write_text("".join(title_cased(h) + "\n" for h in hyps), encoding="utf-8")
    return path


# ------------------------------------------------------------------ item 6
def test_beam_and_lenpen_after_dashdash_are_recorded(runs):
    """README's WMT14 command passes `-- --beam 4 --lenpen 0.6`: fairseq uses 4 and 0.6."""
    results, out, _, _ = runs("beam4", "--", "--beam", "4", "--lenpen", "0.6", *SHORT)
    assert results["bleu_line"].startswith("Generate valid with beam=4: ")  # fairseq's own word
    assert (results["beam"], results["lenpen"]) == (4, 0.6)
    assert results["generation"]["beam"] == 4 and results["generation"]["lenpen"] == 0.6
    assert results["generation"]["max_len_b"] == 20
    assert "with beam 4" in out and "with beam 5" not in out


def test_beam_given_with_equals_sign_is_recorded(runs, truecase_references):
    results, out, _, _ = runs("beam3", "--references", truecase_references, "--", "--beam=3", *SHORT)
    assert results["bleu_line"].startswith("Generate valid with beam=3: ")
    assert (results["beam"], results["lenpen"]) == (3, 1.0)
    assert results["generation"]["beam"] == 3 and "with beam 3" in out


def test_defaults_are_fairseqs_own(truecase_system):
    """Without generation options every recorded one is fairseq's default (GenerationConfig)."""
    from fairseq.dataclass.configs import GenerationConfig

    results = truecase_system[0]
    defaults = {f.name: f.default for f in dataclasses.fields(GenerationConfig) if not f.name.startswith("_")}
    defaults["max_len_b"] = 20
    assert results["generation"] == defaults
    assert (results["beam"], results["lenpen"]) == (5, 1.0)
    assert results["bleu_line"].startswith("Generate valid with beam=5: ")


# ------------------------------------------------------------------ item 7
def test_lowercased_system_against_truecase_references_is_scored_case_insensitively(runs, truecase_references):
    results, out, hyps, _ = runs("beam3", "--references", truecase_references, "--", "--beam=3", *SHORT)
    refs = truecase_references.read_text(encoding="utf-8").splitlines()
    assert all(h == h.lower() for h in hyps) and any(r != r.lower() for r in refs)
    lowercased = sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a", lowercase=True).score
    cased = sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score
    assert lowercased > cased + 10
    assert results["sacrebleu"] == pytest.approx(lowercased, abs=1e-9)
    assert results["lowercase"] is True and "lower case" in results["lowercase_reason"]
    assert "case:lc" in results["sacrebleu_signature"]
    assert results["sacrebleu_case_sensitive"] == pytest.approx(cased, abs=1e-9)
    assert "case:mixed" in results["sacrebleu_case_sensitive_signature"]
    assert len([line for line in out.splitlines() if "case-insensitive" in line]) == 1, out[-3000:]
    # chrF follows sacreBLEU's case decision; sacreBLEU's TER is case-insensitive by default
    assert results["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [[r.lower() for r in refs]]).score, abs=1e-9)
    assert results["chrf_case_sensitive"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert results["chrf"] > results["chrf_case_sensitive"] + 1
    assert "case:lc" in results["chrf_signature"] and "case:mixed" in results["chrf_case_sensitive_signature"]
    assert results["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [refs]).score, abs=1e-9)
    assert "case:lc" in results["ter_signature"]


def test_case_sensitive_flag_keeps_case_sensitive_bleu(runs, truecase_references):
    results, out, hyps, _ = runs("forced", "--references", truecase_references, "--case-sensitive",
                                 "--", "--beam", "4", "--lenpen", "0.6", *SHORT)
    refs = truecase_references.read_text(encoding="utf-8").splitlines()
    assert sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a", lowercase=True).score == pytest.approx(100)
    cased = sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score
    assert cased < 50
    assert results["lowercase"] is False
    assert results["sacrebleu"] == pytest.approx(cased, abs=1e-9) == results["sacrebleu_case_sensitive"]
    assert "case:mixed" in results["sacrebleu_signature"]
    assert "--case-sensitive" in results["lowercase_reason"] and "--case-sensitive" in out
    assert results["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert results["chrf"] == results["chrf_case_sensitive"] and "case:mixed" in results["chrf_signature"]


def test_lowercased_references_are_scored_as_before(runs):
    """The default references (the lower-cased data's T- lines) have no case to lose."""
    results, _, hyps, targets = runs("beam4", "--", "--beam", "4", "--lenpen", "0.6", *SHORT)
    direct = sacrebleu.corpus_bleu(hyps, [targets], tokenize="13a").score
    assert results["lowercase"] is False and results["lowercase_reason"] is None
    assert results["sacrebleu"] == pytest.approx(direct, abs=1e-9) == results["sacrebleu_case_sensitive"]
    assert "case:mixed" in results["sacrebleu_signature"]


@pytest.fixture(scope="module")
def truecase_system(multi30k_bin, checkpoint, truecase_references, tmp_path_factory):
    """evaluate_checkpoints (default generation options) of a true-case system, the tiny model's
    output with its first letter capitalized, against references in another case (every second
    one upper case): (results, log lines, hypotheses, references)."""
    from fairseq_modattn.cli.evaluate import evaluate_checkpoints

    work = tmp_path_factory.mktemp("truecase_system")
    refs = [r.upper() if i % 2 else r
            for i, r in enumerate(truecase_references.read_text(encoding="utf-8").splitlines())]
    (work / "refs.en").write_text("".join(r + "\n" for r in refs), encoding="utf-8")
    plain, logged = scoring.detokenize, []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scoring, "detokenize", lambda lines, lang: [capitalized(s) for s in plain(lines, lang)])
        results = evaluate_checkpoints(multi30k_bin, [checkpoint], subset="valid", references=work / "refs.en",
                                       cpu=True, work_dir=work / "w", extra_generate_args=SHORT,
                                       log=logged.append)
    return results, logged, [capitalized(h) for h in generated(work / "w")[0]], refs


def test_truecase_system_against_truecase_references_is_scored_as_before(truecase_system):
    results, logged, hyps, refs = truecase_system
    assert any(h != h.lower() for h in hyps) and any(r != r.lower() for r in refs)
    cased = sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score
    assert cased < sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a", lowercase=True).score
    assert results["sacrebleu"] == pytest.approx(cased, abs=1e-9)
    assert results["lowercase"] is False and results["lowercase_reason"] is None
    assert results["sacrebleu_case_sensitive"] == pytest.approx(cased, abs=1e-9)
    assert not [line for line in logged if "case-insensitive" in line]


def test_case_detection_rules():
    """Only hypotheses with cased letters, all lower case, against references that are not."""
    assert scoring.lowercased_system(["a man ."], ["A man ."])
    assert not scoring.lowercased_system(["A man ."], ["A man ."])
    assert not scoring.lowercased_system(["a man ."], ["a man ."])
    assert not scoring.lowercased_system(["123 ."], ["A 123 ."])  # nothing cased in the system
    assert not scoring.lowercased_system(["一个 人"], ["一个 人"])


# ------------------------------------------------------------------ issue 57, item 2
def test_evaluate_records_checksums_that_compare_checks(runs, tmp_path, capsys):
    """evaluate records the SHA-256 of the hyp.txt and ref.txt it writes; compare scores them as
    evaluate did, and refuses the hypotheses once the references are copied over them (compare
    then reported BLEU 100 beside a JSON that said otherwise)."""
    from fairseq_modattn.cli.main import main

    results, _, hyps, targets = runs("beam4", "--", "--beam", "4", "--lenpen", "0.6", *SHORT)
    output = runs.root / "beam4.json"
    hyp, ref = Path(results["hypotheses_file"]), Path(results["references_file"])
    assert hyp.read_text(encoding="utf-8").splitlines() == hyps
    assert ref.read_text(encoding="utf-8").splitlines() == targets
    assert results["hypotheses_sha256"] == hashlib.sha256(hyp.read_bytes()).hexdigest()
    assert results["references_sha256"] == hashlib.sha256(ref.read_bytes()).hexdigest()
    assert results["hypotheses_sha256"] != results["references_sha256"]

    compared = tmp_path / "compare.json"
    argv = ["compare", "--system", "tf", str(output), "--system", "dma", str(output), "--metrics", "bleu",
            "--samples", "100", "--json", str(compared)]
    assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(compared.read_text())["metrics"]["bleu"]["scores"]["tf"] == pytest.approx(
        results["sacrebleu"], abs=1e-9)
    capsys.readouterr()
    kept = hyp.read_bytes()
    try:
        hyp.write_bytes(ref.read_bytes())
        code = main(argv)
    finally:
        hyp.write_bytes(kept)  # the module's other tests read this evaluation
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"fairseq-modattn compare: error: system tf: {hyp} has changed since evaluate wrote "
                          f"{output}"), err


# ------------------------------------------------------------------ helpers of item 6
def test_generation_options_are_parsed_by_fairseq(multi30k_bin):
    from fairseq_modattn.analysis import AnalysisError
    from fairseq_modattn.cli.evaluate import generation_options

    base = [str(multi30k_bin), "--path", "x.pt", "--beam", "5", "--lenpen", "1.0"]
    options = generation_options(base + ["--beam=4", "--lenpen", "0.6", "--max-len-a", "1.2"])
    assert (options["beam"], options["lenpen"], options["max_len_a"], options["nbest"]) == (4, 0.6, 1.2, 1)
    with pytest.raises(AnalysisError, match="fairseq-generate rejects its arguments: .*invalid int value: 'four'"):
        generation_options(base + ["--beam", "four"])


def test_logged_generation_options_must_agree(tmp_path):
    """What fairseq-generate logged wins; a disagreement with the parse here is an error."""
    from fairseq_modattn.analysis import AnalysisError
    from fairseq_modattn.cli.evaluate import _generation_fairseq_logged

    parsed = {"beam": 4, "lenpen": 0.6, "max_len_a": 0}
    logged = ("INFO:fairseq_cli.generate:{'_name': None, 'common': {'seed': 1}, 'generation': "
              "{'_name': None, 'beam': 4, 'lenpen': 0.6, 'max_len_a': 0.0}, 'eval_lm': {'x': 1}}\n")
    result = scoring.parse_generate_output("Generate test with beam=4: BLEU4 = 1.00, 1/1/1/1\n")
    assert _generation_fairseq_logged(parsed, logged, result, tmp_path / "g.txt") == parsed
    with pytest.raises(AnalysisError, match="lenpen: 1.0 vs 0.6"):
        _generation_fairseq_logged(parsed, logged.replace("0.6", "1.0"), result, tmp_path / "g.txt")
    other_beam = scoring.parse_generate_output("Generate test with beam=5: BLEU4 = 1.00, 1/1/1/1\n")
    with pytest.raises(AnalysisError, match="beam=5"):
        _generation_fairseq_logged(parsed, "", other_beam, tmp_path / "g.txt")
