"""talking_heads_transformer end to end through the real fairseq commands on real Multi30k."""

import pytest

from cli_checks import check_generate_test_set, check_resume, logged
from conftest import PLUGIN, fairseq_cli, run_cli

# Talking heads everywhere, with h_k, h, h_v all different, so every code path runs.
SMALL_TH = [
    "--arch", "talking_heads_transformer_iwslt_de_en",
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "48", "--decoder-embed-dim", "48",
    "--encoder-ffn-embed-dim", "96", "--decoder-ffn-embed-dim", "96",
    "--th-attention", "enc_self,dec_self,enc_dec", "--th-key-heads", "2", "--th-heads", "4",
    "--th-value-heads", "6",
]
TRAIN = [
    "--user-dir", PLUGIN, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--optimizer", "adam", "--lr", "5e-4", "--dropout", "0.1", "--attention-dropout", "0.1",
    "--max-tokens", "1000", "--log-format", "simple", "--no-progress-bar", "--cpu", "--seed", "3",
    "--num-workers", "0", "--log-interval", "1", "--save-interval-updates", "3",
]


def train(data, save_dir, *extra):
    return run_cli([fairseq_cli("fairseq-train"), data, *TRAIN, *SMALL_TH, "--save-dir", save_dir, *extra])


@pytest.fixture(scope="module")
def trained(multi30k_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("th")
    _, out = train(multi30k_bin, save, "--max-update", "6")
    return save, out


def test_train_builds_talking_heads_everywhere_and_logs(trained):
    _, out = trained
    # torch's repr prints repeated identical layers once: one encoder and one decoder layer
    assert "(self_attn): TalkingHeadsAttention(" in out.split("(decoder): TalkingHeadsDecoder(")[0], out[:4000]
    decoder = out.split("(decoder): TalkingHeadsDecoder(", 1)[1]
    assert "(self_attn): TalkingHeadsAttention(" in decoder and "(encoder_attn): TalkingHeadsAttention(" in decoder
    assert "key_heads=2, heads=4, value_heads=6" in out
    inner = logged(out, "train_inner")
    assert sorted(inner) == list(range(1, 7)), out[-3000:]
    assert inner[6]["loss"] < inner[1]["loss"]


def test_resume_reproduces_uninterrupted_run(multi30k_bin, trained, tmp_path):
    check_resume(train, multi30k_bin, tmp_path / "resumed", trained[1], stop=3, end=6, keys=("loss",))


def test_generate_with_beam_search_prints_bleu(multi30k_bin, trained):
    check_generate_test_set(multi30k_bin, trained[0] / "checkpoint_last.pt")
