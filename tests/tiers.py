"""The suite's three tiers, assigned in one place.

- ``fast``: unit and numerical tests. No process is started and nothing is trained; the tier
  runs in a few minutes on two cores (``python -m pytest -m fast``).
- ``e2e``: end-to-end tests. They run the real ``fairseq-*`` and ``fairseq-modattn`` commands,
  the benchmark scripts, or in-process training, mostly on the shared corpus
  (``python -m pytest -m e2e``).
- ``slow``: on demand only (benchmarks and real-data training); marked by hand with
  ``@pytest.mark.slow`` and left out of the default run by ``addopts``.

A test is ``e2e`` when it can *reach* something that starts a process or trains: a helper
marked with :func:`starts_processes`, :func:`trains` or :func:`needs_shared_corpus`, or the ``subprocess``
module itself. Reaching is decided statically, by following the global names that the test's
code and its fixtures' code refer to, through every function defined in the tests folder. So the
marking lives on the few helpers that do the work, never on the tests that use them.

A test whose *package* code starts processes (a ``workers=2`` pool, say) is out of the walk's
sight: it carries ``@pytest.mark.e2e`` itself. A static walk can also miss a path (a name built
at run time, say). :func:`forbid_processes` closes
that gap: in a ``fast`` test, starting a process fails the test and says which helper to mark.
"""

import os
import subprocess
import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FAST, E2E, SLOW = "fast", "e2e", "slow"
TIERS = (FAST, E2E, SLOW)

_REASON = "__e2e_reason__"


def starts_processes(function):
    """Mark a test helper (function or fixture function) that starts processes."""
    setattr(function, _REASON, f"{function.__name__} starts processes")
    return function


def trains(function):
    """Mark a test helper that trains a model, in-process or not."""
    setattr(function, _REASON, f"{function.__name__} trains a model")
    return function


def needs_shared_corpus(function):
    """Mark a test helper that reads the shared corpus (../shared/data)."""
    setattr(function, _REASON, f"{function.__name__} reads the shared corpus")
    return function


def _defined_in_tests(obj) -> bool:
    """Whether OBJ is a function of the tests folder (this file's own machinery excepted)."""
    code = getattr(obj, "__code__", None)
    if code is None:
        return False
    path = Path(code.co_filename).resolve()
    return path.parent == TESTS and path != Path(__file__).resolve()


def _is_test_helper_module(module) -> bool:
    return Path(getattr(module, "__file__", "") or "").resolve().parent == TESTS


def _code_names(code):
    """Every global or attribute name CODE and the functions nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _unwrap(obj):
    """The plain function behind a bound method, staticmethod or property of a test class."""
    if isinstance(obj, property):
        obj = obj.fget
    return getattr(obj, "__func__", obj)


def e2e_reason(obj, _seen=None):
    """Why OBJ starts processes or trains (a string), or None when nothing it reaches does."""
    _seen = set() if _seen is None else _seen
    obj = _unwrap(obj)
    if id(obj) in _seen:
        return None
    _seen.add(id(obj))
    reason = getattr(obj, _REASON, None)
    if reason:
        return reason
    if obj is subprocess or getattr(obj, "__module__", None) == "subprocess":
        return "uses the subprocess module"
    if isinstance(obj, type):
        # a helper class of the tests: what its methods reach
        methods = [member for member in vars(obj).values() if _defined_in_tests(_unwrap(member))]
        return next(filter(None, (e2e_reason(method, _seen) for method in methods)), None)
    if not _defined_in_tests(obj):
        return None
    names = _code_names(obj.__code__)
    scope = obj.__globals__
    for name in names:
        target = scope.get(name)
        if target is None:
            continue
        if isinstance(target, types.ModuleType) and _is_test_helper_module(target):
            # a helper module of the tests: follow the attributes this code names
            members = (getattr(target, attribute, None) for attribute in names)
            reason = next(filter(None, (e2e_reason(m, _seen) for m in members if m is not None)), None)
        else:  # the subprocess module itself, or a function, class or fixture
            reason = e2e_reason(target, _seen)
        if reason:
            return reason
    return None


def item_e2e_reason(item):
    """Why the test ITEM is end-to-end: its own code or one of its fixtures' reaches a helper."""
    reason = e2e_reason(item.obj)
    if reason:
        return reason
    for name in item.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            reason = e2e_reason(fixturedef.func)
            if reason:
                return f"fixture {name}: {reason}"
    return None


def assign(items):
    """Give every collected test exactly one tier marker; return {tier: count}."""
    counts = dict.fromkeys(TIERS, 0)
    for item in items:
        if item.get_closest_marker(SLOW):
            tier = SLOW
        elif item.get_closest_marker(E2E) or item_e2e_reason(item):
            tier = E2E
        else:
            tier = FAST
        if tier != SLOW:
            item.add_marker(getattr(pytest.mark, tier))
        counts[tier] += 1
    return counts


class ProcessInFastTier(AssertionError):
    pass


_FAST_TIER_MESSAGE = (
    "a test of the fast tier started a process: mark the test helper that starts it with "
    "@tiers.starts_processes (tests/tiers.py), so that its tests move to the e2e tier"
)


def forbid_processes(monkeypatch) -> list:
    """Make starting a process (subprocess, fork, spawn) fail the running test.

    Returns the list of refused starts (a description of each), which the caller checks after
    the test: code that catches the error and carries on (joblib counting the cores with
    ``lscpu``, say) must still fail its test."""
    refused = []

    def refuse(*args, **kwargs):
        command = next((a for a in args if isinstance(a, (list, tuple, str, bytes))), None)
        refused.append(repr(command) if command is not None else "a fork")
        raise ProcessInFastTier(_FAST_TIER_MESSAGE)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    return refused


def refused_starts_message(refused: list) -> str:
    """The failure of a fast test whose code swallowed the refusal of REFUSED starts."""
    return f"{_FAST_TIER_MESSAGE} (refused, and the error caught by the code under test: {', '.join(refused)})"
