"""``fairseq-modattn compare`` end to end, in-process: hypothesis files and evaluate-style results
JSONs written here (no training), the table and the JSON it writes, and its one-line errors."""

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


def evaluate_json(folder, hyps, refs, **extra):
    """What fairseq-modattn evaluate writes: results.json beside hyp.txt and ref.txt, naming them."""
    folder.mkdir(parents=True)
    hyp, ref = write_lines(folder / "hyp.txt", hyps), write_lines(folder / "ref.txt", refs)
    results = {"sacrebleu": 0.0, "sacrebleu_tokenize": "13a", "hypotheses_file": str(hyp.resolve()),
               "references_file": str(ref.resolve()), **extra}
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
    jsons = {f"{n}{s}": evaluate_json(tmp_path / f"{n}{s}", [h.lower() for h in lines(corpus[f"{n}{s}"])], refs)
             for n in ("base", "dma") for s in (1, 2)}
    out_json = tmp_path / "cmp.json"
    code, out, err = run(capsys, "--system", "base", jsons["base1"], jsons["base2"], "--system", "dma",
                         jsons["dma1"], jsons["dma2"], "--metrics", "bleu", "chrf", "--samples", 50,
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
                         "--metrics", "bleu", "--samples", 20, "--case-sensitive", "--json", out_json)
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
