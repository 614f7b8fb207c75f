"""``fairseq-modattn evaluate``: the paper's evaluation protocol.

One command does what docs/design.md, "Evaluation definitions", asks for: average the last N
epoch checkpoints (the mean ``fairseq-modattn average``, cli/average.py, writes), run the real
``fairseq-generate`` (beam 5, ``--remove-bpe``) on a split, check that every sentence of the
split was translated (fairseq main silently drops batches: docs/design.md, "fairseq
pitfalls"), and report fairseq's tokenized BLEU, detokenized sacreBLEU, chrF and TER with their
signatures, optionally COMET (``--comet MODEL``, the ``[comet]`` extra) and, for WMT14,
compound-split BLEU, in a JSON file, with the generation options fairseq-generate ran with
(arguments after ``--`` included). sacreBLEU and chrF of a lower-cased system against true-case
references are case-insensitive unless ``--case-sensitive``.

Beside the JSON go the detokenized hypotheses and references that were scored, one sentence a
line in the split's order (:func:`transcript_paths`), for any other scorer (``sacrebleu
--paired-bs``, ``fairseq-modattn compare``); the JSON names them.
"""

import argparse
import contextlib
import datetime
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import child_processes
from ..analysis import AnalysisError, scoring
from ..analysis import checkpoints as ckpt
from ..atomic_files import check_output_file, load_json, write_json_atomically, write_lines
from ..data.errors import DataError
from ..data.readers import read_lines
from ..disk_space import describe_disk_full
from ..folder_lock import exclusive_use
from .average import add_checkpoint_selection
from .fairseq_commands import PLUGIN_DIR, fairseq_script

# Flags of fairseq-generate that this command sets itself, or that would move the hypotheses
# out of its stdout; passing them after "--" would silently change what is evaluated.
RESERVED_GENERATE_FLAGS = {
    "--path": "choose checkpoints with --checkpoint-dir/--checkpoints/--path",
    "--gen-subset": "use --subset",
    "--results-path": "the output is always saved to WORK_DIR/generate-SUBSET.txt",
    "--user-dir": "the plugin directory is always passed",
}


def _refuse_directory_output(path, flag: str = "--output"):
    """AnalysisError '--output X is a directory; give a file path' (checked before any work)."""
    check_output_file(path, flag, error=AnalysisError)


# ------------------------------------------------------------------ the scored text beside the JSON
def transcript_paths(output) -> Tuple[Path, Path]:
    """(hypotheses file, references file) beside the results JSON OUTPUT: ``hyp.txt`` and
    ``ref.txt`` for the default ``results.json``, else ``STEM.hyp.txt`` and ``STEM.ref.txt``, so
    several results files in one folder (``--output res/dma.json``, ``--output res/base.json``)
    keep their own."""
    output = Path(output)
    prefix = "" if output.name == "results.json" else output.stem + "."
    return output.parent / f"{prefix}hyp.txt", output.parent / f"{prefix}ref.txt"


def _check_transcripts_writable(output) -> None:
    """AnalysisError, before any work, unless the transcripts of OUTPUT may be written: each is
    missing, or is the file that the results JSON OUTPUT already names (an earlier evaluation
    into OUTPUT wrote both). Any other file there is someone else's, and is never replaced. (Two
    evaluations into one OUTPUT are refused by its lock, which so covers its transcripts too.)"""
    output = Path(output)
    named: set = set()
    if output.is_file():
        try:
            recorded = load_json(output)
        except (ValueError, OSError):
            recorded = None
        if isinstance(recorded, dict):
            named = {recorded.get("hypotheses_file"), recorded.get("references_file")}
    for path in transcript_paths(output):
        check_output_file(path, "the scored text", error=AnalysisError)
        if (path.exists() or path.is_symlink()) and str(path.resolve()) not in named:
            raise AnalysisError(f"{path} exists and {output} does not name it as its scored text (an earlier "
                                "evaluation into that results file would): it is not this command's to replace; "
                                "move it away, or give another --output")


def _write_transcripts(output, hyps: Sequence[str], refs: Sequence[str]) -> Dict[str, str]:
    """Write the scored HYPS and REFS beside OUTPUT (each atomically); their absolute paths as
    the results' ``hypotheses_file`` and ``references_file``."""
    hyp_path, ref_path = transcript_paths(output)
    for path, lines in ((hyp_path, hyps), (ref_path, refs)):
        if any("\n" in line or "\r" in line for line in lines):  # one sentence a line, whatever reads it
            raise AnalysisError(f"a sentence to write to {path} holds a line break")
        write_lines(path, lines)
    return {"hypotheses_file": str(hyp_path.resolve()), "references_file": str(ref_path.resolve())}


