"""``fairseq-modattn evaluate`` end to end: a tiny DMA model trained by the real fairseq-train,
its last epoch checkpoints averaged, the real fairseq-generate, BLEU/sacreBLEU in a JSON file."""

import gzip
import json
import os
import re
from pathlib import Path

import pytest
import sacrebleu
from sacremoses import MosesDetokenizer

from conftest import MODATTN, fairseq_cli, run_cli, tiny_train_args
from fairseq_modattn.cli.main import main as modattn_main

# Short hypotheses keep beam search on an untrained model fast.
FAST_GENERATE = ["--", "--max-len-b", "20"]


def evaluate(*args):
    return run_cli([MODATTN, "evaluate", *map(str, args)], check=False)


@pytest.fixture(scope="module")
def three_epochs(multi30k_bin, tmp_path_factory):
    """checkpoint1.pt .. checkpoint3.pt (and checkpoint_last.pt) of a tiny DMA model, trained
    on the 100-sentence valid split (2 updates an epoch) to keep the test fast."""
    save = tmp_path_factory.mktemp("eval_ckpt")
    run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("dma", epoch_checkpoints=True),
             "--save-dir", save, "--train-subset", "valid", "--max-tokens", "4000", "--batch-size", "50",
             "--max-epoch", "3", "--disable-validation"])
    assert sorted(p.name for p in save.glob("checkpoint*.pt")) == \
        ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt", "checkpoint_last.pt"]
    return save


def detokenized_lines(generated: Path, kind: str, count: int, lang: str = "en"):
    """The Moses-detokenized text of the H- (or T-, S-) lines of fairseq-generate's output
    GENERATED, in sentence-id order, computed here independently of the package."""
    detok, lines = MosesDetokenizer(lang=lang), {}
    for line in generated.read_text(encoding="utf-8").splitlines():
        match = re.match(rf"{kind}-(\d+)\t(.*)$", line)
        if match:
            lines[int(match.group(1))] = detok.detokenize(match.group(2).split("\t")[-1].split())
    return [lines[i] for i in range(count)]


def check_scored_text(results: dict, hyp_file: Path, ref_file: Path, refs):
    """HYP_FILE/REF_FILE exist where RESULTS say, hold one sentence a line in test-set order (the
    H- lines of its fairseq-generate output by sentence id, and REFS), and chrF and TER computed
    here from them with sacreBLEU are the results' own."""
    assert results["hypotheses_file"] == str(hyp_file.resolve())
    assert results["references_file"] == str(ref_file.resolve())
    hyps = hyp_file.read_text(encoding="utf-8").split("\n")
    assert hyps[-1] == "" and len(hyps) - 1 == results["sentences"]  # one line per sentence, newline-ended
    hyps = hyps[:-1]
    assert hyps == detokenized_lines(Path(results["generate_output"]), "H", results["sentences"])
    assert ref_file.read_text(encoding="utf-8").splitlines() == refs
    assert results["chrf"] == pytest.approx(
        sacrebleu.corpus_chrf(hyps, [[r.lower() for r in refs] if results["lowercase"] else refs]).score, abs=1e-9)
    assert results["ter"] == pytest.approx(sacrebleu.corpus_ter(hyps, [refs]).score, abs=1e-9)
    lowercase = results["lowercase"]
    assert results["sacrebleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], lowercase=lowercase).score,
                                                 abs=1e-9)
    assert "nc:6" in results["chrf_signature"] and "tok:tercom" in results["ter_signature"]
    return hyps


def test_evaluate_averages_generates_and_scores(multi30k_bin, three_epochs):
    code, out = evaluate(multi30k_bin, "--checkpoint-dir", three_epochs, "--num-epoch-checkpoints", "3",
                         "--compound-split", *FAST_GENERATE)
    assert code == 0, out[-4000:]
    work = three_epochs / "evaluation"
    results = json.loads((work / "results.json").read_text())
    assert results["sentences"] == 300 and results["subset"] == "test"
    assert (results["source_lang"], results["target_lang"]) == ("de", "en")
    assert [Path(c).name for c in results["checkpoints"]] == ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt"]
    assert results["averaged"] and Path(results["model_path"]) == (work / "averaged.pt").resolve()
    for key in ("bleu", "sacrebleu", "compound_split_bleu"):
        assert isinstance(results[key], float) and 0 <= results[key] <= 100, (key, results[key])
    assert results["bleu_line"].startswith("Generate test with beam=5: BLEU4 = ")
    assert "tok:13a" in results["sacrebleu_signature"] and "nrefs:1" in results["sacrebleu_signature"]
    assert results["sacrebleu_references"].startswith("moses-detokenized T- lines")
    # chrF and TER of the scored text that lies beside the JSON, one sentence a line in test-set order
    refs = detokenized_lines(work / "generate-test.txt", "T", 300)
    check_scored_text(results, work / "hyp.txt", work / "ref.txt", refs)
    assert 0 <= results["chrf"] <= 100 and results["ter"] >= 0
    assert results["comet"] is None and results["comet_model"] is None
    assert "--beam 5 --remove-bpe" in results["generate_command"] and "--max-len-b 20" in results["generate_command"]
    assert set(results["versions"]) >= {"fairseq", "torch", "sacrebleu"} and results["date"]
    generated = (work / "generate-test.txt").read_text()
    assert sum(line.startswith("H-") for line in generated.splitlines()) == 300
    assert "averaging 3 checkpoints" in out and "generating 300 sentences" in out
    assert "compound-split BLEU" in out and "sacreBLEU" in out  # the summary table
    for name, key in (("chrF", "chrf"), ("TER", "ter")):
        row = rf"^{name} \(detokenized\) +{results[key]:.2f}  {re.escape(results[key + '_signature'])}$"
        assert re.search(row, out, re.M), (row, out[-2000:])
    assert f"chrF {results['chrf']:.2f}, TER {results['ter']:.2f} on 300 sentences of test" in out  # the log line
    assert not [p for p in work.iterdir() if p.name.endswith(".tmp")]


