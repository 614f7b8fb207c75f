"""Fault tests of data loss and ``prepare``: an output path
that is a directory, a --dest that prepare did not create, litter and orphans after kill -9,
raw paths that are directories, unwritable folders, and a UTF-8 byte-order mark.

The corpus is a tiny synthetic Multi30k raw folder (60/10/10 pairs), so a full ``prepare``
takes a few seconds; the commands run in-process through ``cli.main.main`` unless a test
needs to kill one.
"""

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MODATTN, cli_environment
from fairseq_modattn import data
from fairseq_modattn.atomic_files import atomic_path
from fairseq_modattn.cli.main import main
from fairseq_modattn.data.readers import read_lines

WORDS = "der die das haus katze hund baum stadt fluss berg auto zug licht wasser feuer".split()
SIZES = {"train": 60, "val": 10, "test_2016_flickr": 10}
FLAGS = ["--bpe-size", "30", "--no-download"]


def synthetic_raw(raw: Path, bom: bool = False) -> Path:
    """Multi30k's six raw .gz files with short synthetic sentences (BOM: each starts with U+FEFF)."""
    raw.mkdir(parents=True, exist_ok=True)
    for stem, n in SIZES.items():
        for lang in ("de", "en"):
            lines = [" ".join(WORDS[(i * 7 + k * 3 + len(lang)) % len(WORDS)] for k in range(3 + i % 5))
                     for i in range(n)]
            text = ("\ufeff" if bom else "") + "\n".join(lines) + "\n"
            (raw / f"{stem}.{lang}.gz").write_bytes(gzip.compress(text.encode("utf-8")))
    return raw


def prepare_argv(raw: Path, dest: Path, *extra):
    return ["prepare", "multi30k", "--raw-dir", str(raw), "--dest", str(dest), *FLAGS, *extra]


def one_line_error(capsys, rc: int, *needles):
    """Assert a failed command printed exactly one stderr line holding every NEEDLE."""
    err = capsys.readouterr().err.strip()
    assert rc not in (0, None), err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert str(needle) in err, err
    return err


