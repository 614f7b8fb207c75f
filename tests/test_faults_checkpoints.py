"""Checkpoint faults, through the real fairseq commands.

4. A run trained with ``--eval-bleu`` stores numpy arrays in its checkpoints' metrics; torch's safe
   loader must accept them (resume, generate, average, evaluate) and still refuse object arrays
   and any other class.
5. A truncated checkpoint is reported in one line naming the file and an intact one to restore.
13. ``fairseq-modattn score`` is fairseq-score working with sacrebleu 2.x.
"""

import io
import pickle
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
import torch

import fairseq_modattn  # noqa: F401  (compat, as --user-dir applies it)
from conftest import MODATTN, PLUGIN, cli_environment, fairseq_cli, run_cli, tiny_train_args
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.checkpoints import average_checkpoints
from fairseq_modattn.analysis.loading import load_model

EVAL_BLEU = [
    "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 5}', "--eval-bleu-detok", "space",
    "--eval-bleu-remove-bpe", "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
]


def train(data, save, *extra, check=True):
    """The tiny transformer with --eval-bleu; a checkpoint every 2 updates, no epoch ends."""
    return run_cli([fairseq_cli("fairseq-train"), data, *tiny_train_args("transformer"), *EVAL_BLEU,
                    "--save-interval-updates", "2", "--save-dir", save, *extra], check=check)


def run(args):
    """(exit status, stdout, stderr) of a command."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, env=cli_environment())
    return proc.returncode, proc.stdout, proc.stderr


def truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def bleu_run(multi30k_bin, tmp_path_factory):
    """checkpoint_1_2.pt, checkpoint_1_4.pt, checkpoint_best.pt, checkpoint_last.pt of 4 updates."""
    save = tmp_path_factory.mktemp("eval_bleu")
    train(multi30k_bin, save, "--max-update", "4")
    assert sorted(p.name for p in save.glob("*.pt")) == \
        ["checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    return save


def copy_run(bleu_run, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(bleu_run, target)
    return target


# ------------------------------------------------------------------ 4. numpy arrays in the metrics
def test_eval_bleu_checkpoints_load_with_the_safe_loader(bleu_run):
    state = torch.load(bleu_run / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    meters = {name: meter for rows in state["extra_state"]["metrics"].values() for _, name, _, meter in rows}
    assert isinstance(meters["_bleu_counts"]["sum"], np.ndarray), meters["_bleu_counts"]
    assert meters["_bleu_counts"]["sum"].dtype == np.int64 and meters["_bleu_totals"]["sum"].shape == (4,)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(bleu_run / "checkpoint_best.pt") == []


def test_resume_and_generate_from_eval_bleu_checkpoints(multi30k_bin, bleu_run, tmp_path):
    save = copy_run(bleu_run, tmp_path)
    _, out = train(multi30k_bin, save, "--max-update", "6")
    assert "Loaded checkpoint" in out and "@ 4 updates" in out, out[-3000:]
    assert "num_updates 6" in out, out[-3000:]
    _, out = run_cli([fairseq_cli("fairseq-generate"), multi30k_bin, "--user-dir", PLUGIN, "--path",
                      bleu_run / "checkpoint_best.pt", "--gen-subset", "valid", "--beam", "1", "--max-len-b", "5",
                      "--batch-size", "64", "--cpu", "--remove-bpe"])
    assert sum(line.startswith("H-") for line in out.splitlines()) == 100, out[-2000:]


def test_average_and_evaluate_eval_bleu_checkpoints(multi30k_bin, bleu_run, tmp_path):
    output = tmp_path / "averaged.pt"
    code, out, err = run([MODATTN, "average", "--inputs", bleu_run, "--num-update-checkpoints", "2",
                          "--output", output])
    assert code == 0, out + err[-3000:]
    averaged = torch.load(output, map_location="cpu", weights_only=True)
    assert averaged["extra_state"]["metrics"]
    code, out, err = run([MODATTN, "evaluate", multi30k_bin, "--checkpoint-dir", bleu_run,
                          "--num-update-checkpoints", "2", "--subset", "valid", "--beam", "1",
                          "--work-dir", tmp_path / "eval", "--", "--max-len-b", "5"])
    assert code == 0, out + err[-3000:]
    assert "averaging 2 checkpoints" in out and (tmp_path / "eval" / "results.json").is_file()


class NotAllowListed:
    pass


class CallsNdarray:
    """Pickles as a direct call numpy.ndarray((2,), 'O', buffer): raw bytes as object pointers."""

    def __reduce__(self):
        return np.ndarray, ((2,), "O", b"\x01" * 16)


def legacy_save(obj, path, replace=None):
    """torch.save in the pre-zip format (one flat pickle stream), optionally with bytes replaced."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=False)
    data = buffer.getvalue()
    for old, new in (replace or {}).items():
        assert old in data
        data = data.replace(old, new)
    path.write_bytes(data)
    return path


