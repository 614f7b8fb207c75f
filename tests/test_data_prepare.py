"""Data preparation: the shared pipeline and the Multi30k / IWSLT14 recipes on real-format input.

IWSLT14 runs on a de-en.tgz assembled here in the archive's layout from the real IWSLT XML dev
files of ../shared/data/iwslt16-de-en-dev (renamed) and a small synthetic train.tags file with
metadata lines and planted too-long / bad-ratio / empty pairs; Multi30k runs on the real raw
files of ../shared/data/multi30k with a small training subset.
"""

import gzip
import io
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO
from fairseq_modattn import data
from fairseq_modattn.atomic_files import _write_lines_now, load_json, write_lines
from fairseq_modattn.data import iwslt14, subwords
from fairseq_modattn.data.downloads import RawFile, fetch_raw_files
from fairseq_modattn.data.errors import DataError
from fairseq_modattn.data.moses import clean_corpus, tokenize
from fairseq_modattn.data.readers import count_lines, read_lines, read_parallel, read_segments, strip_metadata
from fairseq_modattn.data.steps import Steps

# ------------------------------------------------------------------------------------- helpers

WORDS_DE = "der die das haus katze hund baum stadt fluss berg auto zug licht wasser feuer".split()
WORDS_EN = "the a house cat dog tree city river mountain car train light water fire sky".split()
METADATA = ["<url>http://www.ted.com/talks/x.html</url>", "<keywords>talks, science</keywords>",
            "<speaker>Some Speaker</speaker>", "<talkid>{}</talkid>", "<title>Title {}</title>",
            "<description>TED Talk Subtitles and Transcript: a talk.</description>",
            "<reviewer></reviewer>", "<translator></translator>"]


def sentence(words, i, n):
    return " ".join(words[(i * 7 + k * 3) % len(words)] for k in range(n))


def synthetic_train_tags():
    """(de lines, en lines, expected kept pairs, planted drops) in train.tags format."""
    de, en, kept = [], [], []
    planted = {"too_long": 0, "bad_ratio": 0, "too_short": 0}
    for i in range(240):
        if i % 40 == 0:  # a new talk: metadata lines on both sides (same count)
            meta = [m.format(i) for m in METADATA]
            de += meta
            en += [m.replace("talks, science", "talks") for m in meta]
        n = 3 + i % 9
        s, t = sentence(WORDS_DE, i, n), sentence(WORDS_EN, i, n + (i % 2))
        if i in (17, 101, 199):  # 176 tokens: too long (max 175)
            s, t = sentence(WORDS_DE, i, 176), sentence(WORDS_EN, i, 170)
            planted["too_long"] += 1
        elif i in (31, 77, 150, 222):  # ratio 16/10 > 1.5
            s, t = sentence(WORDS_DE, i, 10), sentence(WORDS_EN, i, 16)
            planted["bad_ratio"] += 1
        elif i in (60, 61):  # an empty side
            t = ""
            planted["too_short"] += 1
        elif i == 90:  # boundaries that are kept: 175 tokens, ratio exactly 1.5
            s, t = sentence(WORDS_DE, i, 175), sentence(WORDS_EN, i, 175)
        elif i == 91:
            s, t = sentence(WORDS_DE, i, 10), sentence(WORDS_EN, i, 15)
        if i % 5 == 0:  # upper case: the recipe lower-cases
            s, t = s.capitalize(), t.capitalize()
        de.append(s)
        en.append(t)
        if not any(i in g for g in ((17, 101, 199), (31, 77, 150, 222), (60, 61))):
            kept.append((s.lower(), t.lower()))
    return de, en, kept, planted


def cut_xml(path: Path, keep: int) -> bytes:
    """The real XML file with only its first KEEP <seg> lines (same format)."""
    out, n = [], 0
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if "<seg" in line:
            n += 1
            if n > keep:
                continue
        out.append(line)
    return "".join(out).encode("utf-8")


TEST_CUTS = {"IWSLT14.TED.tst2010": ("TED.dev2010", 30), "IWSLT14.TED.tst2011": ("TEDX.dev2012", 20),
             "IWSLT14.TED.tst2012": ("TED.dev2010", 10)}


