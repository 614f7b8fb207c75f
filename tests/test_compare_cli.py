"""``fairseq-modattn compare`` end to end, in-process: hypothesis files and evaluate-style results
JSONs written here (no training), the table and the JSON it writes, and its one-line errors."""

import hashlib
import json
import os
import random

import pytest
from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.significance import PairedTest

from fairseq_modattn.analysis.significance import SACREBLEU_SEED, compare_systems
from fairseq_modattn.cli.main import main

WORDS = "A man in a blue shirt is riding the red bike down street two dogs play on grass near water".split()
SENTENCES = 30


def noisy(rng, refs, p):
    return [" ".join(w if rng.random() > p else rng.choice(WORDS) for w in r.split()) for r in refs]


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def corpus(tmp_path):
    """ref.txt and two seeds of a weak ("base") and a strong ("dma") system as hypothesis files."""
    rng = random.Random(1)
    refs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(SENTENCES)]
    files = {"ref": write_lines(tmp_path / "ref.txt", refs)}
    for name, p in (("base", 0.5), ("dma", 0.15)):
        for seed in (1, 2):
            files[f"{name}{seed}"] = write_lines(tmp_path / f"{name}{seed}.txt", noisy(rng, refs, p))
    return files


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def evaluate_json(folder, hyps, refs, lowercase=False, checksums=True, **extra):
    """What fairseq-modattn evaluate writes: results.json beside hyp.txt and ref.txt, naming them,
    with the sacreBLEU it scored them with and, unless not CHECKSUMS (an evaluate before they
    were recorded), their SHA-256."""
    folder.mkdir(parents=True)
    hyp, ref = write_lines(folder / "hyp.txt", hyps), write_lines(folder / "ref.txt", refs)
    results = {"sacrebleu": BLEU(lowercase=lowercase).corpus_score(hyps, [refs]).score, "sacrebleu_tokenize": "13a",
               "lowercase": lowercase, "hypotheses_file": str(hyp.resolve()), "references_file": str(ref.resolve()),
               **extra}
    if checksums:
        results.update(hypotheses_sha256=sha256(hyp), references_sha256=sha256(ref))
    path = folder / "results.json"
    path.write_text(json.dumps(results), encoding="utf-8")
    return path


def lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def run(capsys, *argv):
    code = main(["compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_hypothesis_files_table_and_json(corpus, tmp_path, capsys):
    out_json = tmp_path / "cmp.json"
    code, out, err = run(capsys, "--system", "base", corpus["base1"], corpus["base2"], "--system", "dma",
                         corpus["dma1"], corpus["dma2"], "--references", corpus["ref"], "--samples", 100,
                         "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["written_by"] == "fairseq-modattn compare" and report["baseline"] == "base"
    assert [s["seeds"] for s in report["systems"]] == [2, 2] and report["sentences"] == SENTENCES
    assert list(report["metrics"]) == ["bleu", "chrf", "ter"] and report["lowercase"] is False

    refs = lines(corpus["ref"])
    runs = {n: [lines(corpus[f"{n}1"]), lines(corpus[f"{n}2"])] for n in ("base", "dma")}
    expected = compare_systems(list(runs.items()), refs, samples=100)
    for metric, scorer in (("bleu", BLEU()), ("chrf", CHRF()), ("ter", TER())):
        m = report["metrics"][metric]
        pooled = scorer.corpus_score(runs["dma"][0] + runs["dma"][1], [refs + refs]).score
        assert m["scores"]["dma"] == pytest.approx(pooled, abs=1e-9)
        assert m["comparisons"]["dma"] == expected[metric].comparisons["dma"].as_dict()
        assert m["comparisons"]["dma"]["verdict"] == "better" and "bs:100" in m["signature"]
        c = m["comparisons"]["dma"]
        row = f"{c['delta']:+.2f} [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}]  {c['p_value']:.4f}  better"
        assert any(line.startswith({"bleu": "BLEU", "chrf": "chrF", "ter": "TER"}[metric]) and " dma " in line
                   and line.endswith(row) for line in out.splitlines()), out
    assert report["metrics"]["ter"]["comparisons"]["dma"]["delta"] < 0  # fewer edits
    assert f"comparison written to {out_json}" in out and "(baseline)" in out


def test_one_file_per_system_gives_sacrebleus_paired_test(corpus, tmp_path, capsys, monkeypatch):
    out_json = tmp_path / "cmp.json"
    code, _, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                       "--system", "dma2", corpus["dma2"], "--references", corpus["ref"], "--samples", 100,
                       "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    monkeypatch.setenv("SACREBLEU_SEED", str(SACREBLEU_SEED))
    names = ("base", "dma", "dma2")
    systems = [(n, lines(corpus[f"{n}1" if n != "dma2" else "dma2"])) for n in names]
    _, sacre = PairedTest(systems, {"BLEU": BLEU(), "chrF": CHRF(), "TER": TER()}, [lines(corpus["ref"])],
                          test_type="bs", n_samples=100)()
    for metric, key in (("bleu", "BLEU"), ("chrf", "chrF2"), ("ter", "TER")):
        m = report["metrics"][metric]
        assert [m["scores"][n] for n in names] == pytest.approx([r.score for r in sacre[key]], abs=1e-9)
        assert [m["comparisons"][n]["p_value"] for n in names[1:]] == [r.p_value for r in sacre[key][1:]]


def test_evaluate_jsons_seeds_pooled_and_case(corpus, tmp_path, capsys):
    refs = lines(corpus["ref"])
    # lower-cased systems against true-case references, as the Multi30k recipe's: case-insensitive
    # BLEU and chrF, as evaluate scores them; each evaluation wrote its own copy of the reference
    jsons = {f"{n}{s}": evaluate_json(tmp_path / f"{n}{s}", [h.lower() for h in lines(corpus[f"{n}{s}"])], refs,
                                      lowercase=True)
             for n in ("base", "dma") for s in (1, 2)}
    out_json = tmp_path / "cmp.json"
    code, out, err = run(capsys, "--system", "base", jsons["base1"], jsons["base2"], "--system", "dma",
                         jsons["dma1"], jsons["dma2"], "--metrics", "bleu", "chrf", "--samples", 100,
                         "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert list(report["metrics"]) == ["bleu", "chrf"] and report["lowercase"] is True
    assert report["lowercase_systems"] == ["base", "dma"] and "case-insensitive" in out
    hyps = [h.lower() for s in (1, 2) for h in lines(corpus[f"dma{s}"])]
    assert report["metrics"]["bleu"]["scores"]["dma"] == pytest.approx(
        BLEU(lowercase=True).corpus_score(hyps, [refs + refs]).score, abs=1e-9)
    assert "case:lc" in report["metrics"]["chrf"]["signature"]
    assert report["systems"][1]["hypotheses_files"] == [str(tmp_path / "dma1" / "hyp.txt"),
                                                        str(tmp_path / "dma2" / "hyp.txt")]

    # --case-sensitive, and a rerun replaces the JSON this command wrote
    code, out, err = run(capsys, "--system", "base", jsons["base1"], "--system", "dma", jsons["dma1"],
                         "--metrics", "bleu", "--samples", 100, "--case-sensitive", "--json", out_json)
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert report["lowercase"] is False and "case:mixed" in report["metrics"]["bleu"]["signature"]
    assert "warning: BLEU and chrF are case-sensitive" in out


def test_mismatched_line_counts(corpus, tmp_path, capsys):
    short = write_lines(tmp_path / "short.txt", lines(corpus["dma1"])[:-1])
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", short,
                         "--references", corpus["ref"])
    assert code == 1 and out == ""
    assert err == (f"fairseq-modattn compare: error: system dma: {short} has {SENTENCES - 1} lines but the "
                   f"reference {corpus['ref']} has {SENTENCES}; one hypothesis per reference sentence, in "
                   "test-set order\n")


def test_different_references(corpus, tmp_path, capsys):
    refs = lines(corpus["ref"])
    base = evaluate_json(tmp_path / "base", lines(corpus["base1"]), refs)
    other = evaluate_json(tmp_path / "dma", lines(corpus["dma1"]), refs[:3] + ["another sentence"] + refs[4:])
    code, out, err = run(capsys, "--system", "base", base, "--system", "dma", other)
    assert code == 1 and len(err.splitlines()) == 1
    assert "not scored against one reference" in err and "first difference at line 4" in err
    # --references that differs from the JSONs' reference
    code, _, err = run(capsys, "--system", "base", base, "--system", "dma", corpus["dma1"],
                       "--references", write_lines(tmp_path / "r.txt", refs[:-1]))
    assert code == 1 and f"ref.txt differs from {tmp_path / 'r.txt'} ({SENTENCES} lines vs {SENTENCES - 1})" in err
    assert len(err.splitlines()) == 1
    # a JSON of an evaluate that named no hypotheses file
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"sacrebleu": 1.0}))
    code, _, err = run(capsys, "--system", "base", base, "--system", "old", old)
    assert code == 1 and 'has no "hypotheses_file"' in err and len(err.splitlines()) == 1


