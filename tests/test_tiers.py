"""tests/tiers.py, the one place that gives each test its tier: what it finds, what it misses,
and the guard that makes a miss fail."""

import subprocess
import sys

import pytest

import tiers
from conftest import run_cli


def _plain_arithmetic():
    return sum(range(3))


def _runs_a_command():
    return run_cli([sys.executable, "-c", "pass"])


def _calls_a_helper_that_runs_a_command():
    return _runs_a_command()


def _starts_a_process_itself():
    return subprocess.run([sys.executable, "-c", "pass"], check=True)


@tiers.trains
def _trains():
    return "trained"


class _Helpers:
    def method(self):
        return _trains()


def _uses_a_helper_class():
    return _Helpers().method()


def test_a_test_reaching_no_marked_helper_has_no_e2e_reason():
    assert tiers.e2e_reason(_plain_arithmetic) is None


@pytest.mark.parametrize("function, reason", [
    (_runs_a_command, "run_cli starts processes"),
    (_calls_a_helper_that_runs_a_command, "run_cli starts processes"),
    (_starts_a_process_itself, "uses the subprocess module"),
    (_trains, "_trains trains a model"),
    (_uses_a_helper_class, "_trains trains a model"),
])
def test_marked_helpers_are_found_through_calls_and_classes(function, reason):
    assert tiers.e2e_reason(function) == reason


def test_every_collected_test_has_exactly_one_tier(request):
    names = set(tiers.TIERS)
    for item in request.session.items:
        found = {mark.name for mark in item.iter_markers() if mark.name in names}
        assert len(found) == 1, f"{item.nodeid} has the tiers {sorted(found)}"


@pytest.mark.parametrize("fixture, reason", [
    ("multi30k_dir", "shared_corpus reads the shared corpus"),
    ("multi30k_bin", "run_cli starts processes"),
    ("tiny_checkpoints", "run_cli starts processes"),
])
def test_the_corpus_and_model_fixtures_are_e2e(request, fixture, reason):
    (fixturedef,) = request._fixturemanager.getfixturedefs(fixture, request.node)
    assert tiers.e2e_reason(fixturedef.func) == reason


def test_a_fast_test_that_starts_a_process_fails_naming_the_fix(monkeypatch):
    tiers.forbid_processes(monkeypatch)
    with pytest.raises(tiers.ProcessInFastTier, match="@tiers.starts_processes"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_a_refused_start_that_the_code_swallows_is_still_recorded(monkeypatch):
    """joblib counts the physical cores with ``lscpu`` and falls back on a failure: the guard's
    record, which conftest checks after each fast test, still holds the refused start."""
    refused = tiers.forbid_processes(monkeypatch)
    try:
        subprocess.run(["lscpu", "--parse=core"], capture_output=True)
    except tiers.ProcessInFastTier:
        pass
    assert refused == [repr(["lscpu", "--parse=core"])]
    message = tiers.refused_starts_message(refused)
    assert "@tiers.starts_processes" in message and "the error caught by the code under test: ['lscpu'" in message