def test_evaluate_one_checkpoint_with_references_file(multi30k_bin, multi30k_dir, three_epochs, tmp_path):
    """--path (no averaging), another split, raw references for sacreBLEU, explicit output."""
    with gzip.open(multi30k_dir / "val.en.gz", "rt", encoding="utf-8") as f:
        raw = [next(f).rstrip("\n") for _ in range(100)]
    refs = tmp_path / "valid.en"
    refs.write_text("".join(line + "\n" for line in raw), encoding="utf-8")
    output = tmp_path / "res" / "valid.json"
    code, out = evaluate(multi30k_bin, "--path", three_epochs / "checkpoint3.pt", "--subset", "valid",
                         "--references", refs, "--output", output, *FAST_GENERATE)
    assert code == 0, out[-4000:]
    results = json.loads(output.read_text())
    assert results["sentences"] == 100 and not results["averaged"] and results["compound_split_bleu"] is None
    assert results["sacrebleu_references"] == f"file {refs.resolve()}"
    assert 0 <= results["sacrebleu"] <= 100
    # the model is trained on lower-cased text, the raw references are true case
    assert results["lowercase"] is True and "case:lc" in results["sacrebleu_signature"]
    assert "sacreBLEU is case-insensitive" in out
    assert (tmp_path / "res" / "valid.work" / "generate-valid.txt").exists()
    assert not (tmp_path / "res" / "valid.work" / "averaged.pt").exists()
    # the scored text beside --output, named after it; the references are the file's lines as given
    check_scored_text(results, tmp_path / "res" / "valid.hyp.txt", tmp_path / "res" / "valid.ref.txt", raw)
    assert "case:lc" in results["chrf_signature"]


def one_error_line(err: str) -> str:
    """The command's error line, checked to be its one line and the last thing it printed (fairseq
    logs to stderr before it)."""
    errors = [line for line in err.splitlines() if line.startswith("fairseq-modattn evaluate: ")]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    return errors[0]


def test_scored_text_of_another_origin_is_not_replaced(multi30k_bin, three_epochs, tmp_path, capsys):
    """A hyp.txt where evaluate would write its own, not named by the results JSON there, is
    refused before anything is translated."""
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "hyp.txt").write_text("my own system's output\n")
    code = modattn_main(["evaluate", str(multi30k_bin), "--path", str(three_epochs / "checkpoint3.pt"),
                         "--work-dir", str(tmp_path / "w")])
    err = one_error_line(capsys.readouterr().err)
    assert code == 1
    assert f"error: {tmp_path / 'w' / 'hyp.txt'} exists and {tmp_path / 'w' / 'results.json'} does not name it" in err
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["hyp.txt"]
    assert (tmp_path / "w" / "hyp.txt").read_text() == "my own system's output\n"


def _comet_importable() -> str:
    """'' when unbabel-comet imports here, else why not."""
    try:
        import comet  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_comet_that_cannot_be_loaded_is_one_line_before_any_work(multi30k_bin, three_epochs, tmp_path, capsys):
    """Without unbabel-comet (this project's environment: it pins numpy < 2), --comet stops the
    command with one line naming the model and the cause; with it, a model that does not exist
    does. Either way before anything is averaged or translated."""
    model = str(tmp_path / "no-such-comet-model")
    code = modattn_main(["evaluate", str(multi30k_bin), "--checkpoint-dir", str(three_epochs),
                         "--num-epoch-checkpoints", "3", "--work-dir", str(tmp_path / "w"), "--comet", model])
    err = one_error_line(capsys.readouterr().err)
    assert code == 1 and err.startswith(f"fairseq-modattn evaluate: error: --comet {model}: "), err
    if _comet_importable():  # a reason: it is not installed
        assert "unbabel-comet cannot be imported (ModuleNotFoundError: No module named 'comet')" in err
        assert "pip install 'fairseq-modattn[comet]'" in err
    else:
        assert "cannot load the COMET model, tried as a Hugging Face hub model" in err
    assert not (tmp_path / "w").exists()


