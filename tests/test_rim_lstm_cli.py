"""rim_lstm end to end through the real fairseq-train / fairseq-generate with --user-dir, on Multi30k."""

import pytest

import fairseq_modattn  # noqa: F401  (compat's allow-list, as --user-dir applies it)
from cli_checks import check_generate_test_set, check_resume, logged
from conftest import PLUGIN, fairseq_cli, run_cli

# rim_lstm_iwslt_de_en with n = 6, k = 4 kept and every width cut down for a CPU test:
# 6 RIMs of 16 units (96 encoder units), decoder 64
SMALL_RIM = [
    "--arch", "rim_lstm_iwslt_de_en",
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--decoder-hidden-size", "64",
    "--decoder-out-embed-dim", "64", "--rim-size", "16", "--rim-input-key-size", "16",
    "--rim-input-value-size", "64", "--rim-comm-key-size", "16", "--rim-comm-value-size", "16",
]
TRAIN = [
    "--user-dir", PLUGIN, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "adam", "--lr", "5e-3", "--clip-norm", "0.1", "--max-tokens", "1000",
    "--log-format", "simple", "--no-progress-bar", "--cpu", "--seed", "7", "--num-workers", "0",
    "--log-interval", "1", "--save-interval-updates", "4",
]


def train(data, save_dir, *extra):
    return run_cli([fairseq_cli("fairseq-train"), data, *TRAIN, *SMALL_RIM, "--save-dir", save_dir, *extra])


@pytest.fixture(scope="module")
def trained(multi30k_bin, tmp_path_factory):
    """8 uninterrupted updates with a checkpoint every 4."""
    save = tmp_path_factory.mktemp("rim_ckpt")
    _, out = train(multi30k_bin, save, "--max-update", "8")
    return save, out


def test_train_builds_the_rim_encoder_and_the_loss_falls(trained):
    _, out = trained
    assert "RIMEncoder(" in out and "LSTMDecoder(" in out, out[-3000:]
    assert out.count("RIMCell(") == 1 and "top_k=4" in out and "num_rims=6" in out
    inner = logged(out, "train_inner")
    assert sorted(inner) == list(range(1, 9)), out[-3000:]
    assert inner[8]["loss"] < inner[1]["loss"]


def test_resume_reproduces_uninterrupted_run(multi30k_bin, trained, tmp_path):
    check_resume(train, multi30k_bin, tmp_path / "resumed", trained[1], stop=4, end=8, keys=("loss", "nll_loss"))


def test_generate_translates_every_test_sentence_and_prints_bleu(multi30k_bin, trained):
    check_generate_test_set(multi30k_bin, trained[0] / "checkpoint_last.pt")
