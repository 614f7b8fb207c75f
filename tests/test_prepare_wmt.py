"""The WMT recipes (wmt14_en_de, wmt17_zh_en) end to end on small files in the official layout.

The raw folders are built here: .tgz archives with the official member paths (built with
tarfile) and, for one corpus, the already-extracted files; WMT-style SGM test/dev sets; real
German/English and Chinese/English sentences (jieba segments the Chinese for real), plus
planted bad pairs that the cleaning must drop. The real recipe code runs, including
sacremoses, subword-nmt and fairseq-preprocess; only the archives' published sizes/checksums
are replaced by those of the small archives built here (and a test checks that a wrong size
is refused).
"""

import dataclasses
import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO
from fairseq_modattn import data
from fairseq_modattn.data import wmt14, wmt17
from fairseq_modattn.data.errors import DataError
from fairseq_modattn.data.readers import read_lines

BIN = Path(sys.executable).parent

EN_DE = [
    ("The well-known author wrote a new book.", "Der bekannte Autor schrieb ein neues Buch."),
    ("We need a long-term solution for the energy problem.",
     "Wir brauchen eine langfristige Lösung für das Energieproblem."),
    ("The European Parliament adopted the resolution today.",
     "Das Europäische Parlament hat die Entschließung heute angenommen."),
    ("This is a state-of-the-art method.", "Das ist eine hochmoderne Methode."),
    ("The children played in the garden all afternoon.", "Die Kinder spielten den ganzen Nachmittag im Garten."),
    ("Prices rose by two percent last year.", "Die Preise stiegen im letzten Jahr um zwei Prozent."),
    ("The government's plan was criticised by many experts.",
     "Der Plan der Regierung wurde von vielen Experten kritisiert."),
    ("She took the train to Berlin on Monday.", "Sie nahm am Montag den Zug nach Berlin."),
    ("The committee will meet again next week.", "Der Ausschuss wird nächste Woche wieder tagen."),
    ("Many small companies are facing difficult times.", "Viele kleine Unternehmen stehen vor schwierigen Zeiten."),
]

ZH_EN = [
    ("我们在北京大学学习机器翻译。", "We study machine translation at Peking University."),
    ("中国经济今年增长了百分之七。", "China's economy grew by seven percent this year."),
    ("这个问题需要国际社会的共同努力。", "This problem requires the joint efforts of the international community."),
    ("他昨天去上海参加了一个会议。", "He went to Shanghai yesterday to attend a meeting."),
    ("政府宣布了新的环境保护政策。", "The government announced a new environmental protection policy."),
    ("许多年轻人希望在大城市工作。", "Many young people hope to work in big cities."),
    ("世界银行发表了最新的报告。", "The World Bank published its latest report."),
    ("这家公司的利润大幅下降。", "The company's profits fell sharply."),
]


def numbered(pairs, n, prefix=""):
    """N pairs cycling through PAIRS, each made unique by a number."""
    return [(f"{s[:-1]} {prefix}{i}{s[-1]}", f"{t[:-1]} {prefix}{i}{t[-1]}")
            for i, (s, t) in ((i, pairs[i % len(pairs)]) for i in range(n))]


def sgm(lines, setid, lang, kind):
    tag = "srcset" if kind == "src" else "refset"
    out = [f'<{tag} setid="{setid}" srclang="any" trglang="{lang}">',
           f'<doc sysid="{kind}" docid="doc-1" genre="news" origlang="en">', "<p>"]
    out += [f'<seg id="{i}">{s}</seg>' for i, s in enumerate(lines, 1)]
    out += ["</p>", "</doc>", f"</{tag}>"]
    return "\n".join(out) + "\n"


def make_tgz(path: Path, members: dict):
    """A .tgz at PATH holding MEMBERS {member path: text or bytes}."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            blob = content.encode("utf-8") if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def text(lines):
    return "".join(s + "\n" for s in lines)


def accept_archives(monkeypatch, module, raw: Path):
    """Give the recipe's archive table the size and md5 of the small archives in RAW."""
    for name, archive in list(module.ARCHIVES.items()):
        path = raw / name
        if path.is_file():
            md5 = hashlib.md5(path.read_bytes()).hexdigest()
            monkeypatch.setitem(module.ARCHIVES, name, dataclasses.replace(
                archive, size=path.stat().st_size, sha256=None, md5=md5))


