"""A data-bin whose dictionaries are not the model's, through the real fairseq commands.

The fault (issue 39): a copy of the training data-bin with ``dict.de.txt`` and ``dict.en.txt``
reversed line by line (``tac``) has the model's dictionary sizes, so fairseq loaded it silently
and translated garbage (``H-0 ▁yell ▁yell ▁yell``), and ``evaluate`` wrote its JSON. Now:

* this package's models keep a fingerprint of their dictionaries in their state dict and refuse
  other dictionaries in one line, in fairseq-generate, fairseq-interactive, fairseq-train's resume,
  evaluate and serve; averaging keeps the fingerprint; a checkpoint saved before it existed loads
  with one warning line;
* for a plain fairseq checkpoint, evaluate and serve compare the data-bin with the one the
  checkpoint recorded, and warn in one line where they cannot tell.
"""

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fairseq_modattn  # noqa: F401  (compat, as --user-dir applies it)
from conftest import (
    MODATTN,
    MODATTN_MAIN,
    PLUGIN,
    bpe_codes,
    cli_environment,
    fairseq_cli,
    run_cli,
    run_commands,
    tiny_train_args,
)
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis.loading import load_model
from fairseq_modattn.dictionaries import DictionaryMismatchError

#: the state-dict key of the fingerprint (docs/design.md, "The model knows its dictionaries")
FINGERPRINT_KEY = "dictionary_fingerprint"

GENERATE = ["--gen-subset", "valid", "--beam", "1", "--max-len-b", "5", "--batch-size", "64", "--cpu"]


def run(args, input_text=None):
    """(exit status, stdout, stderr) of a command."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, input=input_text,
                          env=cli_environment())
    return proc.returncode, proc.stdout, proc.stderr


def last_line(text):
    return text.strip().splitlines()[-1]


def hypotheses(output):
    return sorted(line for line in output.splitlines() if line.startswith("H-"))


def dictionaries_fingerprint_of(path: Path) -> torch.Tensor:
    """(9,) the record of one dictionary file as docs/design.md defines it: its number of symbols
    (as fairseq loads it, special symbols first), then SHA-256 over the symbols, each
    length-prefixed, as eight 32-bit words."""
    from fairseq.data import Dictionary

    symbols = Dictionary.load(str(path)).symbols
    digest = hashlib.sha256(b"".join(len(s.encode()).to_bytes(4, "big") + s.encode() for s in symbols)).digest()
    return torch.tensor([len(symbols), *(int.from_bytes(digest[i:i + 4], "big") for i in range(0, 32, 4))])


def shown(row) -> str:
    """A fingerprint row (size, eight 32-bit words) as the messages show it: '1a2b3c4d5e6f (N symbols)'."""
    values = [int(v) for v in row.tolist()]
    return f"{''.join(f'{w:08x}' for w in values[1:])[:12]} ({values[0]} symbols)"


def dictionary_fingerprint(path: Path) -> str:
    """The fingerprint of the dictionary file PATH as the messages show it."""
    return shown(dictionaries_fingerprint_of(path))


@pytest.fixture(scope="module")
def reordered_bin(multi30k_bin, tmp_path_factory):
    """The fixture's data-bin with both dictionaries reversed (``tac``): same sizes, other order."""
    target = tmp_path_factory.mktemp("reordered") / "bin"
    shutil.copytree(multi30k_bin, target)
    for lang in ("de", "en"):
        lines = (multi30k_bin / f"dict.{lang}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        (target / f"dict.{lang}.txt").write_text("".join(reversed(lines)), encoding="utf-8")
    return target


@pytest.fixture(scope="module")
def dma_run(multi30k_bin, tmp_path_factory):
    """A tiny DMA model of 4 updates: checkpoint_1_2.pt, checkpoint_1_4.pt, checkpoint_last.pt."""
    save = tmp_path_factory.mktemp("dma_dictionaries")
    run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args("dma"), "--max-update", "4",
             "--save-interval-updates", "2", "--save-dir", save])
    assert {"checkpoint_1_2.pt", "checkpoint_1_4.pt", "checkpoint_last.pt"} <= {p.name for p in save.glob("*.pt")}
    return save


