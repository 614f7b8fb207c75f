"""Loading the plugin, through the real fairseq commands.

* ``fairseq-train --tensorboard-logdir`` writes every term the criterion logs (the DMA aux terms
  too) as TensorBoard scalars, with the values of the log lines (docs/analysis.md, "TensorBoard
  and W&B"). fairseq writes the event files with tensorboardX (the test extra) when the
  full tensorboard package is absent.
* A plugin checkpoint loaded without ``--user-dir`` never imports this package: what fairseq then
  prints is quoted in docs/troubleshooting.md, and checked here; with ``--user-dir`` the same
  checkpoint translates.
* A relative ``--user-dir`` resolves against the working folder (fairseq's
  ``utils.import_user_module``): the FileNotFoundError docs/troubleshooting.md quotes, and its fix.
* A checkpoint whose architecture nothing registers stops fairseq-generate and the package's
  commands with one line (compat fix 11) instead of fairseq's IndexError.
"""

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_checks import logged
from conftest import MODATTN, PLUGIN, REPO, cli_environment, fairseq_cli, run_cli, tiny_train_args
from fairseq_modattn.compat.unknown_architecture import (
    UnknownArchitectureError,
    build_model_naming_unknown_architecture,
)

#: what the criterion logs for a DMA model besides fairseq's loss, nll_loss and ppl (docs/analysis.md)
DMA_KEYS = {"ce_loss", "kl", "dqq", "dxq", "div", "gamma"}
FOREIGN_ARCH = "another_plugins_transformer"


def run(args, cwd=None, **env):
    """(exit status, stdout + stderr, stderr) of a command."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=cli_environment(**env))
    return proc.returncode, proc.stdout + proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def dma_run(multi30k_bin, tmp_path_factory):
    """A tiny DMA model trained 6 updates with --tensorboard-logdir (train_inner every 2 updates):
    (save dir, TensorBoard log dir, fairseq-train's output)."""
    root = tmp_path_factory.mktemp("plugin_loading")
    save, logdir = root / "checkpoints", root / "tensorboard"
    _, out = run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("dma"), "--max-update", "6",
                      "--log-interval", "2", "--save-dir", save, "--tensorboard-logdir", logdir])
    return save, logdir, out


def generate(data, checkpoint, *extra, cwd=None, **env):
    return run([fairseq_cli("fairseq-generate"), data, "--path", checkpoint, "--cpu", "--beam", "1",
                "--max-len-b", "5", "--batch-size", "100", *extra], cwd=cwd, **env)


