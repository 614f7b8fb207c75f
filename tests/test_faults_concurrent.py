"""One folder, one writer: a second run pointed at a folder in use is refused at once, in one
line naming the first one's pid; the first one's results are those of a run made alone; a lock
left by a killed process never blocks a rerun; a step marker vouches only for the file its own
run produced.

Real pairs of commands (``prepare``, ``fairseq-train``, ``evaluate``): the first one is started,
paused with SIGSTOP as soon as it holds its folder (so the second surely starts while the first
is running, on any machine), the second one runs to its refusal, then the first one continues to
its end and is compared with a solo run. The other writers (``average``, ``redundancy``, ``plot``,
``quickstart``, ``ablate``, the benchmarks) meet a process that holds their output through the
package's lock the way their first instance would.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MODATTN, MODATTN_MAIN, REPO, cli_environment, fairseq_cli, run_cli, run_commands, tiny_train_args
from fairseq_modattn import folder_lock
from fairseq_modattn.data.steps import Steps
from test_faults_outputs import prepare_argv, synthetic_raw, tree


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_environment(), **kwargs)


@contextlib.contextmanager
def running(args, **kwargs):
    """A started command, killed (and reaped) on every way out of the block."""
    proc = start(args, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.communicate()


def wait_until_held(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until PROC holds the lock of PATH, then pause it (SIGSTOP)."""
    deadline = time.monotonic() + timeout
    while folder_lock.current_holder(path) != proc.pid:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the first run ended (status {proc.returncode}) before it was seen holding {path}:\n"
                        f"{(out + err)[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the first run did not take the lock of {path} within {timeout:.0f} s")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGSTOP)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Let a paused PROC continue to its end; its output (it must succeed)."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, (out + err)[-4000:]
    return out + err


def refused(args, pid: int, *needles, cwd=None) -> str:
    """Run ARGS; it must fail at once with one error line naming PID and every NEEDLE."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=cli_environment(),
                          timeout=300, cwd=cwd)
    return one_refusal(proc.returncode, proc.stdout, proc.stderr, pid, *needles)


def one_refusal(code: int, stdout: str, stderr: str, pid: int, *needles) -> str:
    """A command's exit CODE and output: a failure with one error line naming PID and every NEEDLE."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert code != 0, stdout + stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, stderr[-3000:]
    for needle in (f"in use by pid {pid}", *needles):
        assert str(needle) in errors[0], errors[0]
    return errors[0]


#: folder_lock.py needs only the standard library: loaded from its file, a helper process has the
#: package's locks at hand in a fraction of a second, without importing fairseq (~6 s a process)
LOAD_FOLDER_LOCK = ("import importlib.util, sys\n"
                    f"spec = importlib.util.spec_from_file_location('folder_lock', {folder_lock.__file__!r})\n"
                    "folder_lock = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(folder_lock)\n")