def test_comet_scores_the_translations(multi30k_bin, three_epochs, tmp_path):
    """The real COMET: the system score in the JSON is what the model gives for the scored text.
    Needs unbabel-comet and a model (FAIRSEQ_MODATTN_COMET_MODEL: a hub name in the local cache or
    a downloaded model folder; default Unbabel/wmt22-comet-da); skipped, with the reason, without."""
    why = _comet_importable()
    if why:
        pytest.skip(f"unbabel-comet is not installed ({why}); pip install 'fairseq-modattn[comet]'")
    from fairseq_modattn.analysis import AnalysisError
    from fairseq_modattn.analysis.comet_scoring import load_comet_model

    name = os.environ.get("FAIRSEQ_MODATTN_COMET_MODEL", "Unbabel/wmt22-comet-da")
    try:
        model = load_comet_model(name)
    except AnalysisError as e:
        pytest.skip(f"the COMET model is not available here: {e}")
    output = tmp_path / "comet.json"
    code, out = evaluate(multi30k_bin, "--path", three_epochs / "checkpoint3.pt", "--subset", "valid",
                         "--output", output, "--comet", name, *FAST_GENERATE)
    assert code == 0, out[-4000:]
    results = json.loads(output.read_text())
    assert results["comet_model"] == name and "unbabel-comet" in results["versions"]
    hyps = (tmp_path / "comet.hyp.txt").read_text(encoding="utf-8").splitlines()
    refs = (tmp_path / "comet.ref.txt").read_text(encoding="utf-8").splitlines()
    sources = detokenized_lines(Path(results["generate_output"]), "S", 100, lang="de")
    samples = [{"src": s, "mt": h, "ref": r} for s, h, r in zip(sources, hyps, refs)]
    expected = model.predict(samples, batch_size=16, gpus=0, progress_bar=False).system_score
    assert results["comet"] == pytest.approx(expected, abs=1e-4)
    assert f"COMET {results['comet']:.4f}" in out


def test_missing_checkpoint_dir_is_an_error(multi30k_bin, tmp_path, capsys):
    code = modattn_main(["evaluate", str(multi30k_bin), "--checkpoint-dir", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("fairseq-modattn evaluate: error: checkpoint directory"), err
    assert "nope" in err and not (tmp_path / "nope").exists()


def test_fewer_epoch_checkpoints_than_asked_is_an_error(multi30k_bin, three_epochs, capsys):
    code = modattn_main(["evaluate", str(multi30k_bin), "--checkpoint-dir", str(three_epochs),
                         "--num-epoch-checkpoints", "5", "--work-dir", str(three_epochs / "w5")])
    err = capsys.readouterr().err
    assert code == 1 and "need the last 5 epoch checkpoints" in err, err
    assert "found 3: checkpoint1.pt, checkpoint2.pt, checkpoint3.pt" in err
    # the way out is named (the quickstart's folder, one epoch, met this with the default 5)
    assert err.strip().endswith("; pass --allow-fewer to average those, or --path FILE to evaluate one checkpoint")
    assert len(err.strip().splitlines()) == 1
    assert not (three_epochs / "w5").exists()


def test_references_with_wrong_line_count_is_an_error(multi30k_bin, three_epochs, tmp_path, capsys):
    refs = tmp_path / "refs.en"
    refs.write_text("one line\n" * 299)
    code = modattn_main(["evaluate", str(multi30k_bin), "--checkpoint-dir", str(three_epochs),
                         "--num-epoch-checkpoints", "3", "--references", str(refs), "--work-dir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 1 and f"--references {refs} has 299 lines but split test has 300 sentences" in err, err
    assert not (tmp_path / "w").exists()  # checked before anything was averaged or generated


def test_bad_flags(multi30k_bin, three_epochs, tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        modattn_main(["evaluate", "-h"])
    assert done.value.code == 0 and "--num-epoch-checkpoints" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # no checkpoint selection
        modattn_main(["evaluate", str(multi30k_bin)])
    assert done.value.code == 2
    code = modattn_main(["evaluate", str(multi30k_bin), "--path", str(three_epochs / "checkpoint3.pt"),
                         "--work-dir", str(tmp_path / "w"), "--", "--gen-subset", "valid"])
    assert code == 1 and "--gen-subset is not allowed" in capsys.readouterr().err
    code = modattn_main(["evaluate", str(multi30k_bin), "--path", str(three_epochs / "checkpoint3.pt"),
                         "--subset", "dev", "--work-dir", str(tmp_path / "w")])
    assert code == 1 and "no dev.SRC-TGT.SRC.idx files" in capsys.readouterr().err


def test_untranslated_sentences_fail_loudly(multi30k_bin, three_epochs, tmp_path):
    """fairseq-generate skips the sources longer than 12 tokens: the split's BLEU cannot be
    computed from the 30 that are left, and the command must say so."""
    code, out = evaluate(multi30k_bin, "--path", three_epochs / "checkpoint3.pt", "--work-dir", tmp_path,
                         "--", "--max-len-b", "20", "--skip-invalid-size-inputs-valid-test",
                         "--max-source-positions", "12")
    assert code == 1, out[-3000:]
    assert "fairseq-modattn evaluate: error: fairseq-generate translated 30 of the 300 sentences of split test" in out
    assert "generate-test.txt" in out
    assert not (tmp_path / "results.json").exists()
