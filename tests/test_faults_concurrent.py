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

A lock is asked of the kernel, never decided from a recorded pid (which a killed run may have
left to an unrelated process), it is met through every path to its folder (a bind mount, a
rename), it needs no writable parent, and a folder's lock and a lock anywhere inside the folder
refuse each other in either order. Those cases meet light holders (``folder_lock.py`` loaded
alone), and a real ``fairseq-train`` where the issue names one.
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

import tiers
from conftest import MODATTN, MODATTN_MAIN, REPO, cli_environment, fairseq_cli, run_cli, run_commands, tiny_train_args
from fairseq_modattn import folder_lock
from fairseq_modattn.data.steps import Steps
from test_faults_outputs import prepare_argv, synthetic_raw, tree


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_environment(), **kwargs)


@tiers.starts_processes  # the walk of tiers.py does not see through contextmanager's wrapper
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


@tiers.starts_processes
@contextlib.contextmanager
def held_by_another_process(*paths: Path, prefix=()):
    """A real process holding the package's locks of PATHS (as a first command would); its pid.
    PREFIX: a command that runs it (``unshare ...``), which must exec it (the pid is the holder's)."""
    code = (LOAD_FOLDER_LOCK + "import time\nfor path in sys.argv[1:]:\n    folder_lock.acquire(path)\n"
            "print('held', flush=True)\ntime.sleep(600)\n")
    with running([*prefix, sys.executable, "-c", code, *paths]) as proc:
        assert proc.stdout.readline().strip() == "held", proc.stderr.read()
        yield proc.pid


def refused_here(path: Path, what: str, *needles) -> None:
    """Locking PATH in this process (not the holder's descendant) fails with one line holding
    every NEEDLE; a lock it got by mistake is released at once."""
    with pytest.raises(folder_lock.FolderInUseError) as caught:
        with folder_lock.exclusive_use(path, what=what):
            pass
    message = str(caught.value)
    assert "\n" not in message and all(str(needle) in message for needle in needles), message


#: a light process locking argv[1] as fairseq-train locks its --save-dir: prints ``locked``, or
#: exits with the one error line
LOCK_SAVE_DIR = (LOAD_FOLDER_LOCK + "try:\n    folder_lock.acquire(sys.argv[1], what='--save-dir')\n"
                 "except folder_lock.FolderInUseError as e:\n    sys.exit(f'error: {e}')\nprint('locked')\n")


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
    lock_entry = LOCK_SAVE_DIR
    entry = tmp_path / "bench" / "dma"
    with folder_lock.exclusive_use(tmp_path / "bench"):
        child = subprocess.run([sys.executable, "-c", lock_entry, entry], capture_output=True, text=True,
                               env=cli_environment(), timeout=300)
        assert child.returncode == 0 and child.stdout.strip() == "locked", child.stderr[-2000:]
    with held_by_another_process(tmp_path / "bench") as pid:
        refused([sys.executable, "-c", lock_entry, entry], pid, f"--save-dir {entry} is in {tmp_path / 'bench'}")


# ------------------------------------------------------------------------------ what a lock is
def test_a_folder_and_anything_inside_it_refuse_each_other_at_any_depth_in_either_order(tmp_path):
    """Not only a folder's direct entries: a lock three levels down refuses the folder (and the
    folders between), the folder's lock refuses anything three levels down; the holder's own
    children stay exempt at any depth."""
    with held_by_another_process(tmp_path / "F" / "a" / "b" / "c") as pid:
        for outer in (tmp_path / "F", tmp_path / "F" / "a"):
            refused_here(outer, "--output-dir", f"--output-dir {outer} is in use by pid {pid} (",
                         "which writes inside it")
        with folder_lock.exclusive_use(tmp_path / "F" / "a" / "other"):  # beside it: no conflict
            pass
    with held_by_another_process(tmp_path / "G") as pid:
        refused_here(tmp_path / "G" / "a" / "b" / "c", "--save-dir",
                     f"is in {tmp_path / 'G'}, which is in use by pid {pid}")
    deep = tmp_path / "bench" / "dma" / "seed1" / "checkpoints"
    with folder_lock.exclusive_use(tmp_path / "bench"):
        child = subprocess.run([sys.executable, "-c", LOCK_SAVE_DIR, deep], capture_output=True, text=True,
                               env=cli_environment(), timeout=300)
        assert child.returncode == 0 and child.stdout.strip() == "locked", child.stderr[-2000:]