@contextlib.contextmanager
def held_by_another_process(*paths: Path):
    """A real process holding the package's locks of PATHS (as a first command would); its pid."""
    code = (LOAD_FOLDER_LOCK + "import time\nfor path in sys.argv[1:]:\n    folder_lock.acquire(path)\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    with running([sys.executable, "-c", code, *paths]) as proc:
        assert proc.stdout.readline().strip() == "held", proc.stderr.read()
        yield proc.pid


# ------------------------------------------------------------------------------ prepare
def test_second_prepare_into_one_dest_is_refused_and_the_first_matches_a_solo_run(tmp_path):
    raw = synthetic_raw(tmp_path / "raw")
    dest = tmp_path / "bin"
    with running([MODATTN, *prepare_argv(raw, dest)]) as first:
        wait_until_held(dest, first)
        refused([MODATTN, *prepare_argv(raw, dest, "--bpe-size", "20")], first.pid, f"--dest {dest}")
        # another --dest but the same work dir: refused too (its step markers are shared)
        refused([MODATTN, *prepare_argv(raw, tmp_path / "other", "--work-dir", tmp_path / "bin.work")],
                first.pid, "--work-dir")
        finish(first)
    assert not (tmp_path / "other").exists()
    run_cli([MODATTN, *prepare_argv(raw, tmp_path / "solo")])
    ours, solo = tree(dest), tree(tmp_path / "solo")
    for name in ("prepare-manifest.json", "preprocess.log"):  # they name their own folder
        ours.pop(name), solo.pop(name)
    assert ours == solo
    assert not list(tmp_path.glob(".*.lock"))  # released and removed at the end


def test_a_lock_left_by_a_killed_process_never_blocks_a_rerun(tmp_path):
    raw = synthetic_raw(tmp_path / "raw")
    dest = tmp_path / "bin"
    with held_by_another_process(dest) as pid:
        refused([MODATTN, *prepare_argv(raw, dest)], pid, f"--dest {dest}")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while folder_lock.current_holder(dest) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert folder_lock.lock_file(dest).exists()  # what kill -9 leaves ...
    run_cli([MODATTN, *prepare_argv(raw, dest)])  # ... blocks nothing
    assert (dest / "dict.de.txt").is_file() and not folder_lock.lock_file(dest).exists()


def test_step_marker_vouches_only_for_the_file_its_run_produced(tmp_path):
    """The interleaving of two runs (the other run's file renamed over ours before our marker is
    written, or after it) leaves a file of the same size that the marker did not see made."""
    out = tmp_path / "work" / "spm.model"
    steps = Steps(tmp_path / "work", log=lambda m: None)
    assert steps.run("learn", [out], lambda tmp: tmp.write_bytes(b"A" * 1000), params={"size": 800})
    record = json.loads(steps.marker("learn").read_text())
    assert record["produced"][str(out)]["size"] == 1000
    assert not steps.run("learn", [out], lambda tmp: tmp.write_bytes(b"A" * 1000), params={"size": 800})

    out.write_bytes(b"B" * 1000)  # another writer's model, same size
    redo = []
    assert steps.run("learn", [out], lambda tmp: redo.append(1) or tmp.write_bytes(b"A" * 1000), params={"size": 800})
    assert redo and out.read_bytes() == b"A" * 1000

    # a copy of the same file (a new modification time, same content) is still trusted
    data = out.read_bytes()
    out.unlink()
    out.write_bytes(data)
    os.utime(out, ns=(1, 1))
    assert not steps.run("learn", [out], lambda tmp: pytest.fail("redone"), params={"size": 800})


# ------------------------------------------------------------------------------ fairseq-train
def tiny_train(data, save_dir, seed="7", updates="16"):
    return [fairseq_cli("fairseq-train"), data, *tiny_train_args("dma"), "--max-update", updates,
            "--save-interval-updates", "4", "--seed", seed, "--save-dir", save_dir]


def test_second_training_into_one_save_dir_is_refused_and_the_first_matches_a_solo_run(multi30k_bin, tmp_path):
    save = tmp_path / "checkpoints"
    with running(tiny_train(multi30k_bin, save)) as first:
        wait_until_held(save, first)
        refused([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("transformer"), "--max-update", "8",
                 "--seed", "3", "--save-dir", save], first.pid, f"--save-dir {save}")
        finish(first)
    run_cli(tiny_train(multi30k_bin, tmp_path / "solo"))
    names = sorted(p.name for p in save.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "solo").iterdir()), names
    for name in names:
        ours = torch.load(save / name, map_location="cpu", weights_only=False)
        solo = torch.load(tmp_path / "solo" / name, map_location="cpu", weights_only=False)
        assert ours["model"].keys() == solo["model"].keys()
        for key in ours["model"]:
            assert torch.equal(ours["model"][key], solo["model"][key]), (name, key)
    assert not folder_lock.lock_file(save).exists()


# ------------------------------------------------------------------------------ evaluate
def evaluate_command(data, checkpoint, work_dir, *extra):
    return [MODATTN, "evaluate", data, "--path", checkpoint, "--cpu", "--beam", "2", "--work-dir", work_dir, *extra,
            "--", "--max-len-b", "8"]


def test_second_evaluate_sharing_a_work_dir_is_refused_and_the_first_matches_a_solo_run(
        multi30k_bin, tiny_checkpoints, tmp_path):
    work = tmp_path / "eval"
    with running(evaluate_command(multi30k_bin, tiny_checkpoints["dma"], work)) as first:
        wait_until_held(work, first)
        refused(evaluate_command(multi30k_bin, tiny_checkpoints["transformer"], work), first.pid, f"--work-dir {work}")
        # an --output in the first one's work dir (here, its results.json) is refused too
        refused(evaluate_command(multi30k_bin, tiny_checkpoints["transformer"], tmp_path / "w2", "--output",
                                 work / "results.json"), first.pid, f"--output {work / 'results.json'} is in {work}")
        finish(first)
    run_cli(evaluate_command(multi30k_bin, tiny_checkpoints["dma"], tmp_path / "solo"))
    ours = json.loads((work / "results.json").read_text())
    solo = json.loads((tmp_path / "solo" / "results.json").read_text())
    assert ours["checkpoints"] == [str(Path(tiny_checkpoints["dma"]).resolve())]
    for key in ("bleu", "sacrebleu", "sentences"):
        assert ours[key] == solo[key], key
    assert (work / "generate-test.txt").read_text() == (tmp_path / "solo" / "generate-test.txt").read_text()


