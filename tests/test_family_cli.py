"""Every model family end to end through the real fairseq commands with --user-dir, on real
Multi30k data: fairseq-train logs every update, a run stopped half-way and restarted reproduces
the uninterrupted run, and fairseq-generate translates the whole test split and prints BLEU.

Each family trains its tiny model once (``tiny_train_args``, plus the flags of ``FAMILIES``),
with a checkpoint half-way, and the tests of the family share that run; what only one family
has (DMA's loss terms, the printed model structures, TIM's parameter count) is checked on the
same run's log by the family's ``LOG_CHECKS``.
"""

import re
from dataclasses import dataclass

import pytest
import torch
from fairseq.data import Dictionary

import fairseq_modattn  # noqa: F401  (compat's allow-list, as --user-dir applies it)
from cli_checks import check_generate_test_set, check_resume, logged
from conftest import PLUGIN, fairseq_cli, run_cli
from fairseq_modattn.models.tim_transformer import standard_layer_params, tim_layer_params
from inprocess import train_args


@dataclass(frozen=True)
class Family:
    extra: tuple  # flags after inprocess.train_args(family): a later flag overrides an earlier one
    updates: int  # of the uninterrupted run, with a checkpoint half-way, where the resumed run starts
    resumed_keys: tuple  # logged values the resumed run reproduces


FAMILIES = {
    # every DMA flag keeps its architecture default except the annealing rate (raised in the
    # tiny model, so that gamma is clearly > 0 within a few updates); the criterion goes by the
    # name the DMA authors' code gives it, so that a real fairseq-train run exercises the alias
    "dma": Family(("--criterion", "disentangled_label_smoothed_cross_entropy"), 8, ("loss", "ce_loss", "dqq", "gamma")),
    # talking heads in all three attention types, with h_k, h, h_v all different, so every code path runs
    "talking_heads": Family((
        "--encoder-embed-dim", "48", "--decoder-embed-dim", "48", "--encoder-ffn-embed-dim", "96",
        "--decoder-ffn-embed-dim", "96", "--th-key-heads", "2", "--th-heads", "4", "--th-value-heads", "6",
        "--attention-dropout", "0.1", "--seed", "3"), 6, ("loss",)),
    # 4 encoder layers, so that 'auto' makes layer 2 a TIM layer; decoder layer 1 of 2 is TIM too
    "tim": Family((), 8, ("loss", "nll_loss")),
    # n = 6, k = 4 kept and every width cut down: 6 RIMs of 16 units (96 encoder units), decoder 64;
    # the fused recurrence (a GPU's default) runs here, the step-by-step one in every other run
    "rim": Family(("--lr", "5e-3", "--clip-norm", "0.1", "--rim-recurrence", "fused"), 8, ("loss", "nll_loss")),
}


def train_command(family, *extra):
    """fairseq-train flags (without data and --save-dir) of FAMILY's tiny model, then EXTRA."""
    return [*train_args(family), *FAMILIES[family].extra, *extra]


