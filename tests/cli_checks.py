"""Checks that every model family's CLI tests make through the real fairseq commands.

``logged`` reads fairseq's simple-format log lines; ``check_resume`` stops a run half-way and
restarts the same command, which must reload the checkpoint and reproduce the uninterrupted
run's logged values; ``check_generate_test_set`` runs ``fairseq-generate`` (beam 5) over the
300-sentence test split and checks every sentence is translated once and a BLEU line printed.
"""

import re

import pytest

from conftest import PLUGIN, fairseq_cli, run_cli


def logged(output, kind):
    """{num_updates: {key: value}} of fairseq's simple-format 'train_inner' or 'valid' lines."""
    rows = {}
    for line in output.splitlines():
        if f"| {kind} |" not in line:
            continue
        pairs = dict(re.findall(r"(\w+)[=\s]([-\d.e+]+)(?:,|$|\s\|)", line.split(f"| {kind} |", 1)[1]))
        if "num_updates" in pairs:
            rows[int(float(pairs["num_updates"]))] = {k: float(v) for k, v in pairs.items()}
    return rows


def check_resume(train, data, save_dir, uninterrupted_output, stop: int, end: int, keys=("loss",), extra=()):
    """``train(data, save_dir, *args)`` to ``stop`` updates, then again to ``end``: the second
    run must load the checkpoint at ``stop`` and log the uninterrupted run's ``keys``."""
    reference = logged(uninterrupted_output, "train_inner")
    train(data, save_dir, "--max-update", str(stop), *extra)
    _, out = train(data, save_dir, "--max-update", str(end), *extra)
    assert "Loaded checkpoint" in out and f"@ {stop} updates" in out, out[-3000:]
    resumed = logged(out, "train_inner")
    steps = list(range(stop + 1, end + 1))
    assert sorted(resumed) == steps, out[-3000:]
    for step in steps:
        for key in keys:
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-3, abs=2e-3), (step, key)


def check_generate_test_set(data, checkpoint, sentences: int = 300) -> str:
    """fairseq-generate, beam 5, on the test split: every sentence translated once, BLEU printed."""
    _, out = run_cli([
        fairseq_cli("fairseq-generate"), data, "--user-dir", PLUGIN, "--path", checkpoint,
        "--beam", "5", "--remove-bpe", "--batch-size", "64", "--cpu", "--max-len-b", "20", "--gen-subset", "test",
    ])
    hypotheses = [line for line in out.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == sentences, f"{len(hypotheses)} of {sentences} test sentences translated"
    assert len({line.split("\t")[0] for line in hypotheses}) == sentences
    assert re.search(r"Generate test with beam=5: BLEU4 = [\d.]+", out), out[-2000:]
    return out
