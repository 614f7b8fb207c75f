"""Checkpoint selection, averaging and atomic saving (fairseq_modattn.analysis.checkpoints),
and the ``fairseq-modattn average`` command on checkpoints of a real fairseq-train run."""

import collections
import logging
import pickle

import pytest
import torch

from conftest import MODATTN, PLUGIN, fairseq_cli, run_cli
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.checkpoints import (
    average_checkpoints,
    find_checkpoints,
    save_checkpoint_atomically,
)
from fairseq_modattn.cli.main import main as modattn_main


def fake_checkpoint(path, model, **extra):
    """A file shaped like a fairseq checkpoint (model state dict + metadata)."""
    torch.save({"model": model, "args": None, "extra_state": {"epoch": extra.pop("epoch", 1)}, **extra}, path)
    return path


def two_models():
    first = {
        "w": torch.tensor([[1.0, 2.0], [3.0, -4.0]]),
        "half": torch.tensor([1.0, 2.0], dtype=torch.float16),
        "steps": torch.tensor([7, 8], dtype=torch.long),
    }
    second = {
        "w": torch.tensor([[3.0, 2.5], [-1.0, 4.0]]),
        "half": torch.tensor([2.0, 3.0], dtype=torch.float16),
        "steps": torch.tensor([7, 8], dtype=torch.long),
    }
    return first, second


# ------------------------------------------------------------------ averaging
def test_average_is_the_mean_and_keeps_int_tensors_and_last_metadata(tmp_path):
    first, second = two_models()
    a = fake_checkpoint(tmp_path / "a.pt", first, epoch=1)
    b = fake_checkpoint(tmp_path / "b.pt", second, epoch=2)
    state = average_checkpoints([a, b])
    model = state["model"]
    # every value is exactly representable: the mean must be exact
    assert torch.equal(model["w"], torch.tensor([[2.0, 2.25], [1.0, 0.0]]))
    assert model["w"].dtype == torch.float32
    assert torch.equal(model["half"], torch.tensor([1.5, 2.5], dtype=torch.float16))
    assert model["half"].dtype == torch.float16
    assert torch.equal(model["steps"], torch.tensor([7, 8])) and model["steps"].dtype == torch.long
    assert state["extra_state"] == {"epoch": 2}  # the last checkpoint's dict


def test_average_of_three_accumulates_in_float64(tmp_path):
    values = [torch.tensor([0.1, 1e8]), torch.tensor([0.2, 1.0]), torch.tensor([0.3, -1e8])]
    paths = [fake_checkpoint(tmp_path / f"{i}.pt", {"v": v}) for i, v in enumerate(values)]
    expected = (torch.stack([v.double() for v in values]).sum(0) / 3).float()
    assert torch.equal(average_checkpoints(paths)["model"]["v"], expected)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("half"), "'half' is missing from"),
    (lambda m: m.update(extra=torch.zeros(1)), "'extra' is in"),
    (lambda m: m.update(w=torch.zeros(3, 2)), r"'w' has shape|'w' is \(\(3, 2\)"),
    (lambda m: m.update(steps=torch.tensor([7, 9])), "'steps' differs"),
])
def test_mismatched_checkpoints_name_the_key_and_file(tmp_path, change, message):
    first, second = two_models()
    change(second)
    a = fake_checkpoint(tmp_path / "a.pt", first)
    b = fake_checkpoint(tmp_path / "b.pt", second)
    with pytest.raises(AnalysisError, match=message) as error:
        average_checkpoints([a, b])
    assert "b.pt" in str(error.value)


def test_missing_and_unreadable_files_are_analysis_errors(tmp_path):
    first, _ = two_models()
    a = fake_checkpoint(tmp_path / "a.pt", first)
    with pytest.raises(AnalysisError, match="nothere.pt does not exist"):
        average_checkpoints([a, tmp_path / "nothere.pt"])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(AnalysisError, match="cannot load checkpoint .*junk.pt"):
        average_checkpoints([a, tmp_path / "junk.pt"])
    torch.save({"no_model": 1}, tmp_path / "other.pt")
    with pytest.raises(AnalysisError, match="other.pt is not a fairseq checkpoint"):
        average_checkpoints([tmp_path / "other.pt"])
    with pytest.raises(AnalysisError, match="no checkpoints"):
        average_checkpoints([])


class ForeignStateDict(collections.OrderedDict):
    """A class torch's safe loader has not been told about."""


def test_loading_uses_weights_only_and_refuses_foreign_classes(tmp_path):
    model = ForeignStateDict(w=torch.ones(2))
    path = tmp_path / "foreign.pt"
    torch.save({"model": model, "args": None}, path)
    with pytest.raises(AnalysisError, match="weights_only=True.*ForeignStateDict"):
        average_checkpoints([path])


