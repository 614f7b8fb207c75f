"""The help of every ``fairseq-modattn`` command: each default shown once, no "(default: None)"
noise, and no tensorboardX notice (compat fix 1, compat/tensorboardx_notice.py) before a help or
a one-line error.

The notice is logged while fairseq is imported, so it is looked for in fresh interpreters: the
console script itself (``fairseq-modattn -h`` and a few argument errors), and one interpreter
that imports the package as the console script does and prints every command's help. fairseq
logs it only when tensorboardX cannot be imported, and the test extra installs tensorboardX, so
these interpreters run with a stand-in ``tensorboardX`` package first on PYTHONPATH that fails
to import (``hidden_tensorboardx``).
"""

import argparse
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from conftest import MODATTN, cli_environment

# Every command of cli.main.COMMANDS, every plot kind, every prepare corpus, and `flags --arch A
# --all` of every architecture of the package: their help texts, as JSON on stdout.
HELP_SCRIPT = r"""
import contextlib, io, json, sys
from fairseq_modattn.cli import main as cli
from fairseq_modattn.cli.analyze import PLOT_KINDS
from fairseq_modattn import data

commands = [["-h"]] + [[name, "-h"] for name in cli.COMMANDS]
commands += [["plot", kind, "-h"] for kind in PLOT_KINDS]
commands += [["prepare", corpus, "-h"] for corpus in data.RECIPES]
commands += [["flags", "--arch", arch, "--all"] for arch in cli.plugin_architectures()]
helps = {}
for argv in commands:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main(argv)
        except SystemExit:
            pass
    helps[" ".join(argv)] = out.getvalue()
json.dump(helps, sys.__stdout__)
"""

NOTICE = re.compile(r"tensorboardx", re.IGNORECASE)


def run(args, env=None):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300,
                          env=env or cli_environment())
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def hidden_tensorboardx(tmp_path_factory):
    """The environment of a command that cannot import tensorboardX, installed or not."""
    folder = tmp_path_factory.mktemp("no_tensorboardx")
    (folder / "tensorboardX").mkdir()
    (folder / "tensorboardX" / "__init__.py").write_text('raise ImportError("tensorboardX hidden by the test")\n')
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return cli_environment(PYTHONPATH=path)


@pytest.fixture(scope="module")
def helps(hidden_tensorboardx):
    """{command line: its help text}, and what that interpreter wrote to stderr."""
    code, out, err = run([sys.executable, "-c", HELP_SCRIPT], env=hidden_tensorboardx)
    assert code == 0, err[-3000:]
    return json.loads(out), err


