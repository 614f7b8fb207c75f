"""TIM end to end through the real fairseq-train / fairseq-generate with --user-dir, on Multi30k."""

import re

import pytest
from fairseq.data import Dictionary

import fairseq_modattn  # noqa: F401  (compat's allow-list, as --user-dir applies it)
from cli_checks import check_generate_test_set, check_resume, logged
from conftest import PLUGIN, fairseq_cli, run_cli
from fairseq_modattn.models.tim_transformer import standard_layer_params, tim_layer_params

EMBED, FFN = 64, 128
# 4 encoder layers, so that 'auto' makes layer 2 a TIM layer; decoder layer 1 of 2 is TIM too.
SMALL_TIM = [
    "--arch", "tim_transformer_iwslt_de_en",
    "--encoder-layers", "4", "--decoder-layers", "2", "--tim-decoder-layers", "1",
    "--encoder-embed-dim", str(EMBED), "--decoder-embed-dim", str(EMBED),
    "--encoder-ffn-embed-dim", str(FFN), "--decoder-ffn-embed-dim", str(FFN),
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
TRAIN = [
    "--user-dir", PLUGIN, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "adam", "--lr", "5e-4", "--dropout", "0.1", "--max-tokens", "1000",
    "--log-format", "simple", "--no-progress-bar", "--cpu", "--seed", "7", "--num-workers", "0",
    "--log-interval", "1", "--save-interval-updates", "4",
]


def train(data, save_dir, *extra):
    return run_cli([fairseq_cli("fairseq-train"), data, *TRAIN, *SMALL_TIM, "--save-dir", save_dir, *extra])


@pytest.fixture(scope="module")
def trained(multi30k_bin, tmp_path_factory):
    """8 uninterrupted updates with a checkpoint every 4."""
    save = tmp_path_factory.mktemp("tim_ckpt")
    _, out = train(multi30k_bin, save, "--max-update", "8")
    return save, out


def test_train_prints_the_hand_computed_parameter_count(multi30k_bin, trained):
    _, out = trained
    vocab = len(Dictionary.load(str(multi30k_bin / "dict.de.txt")))  # joined dictionary
    expected = (
        3 * vocab * EMBED  # encoder / decoder embeddings and the (unshared) output projection
        + 3 * standard_layer_params(EMBED, FFN)  # encoder layers 0, 1, 3
        + tim_layer_params(EMBED, FFN, 2)  # encoder layer 2 (auto): 2 mechanisms, per-mechanism step 3, 2 x 32
        + standard_layer_params(EMBED, FFN, decoder=True)  # decoder layer 0
        + tim_layer_params(EMBED, FFN, 2, decoder=True)  # decoder layer 1
    )
    printed = re.search(r"num\. shared model params: ([\d,]+)", out)
    assert printed, out[-3000:]
    assert int(printed.group(1).replace(",", "")) == expected
    assert out.count("TIMEncoderLayer(") == 1 and out.count("TIMDecoderLayer(") == 1
    inner = logged(out, "train_inner")
    assert sorted(inner) == list(range(1, 9)), out[-3000:]
    assert inner[8]["loss"] < inner[1]["loss"]


def test_resume_reproduces_uninterrupted_run(multi30k_bin, trained, tmp_path):
    check_resume(train, multi30k_bin, tmp_path / "resumed", trained[1], stop=4, end=8, keys=("loss", "nll_loss"))


def test_generate_translates_every_test_sentence_and_prints_bleu(multi30k_bin, trained):
    check_generate_test_set(multi30k_bin, trained[0] / "checkpoint_last.pt")