# ------------------------------------------------------------------ selection
@pytest.fixture
def save_dir(tmp_path):
    names = [f"checkpoint{e}.pt" for e in (1, 2, 3, 9, 10, 11)]
    names += ["checkpoint_1_100.pt", "checkpoint_2_250.pt", "checkpoint_3_1000.pt",
              "checkpoint_last.pt", "checkpoint_best.pt", "checkpoint.best_loss_3.2.pt", "checkpoint12.pt.tmp"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    return tmp_path


def names(paths):
    return [p.name for p in paths]


def test_find_last_epoch_checkpoints_oldest_first(save_dir):
    assert names(find_checkpoints(save_dir, num_epoch_checkpoints=3)) == \
        ["checkpoint9.pt", "checkpoint10.pt", "checkpoint11.pt"]
    assert names(find_checkpoints(save_dir, num_epoch_checkpoints=6)) == \
        [f"checkpoint{e}.pt" for e in (1, 2, 3, 9, 10, 11)]
    assert names(find_checkpoints(save_dir, num_epoch_checkpoints=2, upper_bound=9)) == \
        ["checkpoint3.pt", "checkpoint9.pt"]


def test_find_last_update_checkpoints(save_dir):
    assert names(find_checkpoints(save_dir, num_update_checkpoints=2)) == \
        ["checkpoint_2_250.pt", "checkpoint_3_1000.pt"]
    assert names(find_checkpoints(save_dir, num_update_checkpoints=2, upper_bound=999)) == \
        ["checkpoint_1_100.pt", "checkpoint_2_250.pt"]


def test_fewer_than_n_is_an_error_listing_what_was_found(save_dir, caplog):
    with pytest.raises(AnalysisError, match=r"last 5 epoch checkpoints with epoch <= 3 .* found 3: "
                                            r"checkpoint1.pt, checkpoint2.pt, checkpoint3.pt"):
        find_checkpoints(save_dir, num_epoch_checkpoints=5, upper_bound=3)
    with caplog.at_level(logging.WARNING):
        found = find_checkpoints(save_dir, num_epoch_checkpoints=5, upper_bound=3, allow_fewer=True)
    assert names(found) == ["checkpoint1.pt", "checkpoint2.pt", "checkpoint3.pt"]
    assert "found 3" in caplog.text
    with pytest.raises(AnalysisError, match="no epoch checkpoints"):
        find_checkpoints(save_dir, num_epoch_checkpoints=5, upper_bound=0, allow_fewer=True)


def test_find_checkpoints_bad_arguments(tmp_path):
    with pytest.raises(AnalysisError, match="does not exist"):
        find_checkpoints(tmp_path / "missing", num_epoch_checkpoints=5)
    with pytest.raises(AnalysisError, match="exactly one"):
        find_checkpoints(tmp_path, num_epoch_checkpoints=5, num_update_checkpoints=5)
    with pytest.raises(AnalysisError, match=">= 1"):
        find_checkpoints(tmp_path, num_epoch_checkpoints=0)


# ------------------------------------------------------------------ saving
def test_atomic_save_leaves_only_the_target(tmp_path):
    target = tmp_path / "sub" / "dir" / "averaged.pt"
    save_checkpoint_atomically({"model": {"w": torch.ones(2)}}, target)
    assert [p.name for p in target.parent.iterdir()] == ["averaged.pt"]
    assert torch.equal(torch.load(target, weights_only=True)["model"]["w"], torch.ones(2))
    # a failing save (a lambda cannot be pickled) leaves neither a temp file nor a new target
    with pytest.raises((AttributeError, pickle.PicklingError)):
        save_checkpoint_atomically({"model": lambda: 0}, target.parent / "broken.pt")
    assert [p.name for p in target.parent.iterdir()] == ["averaged.pt"]


# ------------------------------------------------------------------ the command
def test_average_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as done:
        modattn_main(["average", "-h"])
    assert done.value.code == 0 and "--num-epoch-checkpoints" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        modattn_main(["average", "--inputs", "x.pt"])  # no --output
    assert done.value.code == 2


def test_average_never_replaces_an_input_nor_counts_one_twice(tmp_path, capsys, monkeypatch):
    """The issue's case: `average --inputs a.pt b.pt --output a.pt` replaced a.pt by the mean,
    which carried b.pt's metadata. An output that is an input, under any name, and an input given
    twice are refused in one line before anything is read; nothing changes on disk."""
    first, second = two_models()
    a = fake_checkpoint(tmp_path / "a.pt", first, epoch=1)
    b = fake_checkpoint(tmp_path / "b.pt", second, epoch=2)
    (tmp_path / "link.pt").symlink_to(a)
    (tmp_path / "hard.pt").hardlink_to(b)
    before = {path: path.read_bytes() for path in (a, b)}
    monkeypatch.chdir(tmp_path)
    read = []
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: read.append(args) or pytest.fail("read"))
    cases = [
        (["a.pt", "b.pt"], "a.pt", "--output a.pt is the input a.pt: averaging would replace it"),
        (["a.pt", "b.pt"], "./b.pt", "--output b.pt is the input b.pt"),
        (["a.pt", "b.pt"], "link.pt", "--output link.pt is the input a.pt"),
        (["link.pt", "b.pt"], str(a), f"--output {a} is the input link.pt"),
        (["a.pt", "b.pt"], "hard.pt", "--output hard.pt is the input b.pt"),
        (["a.pt", "b.pt", "./a.pt"], "avg.pt", "--inputs names one file twice (a.pt and a.pt)"),
        (["a.pt", "link.pt"], "avg.pt", "--inputs names one file twice (a.pt and link.pt)"),
    ]
    for inputs, output, message in cases:
        assert modattn_main(["average", "--inputs", *inputs, "--output", output]) == 1, (inputs, output)
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fairseq-modattn average: error: ") and message in lines[0], \
            (inputs, output, captured.err)
        assert "averaging" not in captured.out  # refused before the list of what would be read
    assert not read and {path: path.read_bytes() for path in (a, b)} == before
    assert not (tmp_path / "avg.pt").exists()