def test_usage_errors(corpus, capsys):
    with pytest.raises(SystemExit) as stop:
        run(capsys, "--system", "base", corpus["base1"], "--references", corpus["ref"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fairseq-modattn compare: error: give at least two --system NAME FILE [FILE ...] (the first is the baseline)")
    with pytest.raises(SystemExit):
        run(capsys, "--system", "base", corpus["base1"], "--system", "dma")
    assert "--system dma names no file" in capsys.readouterr().err
    code, _, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"])
    assert code == 1 and "give the reference with --references FILE" in err


def test_refuses_an_existing_json_it_did_not_write(corpus, tmp_path, capsys):
    mine = write_lines(tmp_path / "notes.json", ['{"my": "notes"}'])
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                         "--references", corpus["ref"], "--json", mine)
    assert code == 1 and out == "" and mine.read_text() == '{"my": "notes"}\n'
    assert err == (f"fairseq-modattn compare: error: --json {mine} exists and was not written by fairseq-modattn "
                   "compare; give another file, or remove it yourself\n")
    code, _, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                       "--references", corpus["ref"], "--json", tmp_path)
    assert code == 1 and "is a directory" in err
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no lock or temporary left


# ------------------------------------------------------------------ issue 57, item 2: what compare refuses
def one_line(err):
    """The error line, checked to be the only line the command wrote to stderr."""
    assert len(err.splitlines()) == 1 and err.startswith("fairseq-modattn compare: error: "), err
    return err


def test_a_scored_text_changed_since_evaluate_is_refused(corpus, tmp_path, capsys):
    """The references copied over a results JSON's hyp.txt scored BLEU 100 beside a JSON that says
    otherwise: the checksums evaluate records name the changed file instead."""
    refs = lines(corpus["ref"])
    tf = evaluate_json(tmp_path / "tf", lines(corpus["base1"]), refs)
    dma = evaluate_json(tmp_path / "dma", lines(corpus["dma1"]), refs)
    hyp, ref = tmp_path / "tf" / "hyp.txt", tmp_path / "tf" / "ref.txt"
    hyp.write_bytes(ref.read_bytes())
    code, out, err = run(capsys, "--system", "tf", tf, "--system", "dma", dma)
    assert code == 1 and out == ""
    assert f"system tf: {hyp} has changed since evaluate wrote {tf}" in one_line(err)
    assert '"hypotheses_sha256"' in err
    # a reference changed is refused the same way, before it is compared with the other JSON's
    write_lines(hyp, lines(corpus["base1"]))
    write_lines(ref, refs[:-1] + ["something else"])
    code, out, err = run(capsys, "--system", "tf", tf, "--system", "dma", dma)
    assert code == 1 and out == "" and f"{ref} has changed since evaluate wrote {tf}" in one_line(err)


