"""``fairseq-modattn evaluate`` end to end: a tiny DMA model trained by the real fairseq-train,
its last epoch checkpoints averaged, the real fairseq-generate, BLEU/sacreBLEU in a JSON file."""

import gzip
import json
from pathlib import Path

import pytest

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
    assert "--beam 5 --remove-bpe" in results["generate_command"] and "--max-len-b 20" in results["generate_command"]
    assert set(results["versions"]) >= {"fairseq", "torch", "sacrebleu"} and results["date"]
    generated = (work / "generate-test.txt").read_text()
    assert sum(line.startswith("H-") for line in generated.splitlines()) == 300
    assert "averaging 3 checkpoints" in out and "generating 300 sentences" in out
    assert "compound-split BLEU" in out and "sacreBLEU" in out  # the summary table
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