# planted pairs that clean-corpus-n (ratio 1.5, 1..250 tokens) must drop
BAD_RATIO = ("Yes.", "Ja, das ist ganz genau so, wie wir es in der letzten Sitzung des Ausschusses besprochen "
             "und danach schriftlich festgehalten haben, ohne jede Ausnahme.")
TOO_LONG = (" ".join(["word"] * 300), " ".join(["Wort"] * 300))
EMPTY = ("There is no translation of this sentence.", "")


def wmt14_raw(root: Path, extracted_europarl=True):
    """RAW folder: europarl extracted by hand, commoncrawl / nc-v9 / test-full as archives.
    150 pairs per corpus (planted bad pairs in europarl), 12 test sentences."""
    raw = root / "raw"
    raw.mkdir()
    corpora = {}
    europarl = numbered(EN_DE, 150, "e")
    europarl[4:7] = [BAD_RATIO, TOO_LONG, EMPTY]
    corpora["training/europarl-v7.de-en"] = europarl
    corpora["commoncrawl.de-en"] = numbered(EN_DE, 150, "c")
    corpora["training/news-commentary-v9.de-en"] = numbered(EN_DE, 150, "n")
    files = {f"{stem}.{lang}": text(p[k] for p in pairs)
             for stem, pairs in corpora.items() for k, lang in ((0, "en"), (1, "de"))}
    if extracted_europarl:
        (raw / "training").mkdir()
        for lang in ("en", "de"):
            (raw / f"training/europarl-v7.de-en.{lang}").write_text(
                files.pop(f"training/europarl-v7.de-en.{lang}"), encoding="utf-8")
    else:
        make_tgz(raw / "training-parallel-europarl-v7.tgz",
                 {k: files.pop(k) for k in list(files) if k.startswith("training/europarl")})
    make_tgz(raw / "training-parallel-commoncrawl.tgz",
             {k: v for k, v in files.items() if k.startswith("commoncrawl")})
    make_tgz(raw / "training-parallel-nc-v9.tgz",
             {k: v for k, v in files.items() if k.startswith("training/news")})
    test = numbered(EN_DE, 12, "t")
    test[0] = ("The minister’s well-known speech.", "Die bekannte Rede des Ministers.")
    make_tgz(raw / "test-full.tgz", {
        "test-full/newstest2014-deen-src.en.sgm": sgm([s for s, _ in test], "newstest2014", "en", "src"),
        "test-full/newstest2014-deen-ref.de.sgm": sgm([t for _, t in test], "newstest2014", "de", "ref"),
        "test-full/newstest2014-deen-src.de.sgm": "not needed\n",
    })
    newstest2013 = numbered(EN_DE, 20, "d")
    make_tgz(raw / "dev.tgz", {f"dev/newstest2013.{lang}": text(p[k] for p in newstest2013)
                               for k, lang in ((0, "en"), (1, "de"))})
    return raw


def wmt17_raw(root: Path):
    raw = root / "raw"
    raw.mkdir()
    train = numbered(ZH_EN, 80, "")
    train[3] = ("是。", "Yes, that is exactly what the committee discussed at its last meeting and "
                     "recorded in writing afterwards, without any exception whatsoever.")
    make_tgz(raw / "training-parallel-nc-v12.tgz", {
        f"training/news-commentary-v12.zh-en.{lang}": text(p[k] for p in train)
        for k, lang in ((0, "zh"), (1, "en"))})
    dev, test = numbered(ZH_EN, 10, "d"), numbered(ZH_EN, 9, "t")
    make_tgz(raw / "dev.tgz", {
        "dev/newsdev2017-zhen-src.zh.sgm": sgm([s for s, _ in dev], "newsdev2017", "zh", "src"),
        "dev/newsdev2017-zhen-ref.en.sgm": sgm([t for _, t in dev], "newsdev2017", "en", "ref"),
    })
    make_tgz(raw / "test.tgz", {
        "test/newstest2017-zhen-src.zh.sgm": sgm([s for s, _ in test], "newstest2017", "zh", "src"),
        "test/newstest2017-zhen-ref.en.sgm": sgm([t for _, t in test], "newstest2017", "en", "ref"),
    })
    return raw


def binfiles(dest: Path, src: str, tgt: str):
    return {f"{split}.{src}-{tgt}.{lang}.{ext}" for split in ("train", "valid", "test")
            for lang in (src, tgt) for ext in ("bin", "idx")} | {f"dict.{src}.txt", f"dict.{tgt}.txt"}