# ----------------------------------------------------------------------------- TensorBoard
def tensorboard_scalars(folder: Path):
    """{tag: {step: value}} of the scalars in the event files of FOLDER, read with the protobuf
    classes tensorboardX ships (records: length, its CRC, the Event, the Event's CRC)."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    scalars = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_logdir_holds_every_term_the_criterion_logs(dma_run):
    pytest.importorskip("tensorboardX")
    _, logdir, out = dma_run
    assert "tensorboard not found" not in out
    assert {p.name for p in logdir.iterdir()} >= {"train_inner", "train", "valid"}
    from fairseq.models import ARCH_MODEL_REGISTRY

    model = ARCH_MODEL_REGISTRY["dma_transformer_iwslt_de_en_tiny"]  # and whatever else the model declares
    declared = {*getattr(model, "aux_loss_names", ()), *getattr(model, "aux_metric_names", ())}
    expected = {"loss", "nll_loss", "ppl", *DMA_KEYS, *declared}
    for tag in ("train_inner", "train", "valid"):
        scalars = tensorboard_scalars(logdir / tag)
        assert expected <= set(scalars), (tag, sorted(expected - set(scalars)))
    # the values are those of fairseq's log lines: every train_inner line, all its terms
    inner, lines = tensorboard_scalars(logdir / "train_inner"), logged(out, "train_inner")
    assert sorted(lines) == [2, 4, 6] and sorted(inner["kl"]) == [2, 4, 6]
    for step, row in lines.items():
        for key in expected:
            assert inner[key][step] == pytest.approx(row[key], rel=1e-4, abs=1e-4), (step, key)
    assert all(inner["kl"][step] > 0 for step in lines)  # DMA's terms are really there
    assert 0 < inner["gamma"][6] < 1


# ----------------------------------------------------------------------------- --user-dir
def test_plugin_checkpoint_without_user_dir(dma_run, multi30k_bin):
    """What fairseq prints (docs/troubleshooting.md): under torch >= 2.6 its safe loader
    refuses the checkpoint's argparse.Namespace (the plugin's fix 4 is not loaded); under an
    older torch (simulated by torch's switch) model building fails with an IndexError."""
    save, _, _ = dma_run
    checkpoint = save / "checkpoint_last.pt"
    code, out, _ = generate(multi30k_bin, checkpoint)
    assert code != 0
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 6):
        assert "Unsupported global: GLOBAL argparse.Namespace" in out, out[-3000:]
    code, out, _ = generate(multi30k_bin, checkpoint, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    assert code != 0
    assert "IndexError: Replacement index 1 out of range for positional args tuple" in out, out[-3000:]
    assert "fairseq/models/__init__.py" in out


def test_relative_user_dir_resolves_against_the_working_folder(dma_run, multi30k_bin, tmp_path):
    save, _, _ = dma_run
    checkpoint = save / "checkpoint_last.pt"
    # from another folder: fairseq looks for ./fairseq_modattn there (and next to its own package)
    code, out, _ = generate(multi30k_bin, checkpoint, "--user-dir", "fairseq_modattn", cwd=tmp_path)
    assert code != 0
    assert f"FileNotFoundError: {tmp_path / 'fairseq_modattn'}" in out, out[-2000:]
    # docs/troubleshooting.md's fix: the folder's absolute path, as Python finds the installed package
    code, found, _ = run([sys.executable, "-c", "import fairseq_modattn, os; print(os.path.dirname("
                          "fairseq_modattn.__file__))"], cwd=tmp_path)
    assert code == 0 and Path(found.strip().splitlines()[-1]) == PLUGIN
    code, out, _ = generate(multi30k_bin, checkpoint, "--user-dir", found.strip().splitlines()[-1], cwd=tmp_path)
    assert code == 0, out[-3000:]
    assert sum(line.startswith("H-") for line in out.splitlines()) == 300
    # and the relative path from the repository root
    code, out, _ = generate(multi30k_bin, checkpoint, "--user-dir", "fairseq_modattn", cwd=REPO)
    assert code == 0, out[-3000:]


# ----------------------------------------------------------------------------- fix 11
@pytest.fixture(scope="module")
def foreign_checkpoint(dma_run):
    """The DMA checkpoint with its architecture renamed to one nothing registers, as a checkpoint
    of another plugin looks to a process that did not load that plugin."""
    save, _, _ = dma_run
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = FOREIGN_ARCH
    path = save.parent / "foreign.pt"
    torch.save(state, path)
    return path


def assert_one_line(code, err, prefix):
    assert code != 0
    assert "Traceback" not in err and "IndexError" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(prefix), err[-2000:]
    assert f"unknown model architecture '{FOREIGN_ARCH}'" in last and "--user-dir" in last


def test_unknown_architecture_is_one_line_in_fairseq_generate(foreign_checkpoint, multi30k_bin):
    code, _, err = generate(multi30k_bin, foreign_checkpoint, "--user-dir", PLUGIN)
    assert_one_line(code, err, "fairseq-generate: error: ")


def test_unknown_architecture_is_one_line_in_the_package_commands(foreign_checkpoint, multi30k_bin):
    code, _, err = run([MODATTN, "redundancy", multi30k_bin, "--path", foreign_checkpoint, "--max-batches", "1"])
    assert_one_line(code, err, f"fairseq-modattn redundancy: error: cannot load checkpoint {foreign_checkpoint}: ")


def test_build_model_names_the_unknown_architecture():
    import argparse

    from fairseq import models

    assert models.build_model is build_model_naming_unknown_architecture
    with pytest.raises(UnknownArchitectureError, match="unknown model architecture 'dma_transformer_iwslt'.*"
                       "similar registered names: dma_transformer_iwslt_de_en"):
        models.build_model(argparse.Namespace(arch="dma_transformer_iwslt", _name="dma_transformer_iwslt"), None)