def _with_checksums(transcripts: Dict[str, str]) -> Dict[str, str]:
    """TRANSCRIPTS (``hypotheses_file``, ``references_file``) and the SHA-256 of each file as
    written, ``hypotheses_sha256`` and ``references_sha256``: ``compare`` refuses a file that no
    longer matches (changed since, so no longer the text these scores are of)."""
    return {**transcripts, "hypotheses_sha256": scoring.scored_text_sha256(transcripts["hypotheses_file"]),
            "references_sha256": scoring.scored_text_sha256(transcripts["references_file"])}


# ------------------------------------------------------------------ the data-bin split
def _split_prefixes(data: Path, subset: str, src: Optional[str], tgt: Optional[str]) -> Tuple[List[Path], str, str]:
    """(source-side index prefixes of SUBSET, SUBSET1, ..., source lang, target lang).

    fairseq's translation task loads ``SUBSET``, ``SUBSET1``, ``SUBSET2``... and concatenates
    them, from ``SUBSET.SRC-TGT.SRC`` or the reverse-named ``SUBSET.TGT-SRC.SRC``; the
    languages, when not given, are read from those file names (only one pair may be present).
    """
    if not data.is_dir():
        raise AnalysisError(f"data-bin directory {data} does not exist")
    if (src is None) != (tgt is None):
        raise AnalysisError("give both --source-lang and --target-lang, or neither")
    if src is None:
        pairs = set()
        for idx in data.glob(f"{subset}.*-*.*.idx"):
            match = re.fullmatch(rf"{re.escape(subset)}\.([^.\-]+)-([^.\-]+)\.([^.]+)\.idx", idx.name)
            if match and match.group(3) in match.group(1, 2):
                pairs.add(match.group(1, 2))
        if not pairs:
            raise AnalysisError(f"no {subset}.SRC-TGT.SRC.idx files in {data}: is --subset {subset} binarised there?")
        if len(pairs) > 1:
            found = ", ".join(sorted(f"{a}-{b}" for a, b in pairs))
            raise AnalysisError(f"{data} holds several language pairs for {subset} ({found}): "
                                "give --source-lang and --target-lang")
        src, tgt = pairs.pop()
    prefixes = []
    for k in range(1000):
        name = subset + (str(k) if k else "")
        found = [data / f"{name}.{a}-{b}.{src}" for a, b in ((src, tgt), (tgt, src))
                 if (data / f"{name}.{a}-{b}.{src}.idx").exists()]
        if not found:
            break
        prefixes.append(found[0])
    if not prefixes:
        raise AnalysisError(f"no {subset}.{src}-{tgt}.{src}.idx (or {subset}.{tgt}-{src}.{src}.idx) in {data}")
    return prefixes, src, tgt


def count_split_sentences(data, subset: str, source_lang: Optional[str] = None,
                          target_lang: Optional[str] = None) -> Tuple[int, str, str]:
    """(number of sentences in SUBSET of the data-bin DATA, source lang, target lang), read from
    the index files with fairseq's own indexed-dataset loader, without a task or a model (unlike
    ``analysis.loading.split_size``, which loads the split into a task). An empty or unreadable
    split is an AnalysisError."""
    from fairseq.data import data_utils

    data = Path(str(data).split(os.pathsep)[0])  # fairseq reads evaluation splits from the first shard
    prefixes, src, tgt = _split_prefixes(data, subset, source_lang, target_lang)
    total = 0
    for prefix in prefixes:
        if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.bin").stat().st_size == 0:
            continue  # no sentences; fairseq's MMapIndexedDataset cannot mmap an empty file
        dataset = data_utils.load_indexed_dataset(str(prefix), None)
        if dataset is None:
            raise AnalysisError(f"fairseq cannot read the indexed dataset {prefix}.idx/.bin")
        total += len(dataset)
    if total == 0:
        raise AnalysisError(f"split {subset} of {data} is empty ({prefixes[0]}.idx has no sentences)")
    return total, src, tgt


# ------------------------------------------------------------------ evaluation
def _check_extra_args(extra: Sequence[str]):
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_GENERATE_FLAGS:
            raise AnalysisError(f"extra fairseq-generate argument {flag} is not allowed: "
                                f"{RESERVED_GENERATE_FLAGS[flag]}")


def _read_references(path: Path, expected: int, subset: str) -> List[str]:
    if not Path(path).is_file():
        raise AnalysisError(f"--references {path} does not exist")
    try:  # UTF-8 or an error naming the line, a byte-order mark dropped
        lines = read_lines(path, allow_empty=True)
    except DataError as e:
        raise AnalysisError(f"--references {e}") from None
    if len(lines) != expected:
        raise AnalysisError(f"--references {path} has {len(lines)} lines but split {subset} has {expected} "
                            "sentences: expected one raw (detokenized) reference per sentence, in data-bin order")
    return lines