@pytest.fixture(scope="module")
def two_epochs(multi30k_bin, tmp_path_factory):
    """checkpoint1.pt and checkpoint2.pt of a tiny real DMA model."""
    save = tmp_path_factory.mktemp("avg_ckpt")
    run_cli([
        fairseq_cli("fairseq-train"), multi30k_bin, "--user-dir", PLUGIN, "--arch", "dma_transformer_iwslt_de_en_tiny",
        "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
        "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
        "--criterion", "label_smoothed_cross_entropy_with_aux", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "4000", "--batch-size", "50", "--max-epoch", "2",
        "--train-subset", "valid",
        "--disable-validation", "--cpu", "--seed", "3", "--num-workers", "0", "--no-progress-bar", "--save-dir", save,
    ])
    return save


def test_average_command_on_real_checkpoints(two_epochs, tmp_path):
    output = tmp_path / "out" / "averaged.pt"
    _, out = run_cli([MODATTN, "average", "--inputs", two_epochs, "--num-epoch-checkpoints", "2", "--output", output])
    assert "checkpoint1.pt" in out and "checkpoint2.pt" in out and f"wrote {output}" in out
    from fairseq import checkpoint_utils  # fairseq's own loader must read the result

    assert checkpoint_utils.load_checkpoint_to_cpu(str(output))["model"]
    averaged = torch.load(output, weights_only=True)
    first = torch.load(two_epochs / "checkpoint1.pt", weights_only=True)
    second = torch.load(two_epochs / "checkpoint2.pt", weights_only=True)
    assert averaged["args"] == second["args"]  # the metadata is the last checkpoint's
    iterator = averaged["extra_state"]["train_iterator"]
    assert iterator == second["extra_state"]["train_iterator"] != first["extra_state"]["train_iterator"]
    assert set(averaged["model"]) == set(first["model"])
    changed = 0
    for key, value in averaged["model"].items():
        if value.is_floating_point():
            mean = ((first["model"][key].double() + second["model"][key].double()) / 2).to(value.dtype)
            assert torch.equal(value, mean), key
            changed += not torch.equal(first["model"][key], second["model"][key])
        else:
            assert torch.equal(value, second["model"][key]), key
    assert changed > 10  # the two epochs really differ



def test_average_command_errors(two_epochs, tmp_path, capsys):
    code = modattn_main(["average", "--inputs", str(two_epochs), "--num-epoch-checkpoints", "3",
                         "--output", str(tmp_path / "x.pt")])
    err = capsys.readouterr().err
    assert code == 1 and "fairseq-modattn average: error: need the last 3 epoch checkpoints" in err, err
    assert "found 2: checkpoint1.pt, checkpoint2.pt" in err and "--allow-fewer" not in err  # evaluate's flag
    code = modattn_main(["average", "--inputs", str(two_epochs), "--output", str(tmp_path / "x.pt")])
    assert code == 1 and "is a directory" in capsys.readouterr().err
    code = modattn_main(["average", "--inputs", str(two_epochs / "checkpoint1.pt"), str(tmp_path / "gone.pt"),
                         "--output", str(tmp_path / "x.pt")])
    assert code == 1 and "gone.pt does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
    # the case on real checkpoints: the first input as --output is refused and kept
    first = two_epochs / "checkpoint1.pt"
    kept = first.read_bytes()
    code = modattn_main(["average", "--inputs", str(first), str(two_epochs / "checkpoint2.pt"), "--output", str(first)])
    assert code == 1 and "averaging would replace it" in capsys.readouterr().err
    assert first.read_bytes() == kept