def test_evaluate_first_then_a_training_into_the_checkpoints_folder_is_refused(multi30k_bin, tmp_path):
    """``evaluate --path ck/checkpoint_last.pt`` writes its work dir ``ck/evaluation``; a
    ``fairseq-train --save-dir ck`` started after it ran before (only the reverse order was
    refused). The holder holds the work dir as evaluate does; the training is the real one."""
    ck = tmp_path / "ck"
    ck.mkdir()
    with held_by_another_process(ck / "evaluation") as pid:
        refused([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("dma"), "--max-update", "1",
                 "--save-dir", ck], pid, f"--save-dir {ck}", "which writes inside it")
        assert sorted(p.name for p in ck.iterdir()) == [".evaluation.lock"]  # no checkpoint, no dummy
        trained = tmp_path / "trained"
        with held_by_another_process(trained) as trainer:  # the order that was refused already
            refused_here(trained / "evaluation", "--work-dir", f"is in {trained}, which is in use by pid {trainer}")


def test_a_stale_lock_file_naming_a_live_unrelated_process_holds_nothing(tmp_path):
    """A killed run's lock file names its pid; once that pid is another process's (a reused
    pid), the folder is still free: ``evaluate --output D/r.json`` (its output and work dir in D)
    was refused as in D, in use by that process."""
    folder = tmp_path / "D"
    folder.mkdir()
    with running(["sleep", "600"]) as unrelated:
        folder_lock.lock_file(folder).write_text(f"{unrelated.pid} fairseq-train data-bin --save-dir {folder}\n")
        assert folder_lock.current_holder(folder) is None
        with folder_lock.exclusive_use(folder / "r.json", what="--output"), \
                folder_lock.exclusive_use(folder / "r.work", what="--work-dir"):
            assert folder_lock.current_holder(folder / "r.json") == os.getpid()
        with folder_lock.exclusive_use(folder, what="--output-dir"):  # the stale file itself is taken over
            assert folder_lock.current_holder(folder) == os.getpid()


def test_a_folder_is_locked_by_its_identity_so_a_renamed_folder_is_still_held(tmp_path):
    """Two paths, one folder (one st_dev and st_ino), without mounting anything: a folder renamed
    while a run holds it is still that run's under its new name (as a bind mount is)."""
    ck, moved = tmp_path / "ck", tmp_path / "moved"
    ck.mkdir()
    with held_by_another_process(ck) as pid:
        ck.rename(moved)
        assert folder_lock.current_holder(moved) == pid
        refused_here(moved, "--save-dir", f"--save-dir {moved} is in use by pid {pid}")
        refused_here(moved / "evaluation", "--work-dir", f"is in {moved}, which is in use by pid {pid}")
    assert not list(moved.iterdir())


def test_two_trainings_through_a_bind_mount_of_the_save_dir_are_refused(tmp_path):
    """``mount --bind ck ck2``: a training into ck2 while one writes ck is refused (in a user and
    mount namespace of its own: ``unshare -rm``, where this machine lets a user mount)."""
    ck, ck2 = tmp_path / "ck", tmp_path / "ck2"
    ck.mkdir()
    ck2.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("mounting is not allowed here (no unshare to mount in a namespace of its own); the identity "
                    "itself is tested by the renamed folder")
    probe = subprocess.run(["unshare", "-rm", "mount", "--bind", ck, ck2], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"mounting is not allowed here (unshare -rm mount --bind: {probe.stderr.strip()[:200]}); "
                    "the identity itself is tested by the renamed folder")
    bind_then_lock = f'mount --bind "$1" "$2" && exec "{sys.executable}" -c "$0" "$2"'
    with held_by_another_process(ck) as pid:
        refused(["unshare", "-rm", "sh", "-c", bind_then_lock, LOCK_SAVE_DIR, ck, ck2], pid,
                f"--save-dir {ck2} is in use by pid {pid}")


def test_a_save_dir_writable_inside_a_read_only_parent_is_locked_not_refused(tmp_path):
    """No lock file can sit beside it: the folder's own lock holds it, and a second run is still
    refused. As root, who may write anywhere, the runs are another user in a user namespace."""
    parent, save = tmp_path / "shared", tmp_path / "shared" / "ck"
    save.mkdir(parents=True)
    parent.chmod(0o555)
    prefix = ["unshare", "--map-user=1000", "--map-group=1000"] if os.geteuid() == 0 else []
    try:
        if prefix and (shutil.which("unshare") is None
                       or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0):
            pytest.skip("running as root, who writes into a read-only folder, and a user namespace to run as "
                        "another user is not allowed here")
        with held_by_another_process(save, prefix=prefix) as pid:
            refused([*prefix, sys.executable, "-c", LOCK_SAVE_DIR, save], pid, f"--save-dir {save} is in use by")
        assert sorted(p.name for p in parent.iterdir()) == ["ck"]
    finally:
        parent.chmod(0o755)
