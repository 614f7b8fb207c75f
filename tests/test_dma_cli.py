"""DMA end to end through the real fairseq commands with --user-dir, on real Multi30k data."""

import pytest
import torch

import fairseq_modattn  # noqa: F401  (compat's allow-list, as --user-dir applies it)
from cli_checks import check_generate_test_set, check_resume, logged
from conftest import PLUGIN, fairseq_cli, run_cli

AUX_KEYS = ("ce_loss", "kl", "dqq", "dxq", "div", "gamma")

# A DMA model small enough for a CPU test; every DMA flag keeps its architecture default
# except the annealing rate, raised so that gamma is clearly > 0 within a few updates.
SMALL_DMA = [
    "--arch", "dma_transformer_iwslt_de_en_tiny",
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--dma-anneal-rate", "0.05",
]
# The criterion goes by the name the DMA authors' code gives it (an alias of
# label_smoothed_cross_entropy_with_aux, which the other CLI tests use), so that a real
# fairseq-train run exercises the alias.
TRAIN = [
    "--user-dir", PLUGIN, "--criterion", "disentangled_label_smoothed_cross_entropy",
    "--label-smoothing", "0.1", "--optimizer", "adam", "--lr", "5e-4", "--dropout", "0.1",
    "--max-tokens", "1000", "--log-format", "simple", "--no-progress-bar", "--cpu", "--seed", "7",
    "--num-workers", "0",
]


def train(data, save_dir, *extra, check=True):
    return run_cli([fairseq_cli("fairseq-train"), data, *TRAIN, *SMALL_DMA, "--save-dir", save_dir, *extra],
                   check=check)


@pytest.fixture(scope="module")
def trained(multi30k_bin, tmp_path_factory):
    """8 updates with a checkpoint every 4: the checkpoints later tests generate from."""
    save = tmp_path_factory.mktemp("ckpt")
    _, out = train(multi30k_bin, save, "--max-update", "8", "--save-interval-updates", "4",
                   "--log-interval", "1")
    return save, out


def test_train_logs_every_loss_term(trained):
    _, out = trained
    inner, valid = logged(out, "train_inner"), logged(out, "valid")
    assert sorted(inner) == list(range(1, 9)), out[-3000:]
    assert valid, out[-3000:]
    for row in list(inner.values()) + list(valid.values()):
        for key in AUX_KEYS + ("loss", "nll_loss"):
            assert key in row, (key, row)
    assert inner[1]["gamma"] < inner[8]["gamma"] <= 0.9  # annealed by update count towards alpha
    # the authors' L_Dqq, -log(1 - p), is >= -log(1 + 1e-6), which the log rounds to 0
    assert all(r["dqq"] >= 0 and r["kl"] > 0 for r in inner.values())
    assert any(r["dqq"] > 0 for r in inner.values())


def test_resume_reproduces_uninterrupted_run(multi30k_bin, trained, tmp_path):
    check_resume(train, multi30k_bin, tmp_path / "resumed", trained[1], stop=4, end=8,
                 keys=("loss", "ce_loss", "dqq", "gamma"), extra=("--save-interval-updates", "4", "--log-interval", "1"))


def test_generate_translates_every_sentence_and_prints_bleu(multi30k_bin, trained):
    check_generate_test_set(multi30k_bin, trained[0] / "checkpoint_last.pt")


def test_interactive_translates_stdin(multi30k_bin, trained):
    save, _ = trained
    source = "ein mann fährt fahrrad .\nzwei hunde spielen im schnee .\nein kind lacht .\n"
    _, out = run_cli([
        fairseq_cli("fairseq-interactive"), multi30k_bin, "--user-dir", PLUGIN, "--path",
        save / "checkpoint_last.pt", "--beam", "5", "--remove-bpe", "--cpu", "--max-len-b", "20",
        "--source-lang", "de", "--target-lang", "en",
    ], input_text=source)
    assert len([line for line in out.splitlines() if line.startswith("H-")]) == 3, out[-2000:]


class NotAllowListed:
    pass


def test_checkpoint_loads_with_safe_torch_load(trained, tmp_path):
    """torch >= 2.6 weights_only loading of a fairseq checkpoint works through the allow-list,
    and a file holding any other class is still refused."""
    save, _ = trained
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["args"] is not None or state["cfg"] is not None
    other = tmp_path / "other.pt"
    torch.save({"x": NotAllowListed()}, other)
    with pytest.raises(Exception, match="NotAllowListed"):
        torch.load(other, weights_only=True)


def test_eval_bleu_and_validation_use_every_sentence(multi30k_bin, tmp_path):
    """Validation with --eval-bleu sees all 100 valid sentences at --batch-size 8: 13 batches,
    the last one of 4 (fairseq main drops it: 96 sentences in 12 batches, bsz 8.0)."""
    _, out = train(
        multi30k_bin, tmp_path / "ck", "--max-update", "2", "--batch-size", "8", "--max-tokens", "4000",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 5}', "--eval-bleu-remove-bpe",
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric", "--log-interval", "1",
    )
    valid = next(iter(logged(out, "valid").values()))
    assert "bleu" in valid, out[-3000:]
    assert valid["bsz"] == pytest.approx(100 / 13, abs=0.05), valid