def build_archive(iwslt_dir: Path, path: Path, train=None, omit=(), prefix="de-en/"):
    de, en, _, _ = synthetic_train_tags() if train is None else (*train, None, None)
    members = {"train.tags.de-en.de": ("\n".join(de) + "\n").encode(),
               "train.tags.de-en.en": ("\n".join(en) + "\n").encode()}
    for lang in ("de", "en"):
        for talks in ("TED.dev2010", "TEDX.dev2012"):
            source = iwslt_dir / f"IWSLT16.{talks}.de-en.{lang}.xml"
            members[f"IWSLT14.{talks}.de-en.{lang}.xml"] = source.read_bytes()
        for name, (stem, keep) in TEST_CUTS.items():
            members[f"{name}.de-en.{lang}.xml"] = cut_xml(iwslt_dir / f"IWSLT16.{stem}.de-en.{lang}.xml", keep)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in sorted(members.items()):
            if name in omit:
                continue
            info = tarfile.TarInfo(prefix + name)
            info.size = len(blob)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(blob))
    return path


def n_segs(path: Path) -> int:
    return sum("<seg" in line for line in path.read_text(encoding="utf-8").splitlines())


def tree_bytes(root: Path):
    """{relative path: bytes} of every file under ROOT except step markers; paths normalised."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".steps" not in p.parts:
            out[str(p.relative_to(root))] = p.read_bytes().replace(str(root).encode(), b"ROOT")
    return out


def leftovers(root: Path):
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


IWSLT_FLAGS = ["--bpe-size", "400", "--no-download"]


def run_iwslt(root: Path, archive: Path, *extra):
    return data.prepare("iwslt14", ["--archive", str(archive), "--dest", str(root / "bin"),
                                    "--raw-dir", str(root / "raw"), *IWSLT_FLAGS, *extra])


@pytest.fixture(scope="module")
def iwslt_run(iwslt_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("iwslt")
    archive = build_archive(iwslt_dir, root / "de-en.tgz")
    summary = run_iwslt(root, archive)
    return root, archive, summary


# ------------------------------------------------------------------------------------ pipeline

def test_read_lines_errors(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path / "none.txt")) + ".*not found"):
        read_lines(tmp_path / "none.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt: file is empty"):
        read_lines(tmp_path / "empty.txt")
    (tmp_path / "bad.txt").write_bytes("eins\nzwei\ndr\xc3\xa4i \xe4\nvier\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"bad\.txt:3: not valid UTF-8"):
        read_lines(tmp_path / "bad.txt")
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"bad\.gz"):
        read_lines(tmp_path / "bad.gz")
    # U+2028 stays inside its line; CRLF is a line end; .gz is read transparently
    with gzip.open(tmp_path / "ok.gz", "wb") as f:
        f.write("a\u2028b\r\nc\n".encode())
    assert read_lines(tmp_path / "ok.gz") == ["a\u2028b", "c"]


def test_read_parallel_mismatch_names_both_files(tmp_path):
    write_lines(tmp_path / "a.de", ["x", "y", "z"])
    write_lines(tmp_path / "a.en", ["x", "y"])
    with pytest.raises(DataError) as e:
        read_parallel(tmp_path / "a.de", tmp_path / "a.en")
    assert f"3 lines in {tmp_path / 'a.de'}" in str(e.value) and f"2 lines in {tmp_path / 'a.en'}" in str(e.value)


def test_segments_and_metadata(iwslt_dir):
    segs = read_segments(iwslt_dir / "IWSLT16.TED.dev2010.de-en.en.xml")
    assert len(segs) == n_segs(iwslt_dir / "IWSLT16.TED.dev2010.de-en.en.xml") == 887
    assert segs[0].startswith("You know, one of the intense") and not segs[0].endswith(" ")
    assert all("<" not in s for s in segs)
    lines = ["<url>u</url>", " <talkid>1</talkid>", "Hallo Welt .", "<title>T</title>", "</doc>", "x <b>"]
    assert strip_metadata(lines) == ["Hallo Welt .", "x <b>"]


def test_clean_corpus_like_moses():
    src = ["a b c", "a", "", " ".join("w" * 1 for _ in range(176)), "a b", "a b c d e f"]
    tgt = ["a b c", "a b", "x", "y", "a b c", "a b c d"]
    s, t, st = clean_corpus(src, tgt, ratio=1.5, min_len=1, max_len=175)
    assert s == ["a b c", "a b", "a b c d e f"] and t == ["a b c", "a b c", "a b c d"]
    assert (st.too_short, st.too_long, st.bad_ratio, st.kept) == (1, 1, 1, 3)


@pytest.mark.e2e  # the tokeniser's worker pool starts processes (tests/tiers.py)
def test_tokenize_workers_and_dashes():
    lines = [f"Hello, world-wide \"thing\" & co. number {i}!" for i in range(2500)]
    one = tokenize(lines, "en", lower=True, aggressive_dash_splits=True)
    assert one[0] == "hello , world @-@ wide &quot; thing &quot; &amp; co. number 0 !"
    assert tokenize(lines, "en", lower=True, aggressive_dash_splits=True, workers=2) == one


def test_steps_resume_and_interrupt(tmp_path):
    steps = Steps(tmp_path / "work", log=lambda m: None)
    write_lines(tmp_path / "in.txt", ["a", "b"])
    calls = []

    def copy(out):
        calls.append(1)
        _write_lines_now(out, read_lines(tmp_path / "in.txt") * 2)

    def broken(out):
        out.write_text("half")
        raise RuntimeError("killed")

    assert steps.run("copy", [tmp_path / "out.txt"], copy, inputs=[tmp_path / "in.txt"])
    assert not steps.run("copy", [tmp_path / "out.txt"], copy, inputs=[tmp_path / "in.txt"])
    write_lines(tmp_path / "in.txt", ["a", "c"])  # a changed input reruns the step
    assert steps.run("copy", [tmp_path / "out.txt"], copy, inputs=[tmp_path / "in.txt"])
    (tmp_path / "out.txt").write_text("truncated")  # a changed output reruns it too
    assert steps.run("copy", [tmp_path / "out.txt"], copy, inputs=[tmp_path / "in.txt"])
    assert len(calls) == 3 and read_lines(tmp_path / "out.txt") == ["a", "c", "a", "c"]
    with pytest.raises(RuntimeError, match="killed"):
        steps.run("other", [tmp_path / "other.txt"], broken)
    assert not (tmp_path / "other.txt").exists() and not steps.marker("other").exists()
    assert leftovers(tmp_path) == []
    (tmp_path / ".other.txt.tmp-99999").write_text("left by a process killed with SIGKILL")
    assert steps.run("other", [tmp_path / "other.txt"], copy)
    assert leftovers(tmp_path) == [] and read_lines(tmp_path / "other.txt") == ["a", "c", "a", "c"]


def test_fetch_raw_files_offline_message(tmp_path):
    files = [RawFile("a.tgz", url="http://127.0.0.1:9/a.tgz"), RawFile("b.gz", url="http://127.0.0.1:9/b.gz")]
    (tmp_path / "b.gz").write_bytes(b"12345")
    with pytest.raises(DataError) as e:
        fetch_raw_files(files, tmp_path, download=True, log=lambda m: None)
    msg = str(e.value)
    assert str(tmp_path / "a.tgz") in msg and "http://127.0.0.1:9/a.tgz" in msg and "b.gz" not in msg
    assert not (tmp_path / "a.tgz").exists() and leftovers(tmp_path) == []
    with pytest.raises(DataError, match="has 5 bytes, expected 6"):
        fetch_raw_files([RawFile("b.gz", size=6)], tmp_path, download=False)
    assert fetch_raw_files([RawFile("b.gz", size=5)], tmp_path) == {"b.gz": tmp_path / "b.gz"}


def test_fetch_raw_files_downloads_and_checks(tmp_path):
    """A real HTTP download (a local server): progress, size/sha256 check, atomic file."""
    import functools
    import hashlib
    import http.server
    import threading

    served = tmp_path / "served"
    served.mkdir()
    blob = gzip.compress(b"ein satz\n" * 5000)
    (served / "train.de.gz").write_bytes(blob)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/train.de.gz"
    raw = tmp_path / "raw"
    try:
        with pytest.raises(DataError, match="sha256 differs"):
            fetch_raw_files([RawFile("train.de.gz", url=url, sha256="0" * 64)], raw, log=lambda m: None)
        assert not (raw / "train.de.gz").exists() and leftovers(tmp_path) == []
        good = RawFile("train.de.gz", url=url, size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
        assert fetch_raw_files([good], raw, log=lambda m: None) == {"train.de.gz": raw / "train.de.gz"}
        assert (raw / "train.de.gz").read_bytes() == blob and read_lines(raw / "train.de.gz")[0] == "ein satz"
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------- IWSLT14

def test_iwslt14_split_sizes_and_cleaning(iwslt_run, iwslt_dir):
    root, _, summary = iwslt_run
    _, _, kept, planted = synthetic_train_tags()
    n_valid = len(kept) // 23
    test_size = n_segs(iwslt_dir / "IWSLT16.TED.dev2010.de-en.en.xml") + n_segs(
        iwslt_dir / "IWSLT16.TEDX.dev2012.de-en.en.xml") + sum(k for _, k in TEST_CUTS.values())
    assert summary.sentences == {"train": len(kept) - n_valid, "valid": n_valid, "test": test_size}
    assert summary.dropped == planted
    tok = root / "bin.work" / "tok"
    assert read_lines(tok / "valid.de") == [s for s, _ in kept[22::23]]
    assert read_lines(tok / "train.en") == [t for i, (_, t) in enumerate(kept) if i % 23 != 22]
    test_en = read_lines(tok / "test.en")
    first = read_segments(iwslt_dir / "IWSLT16.TED.dev2010.de-en.en.xml")[0]
    assert test_en[0] == tokenize([first], "en", lower=True)[0]
    assert test_en[887] == tokenize(read_segments(iwslt_dir / "IWSLT16.TEDX.dev2012.de-en.en.xml")[:1],
                                    "en", lower=True)[0]
    assert all(s == s.lower() for s in test_en)
    bpe_train = read_lines(root / "bin.work" / "bpe" / "train.de")
    assert any("@@ " in s for s in read_lines(root / "bin.work" / "bpe" / "test.de"))
    assert len(bpe_train) == summary.sentences["train"]
    dest = root / "bin"
    for split in ("train", "valid", "test"):
        for lang in ("de", "en"):
            assert (dest / f"{split}.de-en.{lang}.bin").stat().st_size > 0
    assert (dest / "dict.de.txt").read_bytes() == (dest / "dict.en.txt").read_bytes()  # joined
    assert (dest / "code").is_file() and summary.vocab["de"] == count_lines(dest / "dict.de.txt") + 4 > 30
    assert leftovers(root) == []


def test_iwslt14_data_bin_loads_in_fairseq(iwslt_run):
    from fairseq.data import Dictionary, data_utils

    dest = iwslt_run[0] / "bin"
    d = Dictionary.load(str(dest / "dict.de.txt"))
    ds = data_utils.load_indexed_dataset(str(dest / "valid.de-en.de"), d)
    assert len(ds) == iwslt_run[2].sentences["valid"]
    assert d.string(ds[0]) == read_lines(iwslt_run[0] / "bin.work" / "bpe" / "valid.de")[0]


def test_iwslt14_rerun_after_interruption_is_byte_identical(iwslt_run, tmp_path, monkeypatch):
    reference, archive, _ = iwslt_run
    real = subwords.apply_bpe

    def dies_midway(lines, codes):
        out = real(lines, codes)
        if len(out) > 1000:  # the test split: earlier outputs of the step were written already
            raise KeyboardInterrupt("simulated kill in subword-apply")
        return out

    monkeypatch.setattr(subwords, "apply_bpe", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        run_iwslt(tmp_path, archive)
    monkeypatch.setattr(subwords, "apply_bpe", real)
    work = tmp_path / "bin.work"
    steps = Steps(work)
    assert steps.marker("train").exists() and not steps.marker("subword-apply").exists()
    assert not (work / "bpe" / "train.de").exists() and not (tmp_path / "bin").exists()
    assert leftovers(tmp_path) == []
    run_iwslt(tmp_path, archive)
    assert tree_bytes(tmp_path / "bin") == tree_bytes(reference / "bin")
    assert tree_bytes(work) == tree_bytes(reference / "bin.work")
    # a lost marker: that step reruns, the result is the same bytes, later steps stay valid
    steps.marker("test").unlink()
    (work / "tok" / "test.de").write_text("garbage\n")
    run_iwslt(tmp_path, archive)
    assert tree_bytes(work) == tree_bytes(reference / "bin.work")


def test_iwslt14_separate_vocab(iwslt_run, tmp_path):
    _, archive, _ = iwslt_run
    summary = run_iwslt(tmp_path, archive, "--vocab", "separate", "--src-bpe-size", "300",
                        "--tgt-bpe-size", "200")
    dest = tmp_path / "bin"
    assert (dest / "code.de").is_file() and (dest / "code.en").is_file()
    assert summary.vocab["de"] == count_lines(dest / "dict.de.txt") + 4
    assert summary.vocab["en"] == count_lines(dest / "dict.en.txt") + 4
    assert "die" in (dest / "dict.de.txt").read_text() and "die" not in (dest / "dict.en.txt").read_text()
    assert (dest / "dict.de.txt").read_bytes() != (dest / "dict.en.txt").read_bytes()


@pytest.mark.parametrize("problem", ["missing member", "not a tar", "mismatched train", "non-utf8"])
def test_iwslt14_bad_input(problem, iwslt_dir, tmp_path):
    archive = tmp_path / "de-en.tgz"
    de, en, _, _ = synthetic_train_tags()
    if problem == "missing member":
        build_archive(iwslt_dir, archive, omit=("IWSLT14.TED.tst2011.de-en.en.xml",))
        pattern = r"de-en\.tgz: not the IWSLT14 de-en archive: it lacks IWSLT14\.TED\.tst2011\.de-en\.en\.xml"
    elif problem == "not a tar":
        archive.write_bytes(b"<html>404 not found</html>")
        pattern = r"de-en\.tgz: not a readable tar archive"
    elif problem == "mismatched train":
        build_archive(iwslt_dir, archive, train=(de, en[:-1]))
        pattern = (r"after removing metadata lines, 240 sentences in .*train\.tags\.de-en\.de "
                   r"but 239 in .*train\.tags\.de-en\.en")
    else:
        de = list(de)
        bad_line = de.index(next(s for s in de if not s.startswith("<"))) + 1
        build_archive(iwslt_dir, archive, train=(de, en))
        raw = archive.read_bytes()
        with tarfile.open(archive) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        members["de-en/train.tags.de-en.de"] = members["de-en/train.tags.de-en.de"].replace(
            de[bad_line - 1].encode(), de[bad_line - 1].encode() + b" \xfc", 1)
        with tarfile.open(archive, "w:gz") as tar:
            for name, blob in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
        assert archive.read_bytes() != raw
        pattern = rf"train\.tags\.de-en\.de:{bad_line}: not valid UTF-8"
    with pytest.raises(DataError, match=pattern):
        run_iwslt(tmp_path, archive)
    assert not (tmp_path / "bin").exists() and leftovers(tmp_path) == []
    work = tmp_path / "bin.work"
    assert not (work / "tok" / "train.de").exists()


def test_iwslt14_offline_message_lists_archive(tmp_path):
    with pytest.raises(DataError) as e:
        data.prepare("iwslt14", ["--raw-dir", str(tmp_path / "raw"), "--dest", str(tmp_path / "bin"),
                                 "--no-download"])
    assert str(tmp_path / "raw" / "de-en.tgz") in str(e.value) and iwslt14.ARCHIVE.url in str(e.value)


# ------------------------------------------------------------------------------------ Multi30k

def test_multi30k_cli_and_script(multi30k_dir, tmp_path):
    """The console command end to end (via the scripts/ wrapper), then a fully skipped rerun."""
    dest = tmp_path / "bin"
    cmd = [str(REPO / "scripts" / "prepare-multi30k.sh"), "--raw-dir", str(multi30k_dir), "--dest", str(dest),
           "--max-train-sentences", "300", "--bpe-size", "300", "--no-download",
           "--summary-json", str(tmp_path / "summary.json")]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sentences: train 300, valid 1,014, test 1,000" in proc.stdout
    summary = load_json(tmp_path / "summary.json")
    assert summary["sentences"] == {"train": 300, "valid": 1014, "test": 1000}
    assert summary["vocab"]["de"] == summary["vocab"]["en"] > 50
    assert (dest / "code").is_file() and (dest / "train.de-en.en.idx").is_file()
    before = tree_bytes(dest)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stderr.count("up to date, skipped") == 4, proc.stderr
    assert tree_bytes(dest) == before


def test_multi30k_sentencepiece_separate(multi30k_dir, tmp_path):
    pytest.importorskip("sentencepiece")
    summary = data.prepare("multi30k", [
        "--raw-dir", str(multi30k_dir), "--dest", str(tmp_path / "bin"), "--max-train-sentences", "400",
        "--subword", "sentencepiece", "--vocab", "separate", "--src-bpe-size", "300", "--tgt-bpe-size", "250",
        "--no-download"])
    assert summary.sentences == {"train": 400, "valid": 1014, "test": 1000}
    assert (tmp_path / "bin" / "spm.de.model").is_file() and (tmp_path / "bin" / "spm.en.model").is_file()
    first = read_lines(tmp_path / "bin.work" / "spm" / "valid.en")[0]
    assert "\u2581" in first and first.replace(" ", "").replace("\u2581", " ").strip() == \
        read_lines(tmp_path / "bin.work" / "tok" / "valid.en")[0]
    assert summary.vocab["en"] <= 250 + 4 + 8


@pytest.mark.parametrize("problem", ["mismatch", "empty", "missing", "non-utf8"])
def test_multi30k_bad_input(problem, multi30k_dir, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    for f in multi30k_dir.glob("*.gz"):
        (raw / f.name).write_bytes(f.read_bytes())
    if problem == "mismatch":
        lines = gzip.decompress((raw / "val.en.gz").read_bytes()).splitlines(keepends=True)
        (raw / "val.en.gz").write_bytes(gzip.compress(b"".join(lines[:-3])))
        pattern = (rf"1014 lines in {re.escape(str(raw / 'val.de.gz'))} "
                   rf"but 1011 lines in {re.escape(str(raw / 'val.en.gz'))}")
    elif problem == "empty":
        (raw / "test_2016_flickr.de.gz").write_bytes(gzip.compress(b""))
        pattern = r"test_2016_flickr\.de\.gz: file is empty"
    elif problem == "missing":
        (raw / "train.en.gz").unlink()
        pattern = r"1 raw file\(s\) missing.*" + re.escape(str(raw / "train.en.gz"))
    else:
        lines = gzip.decompress((raw / "val.de.gz").read_bytes()).splitlines(keepends=True)
        lines[41] = "Ein Mann läuft.\n".encode("latin-1")
        (raw / "val.de.gz").write_bytes(gzip.compress(b"".join(lines)))
        pattern = r"val\.de\.gz:42: not valid UTF-8"
    with pytest.raises(DataError, match=re.compile(pattern, re.S)):
        data.prepare("multi30k", ["--raw-dir", str(raw), "--dest", str(tmp_path / "bin"),
                                  "--max-train-sentences", "50", "--no-download"])
    assert not (tmp_path / "bin").exists() and leftovers(tmp_path) == []
    assert not (tmp_path / "bin.work" / "tok" / "train.de").exists()


def test_prepare_cli_errors_are_clean(tmp_path):
    from fairseq_modattn.cli.main import main

    assert main(["prepare", "nonesuch"]) == 2
    assert main(["prepare", "multi30k", "--raw-dir", str(tmp_path), "--dest", str(tmp_path / "b"),
                 "--no-download"]) == 1
    assert main(["prepare", "--help"]) == 0