def test_a_json_without_checksums_must_score_as_it_records(corpus, tmp_path, capsys):
    """An evaluate before the checksums: its recorded sacreBLEU, scored again, is the check."""
    refs = lines(corpus["ref"])
    tf = evaluate_json(tmp_path / "tf", lines(corpus["base1"]), refs, checksums=False)
    dma = evaluate_json(tmp_path / "dma", lines(corpus["dma1"]), refs, checksums=False)
    code, _, err = run(capsys, "--system", "tf", tf, "--system", "dma", dma, "--metrics", "bleu")
    assert code == 0, err  # unchanged: accepted without checksums
    recorded = json.loads(tf.read_text())["sacrebleu"]
    write_lines(tmp_path / "tf" / "hyp.txt", refs)
    code, out, err = run(capsys, "--system", "tf", tf, "--system", "dma", dma)
    assert code == 1 and out == ""
    assert f"system tf: {tf} records sacreBLEU {recorded:.2f}, but its {tmp_path / 'tf' / 'hyp.txt'} scores " \
           "100.00" in one_line(err)


def test_one_file_as_two_systems_is_reported_identical(corpus, tmp_path, capsys):
    """sacreBLEU's p is 1 / (N + 1) when every resample ties: identical systems get p = 1."""
    out_json = tmp_path / "cmp.json"
    code, out, err = run(capsys, "--system", "A", corpus["base1"], "--system", "B", corpus["base1"],
                         "--references", corpus["ref"], "--samples", 100, "--json", out_json)
    assert code == 0, err
    for metric in ("bleu", "chrf", "ter"):
        c = json.loads(out_json.read_text())["metrics"][metric]["comparisons"]["B"]
        assert (c["delta"], c["ci95"], c["p_value"], c["identical"]) == (0.0, [0.0, 0.0], 1.0, True), c
        assert c["verdict"] == "no difference"
    rows = [row for row in out.splitlines() if " B " in row]
    assert len(rows) == 3 and all(row.endswith("+0.00 [+0.00, +0.00]  1.0000  no difference (identical)")
                                  for row in rows), out
    assert "identical: the same score as the baseline on the test set and on every resample" in out


def test_too_few_resamples_are_refused(corpus, capsys):
    """--samples 1 gave a verdict whose difference lay outside its own interval."""
    for samples in (1, 99):
        code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                             "--references", corpus["ref"], "--samples", samples)
        assert code == 2 and out == ""
        assert f"--samples {samples}: give at least 100 resamples" in one_line(err)


def test_one_file_given_as_two_seeds_is_refused(corpus, tmp_path, capsys):
    """Another spelling, a symlink and a hard link of one file, and two JSONs naming one hyp.txt."""
    base1 = corpus["base1"]
    (tmp_path / "link.txt").symlink_to(base1)
    os.link(base1, tmp_path / "hard.txt")
    refs = lines(corpus["ref"])
    first = evaluate_json(tmp_path / "e1", lines(corpus["dma1"]), refs)
    second = tmp_path / "e1" / "copy.json"
    second.write_text(first.read_text(), encoding="utf-8")
    for seeds in ([base1, tmp_path / "." / "x" / ".." / "base1.txt"], [base1, tmp_path / "link.txt"],
                  [tmp_path / "hard.txt", base1]):
        (tmp_path / "x").mkdir(exist_ok=True)
        code, out, err = run(capsys, "--system", "base", *seeds, "--system", "dma", corpus["dma1"],
                             "--references", corpus["ref"])
        assert code == 1 and out == ""
        assert f"system base: {seeds[0]} and {seeds[1]} are one file" in one_line(err), seeds
    code, out, err = run(capsys, "--system", "base", base1, "--system", "dma", first, second,
                         "--references", corpus["ref"])
    assert code == 1 and out == ""
    assert f"system dma: {first} (its {tmp_path / 'e1' / 'hyp.txt'}) and {second} (its " in one_line(err)