def assert_names_both(line, multi30k_bin, reordered_bin):
    """The one line names what the checkpoint was built with and the data-bin's two files."""
    for lang in ("de", "en"):
        assert f"{reordered_bin / f'dict.{lang}.txt'} {dictionary_fingerprint(reordered_bin / f'dict.{lang}.txt')}" \
            in line, line
    built = dictionary_fingerprint(multi30k_bin / "dict.de.txt")
    assert f"source dictionary {built}" in line or f"dict.de.txt is {built}" in line, line


# ------------------------------------------------------------------ this package's models
def test_generate_and_interactive_refuse_reordered_dictionaries_in_one_line(multi30k_bin, reordered_bin, dma_run):
    checkpoint = dma_run / "checkpoint_last.pt"
    code, out, err = run([fairseq_cli("fairseq-generate"), reordered_bin, "--user-dir", PLUGIN, "--path", checkpoint,
                          *GENERATE])
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err and not hypotheses(out), err[-3000:]
    assert line.startswith("fairseq-generate: error: the data-bin's dictionaries are not the ones the checkpoint "
                           "was built with"), line
    assert_names_both(line, multi30k_bin, reordered_bin)
    assert f"(trained on {Path(multi30k_bin).resolve()})" in line, line
    code, out, err = run([fairseq_cli("fairseq-interactive"), reordered_bin, "--user-dir", PLUGIN, "--path",
                          checkpoint, "--source-lang", "de", "--target-lang", "en", "--beam", "1", "--cpu"],
                         input_text="zwei hunde spielen im schnee .\n")
    assert code == 1 and "Traceback" not in out + err and not hypotheses(out), err[-3000:]
    assert last_line(err).startswith("fairseq-interactive: error: the data-bin's dictionaries are not"), err[-2000:]
    assert_names_both(last_line(err), multi30k_bin, reordered_bin)


def test_original_data_bin_translates_as_before_and_old_checkpoints_warn_once(multi30k_bin, dma_run, tmp_path):
    """The fingerprint changes nothing the model computes: a checkpoint without it (as saved
    before it existed) translates the same, with one line saying that nothing was checked."""
    checkpoint = dma_run / "checkpoint_last.pt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["model"][FINGERPRINT_KEY].dtype == torch.int64
    assert state["model"][FINGERPRINT_KEY].shape == (2, 9)
    del state["model"][FINGERPRINT_KEY]
    old = tmp_path / "checkpoint_old.pt"
    torch.save(state, old)
    code, out, err = run([fairseq_cli("fairseq-generate"), multi30k_bin, "--user-dir", PLUGIN, "--path", checkpoint,
                          *GENERATE])
    assert code == 0 and len(hypotheses(out)) == 100 and "fingerprint" not in out + err, err[-3000:]
    code, old_out, old_err = run([fairseq_cli("fairseq-generate"), multi30k_bin, "--user-dir", PLUGIN, "--path", old,
                                  *GENERATE])
    assert code == 0 and hypotheses(old_out) == hypotheses(out), old_err[-3000:]
    warnings = [line for line in (old_out + old_err).splitlines() if "records no fingerprint" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], old_err[-3000:]
    assert "cannot check that the data-bin's dictionaries are the ones it was trained with" in warnings[0]


def test_resume_with_reordered_data_bin_is_refused(multi30k_bin, reordered_bin, dma_run, tmp_path):
    save = tmp_path / "run"
    shutil.copytree(dma_run, save)
    code, out, err = run([fairseq_cli("fairseq-train"), reordered_bin, *tiny_train_args("dma"), "--max-update", "6",
                          "--save-dir", save])
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert line.startswith("fairseq-train: error: the data-bin's dictionaries are not the ones the checkpoint was "
                           "built with"), line
    assert_names_both(line, multi30k_bin, reordered_bin)
    assert "num_updates 5" not in out + err  # nothing was trained
    # --restore-file into a fresh --save-dir
    code, out, err = run([fairseq_cli("fairseq-train"), reordered_bin, *tiny_train_args("dma"), "--max-update", "6",
                          "--save-dir", tmp_path / "fresh", "--restore-file", dma_run / "checkpoint_1_2.pt"])
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err).startswith("fairseq-train: error: the data-bin's dictionaries are not"), err[-2000:]