# ------------------------------------------------------------------------------------ end to end

@pytest.mark.e2e  # prepare runs fairseq-preprocess in a process (tests/tiers.py)
def test_wmt14_end_to_end(tmp_path, monkeypatch, capsys):
    raw = wmt14_raw(tmp_path)
    accept_archives(monkeypatch, wmt14, raw)
    dest = tmp_path / "data-bin" / "wmt14_en_de"
    summary = data.prepare("wmt14_en_de", ["--raw-dir", str(raw), "--dest", str(dest), "--bpe-size", "50",
                                           "--no-download"])
    out = capsys.readouterr().out
    work = tmp_path / "data-bin" / "wmt14_en_de.work"

    # splits: 450 pairs, every 100th (4) -> valid; the 3 planted pairs dropped from train
    assert summary.sentences == {"train": 450 - 4 - 3, "valid": 4, "test": 12}
    assert summary.dropped == {"train bad_ratio": 1, "train too_long": 1, "train too_short": 1}
    assert "wmt14 en-de" in out and "train 443" in out and "dropped pairs: 3" in out
    final_train = (work / "final" / "train.en").read_text(encoding="utf-8")
    assert "word word word" not in final_train and "There is no translation" not in final_train
    valid_en = read_lines(work / "tok" / "valid.en")
    assert [s.split()[-2] for s in valid_en] == ["e99", "c49", "c149", "n99"]  # NR % 100 == 0

    # Moses -a: hyphens split as @-@; test: ’ -> ' then Moses escaping, as fairseq's recipe
    tok_train = (work / "tok" / "train.en").read_text(encoding="utf-8")
    assert "well @-@ known" in tok_train and "state @-@ of @-@ the @-@ art" in tok_train
    test_en = read_lines(work / "tok" / "test.en")
    assert len(test_en) == 12 and test_en[0].startswith("The minister &apos;s well @-@ known")

    # a joined dictionary, the fairseq files, the BPE codes
    assert binfiles(dest, "en", "de") <= {p.name for p in dest.iterdir()}
    assert (dest / "dict.en.txt").read_text() == (dest / "dict.de.txt").read_text()
    assert (dest / "code").is_file() and "@@" in (work / "final" / "train.de").read_text(encoding="utf-8")

    # a rerun skips every step and gives the same summary
    again = data.prepare("wmt14_en_de", ["--raw-dir", str(raw), "--dest", str(dest), "--bpe-size", "50",
                                         "--no-download"])
    assert again.sentences == summary.sentences and "up to date" in capsys.readouterr().err


@pytest.mark.e2e  # prepare runs fairseq-preprocess in a process (tests/tiers.py)
def test_wmt14_newstest2013_valid(tmp_path, monkeypatch):
    raw = wmt14_raw(tmp_path, extracted_europarl=False)
    accept_archives(monkeypatch, wmt14, raw)
    dest = tmp_path / "bin"
    summary = data.prepare("wmt14_en_de", ["--raw-dir", str(raw), "--dest", str(dest), "--bpe-size", "30",
                                           "--valid-set", "newstest2013", "--no-download"])
    assert summary.sentences == {"train": 450 - 3, "valid": 20, "test": 12}


@pytest.mark.e2e  # prepare runs fairseq-preprocess in a process (tests/tiers.py)
def test_wmt17_end_to_end(tmp_path, monkeypatch, capsys):
    raw = wmt17_raw(tmp_path)
    accept_archives(monkeypatch, wmt17, raw)
    dest = tmp_path / "data-bin" / "wmt17_zh_en"
    summary = data.prepare("wmt17_zh_en", ["--raw-dir", str(raw), "--dest", str(dest),
                                           "--src-bpe-size", "60", "--tgt-bpe-size", "40", "--no-download"])
    out = capsys.readouterr().out
    work = tmp_path / "data-bin" / "wmt17_zh_en.work"
    assert summary.sentences == {"train": 79, "valid": 10, "test": 9}
    assert summary.dropped == {"train bad_ratio": 1}
    assert "wmt17 zh-en" in out and "dropped pairs: 1" in out

    # jieba put spaces between the Chinese words; English Moses-tokenised with its case kept
    zh = read_lines(work / "tok" / "train.zh")
    assert zh[0] == "我们 在 北京大学 学习 机器翻译 0 。"
    assert zh[1].startswith("中国 经济")
    assert read_lines(work / "tok" / "test.en")[1] == "China &apos;s economy grew by seven percent this year t1 ."

    # separate dictionaries and BPE codes, the fairseq files
    assert binfiles(dest, "zh", "en") <= {p.name for p in dest.iterdir()}
    assert (dest / "code.zh").is_file() and (dest / "code.en").is_file()
    zh_dict = (dest / "dict.zh.txt").read_text(encoding="utf-8")
    en_dict = (dest / "dict.en.txt").read_text(encoding="utf-8")
    assert zh_dict != en_dict and "北" in zh_dict and "北" not in en_dict