def option_entries(help_text: str):
    """The entries of a help text: each option or positional argument with its help (an entry
    starts on a line indented by exactly two spaces), and each paragraph at the margin."""
    entries, current = [], []
    for line in help_text.splitlines():
        if re.match(r"^(  )?\S", line) and current:
            entries.append(" ".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    if current:
        entries.append(" ".join(current))
    return entries


def test_every_command_has_a_help(helps):
    texts, _ = helps
    # the commands, plot kinds, corpora and architectures the script found
    assert {"-h", "evaluate -h", "redundancy -h", "plot clusters -h", "ablate -h", "quickstart -h", "serve -h",
            "prepare multi30k -h"} <= set(texts)
    assert any(k.startswith("flags --arch dma_transformer") for k in texts)
    empty = [command for command, text in texts.items() if len(text.strip()) < 100]
    assert not empty, f"no help printed by: {empty}"


def test_no_option_states_its_default_twice(helps):
    texts, _ = helps
    doubled = [
        f"fairseq-modattn {command}: {entry}"
        for command, text in texts.items() for entry in option_entries(text)
        if len(re.findall(r"\(default\b", entry)) > 1
    ]
    assert not doubled, "defaults printed twice:\n" + "\n".join(doubled)


def test_no_empty_default_notes(helps):
    """"(default: None)" of an unset option, "(default: False)" of a flag, "(default: )" of an
    empty string tell nothing (help_format.py leaves them out)."""
    texts, _ = helps
    noise = [
        f"fairseq-modattn {command}: {entry}"
        for command, text in texts.items() for entry in option_entries(text)
        if re.search(r"\(default: (None|False|)\)", entry)
    ]
    assert not noise, "empty default notes:\n" + "\n".join(noise)


def test_helps_print_no_tensorboardx_notice(helps):
    texts, err = helps
    assert not NOTICE.search(err), err[-2000:]
    assert not re.search(r"\| INFO \||^INFO:", err, re.MULTILINE), err[-2000:]
    assert not [command for command, text in texts.items() if NOTICE.search(text)]


def test_fairseq_itself_logs_the_notice(hidden_tensorboardx):
    """The behaviour fix 1 corrects, seen in the same setting (else the tests here prove nothing)."""
    from fairseq_modattn.compat import tensorboardx_notice

    if not tensorboardx_notice._logs_tensorboardx_notice():
        pytest.skip("the installed fairseq does not log the tensorboardX notice")
    code, _, err = run([sys.executable, "-c", "import fairseq"], env=hidden_tensorboardx)
    assert code == 0, err
    assert "Please install tensorboardX" in err


def test_console_script_help_has_no_notice(hidden_tensorboardx):
    code, out, err = run([MODATTN, "-h"], env=hidden_tensorboardx)
    assert code == 0, err
    assert out.startswith("fairseq-modattn: helpers around fairseq's own commands"), out[:300]
    assert "``" not in out  # the docstring's reST markup is not shown
    assert err == "", err


@pytest.mark.parametrize("argv, error", [
    (["evaluate"], "fairseq-modattn evaluate: error: the following arguments are required"),
    (["plot", "rim", "--dpi", "x"], "fairseq-modattn plot rim: error: argument --dpi: invalid int value"),
    (["prepare", "no-such-corpus"], "fairseq-modattn prepare: unknown corpus 'no-such-corpus'"),
])
def test_argument_errors_are_one_line_without_notice(argv, error, hidden_tensorboardx):
    code, out, err = run([MODATTN, *argv], env=hidden_tensorboardx)
    assert code == 2, (out, err)
    assert not NOTICE.search(out + err), err
    assert err.strip().splitlines()[-1].startswith(error), err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- the formatter
def formatted(formatter_class, *arguments):
    parser = argparse.ArgumentParser(prog="p", formatter_class=formatter_class)
    for args, kwargs in arguments:
        parser.add_argument(*args, **kwargs)
    return " ".join(parser.format_help().split())


def test_formatter_shows_each_default_once_and_only_when_it_tells_something():
    from fairseq_modattn.help_format import DefaultsHelpFormatter

    text = formatted(
        DefaultsHelpFormatter,
        (["--beam"], dict(type=int, default=5, help="beam size")),
        (["--layer"], dict(type=int, default=None, help="layer (default: the last)")),
        (["--batches"], dict(type=int, default=None, help="stop after this many batches")),
        (["--cpu"], dict(action="store_true", help="on the CPU")),
        (["--extra"], dict(default="", help="more flags, e.g. '--max-len-b 50'")),
        (["--models"], dict(nargs="+", default=["transformer", "dma"], help="models")),
        (["--rate"], dict(default="5%", help="a rate")),
        (["--subset"], dict(default="test", help="the split (default: test)")),
        (["--out"], dict(required=True, help="output file")),
    )
    assert "beam size (default: 5)" in text
    assert "layer (default: the last) --batches" in text
    assert "stop after this many batches --cpu" in text
    assert "on the CPU --extra" in text
    assert "e.g. '--max-len-b 50' --models" in text  # no "(default: )", the flag not split at a hyphen
    assert "models (default: transformer dma)" in text
    assert "a rate (default: 5%)" in text
    assert text.count("(default: test)") == 1
    assert "output file" in text and "(default: None)" not in text


def test_arch_formatter_names_an_architecture_value_its_help_does_not():
    from fairseq_modattn.help_format import ArchDefaultsHelpFormatter

    text = formatted(
        ArchDefaultsHelpFormatter,
        (["--th-attention"], dict(default="enc_self", help="types (default: enc_self, the paper's best place)")),
        (["--init"], dict(default="xavier", help="'xavier' (default; soft) or 'spread'")),
        (["--heads"], dict(default=4, help="heads (default: h)")),
        (["--clusters"], dict(default=8, help="clusters")),
    )
    assert "the paper's best place) --init" in text  # its own note names the value: nothing appended
    assert "or 'spread' --heads" in text
    assert "heads (default: h) (this architecture: 4)" in text
    assert "clusters (default: 8)" in text


def test_the_filter_drops_the_notice_only():
    """compat fix 1: on fairseq's text_to_speech logger, the notice goes and nothing else."""
    import logging

    from fairseq_modattn.compat import tensorboardx_notice

    log = logging.getLogger("fairseq.tasks.text_to_speech")
    if tensorboardx_notice._logs_tensorboardx_notice():
        assert sum(isinstance(f, tensorboardx_notice.DropTensorboardXNotice) for f in log.filters) == 1

    def record(message, name="fairseq.tasks.text_to_speech"):
        return logging.LogRecord(name, logging.INFO, __file__, 1, message, None, None)

    drop = tensorboardx_notice.DropTensorboardXNotice()
    assert not drop.filter(record("Please install tensorboardX: pip install tensorboardX"))
    assert drop.filter(record("loading speech data"))
    assert drop.filter(record("Please install tensorboardX: pip install tensorboardX", name="elsewhere"))


ROOT_LOGGER_STATE = "import logging; r = logging.getLogger(); print(r.level, len(r.handlers))"


def test_importing_the_plugin_leaves_the_root_logger_alone():
    """compat fix 2: fairseq's import sets the root logger to DEBUG with a stderr handler
    (wav2vec2_classification.py), so a script importing the plugin printed every library's debug
    records; after ``import fairseq_modattn`` the root logger is as Python left it, and a debug
    record of another library prints nothing."""
    code, out, err = run([sys.executable, "-c", "import fairseq_modattn; " + ROOT_LOGGER_STATE +
                          "; logging.getLogger('matplotlib').debug('font search')"])
    assert code == 0, err
    assert out.split() == [str(logging.WARNING), "0"] and "font search" not in err, (out, err)


def test_fairseq_itself_sets_the_root_logger_to_debug():
    """The behaviour fix 2 corrects (else the test above proves nothing), and fix 2 leaves a root
    logger alone that fairseq configured before the plugin was imported."""
    code, out, err = run([sys.executable, "-c", "import importlib.util, pathlib; print(pathlib.Path("
                          "importlib.util.find_spec('fairseq.models.wav2vec.wav2vec2_classification').origin)"
                          ".read_text())"])
    if "basicConfig(level=logging.DEBUG)" not in out:
        pytest.skip("the installed fairseq does not set the root logger to DEBUG")
    for imports in ("import fairseq", "import fairseq, fairseq_modattn"):
        code, out, err = run([sys.executable, "-c", f"{imports}; {ROOT_LOGGER_STATE}"])
        assert code == 0, err
        assert out.split() == [str(logging.DEBUG), "1"], (imports, out)