def test_resamples_beyond_the_memory_are_refused_before_allocating(corpus, capsys, monkeypatch):
    """--samples 100000000 ended in numpy's _ArrayMemoryError traceback."""
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                         "--references", corpus["ref"], "--samples", 10 ** 12)
    assert code == 1 and out == ""
    assert (f"--samples 1000000000000 would need 480000.0 GB of memory (1,000,000,000,000 resamples x "
            f"{SENTENCES} sentences x 16 bytes), more than the ") in one_line(err)
    # the bound is the memory available now: 1000 resamples of 30 sentences need 480,000 bytes
    from fairseq_modattn.analysis import significance

    monkeypatch.setattr(significance, "available_memory", lambda: 479_999)
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                         "--references", corpus["ref"])
    assert code == 1 and out == "" and "would need 480.0 KB of memory" in one_line(err)
    monkeypatch.setattr(significance, "available_memory", lambda: 480_000)
    code, _, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                       "--references", corpus["ref"], "--metrics", "bleu")
    assert code == 0, err


def test_a_line_longer_than_the_limit_is_refused(corpus, tmp_path, capsys):
    """One 10 MB hypothesis line made TER run for minutes at gigabytes: lines over 10,000
    characters are refused, naming the file and line; 10,000 are scored."""
    hyps = lines(corpus["dma1"])
    at_limit = write_lines(tmp_path / "at_limit.txt", hyps[:4] + ["x" * 10_000] + hyps[5:])
    code, _, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", at_limit,
                       "--references", corpus["ref"], "--metrics", "ter")
    assert code == 0, err
    over = write_lines(tmp_path / "over.txt", hyps[:4] + ["x" * 10_001] + hyps[5:])
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", over,
                         "--references", corpus["ref"])
    assert code == 1 and out == ""
    assert one_line(err) == (f"fairseq-modattn compare: error: system dma: {over} line 5 has 10,001 characters, more "
                             "than the 10,000 compare scores in a line (no sentence is that long: a binary file, or "
                             "a whole document on one line?)\n")
    refs = write_lines(tmp_path / "refs.txt", lines(corpus["ref"])[:-1] + ["y" * 20_000])
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                         "--references", refs)
    assert code == 1 and out == "" and f"references: {refs} line {SENTENCES} has 20,000 characters" in one_line(err)


def test_a_json_folder_that_cannot_be_written_is_refused_before_the_bootstrap(corpus, tmp_path, capsys, monkeypatch):
    """--json in a folder that cannot be created (its parent is a file) was refused only after the
    whole computation."""
    from fairseq_modattn.cli import compare as compare_cli

    def no_bootstrap(*args, **kwargs):
        raise AssertionError("the bootstrap ran before the --json folder was checked")

    monkeypatch.setattr(compare_cli, "compare_systems", no_bootstrap)
    blocker = write_lines(tmp_path / "notes.txt", ["a file, not a folder"])
    code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                         "--references", corpus["ref"], "--json", blocker / "cmp.json")
    assert code == 1 and out == ""
    assert f"--json {blocker / 'cmp.json'} is not writable (cannot create {blocker / '.cmp.json.tmp-'}" in \
        one_line(err)
    if os.geteuid() != 0:  # root writes into a read-only folder regardless
        locked = tmp_path / "read-only"
        locked.mkdir(mode=0o555)
        code, out, err = run(capsys, "--system", "base", corpus["base1"], "--system", "dma", corpus["dma1"],
                             "--references", corpus["ref"], "--json", locked / "cmp.json")
        assert code == 1 and out == "" and f"--json {locked / 'cmp.json'} is not writable" in one_line(err)