def interval_flags(family):
    """Log every update, checkpoint half-way."""
    return ("--log-interval", "1", "--save-interval-updates", str(FAMILIES[family].updates // 2))


def train(family, data, save_dir, *extra):
    """fairseq-train of FAMILY's tiny model (every update logged, a checkpoint half-way), then EXTRA."""
    return run_cli([fairseq_cli("fairseq-train"), data, *train_command(family, *interval_flags(family)),
                    "--save-dir", save_dir, *extra])


@pytest.fixture(scope="module")
def trained(multi30k_bin, tmp_path_factory):
    """trained(family) -> (save dir, log) of FAMILY's uninterrupted run, trained on first use."""
    runs = {}

    def run(family):
        if family not in runs:
            save = tmp_path_factory.mktemp(family)
            _, out = train(family, multi30k_bin, save, "--max-update", str(FAMILIES[family].updates))
            runs[family] = save, out
        return runs[family]

    return run


# ----------------------------------------------------------------------------- what each family's log shows
AUX_KEYS = ("ce_loss", "kl", "dqq", "dxq", "div", "gamma")


def check_dma_log(out, inner, data):
    valid = logged(out, "valid")
    assert valid, out[-3000:]
    for row in list(inner.values()) + list(valid.values()):
        for key in AUX_KEYS + ("loss", "nll_loss"):
            assert key in row, (key, row)
    assert inner[1]["gamma"] < inner[8]["gamma"] <= 0.9  # annealed by update count towards alpha
    # the authors' L_Dqq, -log(1 - p), is >= -log(1 + 1e-6), which the log rounds to 0
    assert all(r["dqq"] >= 0 and r["kl"] > 0 for r in inner.values())
    assert any(r["dqq"] > 0 for r in inner.values())


def check_talking_heads_log(out, inner, data):
    # torch's repr prints repeated identical layers once: one encoder and one decoder layer
    assert "(self_attn): TalkingHeadsAttention(" in out.split("(decoder): TalkingHeadsDecoder(")[0], out[:4000]
    decoder = out.split("(decoder): TalkingHeadsDecoder(", 1)[1]
    assert "(self_attn): TalkingHeadsAttention(" in decoder and "(encoder_attn): TalkingHeadsAttention(" in decoder
    assert "key_heads=2, heads=4, value_heads=6" in out
    assert inner[6]["loss"] < inner[1]["loss"]


def check_tim_log(out, inner, data):
    embed, ffn = 64, 128
    vocab = len(Dictionary.load(str(data / "dict.de.txt")))  # joined dictionary
    expected = (
        3 * vocab * embed  # encoder / decoder embeddings and the (unshared) output projection
        + 3 * standard_layer_params(embed, ffn)  # encoder layers 0, 1, 3
        + tim_layer_params(embed, ffn, 2)  # encoder layer 2 (auto): 2 mechanisms, per-mechanism step 3, 2 x 32
        + standard_layer_params(embed, ffn, decoder=True)  # decoder layer 0
        + tim_layer_params(embed, ffn, 2, decoder=True)  # decoder layer 1
    )
    printed = re.search(r"num\. shared model params: ([\d,]+)", out)
    assert printed, out[-3000:]
    assert int(printed.group(1).replace(",", "")) == expected
    assert out.count("TIMEncoderLayer(") == 1 and out.count("TIMDecoderLayer(") == 1
    assert inner[8]["loss"] < inner[1]["loss"]


def check_rim_log(out, inner, data):
    assert "RIMEncoder(" in out and "LSTMDecoder(" in out, out[-3000:]
    assert out.count("RIMCell(") == 1 and "top_k=4" in out and "num_rims=6" in out
    assert "recurrence=fused" in out
    assert inner[8]["loss"] < inner[1]["loss"]


LOG_CHECKS = {"dma": check_dma_log, "talking_heads": check_talking_heads_log, "tim": check_tim_log,
              "rim": check_rim_log}


# ----------------------------------------------------------------------------- every family
@pytest.mark.parametrize("family", FAMILIES)
def test_train_logs_every_update(family, trained, multi30k_bin):
    _, out = trained(family)
    inner = logged(out, "train_inner")
    assert sorted(inner) == list(range(1, FAMILIES[family].updates + 1)), out[-3000:]
    LOG_CHECKS[family](out, inner, multi30k_bin)


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_reproduces_uninterrupted_run(family, multi30k_bin, trained, tmp_path):
    updates = FAMILIES[family].updates
    check_resume(lambda *args: train(family, *args), multi30k_bin, tmp_path / "resumed", trained(family)[1],
                 stop=updates // 2, end=updates, keys=FAMILIES[family].resumed_keys)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_translates_every_test_sentence_and_prints_bleu(family, multi30k_bin, trained):
    check_generate_test_set(multi30k_bin, trained(family)[0] / "checkpoint_last.pt")


# ----------------------------------------------------------------------------- on one family's run
def test_interactive_translates_stdin(multi30k_bin, trained):
    save, _ = trained("dma")
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
    save, _ = trained("dma")
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["args"] is not None or state["cfg"] is not None
    other = tmp_path / "other.pt"
    torch.save({"x": NotAllowListed()}, other)
    with pytest.raises(Exception, match="NotAllowListed"):
        torch.load(other, weights_only=True)


def test_eval_bleu_and_validation_use_every_sentence(multi30k_bin, tmp_path):
    """Validation with --eval-bleu sees all 100 valid sentences at --batch-size 8: 13 batches,
    the last one of 4 (fairseq main drops it: 96 sentences in 12 batches, bsz 8.0)."""
    _, out = run_cli([
        fairseq_cli("fairseq-train"), multi30k_bin, *train_command("dma"), "--save-dir", tmp_path / "ck",
        "--max-update", "2", "--batch-size", "8", "--max-tokens", "4000",
        "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 5}', "--eval-bleu-remove-bpe",
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric", "--log-interval", "1",
    ])
    valid = next(iter(logged(out, "valid").values()))
    assert "bleu" in valid, out[-3000:]
    assert valid["bsz"] == pytest.approx(100 / 13, abs=0.05), valid