def test_evaluate_serve_and_analysis_loading_refuse_reordered_dictionaries(multi30k_bin, reordered_bin, dma_run,
                                                                          tmp_path):
    code, out, err = run([MODATTN, "evaluate", reordered_bin, "--path", dma_run / "checkpoint_last.pt",
                          "--subset", "valid", "--beam", "1", "--work-dir", tmp_path / "eval", "--",
                          "--max-len-b", "5"])
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    # refused before anything is generated: evaluate compares each checkpoint's record itself
    assert line.startswith("fairseq-modattn evaluate: error: the data-bin's dictionaries are not the ones the "
                           "checkpoint was built with"), line
    assert_names_both(line, multi30k_bin, reordered_bin)
    assert not (tmp_path / "eval" / "results.json").exists()
    # redundancy / plot and serve's translator load through analysis.loading
    with pytest.raises(AnalysisError) as error:
        load_model(dma_run / "checkpoint_last.pt", reordered_bin)
    assert "\n" not in str(error.value)
    assert_names_both(str(error.value), multi30k_bin, reordered_bin)
    pytest.importorskip("flask", reason="serve needs Flask: pip install -e '.[demo]'")
    pytest.importorskip("plotly", reason="serve needs plotly: pip install -e '.[demo]'")
    code, out, err = run([MODATTN, "serve", "--path", dma_run / "checkpoint_last.pt", "--data", reordered_bin,
                          "--port", "0", "--bpe", "subword_nmt", "--bpe-codes", bpe_codes(multi30k_bin)])
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err).startswith("fairseq-modattn serve: error: the data-bin's dictionaries are not"), err[-2000:]
    assert_names_both(last_line(err), multi30k_bin, reordered_bin)


