"""benchmarks/multi30k.py --status and the lock that keeps two benchmark processes out of one
directory (benchmarks/run_progress.py), on directories laid out as fairseq_modattn/cli/runs.py
leaves them, with fairseq-train logs whose times give a known speed."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, cli_environment

SCRIPT = REPO / "benchmarks" / "multi30k.py"


@pytest.fixture()
def progress():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import run_progress

        yield run_progress
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def epoch(when, updates):
    return f"2026-11-26 {when} | INFO | train | epoch 001 | loss 5.1 | nll_loss 4.2 | wps 2000 | ups 0.5 | num_updates {updates} | train_wall 200 | wall 9\n"


START = "2026-11-26 09:00:00 | INFO | fairseq_cli.train | {'_name': None, 'common': {}}\n"
INNER = "2026-11-26 13:00:00 | INFO | train_inner | epoch 005:  3 / 100 loss=4.9, num_updates=212, wall=5\n"
VALID = "2026-11-26 13:00:00 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 3.25 | nll_loss 2.5 | ppl 5.7\n"


def test_seconds_per_update_is_the_median_over_epochs_of_one_process(progress, tmp_path):
    log = tmp_path / "train.log"
    # 2 s/update, then a restart (the 3 hours between the processes are not training), then 4 and
    # 5 s/update: the median is 4
    log.write_text(START + epoch("10:00:00", 100) + epoch("10:03:20", 200)
                   + START + epoch("13:00:00", 300) + epoch("13:06:40", 400) + epoch("13:15:00", 500))
    assert progress.seconds_per_update([log]) == pytest.approx(4.0)
    assert progress.seconds_per_update([]) is None
    (tmp_path / "one.log").write_text(START + epoch("10:00:00", 100))
    assert progress.seconds_per_update([tmp_path / "one.log"]) is None  # one epoch gives no span

    run = tmp_path / "run"
    assert progress.run_state(run, 400).state == "not started"
    run.mkdir()
    (run / "train.log").write_text(START + epoch("10:00:00", 100) + INNER)
    state = progress.run_state(run, 400)
    assert (state.state, state.updates, state.updates_left) == ("training", 212, 188)
    (run / "train.done").write_text("{}")
    assert progress.run_state(run, 400).state == "trained" and progress.run_state(run, 400).updates_left == 0
    (run / "evaluation").mkdir()
    (run / "evaluation" / "results.json").write_text("{}")
    assert progress.run_state(run, 400).state == "trained"  # the redundancy is still to measure
    (run / "redundancy.json").write_text("{}")
    assert progress.run_state(run, 400).state == "done"


def status(data, out, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--output-dir", str(out),
                           "--models", "dma", "--seeds", "1", "2", "3", "--max-update", "400", "--jobs", "2",
                           *extra], capture_output=True, text=True, timeout=120, env=cli_environment(), cwd=REPO)


@pytest.fixture()
def data(tmp_path):
    data = tmp_path / "data-bin"
    data.mkdir()
    (data / "dict.de.txt").write_text("")  # --status reads no data; the flag check wants a data-bin
    return data


def test_status_lists_every_run_and_estimates_the_time_left(data, tmp_path):
    out = tmp_path / "bench"
    assert status(data, out, "--status").returncode == 1  # nothing there yet
    assert not out.exists()
    out.mkdir()
    (out / "settings.json").write_text("{}")
    done = out / "dma" / "seed1"
    (done / "evaluation").mkdir(parents=True)
    (done / "train.log").write_text(START + epoch("10:00:00", 200) + epoch("10:06:40", 400) + VALID)
    for marker in ("train.done", "redundancy.json"):
        (done / marker).write_text("{}")
    (done / "evaluation" / "results.json").write_text(json.dumps({"sacrebleu": 31.234}))
    (out / "dma" / "seed2").mkdir()
    (out / "dma" / "seed2" / "train.log").write_text(START + epoch("11:00:00", 100) + epoch("11:03:20", 200))

    proc = status(data, out, "--status")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{out}: 1 of 3 runs done; no benchmark process is working on it",
        "  dma seed 1: done, sacreBLEU 31.23, valid nll 2.500",
        "  dma seed 2: training, update 200 of 400 in its train.log",
        "  dma seed 3: not started",
        # 2 and 2 s/update: (200 + 400) updates x 2 s over 2 runs at a time
        "Left: 600 updates; about 10 min at 2 runs at a time, at the seconds per update measured in this "
        "directory (dma 2.00 s).",
    ]
    assert sorted(p.name for p in out.iterdir()) == ["dma", "settings.json"]  # --status writes nothing


def test_a_directory_in_use_is_refused_and_named_by_status(progress, data, tmp_path):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "settings.json").write_text('{"mine": 1}')
    with progress.exclusive_use(out):
        assert progress.holder(out) == str(os.getpid())
        proc = status(data, out)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        message = proc.stderr.strip()
        assert message.startswith(f"multi30k benchmark: error: --output-dir {out} is in use by pid {os.getpid()} ("), \
            message
        assert message.endswith("(--status shows where it stands)") and "\n" not in message, message
        assert json.loads((out / "settings.json").read_text()) == {"mine": 1}  # nothing was touched
        proc = status(data, out, "--status")
        assert proc.returncode == 0 and f"a benchmark process (pid {os.getpid()}) is working on it" in proc.stdout
    assert progress.holder(out) is None  # released with the block (or the process)
