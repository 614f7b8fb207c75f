"""Fault suite: non-finite values of the package's float flags are refused at start-up.

``float('nan')`` passes every range check (NaN compares false), so ``--dma-noise-var nan`` used
to reach training and end at the first update with an unrelated ``StopIteration``. The flags
must be refused while fairseq parses them, in one line naming the flag.
"""

import argparse

import pytest

from conftest import fairseq_cli, run_cli, tiny_train_args
from fairseq_modattn.models.dma_transformer import validate_dma_args
from fairseq_modattn.models.flag_types import check_finite, finite_float
from tiny_models import model_args

BAD_FLAGS = [
    ("dma_transformer_iwslt_de_en_tiny", "--dma-noise-var", "nan"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-kl-weight", "nan"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-qq-weight", "inf"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-xq-weight", "-inf"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-div-weight", "NaN"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-centroid-grad-mult", "Infinity"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-anneal-rate", "nan"),
    ("dma_transformer_iwslt_de_en_tiny", "--dma-alpha", "nan"),
    ("rim_lstm_iwslt_de_en", "--rim-attention-dropout", "nan"),
]


@pytest.mark.parametrize("arch,flag,value", BAD_FLAGS)
def test_fairseq_parser_refuses_non_finite_value_naming_the_flag(arch, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        model_args(arch, f"{flag}={value}")  # '=': argparse reads a bare '-inf' as a flag
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a finite number, got '{value}'" in err, err


@pytest.mark.parametrize("arch,flag,value", [(a, f, "0.25") for a, f, _ in BAD_FLAGS])
def test_finite_values_still_parse(arch, flag, value):
    args = model_args(arch, flag, value)
    assert getattr(args, flag[2:].replace("-", "_")) == 0.25


def test_finite_float_type():
    assert finite_float("1e-3") == 1e-3
    for text in ("nan", "inf", "-inf", "abc", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            finite_float(text)


@pytest.mark.parametrize("field,flag", [
    ("dma_noise_var", "--dma-noise-var"), ("dma_kl_weight", "--dma-kl-weight"),
    ("dma_qq_weight", "--dma-qq-weight"), ("dma_alpha", "--dma-alpha"),
])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_config_that_bypassed_argparse_is_refused_naming_the_flag(field, flag, bad):
    args = model_args("dma_transformer_iwslt_de_en_tiny")
    validate_dma_args(args)  # the preset itself is fine
    setattr(args, field, bad)
    with pytest.raises(ValueError, match=flag):
        validate_dma_args(args)


def test_check_finite_bounds():
    check_finite(0.0, "--x", minimum=0.0)
    with pytest.raises(ValueError, match="--x must be > 0"):
        check_finite(0.0, "--x", minimum=0.0, exclusive=True)
    with pytest.raises(ValueError, match="--x must be >= 0"):
        check_finite(-1e-9, "--x", minimum=0.0)


def test_fairseq_train_stops_at_start_up_with_one_line(multi30k_bin, tmp_path):
    """The real command: exit 2 before any model, data or checkpoint directory is touched."""
    save = tmp_path / "checkpoints"
    code, out = run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("dma"),
                         "--dma-noise-var", "nan", "--max-update", "1", "--save-dir", save], check=False)
    assert code == 2, out[-3000:]
    assert "fairseq-train: error: argument --dma-noise-var: must be a finite number, got 'nan'" in out, out[-3000:]
    assert "Traceback" not in out and "StopIteration" not in out
    assert not save.exists()