# ------------------------------------------------------------------------------ the other writers
def test_every_other_writer_refuses_an_output_in_use(multi30k_bin, tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints["dma"]
    copy = shutil.copy(ckpt, tmp_path / "copy.pt")  # one file given twice is refused before the lock is asked
    cases = [
        (tmp_path / "avg.pt", [MODATTN, "average", "--inputs", ckpt, copy, "--output", tmp_path / "avg.pt"],
         "--output"),
        (tmp_path / "r.json", [MODATTN, "redundancy", multi30k_bin, "--path", ckpt, "--cpu", "--max-batches", "1",
                               "--output", tmp_path / "r.json"], "--output"),
        (tmp_path / "r.png", [MODATTN, "redundancy", multi30k_bin, "--path", ckpt, "--cpu", "--max-batches", "1",
                              "--plot", tmp_path / "r.png"], "--plot"),
        (tmp_path / "p.png", [MODATTN, "plot", "redundancy", multi30k_bin, "--path", ckpt, "--cpu",
                              "--max-batches", "1", "--output", tmp_path / "p.png"], "--output"),
        (tmp_path / "qs", [MODATTN, "quickstart", "--output-dir", tmp_path / "qs", "--data", multi30k_bin,
                           "--max-update", "2", "--cpu"], "--output-dir"),
        (tmp_path / "abl", [MODATTN, "ablate", multi30k_bin, "--output-dir", tmp_path / "abl", "--clusters", "2",
                            "--arch", "dma_transformer_iwslt_de_en_tiny", "--max-epoch", "1", "--cpu"], "--output-dir"),
        (tmp_path / "obj", [sys.executable, REPO / "benchmarks" / "dma_objective.py", "--data", multi30k_bin,
                            "--output-dir", tmp_path / "obj", "--max-update", "2"], "--output-dir"),
        (tmp_path / "half", [sys.executable, REPO / "benchmarks" / "half_precision_train.py", "--data", multi30k_bin,
                             "--output-dir", tmp_path / "half", "--cpu"], "--output-dir"),
    ]
    with held_by_another_process(*[path for path, _, _ in cases]) as pid:
        # each command as its console script (or `python script.py`) calls it, all in one process
        # other than the holder and this one
        results = run_commands([(f"{command[1]}:main", command[2:]) if command[0] == sys.executable
                                else (MODATTN_MAIN, command[1:]) for _, command, _ in cases], cwd=REPO)
        for (path, _, flag), (code, out, err) in zip(cases, results, strict=True):
            one_refusal(code, out, err, pid, f"{flag} {path}")
            assert not path.exists(), path  # nothing written there


def test_a_folder_lock_covers_its_entries_except_for_the_holders_own_children(tmp_path):
    """What lies directly in a held folder is refused to other processes, not to the holder's
    children (a benchmark's fairseq-train writes its --save-dir inside the benchmark's folder)."""
    lock_entry = (LOAD_FOLDER_LOCK + "try:\n    folder_lock.acquire(sys.argv[1], what='--save-dir')\n"
                  "except folder_lock.FolderInUseError as e:\n    sys.exit(f'error: {e}')\nprint('locked')\n")
    entry = tmp_path / "bench" / "dma"
    with folder_lock.exclusive_use(tmp_path / "bench"):
        child = subprocess.run([sys.executable, "-c", lock_entry, entry], capture_output=True, text=True,
                               env=cli_environment(), timeout=300)
        assert child.returncode == 0 and child.stdout.strip() == "locked", child.stderr[-2000:]
    with held_by_another_process(tmp_path / "bench") as pid:
        refused([sys.executable, "-c", lock_entry, entry], pid, f"--save-dir {entry} is in {tmp_path / 'bench'}")
