"""TIM end to end through the real fairseq-train / fairseq-generate with --user-dir, on Multi30k."""

import re

import pytest
from fairseq.data import Dictionary

import fairseq_modattn  # noqa: F401  (the allow-list of compat.py, as --user-dir applies it)
from conftest import PLUGIN, fairseq_cli, run_cli
from fairseq_modattn.models.tim_transformer import standard_layer_params, tim_layer_params
from test_cli import logged

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
        + tim_layer_params(EMBED, FFN, 2)  # encoder layer 2 (auto): 2 mechanisms, H_c = 2
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
    _, uninterrupted = trained
    reference = logged(uninterrupted, "train_inner")
    save = tmp_path / "resumed"
    train(multi30k_bin, save, "--max-update", "4")
    _, out = train(multi30k_bin, save, "--max-update", "8")
    assert "Loaded checkpoint" in out and "@ 4 updates" in out, out[-3000:]
    resumed = logged(out, "train_inner")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        for key in ("loss", "nll_loss"):
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-3, abs=2e-3), (step, key)


def test_generate_translates_every_test_sentence_and_prints_bleu(multi30k_bin, trained):
    save, _ = trained
    _, out = run_cli([
        fairseq_cli("fairseq-generate"), multi30k_bin, "--user-dir", PLUGIN, "--path", save / "checkpoint_last.pt",
        "--beam", "5", "--remove-bpe", "--batch-size", "64", "--cpu", "--max-len-b", "20", "--gen-subset", "test",
    ])
    hypotheses = [line for line in out.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 300, f"{len(hypotheses)} of 300 test sentences translated"
    assert len({line.split("\t")[0] for line in hypotheses}) == 300
    assert re.search(r"Generate test with beam=5: BLEU4 = [\d.]+", out), out[-2000:]