def _check_every_sentence_translated(result: scoring.GenerateResult, expected: int, subset: str, output: Path):
    """Fail loudly when fairseq-generate did not translate each sentence of the split once:
    BLEU over a subset (fairseq main drops batches; ``--skip-invalid-size-inputs-valid-test``
    drops long sentences) is not the split's BLEU."""
    ids = set(result.hypotheses)
    if len(ids) == expected and ids == set(range(expected)):
        return
    missing = sorted(set(range(expected)) - ids)
    hint = f" (missing ids include {', '.join(map(str, missing[:10]))})" if missing else ""
    raise AnalysisError(
        f"fairseq-generate translated {len(ids)} of the {expected} sentences of split {subset}{hint}; "
        "BLEU over a subset of the split is not comparable (sentences are dropped by "
        "--skip-invalid-size-inputs-valid-test / max positions, or by fairseq's dropped last batch, "
        f'see docs/design.md, "fairseq pitfalls"); full output in {output}')


def _run_generate(command: List[str], output: Path, expected: int, log: Callable[[str], None]) -> str:
    """Run fairseq-generate with its stdout kept in OUTPUT (stderr in OUTPUT.log), logging how
    many sentences are translated so far (every tenth of the split)."""
    log(f"running: {shlex.join(command)}")
    lines, done, step = [], 0, max(1, expected // 10)
    with open(output.with_suffix(".log"), "w", encoding="utf-8") as err, child_processes.running(
            command, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("H-"):
                done += 1
                if done % step == 0 or done == expected:
                    log(f"translated {done}/{expected} sentences")
        code = proc.wait()
    stdout = "".join(lines)
    output.write_text(stdout, encoding="utf-8")
    if code != 0:
        log_file = output.with_suffix(".log")
        said = last_error_line(stdout + log_file.read_text(encoding="utf-8", errors="replace"))
        one_line = re.match(r"fairseq-generate: error: (.+)$", said)
        # compat's one-line errors (fix 15: a damaged checkpoint, a data-bin of other dictionaries)
        if one_line:
            raise AnalysisError(f"fairseq-generate: {one_line.group(1)}")
        raise AnalysisError(f"fairseq-generate exited with status {code}{f': {said}' if said else ''} "
                            f"(its output: {output}, {log_file})")
    return stdout


_ERROR_LINE = re.compile(r"^(?:[\w.]+(?:Error|Exception|Interrupt)\b|[\w.-]+: error: )")


def last_error_line(text: str) -> str:
    """The last line of a failed command's output that states the error (Python's final
    traceback line or argparse's ``PROG: error: ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return next((line for line in reversed(lines) if _ERROR_LINE.match(line)), lines[-1] if lines else "")[:500]


def _json_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


def generation_options(generate_args: Sequence[str]) -> Dict[str, object]:
    """fairseq's generation options (every field of its GenerationConfig: beam, lenpen,
    max_len_b, ..., defaults included) for the fairseq-generate arguments GENERATE_ARGS (the
    command line without the program), parsed by fairseq's own parser exactly as
    ``fairseq-generate`` builds it, so a later ``--beam 4`` or ``--beam=4`` wins over an
    earlier ``--beam 5``. Arguments fairseq rejects are an AnalysisError."""
    import contextlib
    import dataclasses
    import io
    import logging

    from fairseq import options
    from fairseq.dataclass.configs import GenerationConfig

    parser = options.get_generation_parser()
    parser.prog = "fairseq-generate"
    # fairseq_cli.generate.cli_main adds this one to the generation parser
    parser.add_argument("--arch", "-a", metavar="ARCH", default="wav2vec2")
    messages, quiet = io.StringIO(), logging.getLogger("fairseq.utils")  # "--user-dir ... already imported"
    level = quiet.level
    try:
        quiet.setLevel(logging.WARNING)
        with contextlib.redirect_stderr(messages):
            args = options.parse_args_and_arch(parser, input_args=list(generate_args))
    except SystemExit:
        said = messages.getvalue().strip().splitlines()
        raise AnalysisError("fairseq-generate rejects its arguments: "
                            f"{said[-1] if said else shlex.join(generate_args)}") from None
    finally:
        quiet.setLevel(level)
    options = {f.name: _json_value(getattr(args, f.name)) for f in dataclasses.fields(GenerationConfig)
               if not f.name.startswith("_") and hasattr(args, f.name)}
    _check_length_limits(options)
    return options


def _check_length_limits(options: Dict[str, object]) -> None:
    """fairseq's SequenceGenerator asserts min_len <= int(max_len_a * source length + max_len_b)
    for every batch ("min_len cannot be larger than max_len"); for a source of one token (its
    </s>) that fails at once, so say which flags to change before running fairseq-generate."""
    a, b, min_len = options.get("max_len_a"), options.get("max_len_b"), options.get("min_len")
    if not all(isinstance(v, (int, float)) for v in (a, b, min_len)):
        return
    longest = int(a * 1 + b)
    if longest < min_len:
        raise AnalysisError(
            f"fairseq-generate arguments --max-len-a {a} --max-len-b {b} allow translations of at most {longest} "
            f"tokens for a one-token source, fewer than --min-len {min_len} (fairseq-generate would stop with "
            "'min_len cannot be larger than max_len'): give --max-len-b of at least "
            f"{int(min_len - a)} (fairseq's default is 200) or a lower --min-len")


_LOGGED_GENERATION = re.compile(r"fairseq_cli\.generate\b.*?'generation': (\{[^{}]*\})")


def _generation_fairseq_logged(parsed: Dict[str, object], text: str, result: scoring.GenerateResult,
                               output: Path) -> Dict[str, object]:
    """The generation options fairseq-generate logged (its config line, in TEXT: its stdout and
    stderr), checked against PARSED (:func:`generation_options`) and the beam of its BLEU line;
    PARSED when no config line was logged (e.g. LOGLEVEL=WARNING). A disagreement means the
    fairseq-generate that ran is not the fairseq this interpreter parses with: an AnalysisError."""
    import ast

    generation = parsed
    match = _LOGGED_GENERATION.search(text)
    if match:
        try:
            logged = ast.literal_eval(match.group(1))
        except (ValueError, SyntaxError):
            logged = None
        if isinstance(logged, dict):
            differ = sorted(k for k in parsed if k in logged and parsed[k] != logged[k])
            if differ:
                raise AnalysisError(
                    "fairseq-generate logged generation options other than fairseq's parser here gives ("
                    + ", ".join(f"{k}: {logged[k]!r} vs {parsed[k]!r}" for k in differ)
                    + f"); is {fairseq_script('fairseq-generate')} from another fairseq installation? "
                    f"Its log: {output.with_suffix('.log')}")
            generation = {k: _json_value(logged[k]) if k in logged else v for k, v in parsed.items()}
    if result.beam is not None and result.beam != generation["beam"]:
        raise AnalysisError(f"fairseq-generate's BLEU line says beam={result.beam} but its options give "
                            f"beam {generation['beam']}; output in {output}")
    return generation


def _versions(comet: bool = False) -> Dict[str, str]:
    import fairseq
    import sacrebleu
    import torch

    versions = {"fairseq": fairseq.__version__, "torch": torch.__version__, "sacrebleu": sacrebleu.__version__,
                "python": sys.version.split()[0]}
    if comet:
        from ..analysis.comet_scoring import comet_version

        versions["unbabel-comet"] = comet_version()
    return versions


def evaluate_checkpoints(
    data,
    checkpoints: List[Path],
    *,
    subset: str = "test",
    beam: int = 5,
    batch_size: Optional[int] = 128,
    max_tokens: Optional[int] = None,
    lenpen: float = 1.0,
    compound_split: bool = False,
    references: Optional[Path] = None,
    sacrebleu_tokenize: Optional[str] = None,
    cpu: bool = False,
    work_dir,
    extra_generate_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
    source_lang: Optional[str] = None,
    target_lang: Optional[str] = None,
    case_sensitive: bool = False,
    output=None,
    comet: Optional[str] = None,
) -> dict:
    """Average CHECKPOINTS (when more than one), translate SUBSET of DATA with the real
    ``fairseq-generate``, check every sentence was translated, and return the results dict
    (the JSON that ``fairseq-modattn evaluate`` writes).

    ``work_dir`` receives ``averaged.pt`` and ``generate-SUBSET.txt`` (fairseq-generate's stdout;
    its stderr goes to ``generate-SUBSET.log``). The detokenized hypotheses and references that
    were scored go beside OUTPUT, the results JSON the caller writes (default
    ``WORK_DIR/results.json``), in the files :func:`transcript_paths` names, recorded as
    ``hypotheses_file`` and ``references_file``; existing files there that OUTPUT does not name
    are refused. Nothing is written before the inputs are checked.

    COMET, the model COMET names (:mod:`..analysis.comet_scoring`), is loaded before the
    translation, so a missing package or model stops the command at once.

    BEAM and LENPEN go on fairseq-generate's command line before EXTRA_GENERATE_ARGS, which
    override them; the results' ``beam``, ``lenpen`` and ``generation`` (all of fairseq's
    GenerationConfig) are what fairseq-generate ran with. sacreBLEU is case-insensitive when
    the hypotheses are all lower case and the references are not, unless CASE_SENSITIVE
    (:func:`scoring.sacrebleu_scores`).
    """
    import torch

    checkpoints = [Path(c) for c in checkpoints]
    if not checkpoints:
        raise AnalysisError("no checkpoints to evaluate")
    for path in checkpoints:
        if not path.is_file():
            raise AnalysisError(f"checkpoint {path} does not exist")
    _check_extra_args(extra_generate_args)
    expected, src, tgt = count_split_sentences(data, subset, source_lang, target_lang)
    raw_refs = _read_references(references, expected, subset) if references is not None else None
    output = Path(output) if output is not None else Path(work_dir) / "results.json"
    _check_transcripts_writable(output)
    tokenize = sacrebleu_tokenize or ("zh" if tgt == "zh" else "13a")
    generate = fairseq_script("fairseq-generate")
    work_dir = Path(work_dir)
    model_path = work_dir / "averaged.pt" if len(checkpoints) > 1 else checkpoints[0]
    data = os.pathsep.join(str(Path(part).resolve()) for part in str(data).split(os.pathsep))
    command = [generate, data, "--user-dir", str(PLUGIN_DIR), "--path", str(Path(model_path).resolve()),
               "--gen-subset", subset, "--beam", str(beam), "--remove-bpe", "--lenpen", str(lenpen)]
    if batch_size is not None:
        command += ["--batch-size", str(batch_size)]
    if max_tokens is not None:
        command += ["--max-tokens", str(max_tokens)]
    if source_lang is not None:
        command += ["--source-lang", src, "--target-lang", tgt]
    if cpu or not torch.cuda.is_available():
        command.append("--cpu")
    command += [str(a) for a in extra_generate_args]
    generation = generation_options(command[1:])  # what fairseq-generate will run with (-- args win)

    # every checkpoint against the data-bin's dictionaries, before any is averaged: the average of
    # models of other dictionaries is no model, and fairseq-generate sees only the average
    from ..dictionaries import DictionaryMismatchError, check_checkpoint_dictionaries

    for checkpoint in checkpoints:
        try:
            cannot_tell = check_checkpoint_dictionaries(checkpoint, data, src, tgt)
        except DictionaryMismatchError as e:
            raise AnalysisError(f"{checkpoint}: {e}" if len(checkpoints) > 1 else str(e)) from e
        if cannot_tell:
            log(f"warning: {cannot_tell}")
    comet_model = None
    if comet is not None:  # before the translation: a model that cannot be loaded stops the command now
        from ..analysis.comet_scoring import load_comet_model

        log(f"loading the COMET model {comet}")
        comet_model = load_comet_model(comet)
    work_dir.mkdir(parents=True, exist_ok=True)
    if len(checkpoints) > 1:
        log(f"averaging {len(checkpoints)} checkpoints: {', '.join(str(c) for c in checkpoints)}")
        ckpt.save_checkpoint_atomically(ckpt.average_checkpoints(checkpoints), model_path)
    log(f"generating {expected} sentences of {subset} ({src}-{tgt}) with beam {generation['beam']}, "
        f"lenpen {generation['lenpen']}")
    generated = work_dir / f"generate-{subset}.txt"
    stdout = _run_generate(command, generated, expected, log)
    result = scoring.parse_generate_output(stdout)
    _check_every_sentence_translated(result, expected, subset, generated)
    if result.bleu is None:
        raise AnalysisError(f"fairseq-generate printed no 'Generate {subset} with beam=...: BLEU4' line "
                            f"(does the data-bin hold the {tgt} side of {subset}?); output in {generated}")
    if len(result.targets) != expected and (raw_refs is None or compound_split):
        raise AnalysisError(f"fairseq-generate printed {len(result.targets)} T- (reference) lines for "
                            f"{expected} sentences; output in {generated}")
    generation = _generation_fairseq_logged(
        generation, stdout + "\n" + generated.with_suffix(".log").read_text(encoding="utf-8"), result, generated)

    log("scoring")
    ids = range(expected)
    hyps = [result.hypotheses[i] for i in ids]
    detok_hyps = scoring.detokenize(hyps, tgt)
    if raw_refs is None:
        refs_for_sacrebleu = scoring.detokenize([result.targets[i] for i in ids], tgt)
        reference_kind = "moses-detokenized T- lines of fairseq-generate"
    else:
        refs_for_sacrebleu, reference_kind = raw_refs, f"file {Path(references).resolve()}"
    sacre = scoring.translation_scores(detok_hyps, refs_for_sacrebleu, tokenize, case_sensitive=case_sensitive)
    if sacre["lowercase"]:
        log(f"sacreBLEU is case-insensitive (sacreBLEU lowercase=True), and so is chrF: {sacre['lowercase_reason']}; "
            f"the case-sensitive scores, sacreBLEU {sacre['sacrebleu_case_sensitive']:.2f} and chrF "
            f"{sacre['chrf_case_sensitive']:.2f}, are recorded too (--case-sensitive makes them the headline)")
    elif sacre["lowercase_reason"]:
        log(f"warning: sacreBLEU is case-sensitive as --case-sensitive asks, although {scoring.LOWERCASE_REASON}")
    split_bleu = None
    if compound_split:
        split_bleu = scoring.tokenized_bleu([scoring.compound_split(h) for h in hyps],
                                            [scoring.compound_split(result.targets[i]) for i in ids])
    comet_score = None
    if comet_model is not None:
        from ..analysis.comet_scoring import comet_system_score

        if len(result.sources) != expected:
            raise AnalysisError(f"fairseq-generate printed {len(result.sources)} S- (source) lines for "
                                f"{expected} sentences, and COMET needs the sources; output in {generated}")
        sources = scoring.detokenize([result.sources[i] for i in ids], src)
        log(f"scoring with COMET ({comet})")
        comet_score = comet_system_score(comet_model, sources, detok_hyps, refs_for_sacrebleu,
                                         gpus=0 if "--cpu" in command else 1)
    log("sacreBLEU {:.2f}, chrF {:.2f}, TER {:.2f}{} on {} sentences of {}".format(
        sacre["sacrebleu"], sacre["chrf"], sacre["ter"], "" if comet_score is None else f", COMET {comet_score:.4f}",
        expected, subset))
    transcripts = _with_checksums(_write_transcripts(output, detok_hyps, refs_for_sacrebleu))
    return {
        "data": data,
        "subset": subset,
        "source_lang": src,
        "target_lang": tgt,
        "sentences": expected,
        "checkpoints": [str(c.resolve()) for c in checkpoints],
        "averaged": len(checkpoints) > 1,
        "model_path": str(Path(model_path).resolve()),
        "beam": generation["beam"],
        "lenpen": generation["lenpen"],
        "generation": generation,
        "generate_command": shlex.join(command),
        "generate_output": str(generated.resolve()),
        "bleu": result.bleu,
        "bleu_line": result.bleu_line,
        **sacre,
        "sacrebleu_tokenize": tokenize,
        "sacrebleu_references": reference_kind,
        **transcripts,
        "compound_split_bleu": split_bleu,
        "comet": comet_score,
        "comet_model": comet,
        "versions": _versions(comet is not None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


#: the results keys that evaluations made before chrF and TER were scored lack
LATER_KEYS = ("chrf", "chrf_signature", "ter", "ter_signature", "hypotheses_file", "references_file")


def complete_recorded_scores(results: dict, output) -> bool:
    """Give RESULTS, the results JSON OUTPUT of an evaluation made before chrF, TER and the
    scored text files existed, what it lacks, from its kept ``generate_output`` (fairseq-generate's
    stdout) and the references it recorded: the same detokenized text scored again, no
    translation. Its sacreBLEU must come out as recorded (else the kept output is not what was
    scored: an AnalysisError). Writes the transcripts beside OUTPUT; the caller rewrites OUTPUT.
    False when nothing was missing."""
    if all(key in results for key in LATER_KEYS):
        return False
    generated = Path(results["generate_output"])
    if not generated.is_file():
        raise AnalysisError(f"{output} has no chrF/TER and its fairseq-generate output {generated} is gone: "
                            "it cannot be scored again; remove it to evaluate anew")
    _check_transcripts_writable(output)
    result = scoring.parse_generate_output(generated.read_text(encoding="utf-8"))
    ids = range(results["sentences"])
    tgt = results["target_lang"]
    _check_every_sentence_translated(result, results["sentences"], results["subset"], generated)
    hyps = scoring.detokenize([result.hypotheses[i] for i in ids], tgt)
    kind = results["sacrebleu_references"]
    if kind.startswith("file "):
        refs = _read_references(Path(kind[len("file "):]), results["sentences"], results["subset"])
    else:
        refs = scoring.detokenize([result.targets[i] for i in ids], tgt)
    case_sensitive = bool(results.get("lowercase_reason")) and not results.get("lowercase")
    scores = scoring.translation_scores(hyps, refs, results["sacrebleu_tokenize"], case_sensitive=case_sensitive)
    if abs(scores["sacrebleu"] - results["sacrebleu"]) > 1e-6:
        raise AnalysisError(f"{generated} scores sacreBLEU {scores['sacrebleu']:.4f}, but {output} records "
                            f"{results['sacrebleu']:.4f}: the kept output is not what was scored; remove {output} "
                            "to evaluate anew")
    results.update({k: v for k, v in scores.items() if k not in results})
    results.update(_with_checksums(_write_transcripts(output, hyps, refs)))
    return True


def summary_table(results: dict, output: Path) -> str:
    """A few aligned lines with what the paper tables report."""
    names = [Path(c).name for c in results["checkpoints"]]
    rows = [
        ("checkpoints", f"{len(names)} {'averaged' if results['averaged'] else 'used'}: {', '.join(names)}"),
        ("split", f"{results['subset']} ({results['source_lang']}-{results['target_lang']}), "
                  f"{results['sentences']} sentences, all translated"),
        ("BLEU (fairseq, tokenized)", f"{results['bleu']:.2f}"),
        ("sacreBLEU (detokenized)", f"{results['sacrebleu']:.2f}  {results['sacrebleu_signature']}"),
        ("chrF (detokenized)", f"{results['chrf']:.2f}  {results['chrf_signature']}"),
        ("TER (detokenized)", f"{results['ter']:.2f}  {results['ter_signature']}"),
    ]
    if results.get("lowercase_reason"):
        rows.append(("sacreBLEU case-sensitive", f"{results['sacrebleu_case_sensitive']:.2f}  "
                                                 f"{results['sacrebleu_case_sensitive_signature']}"))
        rows.append(("chrF case-sensitive", f"{results['chrf_case_sensitive']:.2f}  "
                                           f"{results['chrf_case_sensitive_signature']}"))
    if results.get("comet") is not None:
        rows.append(("COMET", f"{results['comet']:.4f}  {results['comet_model']}"))
    if results["compound_split_bleu"] is not None:
        rows.append(("compound-split BLEU", f"{results['compound_split_bleu']:.2f}"))
    rows.append(("scored text", f"{results['hypotheses_file']}, {results['references_file']}"))
    rows.append(("results", str(output)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# ------------------------------------------------------------------ evaluate command
def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn evaluate",
        usage="fairseq-modattn evaluate DATA (--checkpoint-dir DIR | --checkpoints F [F ...] | --path F) "
              "[options] [-- extra fairseq-generate args]",
        description="Average checkpoints, translate a data-bin split with fairseq-generate (beam 5, "
                    "--remove-bpe), check every sentence was translated, and write tokenized BLEU, "
                    "detokenized sacreBLEU, chrF and TER (with their signatures), optionally COMET and "
                    "compound-split BLEU to a JSON file, and the scored detokenized hypotheses and "
                    "references beside it (hyp.txt and ref.txt beside results.json, else STEM.hyp.txt "
                    "and STEM.ref.txt). "
                    "Arguments after '--' go to fairseq-generate unchanged (e.g. -- --max-len-b 200) and "
                    "override --beam/--lenpen; the JSON records the generation options fairseq-generate "
                    "ran with (\"beam\", \"lenpen\" and all of them in \"generation\").",
    )
    p.add_argument("data", metavar="DATA", help="the fairseq data-bin directory the model was trained on")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint-dir", metavar="DIR",
                       help="a fairseq --save-dir: average its last N epoch (or update) checkpoints")
    which.add_argument("--checkpoints", nargs="+", metavar="FILE", help="average exactly these checkpoint files")
    which.add_argument("--path", metavar="FILE", help="evaluate this one checkpoint, without averaging")
    add_checkpoint_selection(p, "--checkpoint-dir", " (default 5, the paper's)")
    p.add_argument("--allow-fewer", action="store_true",
                   help="with --checkpoint-dir: average the checkpoints there are when fewer than N exist (warns)")
    p.add_argument("--subset", "--gen-subset", default="test", help="data-bin split to translate (default: test)")
    p.add_argument("--source-lang", help="source language (default: read from the data-bin file names)")
    p.add_argument("--target-lang", help="target language (default: read from the data-bin file names)")
    p.add_argument("--beam", type=int, default=5,
                   help="beam size (default: 5, the paper's; a --beam after '--' overrides it)")
    p.add_argument("--lenpen", type=float, default=1.0,
                   help="length penalty of the beam search (default: 1.0; a --lenpen after '--' overrides it)")
    p.add_argument("--batch-size", type=int, default=128, help="sentences per generation batch (default: 128)")
    p.add_argument("--max-tokens", type=int, help="tokens per generation batch (default: no limit)")
    p.add_argument("--compound-split", action="store_true",
                   help="also report compound-split BLEU (WMT14 en-de: hyphens as ##AT##-##AT##)")
    p.add_argument("--references", metavar="FILE",
                   help="raw detokenized target text, one line per sentence in data-bin order, for sacreBLEU "
                        "(default: the Moses-detokenized T- lines of fairseq-generate)")
    p.add_argument("--sacrebleu-tokenize", metavar="TOK",
                   help="sacreBLEU tokenizer (default: zh when the target language is zh, else 13a)")
    p.add_argument("--case-sensitive", action="store_true",
                   help="always score sacreBLEU case-sensitively. By default, when the hypotheses are all "
                        "lower case and the references are not (a system trained on lower-cased data, as "
                        "the Multi30k and IWSLT recipes make, against true-case --references), sacreBLEU is "
                        "case-insensitive (lowercase=True, case:lc in its signature), the JSON says so in "
                        "\"lowercase\" and \"lowercase_reason\", and the case-sensitive score is kept in "
                        "\"sacrebleu_case_sensitive\"")
    p.add_argument("--comet", metavar="MODEL",
                   help="also score with COMET (needs the optional unbabel-comet package: pip install "
                        "'fairseq-modattn[comet]'): MODEL is a Hugging Face hub name (e.g. Unbabel/wmt22-comet-da; "
                        "downloaded, or found in the hub cache) or a local model folder or checkpoint file; the "
                        "JSON gains \"comet\" (the system score) and \"comet_model\". The model is loaded before "
                        "the translation, so one that cannot be loaded stops the command at once")
    p.add_argument("--cpu", action="store_true", help="generate on CPU (also the default without CUDA)")
    p.add_argument("--output", metavar="FILE",
                   help="results JSON file (default: WORK_DIR/results.json; a directory is refused); the scored "
                        "text goes beside it")
    p.add_argument("--work-dir", metavar="DIR",
                   help="folder for averaged.pt and generate-SUBSET.txt (default: OUTPUT's name + '.work' next "
                        "to --output, else evaluation/ under the checkpoint directory)")
    return p


def _select_checkpoints(args, parser) -> List[Path]:
    counted = (args.num_epoch_checkpoints, args.num_update_checkpoints, args.checkpoint_upper_bound)
    if args.checkpoint_dir is None:
        if any(v is not None for v in counted) or args.allow_fewer:
            parser.error("--num-epoch-checkpoints/--num-update-checkpoints/--checkpoint-upper-bound/"
                         "--allow-fewer need --checkpoint-dir")
        return [Path(args.path)] if args.path else [Path(c) for c in args.checkpoints]
    epochs = args.num_epoch_checkpoints
    if epochs is None and args.num_update_checkpoints is None:
        epochs = 5
    try:
        return ckpt.find_checkpoints(args.checkpoint_dir, epochs, args.num_update_checkpoints,
                                     args.checkpoint_upper_bound, allow_fewer=args.allow_fewer)
    except ckpt.TooFewCheckpointsError as e:
        # a short run (quickstart's, say) has fewer epoch checkpoints than the paper's 5
        raise AnalysisError(f"{e}; pass --allow-fewer to average those, or --path FILE to evaluate one "
                            "checkpoint") from None


def _default_paths(args, checkpoints: List[Path]) -> Tuple[Path, Path]:
    if args.work_dir:
        work_dir = Path(args.work_dir)
    elif args.output:
        work_dir = Path(args.output).parent / (Path(args.output).stem + ".work")
    elif args.checkpoint_dir:
        work_dir = Path(args.checkpoint_dir) / "evaluation"
    else:
        work_dir = checkpoints[-1].parent / "evaluation"
    output = Path(args.output) if args.output else work_dir / "results.json"
    return work_dir, output


def evaluate(argv: List[str]) -> int:
    """``fairseq-modattn evaluate``: exit 0 on success, 1 on bad input or a failed check, 2 on usage errors."""
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = evaluate_parser()
    args = parser.parse_args(argv)
    try:
        _refuse_directory_output(args.output)  # before any work; a folder is never replaced
        checkpoints = _select_checkpoints(args, parser)
        work_dir, output = _default_paths(args, checkpoints)
        _refuse_directory_output(output)  # the default WORK_DIR/results.json too
        if len(checkpoints) > 1:
            _refuse_directory_output(work_dir / "averaged.pt", "the averaged model")
        if work_dir.exists() and not work_dir.is_dir():
            raise AnalysisError(f"--work-dir {work_dir} is a file; give a folder")
        # one writer per folder: two evaluations sharing a work dir would read one averaged.pt
        # (the default results.json lies in the work dir, whose lock covers it, and locking it
        # apart would create the work dir before the inputs are checked)
        with exclusive_use(work_dir, error=AnalysisError, what="--work-dir"), contextlib.ExitStack() as stack:
            if output.parent.resolve() != work_dir.resolve():
                stack.enter_context(exclusive_use(output, error=AnalysisError, what="--output"))
            results = evaluate_checkpoints(
                args.data, checkpoints, subset=args.subset, beam=args.beam, batch_size=args.batch_size,
                max_tokens=args.max_tokens, lenpen=args.lenpen, compound_split=args.compound_split,
                references=Path(args.references) if args.references else None,
                sacrebleu_tokenize=args.sacrebleu_tokenize, cpu=args.cpu, work_dir=work_dir,
                extra_generate_args=extra, log=print, source_lang=args.source_lang,
                target_lang=args.target_lang, case_sensitive=args.case_sensitive, output=output,
                comet=args.comet,
            )
            write_json_atomically(results, output)
    except AnalysisError as e:
        print(f"fairseq-modattn evaluate: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk (averaged.pt, fairseq-generate's output, the results)
        message = describe_disk_full(e, args.work_dir or args.output and Path(args.output).parent)
        if message is None:
            raise
        print(f"fairseq-modattn evaluate: error: {message}", file=sys.stderr)
        return 1
    print()
    print(summary_table(results, output))
    return 0