def test_averaged_checkpoints_keep_the_fingerprint(multi30k_bin, reordered_bin, dma_run, tmp_path):
    output = tmp_path / "averaged.pt"
    run_cli([MODATTN, "average", "--inputs", dma_run, "--num-update-checkpoints", "2", "--output", output])
    first = torch.load(dma_run / "checkpoint_1_2.pt", map_location="cpu", weights_only=True)["model"]
    averaged = torch.load(output, map_location="cpu", weights_only=True)["model"]
    assert torch.equal(averaged[FINGERPRINT_KEY], first[FINGERPRINT_KEY])
    # fairseq's scripts/average_checkpoints.py sums integer tensors and floor-divides the sum:
    # 32-bit words in int64 keep their value for any number of checkpoints one could average
    total = first[FINGERPRINT_KEY].clone()
    for _ in range(999):
        total += first[FINGERPRINT_KEY]
    assert torch.equal(total // 1000, first[FINGERPRINT_KEY])
    assert int(first[FINGERPRINT_KEY].max()) < 2 ** 32 and int(first[FINGERPRINT_KEY].min()) >= 0
    with pytest.raises(AnalysisError, match="the data-bin's dictionaries are not the ones"):
        load_model(output, reordered_bin)
    model, _, _ = load_model(output, multi30k_bin)
    assert torch.equal(getattr(model, FINGERPRINT_KEY), first[FINGERPRINT_KEY])
    # a buffer, not a parameter: the parameter counts the package reports are unchanged
    assert FINGERPRINT_KEY not in dict(model.named_parameters())


# ------------------------------------------------------------------ plain fairseq checkpoints
@pytest.fixture(scope="module")
def transformer_run(multi30k_bin, tmp_path_factory):
    """A plain fairseq ``--arch transformer`` of 2 updates trained with the plugin loaded, on a
    copy of the fixture's data-bin (``train_bin``, which a test may remove):
    checkpoint_1_1.pt, checkpoint_1_2.pt, checkpoint_last.pt."""
    root = tmp_path_factory.mktemp("transformer_dictionaries")
    shutil.copytree(multi30k_bin, root / "train_bin")
    run_cli([fairseq_cli("fairseq-train"), root / "train_bin", *tiny_train_args("transformer"), "--max-update", "2",
             "--save-interval-updates", "1", "--save-dir", root / "run"])
    return root


@pytest.fixture(scope="module")
def swapped_bin(multi30k_bin, tmp_path_factory):
    """The fixture's data-bin with two words of both dictionaries swapped: same symbols, same
    sizes, only two ids mean other words."""
    target = tmp_path_factory.mktemp("swapped") / "bin"
    shutil.copytree(multi30k_bin, target)
    for lang in ("de", "en"):
        lines = (multi30k_bin / f"dict.{lang}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        lines[10], lines[11] = lines[11], lines[10]
        (target / f"dict.{lang}.txt").write_text("".join(lines), encoding="utf-8")
    return target


def without_record(checkpoint: Path, output: Path) -> Path:
    """CHECKPOINT as saved before the plugin recorded dictionaries (no extra-state fingerprint)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del state["extra_state"][FINGERPRINT_KEY]
    torch.save(state, output)
    return output


def test_plain_transformer_checkpoint_records_its_dictionaries_and_every_load_checks_them(
        multi30k_bin, swapped_bin, transformer_run, tmp_path):
    """Issue 57 (3): a plain --arch transformer trained with --user-dir fairseq_modattn loaded
    silently on a data-bin with two symbols swapped in fairseq-generate (exit 0, 100
    hypotheses), from_pretrained, fairseq-train's --restore-file, `evaluate --checkpoints
    other.pt good.pt` (only the last was compared; the mixed average was scored) and `average`
    of checkpoints of different dictionaries (exit 0). Each fails on the main before the record."""
    run_dir, trained_on = transformer_run / "run", transformer_run / "train_bin"
    checkpoint = run_dir / "checkpoint_last.pt"
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    recorded = state["extra_state"][FINGERPRINT_KEY]
    assert recorded.dtype == torch.int64 and recorded.shape == (2, 9)
    assert [shown(r) for r in recorded] == [dictionary_fingerprint(trained_on / f"dict.{lang}.txt")
                                           for lang in ("de", "en")]
    assert FINGERPRINT_KEY not in state["model"]  # fairseq's model and its strict loading are untouched

    code, out, err = run([fairseq_cli("fairseq-generate"), swapped_bin, "--user-dir", PLUGIN, "--path",
                                     checkpoint, *GENERATE])
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err and not hypotheses(out), err[-3000:]
    assert line.startswith("fairseq-generate: error: the data-bin's dictionaries are not the ones the checkpoint "
                           "was built with"), line
    assert_names_both(line, trained_on, swapped_bin)
    assert f"(trained on {trained_on.resolve()})" in line, line

    text = {"tokenizer": "moses", "bpe": "subword_nmt", "bpe_codes": str(bpe_codes(multi30k_bin))}
    with pytest.raises(DictionaryMismatchError, match="the data-bin's dictionaries are not the ones"):
        fairseq_modattn.from_pretrained(str(run_dir), "checkpoint_last.pt", str(swapped_bin), **text)
    assert fairseq_modattn.from_pretrained(str(run_dir), "checkpoint_last.pt", str(multi30k_bin), **text) is not None

    code, out, err = run([fairseq_cli("fairseq-train"), swapped_bin, *tiny_train_args("transformer"),
                                     "--max-update", "3", "--save-dir", tmp_path / "fresh", "--restore-file",
                                     checkpoint])
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err).startswith("fairseq-train: error: the data-bin's dictionaries are not the ones"), err[-2000:]
    assert not list((tmp_path / "fresh").glob("*.pt"))

    # a checkpoint of the same architecture trained on the swapped data-bin: the record is what
    # decides, so that checkpoint's record and recorded data-bin are those training would write
    other = tmp_path / "other.pt"
    state["extra_state"][FINGERPRINT_KEY] = torch.stack(
        [dictionaries_fingerprint_of(swapped_bin / f"dict.{lang}.txt") for lang in ("de", "en")])
    state["cfg"]["task"]["data"] = str(swapped_bin)
    torch.save(state, other)
    evaluated, averaged = run_commands([
        (MODATTN_MAIN, ["evaluate", multi30k_bin, "--checkpoints", other, checkpoint, "--subset", "valid", "--beam",
                        "1", "--work-dir", tmp_path / "eval", "--", "--max-len-b", "5"]),
        (MODATTN_MAIN, ["average", "--inputs", checkpoint, other, "--output", tmp_path / "averaged.pt"]),
    ])
    code, out, err = evaluated
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err).startswith(f"fairseq-modattn evaluate: error: {other}: the data-bin's dictionaries are not "
                                     "the ones the checkpoint was built with"), err[-2000:]
    assert not (tmp_path / "eval" / "results.json").exists() and not (tmp_path / "eval" / "averaged.pt").exists()
    code, out, err = averaged
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert last_line(err) == (
        f"fairseq-modattn average: error: {other} was trained with other dictionaries than {checkpoint} (source "
        f"{shown(state['extra_state'][FINGERPRINT_KEY][0])}, target {shown(state['extra_state'][FINGERPRINT_KEY][1])} "
        f"against source {shown(recorded[0])}, target {shown(recorded[1])}): checkpoints of different dictionaries "
        "cannot be averaged"), err[-2000:]
    assert not (tmp_path / "averaged.pt").exists()


def test_plain_checkpoint_without_a_record_is_compared_with_its_recorded_data_bin(multi30k_bin, reordered_bin,
                                                                                 transformer_run, tmp_path, caplog):
    """A checkpoint that records no fingerprint (saved by fairseq without the plugin, or before
    the record): the data-bin given now is compared with the one its task recorded."""
    trained_on = transformer_run / "train_bin"
    checkpoint = without_record(transformer_run / "run" / "checkpoint_last.pt", tmp_path / "old.pt")

    def evaluate(data, work):
        return run([MODATTN, "evaluate", data, "--path", checkpoint, "--subset", "valid", "--beam", "1",
                    "--work-dir", tmp_path / work, "--", "--max-len-b", "5"])

    code, out, err = evaluate(reordered_bin, "e1")
    line = last_line(err)
    assert code == 1 and "Traceback" not in out + err, err[-3000:]
    assert line.startswith("fairseq-modattn evaluate: error: the data-bin's dictionaries are not the ones the "
                           f"checkpoint was trained with: it was trained on {trained_on.resolve()}, whose dict.de.txt "
                           f"is {dictionary_fingerprint(multi30k_bin / 'dict.de.txt')}"), line
    assert_names_both(line, multi30k_bin, reordered_bin)
    assert not (tmp_path / "e1" / "results.json").exists()
    with pytest.raises(AnalysisError, match=re.escape(f"it was trained on {trained_on.resolve()}")):
        load_model(checkpoint, reordered_bin)  # serve's translator, redundancy, plot
    # another folder with the same dictionaries, or the same folder as it was when the checkpoint
    # was saved: loads without a warning; the same folder with its dictionaries written again
    # since: one warning, since there is nothing to compare with
    with caplog.at_level("WARNING"):
        load_model(checkpoint, multi30k_bin)
        load_model(checkpoint, trained_on)
    assert not [r for r in caplog.records if "cannot tell" in r.getMessage()]
    later = checkpoint.stat().st_mtime + 10
    os.utime(trained_on / "dict.de.txt", (later, later))
    with caplog.at_level("WARNING"):
        load_model(checkpoint, trained_on)
    warnings = [r.getMessage() for r in caplog.records if "cannot tell" in r.getMessage()]
    assert len(warnings) == 1 and "it recorded this same data-bin, whose dictionaries were written again" \
        in warnings[0], warnings
    caplog.clear()
    # the recorded folder is gone: one warning line, and the evaluation runs
    shutil.rmtree(trained_on)
    code, out, err = evaluate(multi30k_bin, "e2")
    warnings = [line for line in out.splitlines() if "cannot tell" in line]
    assert code == 0 and (tmp_path / "e2" / "results.json").is_file(), err[-3000:]
    assert warnings == [f"warning: cannot tell whether the dictionaries of {Path(multi30k_bin).absolute()} are the "
                        f"ones {checkpoint} was trained with: the data-bin it recorded, {trained_on.resolve()}, no "
                        "longer holds dict.de.txt and dict.en.txt"], out
    with caplog.at_level("WARNING"):
        load_model(checkpoint, reordered_bin)  # cannot tell any more: loads, and warns
    warnings = [r.getMessage() for r in caplog.records if "cannot tell" in r.getMessage()]
    assert len(warnings) == 1 and f"{trained_on.resolve()}, no longer holds" in warnings[0], warnings
    # the checkpoint that records its dictionaries needs no folder to compare with
    with pytest.raises(AnalysisError, match="the data-bin's dictionaries are not the ones the checkpoint was built"):
        load_model(transformer_run / "run" / "checkpoint_last.pt", reordered_bin)