def tree(root: Path):
    """{relative path: bytes} of every file under ROOT."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def litter(root: Path):
    """Temporaries of the pipeline (``.NAME.tmp-*``, ``.NAME.old-*``, nested ``..NAME...``)."""
    return sorted(str(p) for p in root.rglob("*")
                  if ".tmp-" in p.name or ".old-" in p.name or p.name.startswith(".."))


# ------------------------------------------------------------- item 1: output path is a directory

def test_output_path_that_is_a_directory_is_refused_and_kept(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    for i in range(1, 12):
        torch.save({"model": {"w": torch.full((2,), float(i))}, "args": None,
                    "extra_state": {"epoch": i}}, ck / f"checkpoint_{i}_{i * 10}.pt")
    before = tree(ck)
    rc = main(["average", "--inputs", str(ck), "--num-update-checkpoints", "3", "--output", str(ck)])
    one_line_error(capsys, rc, "fairseq-modattn average: error: --output", str(ck), "is a directory")
    assert tree(ck) == before

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine\n")
    rc = main(["evaluate", str(tmp_path / "no-data"), "--checkpoint-dir", str(ck), "--num-update-checkpoints",
               "3", "--output", str(out)])
    one_line_error(capsys, rc, "fairseq-modattn evaluate: error: --output", str(out), "is a directory")
    default_output = ck / "evaluation" / "results.json"  # evaluate's default, WORK_DIR/results.json
    default_output.mkdir(parents=True)
    (default_output / "keep.txt").write_text("mine\n")
    rc = main(["evaluate", str(tmp_path / "no-data"), "--checkpoint-dir", str(ck), "--num-update-checkpoints", "3"])
    one_line_error(capsys, rc, "fairseq-modattn evaluate: error: --output", str(default_output), "is a directory")
    assert (default_output / "keep.txt").read_text() == "mine\n"
    ckpt = str(ck / "checkpoint_11_110.pt")
    rc = main(["redundancy", str(tmp_path / "no-data"), "--path", ckpt, "--output", str(out)])
    one_line_error(capsys, rc, "fairseq-modattn redundancy: error: --output", str(out), "is a directory")
    rc = main(["redundancy", str(tmp_path / "no-data"), "--path", ckpt, "--plot", str(out)])
    one_line_error(capsys, rc, "fairseq-modattn redundancy: error: --plot", str(out), "is a directory")
    png = tmp_path / "fig.png"
    png.mkdir()
    rc = main(["plot", "redundancy", str(tmp_path / "no-data"), "--path", ckpt, "--output", str(png)])
    one_line_error(capsys, rc, "fairseq-modattn plot: error: --output", str(png), "is a directory")

    raw = synthetic_raw(tmp_path / "raw")
    rc = main(prepare_argv(raw, tmp_path / "bin", "--summary-json", str(out)))
    one_line_error(capsys, rc, "--summary-json", str(out), "is a directory")
    assert not (tmp_path / "bin").exists() and not (tmp_path / "bin.work").exists()  # refused at start
    assert tree(out) == {"keep.txt": b"mine\n"}

    # the library call itself never replaces a directory with a file
    with pytest.raises(IsADirectoryError, match="is a directory"):
        with atomic_path(out) as tmp:
            tmp.write_text("{}")
    assert tree(out) == {"keep.txt": b"mine\n"} and litter(tmp_path) == []


# ------------------------------------------------------------- item 2: --dest prepare did not make

@pytest.mark.e2e  # prepare runs fairseq-preprocess in a process (tests/tiers.py)
def test_prepare_refuses_foreign_dest_and_keeps_user_files(tmp_path, capsys):
    raw = synthetic_raw(tmp_path / "raw")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "NOTES.txt").write_text("do not delete\n")
    rc = main(prepare_argv(raw, notes))
    one_line_error(capsys, rc, f"--dest {notes}", "not created by")
    assert tree(notes) == {"NOTES.txt": b"do not delete\n"} and not (tmp_path / "notes.work").exists()

    parent = tmp_path / "data-bin"
    for name in ("a", "b"):
        (parent / name).mkdir(parents=True)
        (parent / name / "dict.de.txt").write_text(f"{name} 1\n")
    before = tree(parent)
    rc = main(prepare_argv(raw, parent))
    one_line_error(capsys, rc, f"--dest {parent}")
    assert tree(parent) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(prepare_argv(raw, empty)) == 0  # an empty folder is fine
    capsys.readouterr()
    (empty / "NOTES.txt").write_text("my notes on this data-bin\n")
    dict_before = (empty / "dict.de.txt").read_bytes()
    assert main(prepare_argv(raw, empty)) == 0  # fully skipped rerun
    assert main(prepare_argv(raw, empty, "--bpe-size", "40")) == 0  # "[binarize] running" again
    err = capsys.readouterr().err
    assert "[binarize] running" in err, err
    assert (empty / "NOTES.txt").read_text() == "my notes on this data-bin\n"
    assert (empty / "dict.de.txt").read_bytes() != dict_before and (empty / "train.de-en.de.bin").is_file()
    assert litter(tmp_path) == []

    # another corpus's data-bin is refused
    before = tree(empty)
    rc = main(["prepare", "iwslt14", "--raw-dir", str(raw), "--dest", str(empty), "--no-download"])
    one_line_error(capsys, rc, f"--dest {empty}", "multi30k")
    assert tree(empty) == before


# ---------------------------------------------------- item 3: kill -9: nested temporaries, orphans

KILL_IN_BPE = """
import os, sys
import subword_nmt.learn_bpe
def die(infile, outfile, *args, **kwargs):
    outfile.write("#version: 0.2\\n")
    outfile.flush()
    os._exit(9)  # as if killed with SIGKILL while learning BPE: no finally block runs
