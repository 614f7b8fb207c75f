"""Several commands run one after another in one child process: ``python commands_in_one_process.py``
reads a JSON list of ``[target, argv]`` from stdin and prints a JSON list of ``{"code", "stdout",
"stderr"}``, one per command, in order.

A target is a console script's function, ``"fairseq_modattn.cli.main:main"``, or a script's,
``"/path/to/benchmarks/dma_objective.py:main"`` (its folder first on ``sys.path``, as ``python
script.py`` has it). Each is called as its console script calls it, ``sys.exit(function(argv))``:
the exit status is the returned value or the ``SystemExit``'s, a ``sys.exit("message")`` prints
its message to stderr with status 1, and any other exception prints its traceback with status 1.
Output is captured at the file descriptors, so log handlers bound to the original streams are
captured too.

Why: a process start costs ~6 s of imports (torch, fairseq) on a 2-core machine. Tests that check
how several commands refuse bad input or a folder in use need a process other than the test's own
(a lock held by the test process would be its own), not one process per command.
"""

import json
import os
import runpy
import sys
import tempfile
import traceback


def function_of(target: str):
    where, name = target.rsplit(":", 1)
    if where.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        return runpy.run_path(where, run_name="commands_in_one_process")[name]
    module = __import__(where, fromlist=[name])
    return getattr(module, name)


def call(target: str, argv: list):
    sys.argv = [target.rsplit(":", 1)[0], *argv]  # a script's argparse names it by its file
    try:
        code = function_of(target)(argv)
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001 - reported as the console script would: a traceback
        traceback.print_exc()
        code = 1
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def captured(target: str, argv: list) -> dict:
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for fd, file in ((1, out), (2, err)):
            os.dup2(file.fileno(), fd)
        try:
            code = call(target, argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        texts = []
        for file in (out, err):
            file.seek(0)
            texts.append(file.read().decode("utf-8", errors="replace"))
    return {"code": code, "stdout": texts[0], "stderr": texts[1]}


def main() -> None:
    commands = json.load(sys.stdin)
    results = [captured(target, [str(a) for a in argv]) for target, argv in commands]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
