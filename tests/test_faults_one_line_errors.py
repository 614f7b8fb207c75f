"""Bad input the README promises one error line for (issue 39), each of which ended in a
traceback: ``evaluate --references`` with non-UTF-8 bytes, ``serve --data`` of an empty folder,
``score`` on an empty file, a folder or non-UTF-8 bytes, and ``evaluate ... -- --max-len-b 0``
(fairseq-generate's AssertionError). The real commands run as a user runs them; each must exit
1 with ``PROG: error: ...`` as the only line on stderr besides fairseq's INFO log records."""

import re
import subprocess

import pytest

from conftest import MODATTN, cli_environment

# INFO records, not errors: what importing fairseq 0.12.x may print by itself
# (fairseq.tasks.text_to_speech without tensorboardX) and fairseq's progress log lines
INFO_RECORD = re.compile(r"INFO:fairseq\.|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| ")
LATIN1 = "Ein Mädchen läuft.\n".encode("latin-1")  # ä as the single byte 0xe4


def one_error_line(args, command, status=1, **run):
    """Run ``fairseq-modattn COMMAND ARGS``; its one stderr line (after checking it)."""
    proc = subprocess.run([MODATTN, command, *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=cli_environment(), **run)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not INFO_RECORD.match(line)]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"fairseq-modattn {command}: error: "), lines[0]
    assert proc.returncode == status, (proc.returncode, lines[0])
    return lines[0]


def test_evaluate_references_that_are_not_utf8(multi30k_bin, tiny_checkpoints, tmp_path):
    references = tmp_path / "refs.txt"
    references.write_bytes(b"A man runs.\n" + LATIN1 + b"A dog.\n")
    error = one_error_line([multi30k_bin, "--path", tiny_checkpoints["transformer"], "--subset", "valid",
                            "--references", references, "--output", tmp_path / "out.json"], "evaluate")
    assert f"--references {references}:2: not valid UTF-8" in error and "convert the file to UTF-8" in error, error
    assert not (tmp_path / "out.json").exists()


def test_evaluate_max_len_b_0_after_dashdash(multi30k_bin, tiny_checkpoints, tmp_path):
    error = one_error_line([multi30k_bin, "--path", tiny_checkpoints["transformer"], "--subset", "valid",
                            "--output", tmp_path / "out.json", "--", "--max-len-b", "0"], "evaluate")
    assert "--max-len-b 0" in error and "--min-len 1" in error and "give --max-len-b of at least 1" in error, error


def test_serve_with_an_empty_data_folder(tiny_checkpoints, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    error = one_error_line(["--path", tiny_checkpoints["dma"], "--data", empty, "--port", "0"], "serve")
    assert f"data-bin {empty} holds no dictionaries" in error and "dict.SRC.txt" in error, error


@pytest.mark.parametrize("case", ["empty", "folder", "latin1"])
@pytest.mark.parametrize("flag", ["--ref", "--sys"])
def test_score_on_an_empty_file_a_folder_or_non_utf8(tmp_path, case, flag):
    good = tmp_path / "good.txt"
    good.write_text("a man runs .\na dog .\n", encoding="utf-8")
    bad = tmp_path / "bad"
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "folder":
        bad.mkdir()
    else:
        bad.write_bytes(b"a man runs .\n" + LATIN1)
    files = {"--ref": good, "--sys": good, flag: bad}
    error = one_error_line(["--sys", files["--sys"], "--ref", files["--ref"]], "score")
    expected = {"empty": f"{flag} {bad}: file is empty", "folder": f"{flag} {bad}: is a directory",
                "latin1": f"{flag} {bad}:2: not valid UTF-8"}[case]
    assert expected in error, error


def test_score_on_empty_standard_input(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("a man runs .\n", encoding="utf-8")
    error = one_error_line(["--ref", good], "score", input="")
    assert "standard input" in error and "empty" in error, error
