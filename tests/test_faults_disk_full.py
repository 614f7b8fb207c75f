"""A full disk, through the real fairseq commands: never a damaged file, always one line.

fairseq 0.12 copies its first checkpoint over ``checkpoint_last.pt`` / ``checkpoint_best.pt`` in
place and leaves ``NAME.tmp`` behind when a write fails (compat fix 13); torch's zip writer
says "unexpected pos", not that the disk is full. Each test runs on two kinds of full disk:

* ``tmpfs``: a real small tmpfs mounted for the test (skipped where mounting is not permitted);
* ``injected``: tests/disk_full_injection/sitecustomize.py, loaded only in the commands the test
  starts, makes the folder a filesystem of a fixed size for Python's file writes (partial write,
  then ENOSPC; ``shutil.disk_usage`` agrees). It is an injection, not a disk, so it runs anywhere.
"""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fairseq_modattn  # noqa: F401  (compat: the safe loader reads fairseq checkpoints)
from conftest import MODATTN, REPO, cli_environment, fairseq_cli, run_cli, tiny_train_args

INJECTION = REPO / "tests" / "disk_full_injection"
MiB = 1 << 20


def _can_mount_tmpfs() -> bool:
    import tempfile

    with tempfile.TemporaryDirectory() as probe:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe], capture_output=True).returncode:
            return False
        subprocess.run(["umount", probe], capture_output=True)
        return True


# Both kinds test the same code; the default suite runs one of them, the real tmpfs where this
# process may mount one, and the other runs with -m slow (its tests take a minute each).
DISKS = ([pytest.param("tmpfs"), pytest.param("injected", marks=pytest.mark.slow)] if _can_mount_tmpfs()
         else [pytest.param("tmpfs", marks=pytest.mark.slow), pytest.param("injected")])


class SmallDisk:
    """A folder holding at most SIZE bytes, as a tmpfs or by injection; ``env`` is the
    environment of commands that must see it full, ``grow`` gives it more room."""

    def __init__(self, kind: str, path: Path, size: int):
        self.kind, self.path, self.size = kind, path, size
        path.mkdir(parents=True)
        self.env = cli_environment()
        if kind == "tmpfs":
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                     capture_output=True, text=True)
            if mounted.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.strip()}")
        else:
            self.env.update(FAIRSEQ_MODATTN_TEST_FULL_DIR=str(path), FAIRSEQ_MODATTN_TEST_DISK_BYTES=str(size),
                            PYTHONPATH=os.pathsep.join([str(INJECTION), os.environ.get("PYTHONPATH", "")]))

    def grow(self, size: int):
        if self.kind == "tmpfs":
            subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)
        else:
            self.env["FAIRSEQ_MODATTN_TEST_DISK_BYTES"] = str(size)

    def close(self):
        if self.kind == "tmpfs":
            subprocess.run(["umount", str(self.path)], check=False)


@contextlib.contextmanager
def small_disk(kind: str, path: Path, size: int):
    disk = SmallDisk(kind, path, size)
    try:
        yield disk
    finally:
        disk.close()