# ------------------------------------------------------------------------------------- bad input

def run_bad(name, raw, tmp_path, *extra):
    with pytest.raises(DataError) as e:
        data.prepare(name, ["--raw-dir", str(raw), "--dest", str(tmp_path / "bin"), "--no-download",
                            "--bpe-size", "20", *extra])
    assert not (tmp_path / "bin").exists()  # nothing half-written
    return str(e.value)


def test_missing_files_offline_message(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    msg = run_bad("wmt14_en_de", raw, tmp_path)
    for name, archive in wmt14.ARCHIVES.items():
        if name != "dev.tgz":  # only for --valid-set newstest2013
            assert str(raw / name) in msg and archive.url in msg
    assert "dev.tgz" not in msg and str(raw / "training" / "europarl-v7.de-en.en") in msg
    msg = run_bad("wmt17_zh_en", raw, tmp_path)
    assert "3 raw file(s) missing" in msg and "training-parallel-nc-v12.tgz" in msg
    assert wmt17.ARCHIVES["test.tgz"].url in msg


def test_mismatched_line_counts(tmp_path, monkeypatch):
    raw = wmt14_raw(tmp_path)
    accept_archives(monkeypatch, wmt14, raw)
    de = raw / "training" / "europarl-v7.de-en.de"
    de.write_text("".join(de.read_text(encoding="utf-8").splitlines(keepends=True)[:-1]), encoding="utf-8")
    msg = run_bad("wmt14_en_de", raw, tmp_path)
    assert "150 lines" in msg and "149 lines" in msg and str(de) in msg and "europarl-v7.de-en.en" in msg


def test_non_utf8_names_file_and_line(tmp_path, monkeypatch):
    raw = wmt14_raw(tmp_path)
    accept_archives(monkeypatch, wmt14, raw)
    en = raw / "training" / "europarl-v7.de-en.en"
    lines = en.read_bytes().split(b"\n")
    lines[2] = b"Caf\xe9 in latin-1"
    en.write_bytes(b"\n".join(lines))
    msg = run_bad("wmt14_en_de", raw, tmp_path)
    assert f"{en}:3:" in msg and "UTF-8" in msg


def test_wrong_archive_refused(tmp_path, monkeypatch):
    raw = wmt17_raw(tmp_path)
    msg = run_bad("wmt17_zh_en", raw, tmp_path)  # the published size of the real archive
    assert "training-parallel-nc-v12.tgz" in msg and "expected 168591139" in msg
    accept_archives(monkeypatch, wmt17, raw)
    make_tgz(raw / "test.tgz", {"test/other.sgm": "x\n"})  # right checksum, wrong content
    monkeypatch.setitem(wmt17.ARCHIVES, "test.tgz", dataclasses.replace(
        wmt17.ARCHIVES["test.tgz"], size=(raw / "test.tgz").stat().st_size,
        md5=hashlib.md5((raw / "test.tgz").read_bytes()).hexdigest()))
    msg = run_bad("wmt17_zh_en", raw, tmp_path)
    assert "test.tgz" in msg and "newstest2017-zhen-src.zh.sgm" in msg


# ---------------------------------------------------------------------------------- command line

def test_cli_and_script(tmp_path):
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([str(REPO / "scripts" / "prepare-wmt17-zh-en.sh"), "-h"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "--src-bpe-size" in proc.stdout and "--clean-ratio" in proc.stdout
    raw = tmp_path / "raw"
    raw.mkdir()
    proc = subprocess.run([str(REPO / "scripts" / "prepare-wmt14-en-de.sh"), "--raw-dir", str(raw),
                           "--dest", str(tmp_path / "bin"), "--no-download"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "raw file(s) missing" in proc.stderr and "Traceback" not in proc.stderr
