"""The fairseq commands the package starts never outlive the command that started them
(``fairseq_modattn/child_processes.py``): a parent killed with SIGKILL takes its children with it,
and SIGTERM ends a resumable command as Ctrl-C does, after stopping its children, without
starting the runs still queued.

Each test runs a small parent script in its own process, whose children are long sleeps that
write their pid into a folder; every pid recorded is killed at the end whatever happens.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, cli_environment

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

#: a child: records its pid, then sleeps far longer than any test
SLEEPER = "import os, sys, time; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close(); time.sleep(600)"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; its parent (here: init, after the parent's death) has not reaped it yet
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.fixture
def pids(tmp_path):
    """The folder children record their pids in; they are all killed at the end."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    for entry in folder.iterdir():
        try:
            os.kill(int(entry.name), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def start_parent(script: str, pids: Path) -> subprocess.Popen:
    """The parent script, its stderr in a file (``stderr_of``): a pipe would be inherited by a
    child that outlives it, and reading it to its end would then wait for that child."""
    with open(pids.parent / "parent.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(pids)], cwd=REPO,
                                env=cli_environment(), stdout=subprocess.DEVNULL, stderr=err)


def stderr_of(pids: Path) -> str:
    return (pids.parent / "parent.err").read_text()


def stop(parent: subprocess.Popen):
    parent.kill()
    parent.wait()


def recorded(pids: Path):
    return sorted(int(p.name) for p in pids.iterdir())


def test_children_die_with_a_killed_parent(pids):
    parent = start_parent(f"""
        import sys, time
        from fairseq_modattn import child_processes
        child_processes.start([sys.executable, "-c", {SLEEPER!r}, sys.argv[1]])
        time.sleep(600)
    """, pids)
    try:
        assert wait_until(lambda: len(recorded(pids)) == 1), stderr_of(pids)
        parent.kill()  # no finally, no handler of the parent runs
        parent.wait(30)
        child = recorded(pids)[0]
        assert wait_until(lambda: not alive(child)), f"child {child} outlived its SIGKILLed parent"
    finally:
        stop(parent)


def test_sigterm_ends_a_resumable_command_like_ctrl_c(pids):
    """Two runs at a time out of four: SIGTERM stops both running children, the two queued runs
    never start, and the command ends with the 'rerun to continue' line and status 130."""
    parent = start_parent(f"""
        import sys
        from fairseq_modattn import child_processes
        from fairseq_modattn.cli import runs

        def one(item):
            with child_processes.running([sys.executable, "-c", {SLEEPER!r}, sys.argv[1]]) as proc:
                proc.wait()
            return item

        sys.exit(runs.resumable_command("demo", lambda: runs.run_concurrently(one, range(4), 2) and 0))
    """, pids)
    try:
        assert wait_until(lambda: len(recorded(pids)) == 2), stderr_of(pids)
        children = recorded(pids)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 130, stderr_of(pids)
        assert stderr_of(pids).strip() == \
            "demo: interrupted; finished steps are kept, rerun the same command to continue"
        assert wait_until(lambda: not any(alive(pid) for pid in children))
        time.sleep(1)
        assert recorded(pids) == children, "a queued run started after SIGTERM"
    finally:
        stop(parent)


def _sleep_until_killed(ready):
    ready.set()
    time.sleep(600)


def _blocked_signals(status: str) -> set:
    """The signals blocked in a process, from the SigBlk line of its /proc/PID/status."""
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.e2e  # forks the test's process (tests/tiers.py: process starts the walk cannot see)
def test_a_process_forked_under_the_handler_dies_by_sigterm_quietly(pids, capfd):
    """A process forked while ``stopping_on_sigterm``'s handler is installed (the Moses
    tokeniser's Pool workers in ``prepare``, whose ``terminate()`` sends them SIGTERM) ends by the
    signal: it neither inherits the handler, which raised KeyboardInterrupt in the worker
    ('Process ForkPoolWorker-3: Traceback ... raise KeyboardInterrupt'), nor stops the fairseq
    processes its parent started. A command started meanwhile gets SIGTERM unblocked."""
    import multiprocessing

    from fairseq_modattn import child_processes

    context = multiprocessing.get_context("fork")
    with child_processes.stopping_on_sigterm():
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the handler is in place
        sibling = child_processes.start([sys.executable, "-c", SLEEPER, str(pids)])
        ready = context.Event()
        worker = context.Process(target=_sleep_until_killed, args=(ready,))
        worker.start()
        try:
            assert ready.wait(30)
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(30)
            status = child_processes.start(["cat", "/proc/self/status"], stdout=subprocess.PIPE, text=True)
            blocked = _blocked_signals(status.communicate(timeout=30)[0])
            child_processes.finished(status)
            sibling_alive = sibling.poll() is None
        finally:
            if worker.is_alive():
                worker.kill()
                worker.join()
            sibling.kill()
            sibling.wait()
            child_processes.finished(sibling)
    err = capfd.readouterr().err
    assert worker.exitcode == -signal.SIGTERM, f"the worker ended with {worker.exitcode}:\n{err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert sibling_alive, "the forked worker stopped its parent's child"
    assert signal.SIGTERM not in blocked


def test_sigterm_stops_the_multi30k_benchmark_and_its_fairseq_train(multi30k_bin, tmp_path):
    """The real thing: benchmarks/multi30k.py stopped by SIGTERM while fairseq-train runs ends
    with status 130, and no fairseq-train is left writing into the run's folder."""
    out = tmp_path / "bench"
    command = [sys.executable, str(REPO / "benchmarks" / "multi30k.py"), "--data", str(multi30k_bin),
               "--output-dir", str(out), "--models", "transformer", "--seeds", "1", "--max-update", "100000",
               "--jobs", "1", "--train-args", "--max-tokens 1000 --num-workers 0"]
    err_path = tmp_path / "bench.err"
    with open(err_path, "w") as err:
        parent = subprocess.Popen(command, cwd=REPO, env=cli_environment(), stdout=subprocess.DEVNULL, stderr=err)
    save_dir = str(out / "transformer" / "seed1" / "checkpoints")

    def trainers():
        found = subprocess.run(["pgrep", "-f", save_dir], capture_output=True, text=True).stdout.split()
        return [int(pid) for pid in found if int(pid) != parent.pid]

    try:
        # fairseq-train has started (its log has lines) before the signal
        log = out / "transformer" / "seed1" / "train.log"
        assert wait_until(lambda: log.exists() and log.stat().st_size > 0, timeout=120), err_path.read_text()
        assert trainers()
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(60) == 130, err_path.read_text()[-3000:]
        assert "interrupted; finished runs are kept, rerun the same command to continue" in err_path.read_text()
        assert wait_until(lambda: not trainers()), f"fairseq-train outlived the benchmark: {trainers()}"
    finally:
        stop(parent)
        for pid in trainers():
            os.kill(pid, signal.SIGKILL)