subword_nmt.learn_bpe.learn_bpe = die
from fairseq_modattn import data
data.prepare("multi30k", sys.argv[1:])
"""


def _children(pid: int, needle: str):
    """Pids of the live processes whose parent is PID and whose command line holds NEEDLE."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and needle in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _kill(pid: int, group: bool = False):
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, needs PR_SET_PDEATHSIG")
def test_kill_9_leaves_no_orphan_and_a_rerun_no_litter(tmp_path):
    raw = synthetic_raw(tmp_path / "raw")
    dest = tmp_path / "bin"
    argv = ["--raw-dir", str(raw), "--dest", str(dest), *FLAGS]
    env = cli_environment()

    # killed while learning BPE: the temporary must not nest (..code.tmp-PID.tmp-PID)
    proc = subprocess.run([sys.executable, "-c", KILL_IN_BPE, *argv], capture_output=True, text=True,
                          timeout=120, env=env, start_new_session=True)
    assert proc.returncode == 9, proc.stderr
    assert not [p for p in litter(tmp_path) if Path(p).name.startswith("..")], litter(tmp_path)

    # the main process killed with SIGKILL while fairseq-preprocess runs: the child dies too
    main_proc = subprocess.Popen([MODATTN, "prepare", "multi30k", *argv], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    child = None
    try:
        deadline = time.monotonic() + 120
        while child is None and time.monotonic() < deadline and main_proc.poll() is None:
            found = _children(main_proc.pid, "fairseq_cli.preprocess")
            child = found[0] if found else None
            time.sleep(0.02)
        assert child is not None, f"no fairseq-preprocess child seen (exit {main_proc.poll()})"
        os.kill(main_proc.pid, signal.SIGKILL)
        main_proc.wait(timeout=30)
        deadline = time.monotonic() + 3
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "fairseq-preprocess kept running after its parent was killed"
    finally:
        _kill(main_proc.pid, group=True)
        main_proc.wait(timeout=30)
        if child is not None and _alive(child):
            _kill(child)

    # a rerun finishes the data-bin and removes every temporary of the killed runs
    data.prepare("multi30k", argv)
    assert litter(tmp_path) == []
    assert (dest / "dict.de.txt").is_file() and (dest / "test.de-en.en.idx").is_file()


# ------------------------------------------- item 9: raw path is a folder, unwritable destinations

def _unwritable_dir(tmp_path: Path) -> Path:
    """A folder this process cannot create files in (a chmod 555 one; as root, /sys)."""
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    for cand in (ro, Path("/sys")):
        try:
            probe = cand / f"probe-{os.getpid()}"
            probe.mkdir()
        except OSError:
            return cand
        probe.rmdir()
    pytest.skip("no unwritable folder available (root on a writable /sys?)")


def test_raw_directory_and_unwritable_dest_fail_at_start_in_one_line(tmp_path, capsys):
    raw = synthetic_raw(tmp_path / "raw")
    (raw / "train.en.gz").unlink()
    (raw / "train.en.gz").mkdir()
    rc = main(prepare_argv(raw, tmp_path / "bin"))
    one_line_error(capsys, rc, str(raw / "train.en.gz"), "is a directory, expected a file")
    (raw / "train.en.gz").rmdir()
    synthetic_raw(raw)

    ro = _unwritable_dir(tmp_path)
    try:
        work = tmp_path / "work"
        rc = main(prepare_argv(raw, ro / "bin", "--work-dir", str(work)))
        one_line_error(capsys, rc, f"--dest {ro / 'bin'}", "not writable")
        assert not (work / "tok").exists()  # refused before any work
        rc = main(prepare_argv(raw, tmp_path / "bin", "--work-dir", str(ro / "work")))
        one_line_error(capsys, rc, f"--work-dir {ro / 'work'}", "not writable")
        assert not (tmp_path / "bin").exists()
    finally:
        (tmp_path / "read-only").chmod(0o755)


# --------------------------------------------------------------------- item 10: byte-order mark

@pytest.mark.e2e  # prepare runs fairseq-preprocess in a process (tests/tiers.py)
def test_utf8_byte_order_mark_is_stripped(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffeins zwei\n\ufeffdrei\n".encode("utf-8"))
    assert read_lines(tmp_path / "a.txt") == ["eins zwei", "\ufeffdrei"]  # only at the file's start
    (tmp_path / "a.gz").write_bytes(gzip.compress("\ufeffeins\n".encode("utf-8")))
    assert read_lines(tmp_path / "a.gz") == ["eins"]

    raw = synthetic_raw(tmp_path / "raw", bom=True)
    dest = tmp_path / "bin"
    data.prepare("multi30k", ["--raw-dir", str(raw), "--dest", str(dest), *FLAGS])
    for path in [*(dest.parent / "bin.work").rglob("*.de"), *(dest.parent / "bin.work").rglob("*.en"),
                 dest / "dict.de.txt", dest / "dict.en.txt"]:
        assert "\ufeff" not in path.read_text(encoding="utf-8"), path


# ------------------------------------------------------------- a command's section of a page
def test_marked_section_replaces_only_its_section(tmp_path):
    """``write_marked_section``: a missing page is created with the section alone; a page with the
    markers keeps every byte outside them; a page without them (or a folder) is refused and kept."""
    from fairseq_modattn.atomic_files import check_marked_section, write_marked_section

    page = tmp_path / "results.md"
    write_marked_section(page, "report", "first\n")
    begin, end = page.read_text().splitlines()[0], page.read_text().splitlines()[-1]
    assert page.read_text() == f"{begin}\nfirst\n{end}\n" and begin.startswith("<!-- report: begin")

    page.write_text(f"# My notes\n\nbefore\n{begin}\nfirst\n{end}\nafter, by hand\n")
    write_marked_section(page, "report", "second\nline")
    assert page.read_text() == f"# My notes\n\nbefore\n{begin}\nsecond\nline\n{end}\nafter, by hand\n"
    assert litter(tmp_path) == []

    for text in ("# a page of someone else's\n", f"{end}\n{begin}\n", f"{begin}\n{begin}\n{end}\n"):
        page.write_text(text)
        for call in (lambda: check_marked_section(page, "report"),
                     lambda: write_marked_section(page, "report", "third")):
            with pytest.raises(FileExistsError, match="has no 'report' section"):
                call()
        assert page.read_text() == text
    with pytest.raises(FileExistsError, match="is a directory"):
        write_marked_section(tmp_path, "report", "x")