def test_numeric_numpy_loads_and_everything_else_is_still_refused(tmp_path):
    numeric = {"counts": np.array([5, 4, 3, 2]), "f32": np.eye(2, dtype=np.float32).T, "flags": np.array([True]),
               "scalar": np.float64(0.25), "complex": np.array([1 + 2j]), "empty": np.zeros((0, 3))}
    torch.save({"model": {"w": torch.ones(1)}, "metrics": numeric}, tmp_path / "numeric.pt")
    loaded = torch.load(tmp_path / "numeric.pt", weights_only=True)["metrics"]
    for key, value in numeric.items():
        assert type(loaded[key]) is type(value) and loaded[key].dtype == value.dtype, key
        assert np.array_equal(loaded[key], value), key
    # written by numpy 1.x, which spells the module numpy.core
    old = legacy_save({"model": {}, "counts": np.array([1, 2])}, tmp_path / "numpy1.pt",
                      {b"numpy._core.multiarray\n": b"numpy.core.multiarray\n"})
    assert np.array_equal(torch.load(old, weights_only=True)["counts"], [1, 2])

    refused = {
        "object": ({"model": {}, "x": np.array([1, "a"], dtype=object)}, "numpy dtype 'object' refused"),
        "str": ({"model": {}, "x": np.array(["a"])}, "numpy dtype '<U1' refused"),
        "class": ({"model": {}, "x": NotAllowListed()}, "NotAllowListed, which is not among what fairseq writes"),
        "recarray": ({"model": {}, "x": np.rec.array([(1, 2.0)])}, "numpy.rec.recarray, which is not among"),
        "ndarray call": ({"model": {}, "x": CallsNdarray()}, "numpy.ndarray called directly refused"),
    }
    for name, (obj, message) in refused.items():
        if name == "ndarray call":
            path = legacy_save(obj, tmp_path / f"{name.replace(' ', '_')}.pt")
        else:
            path = tmp_path / f"{name}.pt"
        if name != "ndarray call":
            torch.save(obj, path)
        with pytest.raises(pickle.UnpicklingError):
            torch.load(path, weights_only=True)
        with pytest.raises(AnalysisError, match=message) as error:
            average_checkpoints([path])
        assert "\n" not in str(error.value) and "weights_only=True" in str(error.value), name


# ------------------------------------------------------------------ 5. truncated checkpoints
def last_line(text):
    return text.strip().splitlines()[-1]


def test_truncated_checkpoint_last_is_one_line_for_fairseq_train_and_generate(multi30k_bin, bleu_run, tmp_path):
    save = copy_run(bleu_run, tmp_path)
    truncate(save / "checkpoint_last.pt")
    code, out, err = run([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("transformer"), *EVAL_BLEU,
                          "--save-dir", save, "--max-update", "6"])
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert line.startswith(f"fairseq-train: error: cannot load checkpoint {save / 'checkpoint_last.pt'}: "
                           "the file is damaged (truncated"), line
    assert f"restore it from the newest intact one: cp {save / 'checkpoint_1_4.pt'} {save / 'checkpoint_last.pt'} " \
           "(also intact there: checkpoint_1_2.pt, checkpoint_best.pt)" in line, line
    code, out, err = run([fairseq_cli("fairseq-generate"), multi30k_bin, "--user-dir", PLUGIN, "--path",
                          save / "checkpoint_last.pt", "--gen-subset", "valid", "--cpu"])
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err).startswith(f"fairseq-generate: error: cannot load checkpoint {save / 'checkpoint_last.pt'}")
    # the advice works: restored, training resumes from update 4
    shutil.copyfile(save / "checkpoint_1_4.pt", save / "checkpoint_last.pt")
    _, out = train(multi30k_bin, save, "--max-update", "5")
    assert "Loaded checkpoint" in out and "@ 4 updates" in out, out[-3000:]