def run(args, env):
    """(exit status, stdout, stderr) of a command in ENV."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def last_line(text):
    return text.strip().splitlines()[-1]


def temporaries(folder: Path):
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


def train(data, save, env, max_update):
    """The tiny transformer, a checkpoint every 2 updates (each about 4.05 MB)."""
    return run([fairseq_cli("fairseq-train"), data, *tiny_train_args("transformer"), "--save-interval-updates", "2",
                "--max-update", str(max_update), "--save-dir", save], env)


def assert_complete_checkpoint(path: Path, updates: int):
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["optimizer_history"][-1]["num_updates"] == updates, path


# ------------------------------------------------------------------ fairseq-train
# 14 MiB: checkpoint_1_2.pt, _best and _last fit (12.1 MB), checkpoint_1_4.pt's write does not
# (fairseq left checkpoint_1_4.pt.tmp and a traceback); the rerun resumes from checkpoint_last.pt.
# 10 MiB: the first save's checkpoint_1_2.pt and its copy onto checkpoint_best.pt fit, the copy
# onto checkpoint_last.pt does not (fairseq's copy wrote into checkpoint_last.pt itself and left a
# fragment); the line names the complete checkpoint to copy there, and the rerun resumes from it.
@pytest.mark.parametrize("kind", DISKS)
@pytest.mark.parametrize("failing, size", [("write", 14 * MiB), ("copy", 10 * MiB)])
def test_full_disk_during_a_save_keeps_checkpoints_whole_and_the_rerun_resumes(
        multi30k_bin, tmp_path, kind, failing, size):
    with small_disk(kind, tmp_path / "disk", size) as disk:
        save = disk.path / "save"
        last = save / "checkpoint_last.pt"
        code, out, err = train(multi30k_bin, save, disk.env, 4)
        line = last_line(err)
        assert code == 1 and "Traceback" not in out + err, err[-3000:]
        assert temporaries(disk.path) == [], temporaries(disk.path)
        written = "checkpoint_1_4.pt" if failing == "write" else "checkpoint_last.pt"
        assert line.startswith(f"fairseq-train: error: no space left on the device of {save}: writing {written} "
                               "needs about "), line
        if failing == "write":
            assert line.endswith(f"; {last} is intact; rerunning the same command once there is room resumes "
                                 "from it"), line
            assert not (save / "checkpoint_1_4.pt").exists()
            assert_complete_checkpoint(last, 2)
        else:
            assert line.endswith("; no checkpoint_last.pt was saved yet: a rerun starts from the beginning, or "
                                 f"resumes from the complete checkpoint_1_2.pt after: cp {save / 'checkpoint_1_2.pt'} "
                                 f"{last}"), line
            assert not last.exists()
        for name in ("checkpoint_best.pt", "checkpoint_1_2.pt"):
            assert_complete_checkpoint(save / name, 2)

        # space freed (and the advice followed); what a save killed with -9 leaves (our temporary,
        # fairseq's NAME.tmp) goes too
        disk.grow(64 * MiB)
        if failing == "copy":
            shutil.copyfile(save / "checkpoint_1_2.pt", last)
        (save / ".checkpoint_last.pt.tmp-999999").write_bytes(b"PK" * 1000)
        (save / "checkpoint_last.pt.tmp").write_bytes(b"PK" * 1000)
        code, out, err = train(multi30k_bin, save, disk.env, 6)
        assert code == 0, err[-3000:]
        assert f"Loaded checkpoint {last} (epoch 1 @ 2 updates)" in out + err, err[-3000:]
        assert_complete_checkpoint(last, 6)
        assert temporaries(disk.path) == [], temporaries(disk.path)


# ------------------------------------------------------------------ average, evaluate
@pytest.fixture(scope="module")
def update_checkpoints(multi30k_bin, tmp_path_factory):
    """checkpoint_1_2.pt and checkpoint_1_4.pt of the tiny transformer (4 updates)."""
    save = tmp_path_factory.mktemp("update_checkpoints")
    run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("transformer"), "--save-interval-updates",
             "2", "--max-update", "4", "--save-dir", save, "--no-last-checkpoints"])
    return save


@pytest.mark.parametrize("kind", DISKS)
def test_average_and_evaluate_on_a_full_disk_are_one_line(multi30k_bin, update_checkpoints, tmp_path, kind):
    with small_disk(kind, tmp_path / "disk", 2 * MiB) as disk:
        output = disk.path / "averaged.pt"
        code, out, err = run([MODATTN, "average", "--inputs", update_checkpoints, "--num-update-checkpoints", "2",
                              "--output", output], disk.env)
        assert code == 1 and "Traceback" not in out + err, err[-3000:]
        assert last_line(err).startswith(f"fairseq-modattn average: error: no space left on the device of "
                                         f"{disk.path}: writing averaged.pt needs about "), err[-2000:]
        assert "free; free at least" in last_line(err) and last_line(err).endswith(
            f"; nothing was written to {output}"), last_line(err)
        assert list(disk.path.iterdir()) == []

        work = disk.path / "eval"
        code, out, err = run([MODATTN, "evaluate", multi30k_bin, "--checkpoint-dir", update_checkpoints,
                              "--num-update-checkpoints", "2", "--subset", "valid", "--work-dir", work], disk.env)
        assert code == 1 and "Traceback" not in out + err, err[-3000:]
        assert last_line(err).startswith(f"fairseq-modattn evaluate: error: no space left on the device of {work}: "
                                         "writing averaged.pt needs about "), err[-2000:]
        assert temporaries(disk.path) == [] and list(work.iterdir()) == []


# ------------------------------------------------------------------ prepare
@pytest.mark.parametrize("kind", DISKS)
def test_prepare_on_a_full_disk_names_the_folder_and_the_space(multi30k_dir, tmp_path, kind):
    # 200 KB: the raw text of 50 training and 2014 valid/test sentence pairs fits, tokenised it does not
    with small_disk(kind, tmp_path / "disk", 200_000) as disk:
        code, out, err = run([MODATTN, "prepare", "multi30k", "--raw-dir", multi30k_dir, "--dest", disk.path / "bin",
                              "--max-train-sentences", "50", "--no-download"], disk.env)
        line = last_line(err)
        assert code == 1 and "Traceback" not in out + err, err[-3000:]
        tok = disk.path / "bin.work" / "tok"
        assert line.startswith(f"fairseq-modattn prepare multi30k: error: no space left on the device of {tok}: "
                               "writing the outputs of step text needs more than the "), line
        assert " written when the disk filled (its inputs are " in line and line.endswith(
            " free; finished steps are kept, fix it and rerun the same command to continue"), line
        assert temporaries(disk.path) == []


# ------------------------------------------------------------------ the atomic copy
COPY = """
import sys
from fairseq_modattn.atomic_files import atomic_copy, atomic_write
from fairseq_modattn.disk_space import DiskFullError
try:
    atomic_copy(sys.argv[1], sys.argv[2])
except DiskFullError as e:
    print(e)
if len(sys.argv) > 3:  # torch.save given a file NAME: its C++ writer leaves no errno to see
    import torch
    try:
        atomic_write(sys.argv[3], lambda name: torch.save({"w": torch.ones(1 << 20)}, name), expected_size=4 << 20)
    except DiskFullError as e:
        print(e)
"""


@pytest.mark.parametrize("kind", DISKS)
def test_an_interrupted_copy_leaves_the_old_destination_whole(tmp_path, kind):
    source = tmp_path / "new.pt"
    source.write_bytes(os.urandom(3 * MiB))
    with small_disk(kind, tmp_path / "disk", 4 * MiB) as disk:
        destination = disk.path / "checkpoint_last.pt"
        old = os.urandom(2 * MiB)
        destination.write_bytes(old)
        extra = [disk.path / "saved.pt"] if kind == "tmpfs" else []
        code, out, err = run([sys.executable, "-c", COPY, source, destination, *extra], disk.env)
        assert code == 0, err[-3000:]
        lines = out.strip().splitlines()
        assert lines[0].startswith(f"no space left on the device of {disk.path}: writing checkpoint_last.pt needs "
                                   "about 3.1 MB, "), out
        assert destination.read_bytes() == old and sorted(p.name for p in disk.path.iterdir()) == [destination.name]
        if kind == "tmpfs":
            assert lines[1].startswith(f"no space left on the device of {disk.path}: writing saved.pt needs "
                                       "about 4.2 MB, "), out