def test_truncated_checkpoint_is_one_line_for_average_evaluate_and_serve_loading(multi30k_bin, bleu_run, tmp_path):
    save = copy_run(bleu_run, tmp_path)
    truncate(save / "checkpoint_1_4.pt")
    truncate(save / "checkpoint_best.pt")
    damaged = save / "checkpoint_1_4.pt"
    code, out, err = run([MODATTN, "average", "--inputs", save, "--num-update-checkpoints", "2",
                          "--output", tmp_path / "avg.pt"])
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert last_line(err) == (f"fairseq-modattn average: error: cannot load checkpoint {damaged}: the file is "
                              f"damaged (truncated or corrupt: {damaged.stat().st_size} bytes without a readable zip "
                              f"directory, File is not a zip file); intact checkpoints in {save}: "
                              "checkpoint_1_2.pt, checkpoint_last.pt"), err[-2000:]
    code, out, err = run([MODATTN, "evaluate", multi30k_bin, "--checkpoint-dir", save, "--num-update-checkpoints",
                          "2", "--subset", "valid", "--work-dir", tmp_path / "eval"])
    assert code == 1 and f"error: cannot load checkpoint {damaged}: the file is damaged" in last_line(err), err[-2000:]
    # fairseq-modattn serve, analyze and evaluate --path load models through load_model
    with pytest.raises(AnalysisError) as error:
        load_model(save / "checkpoint_best.pt", multi30k_bin)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"cannot load checkpoint {save / 'checkpoint_best.pt'}: "
                                                      "the file is damaged"), message
    assert f"cp {save / 'checkpoint_1_2.pt'} {save / 'checkpoint_best.pt'} (also intact there: checkpoint_last.pt)" \
        in message


def test_a_file_that_is_no_checkpoint_is_never_advised_deleted(tmp_path, multi30k_bin):
    """`serve --path notes.txt` advised deleting the user's file ("delete it to start again
    without it"), and `--path DIR` said the folder did not exist."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    empty = tmp_path / "empty.pt"
    empty.touch()
    for path, expected in ((notes, "it is not a torch checkpoint (neither a zip archive nor a pickle); pass a .pt "
                                   "file that fairseq-train saved"),
                           (empty, "the file is damaged (empty file); pass an intact .pt file that fairseq-train "
                                   "saved")):
        with pytest.raises(AnalysisError) as error:
            load_model(path, multi30k_bin)
        assert str(error.value) == f"cannot load checkpoint {path}: {expected}"
        assert "delete" not in str(error.value)
    with pytest.raises(AnalysisError, match=f"^checkpoint {tmp_path} is a folder: pass the .pt file in it"):
        load_model(tmp_path, multi30k_bin)
    assert notes.read_text() == "my notes\n" and empty.exists()


# ------------------------------------------------------------------ 13. fairseq-score
def test_score_command_runs_fairseq_score_with_sacrebleu_2(tmp_path):
    hyps = ["a man rides a bike .", "two dogs play in snow ."]
    refs = ["a man rides a bike .", "two dogs play in the snow ."]
    (tmp_path / "sys.txt").write_text("".join(h + "\n" for h in hyps))
    (tmp_path / "ref.txt").write_text("".join(r + "\n" for r in refs))
    code, out, err = run([MODATTN, "score", "-s", tmp_path / "sys.txt", "-r", tmp_path / "ref.txt", "--sacrebleu"])
    assert code == 0, err[-3000:]
    assert last_line(out) == sacrebleu.corpus_bleu(hyps, [refs]).format(), out
    code, out, err = run([MODATTN, "score", "-s", tmp_path / "sys.txt", "-r", tmp_path / "ref.txt", "--sentence-bleu"])
    assert code == 0 and out.strip().splitlines()[-2].startswith("0 BLEU4 = 100.00"), out + err[-3000:]
    code, out, err = run([MODATTN, "score", "-s", tmp_path / "sys.txt", "-r", tmp_path / "ref.txt"])
    assert code == 0 and last_line(out).startswith("BLEU4 = "), out + err[-3000:]
    code, out, err = run([MODATTN, "score", "-s", tmp_path / "nope.txt", "-r", tmp_path / "ref.txt"])
    assert code == 1 and last_line(err) == f"fairseq-modattn score: error: System output file " \
                                           f"{tmp_path / 'nope.txt'} does not exist", err
    # the adjustment lasts for the command only
    from fairseq.scoring import bleu

    from fairseq_modattn.compat.fairseq_score import fairseq_score

    assert fairseq_score(["-s", str(tmp_path / "sys.txt"), "-r", str(tmp_path / "ref.txt"), "--sacrebleu"]) == 0
    assert sacrebleu.corpus_bleu.__module__.startswith("sacrebleu") and bleu.Scorer.__module__ == bleu.__name__
