"""``fairseq-modattn compare``: is one system better than another on this test set, by BLEU, chrF and TER?

Two or more systems, the first the baseline, each given by one or more ``evaluate`` results JSONs
(several are the seeds of one system; the JSON names its detokenised ``hyp.txt`` and ``ref.txt``
under ``"hypotheses_file"`` and ``"references_file"``) or by plain hypothesis files (one
detokenised sentence a line, with ``--references``). Every system is scored against the same
reference; each difference to the baseline gets the paired bootstrap's 95 % interval, p-value and
verdict (analysis/significance.py, seeds pooled sentence by sentence), printed as a table and
optionally written to a JSON file.

What it scores must be what ``evaluate`` scored: a results JSON's ``hyp.txt`` and ``ref.txt`` must
still have the SHA-256 it records (``hypotheses_sha256``, ``references_sha256``), and its
sacreBLEU, recomputed from them with its own tokenizer and case, must be the one it records (the
one check a JSON written before the checksums gets). It refuses, in one line and before the
bootstrap: one file given as two seeds of a system (by identity: another spelling, a symlink, a
hard link), fewer than ``MIN_SAMPLES`` resamples, resamples that would not fit in memory, a line
longer than ``MAX_LINE_CHARS`` characters (sacreBLEU's TER would take minutes and gigabytes on
it), and a ``--json`` whose folder cannot be written (probed first; its lock is then held to the
end).
"""

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..analysis import AnalysisError
from ..analysis.significance import (
    MAX_LINE_CHARS,
    METRIC_LABELS,
    METRICS,
    MIN_SAMPLES,
    RESAMPLE_BYTES_PER_CELL,
    SACREBLEU_SEED,
    MetricComparison,
    check_resample_memory,
    compare_systems,
)
from ..atomic_files import check_output_file, write_json_atomically
from ..folder_lock import exclusive_use
from ..help_format import DefaultsHelpFormatter

PROG = "fairseq-modattn compare"
#: the mark of a --json file this command wrote, the only kind it overwrites
WRITTEN_BY = PROG


@dataclass
class SystemInput:
    """One system: its name, the files given for it, and each run's (seed's) hypotheses; for
    each run given by a results JSON, (the JSON, what it records), else None."""

    name: str
    inputs: List[Path]
    hypotheses_files: List[Path] = field(default_factory=list)
    runs: List[List[str]] = field(default_factory=list)
    recorded: List[Optional[Tuple[Path, Dict[str, Any]]]] = field(default_factory=list)


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --system NAME FILE [FILE ...] --system NAME FILE [FILE ...] [...] [--references REF] "
              "[options]",
        formatter_class=DefaultsHelpFormatter,
        description="Paired bootstrap comparison of two or more translation systems on one test set, by "
                    "sacreBLEU's BLEU, chrF and TER: each system's corpus score, and for each system after the "
                    "first (the baseline) the difference to the baseline with its 95 % interval, p-value and "
                    "verdict. Several files of one system are its training seeds: they are pooled sentence by "
                    "sentence (a resample that draws sentence i draws every seed's translation of it).",
        epilog="Example: fairseq-modattn compare --system transformer runs/t1/results.json runs/t2/results.json "
               "--system dma runs/d1/results.json runs/d2/results.json --json compare.json. "
               "Verdict: 'better' or 'worse' when the 95 % interval of the difference excludes 0, else 'no "
               "difference'; higher BLEU and chrF are better, lower TER is better. The p-value is sacreBLEU's "
               "paired bootstrap p-value (sacrebleu --paired-bs) on the same resamples, but for two systems that "
               "score the same on every resample: p = 1 and 'no difference (identical)', where sacreBLEU prints "
               "1/(samples+1). Lines: at most "
               f"{MAX_LINE_CHARS:,} characters in every hypothesis and reference file (no sentence is that long; "
               "sacreBLEU's TER would take minutes and gigabytes on a longer one); a longer one is refused, naming "
               "its file and line. docs/analysis.md, 'Comparing systems', says how to read the table.",
    )
    p.add_argument("--system", nargs="+", action="append", metavar=("NAME FILE", "FILE"), required=True,
                   help="a system: its name, then one or more files, one per training seed: results JSONs of "
                        "fairseq-modattn evaluate (ending in .json; their \"hypotheses_file\" and "
                        "\"references_file\" are read, and must still be the text evaluate scored: the "
                        "checksums and the sacreBLEU the JSON records) or detokenised hypothesis files (one "
                        "sentence a line, in test-set order; needs --references). Each seed's file once: one "
                        "file given twice (under another name, a symlink or a hard link) is refused. Repeat "
                        "for every system; the first is the baseline")
    p.add_argument("--references", metavar="FILE",
                   help="the detokenised reference, one sentence a line, in test-set order: required with "
                        "hypothesis files; with results JSONs it must equal their references")
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS), metavar="METRIC",
                   help=f"the metrics to compare, from: {', '.join(METRICS)}")
    p.add_argument("--samples", type=int, default=1000,
                   help=f"bootstrap resamples of the test set, at least {MIN_SAMPLES} (fewer leave the 95 %% "
                        "interval's ends to one or two resamples). They take "
                        f"{RESAMPLE_BYTES_PER_CELL} bytes of memory per resample and sentence (1000 resamples of "
                        "3,000 sentences: 48 MB); more than the memory available is refused")
    p.add_argument("--seed", type=int, default=SACREBLEU_SEED,
                   help="seed of the resampling (sacreBLEU's default, so the p-value is what sacrebleu --paired-bs "
                        "prints for one file per system)")
    p.add_argument("--tokenize", metavar="TOK",
                   help="sacreBLEU's BLEU tokenizer (default: the results JSONs' \"sacrebleu_tokenize\", else 13a)")
    p.add_argument("--case-sensitive", action="store_true",
                   help="always score BLEU and chrF case-sensitively. By default, as evaluate does, they are "
                        "case-insensitive (sacreBLEU lowercase=True, case:lc in their signatures) when a system's "
                        "hypotheses are all lower case and the references are not. TER is sacreBLEU's, "
                        "case-insensitive either way")
    p.add_argument("--json", metavar="OUT",
                   help="also write the comparison to this JSON file (an existing file is replaced only when "
                        "this command wrote it; a folder that cannot be written is refused before any work)")
    return p


# ------------------------------------------------------------------ reading the inputs
def _read_text(path: Path, what: str) -> List[str]:
    """The lines of PATH; AnalysisError (WHAT: ...) for an unreadable file or a line longer than
    MAX_LINE_CHARS, found while reading, so reading stops at the first such line."""
    from ..data.errors import DataError
    from ..data.readers import iter_lines

    lines = []
    try:
        for number, line in enumerate(iter_lines(path, allow_empty=True), 1):
            if len(line) > MAX_LINE_CHARS:
                raise AnalysisError(f"{what}: {path} line {number} has {len(line):,} characters, more than the "
                                    f"{MAX_LINE_CHARS:,} compare scores in a line (no sentence is that long: a "
                                    "binary file, or a whole document on one line?)")
            lines.append(line)
    except DataError as e:
        raise AnalysisError(f"{what}: {e}") from None
    return lines


def _load_results(path: Path) -> Dict:
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AnalysisError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AnalysisError(f"{path} is not a readable JSON file ({e})") from None
    if not isinstance(results, dict):
        raise AnalysisError(f"{path} is not a results JSON of fairseq-modattn evaluate (not a JSON object)")
    for key in ("hypotheses_file", "references_file"):
        if not isinstance(results.get(key), str):
            raise AnalysisError(f"{path} has no \"{key}\": it is not a results JSON of an evaluate that writes "
                                "hyp.txt and ref.txt; rerun evaluate, or give the hypotheses as a text file with "
                                "--references")
    return results


def _named_file(results_path: Path, value: str) -> Path:
    """A file a results JSON names: absolute as evaluate writes it; a relative one is taken
    relative to the JSON's folder."""
    path = Path(value)
    return path if path.is_absolute() else results_path.parent / path


def _identity(path: Path) -> Optional[Tuple[int, int]]:
    """(device, inode) of the file PATH names, links followed: one for every name of one file
    (another spelling, a symlink, a hard link). None when it cannot be read (reported later)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _refuse_one_file_as_two_seeds(system: SystemInput):
    """AnalysisError when two seeds of SYSTEM read one hypothesis file: it would count one run's
    translations twice, as if two trainings had agreed on every sentence, and narrow the interval."""
    seen: Dict[Tuple[int, int], int] = {}
    for i, path in enumerate(system.hypotheses_files):
        identity = _identity(path)
        if identity is None:
            continue
        if identity in seen:
            raise AnalysisError(f"system {system.name}: {_seed_file(system, seen[identity])} and "
                                f"{_seed_file(system, i)} are one file (the same path, a symlink or a hard link), "
                                "which would count one run as two seeds; give each seed's file once")
        seen[identity] = i


def _seed_file(system: SystemInput, k: int) -> str:
    """The K-th file given for SYSTEM, and the hypothesis file it names when it is a results JSON."""
    given, hypotheses = system.inputs[k], system.hypotheses_files[k]
    return str(given) if given == hypotheses else f"{given} (its {hypotheses})"


def _check_checksums(system: SystemInput):
    """AnalysisError when a text file a results JSON of SYSTEM names has changed since evaluate
    wrote it: its SHA-256 is not the one the JSON records. A JSON without checksums (written
    before evaluate recorded them) is checked by its score alone (:func:`_check_recorded_score`)."""
    from ..analysis.scoring import scored_text_sha256

    for recorded in system.recorded:
        if recorded is None:
            continue
        json_path, results = recorded
        for file_key, sum_key in (("hypotheses_file", "hypotheses_sha256"), ("references_file", "references_sha256")):
            expected = results.get(sum_key)
            path = _named_file(json_path, results[file_key])
            if not isinstance(expected, str) or not path.is_file():
                continue  # no checksum recorded; a missing file is reported when it is read
            if scored_text_sha256(path) != expected:
                raise AnalysisError(f"system {system.name}: {path} has changed since evaluate wrote {json_path} "
                                    f"(its SHA-256 is not the \"{sum_key}\" recorded there): it is not the text "
                                    f"that was scored; evaluate again, or compare the file as it is now as a "
                                    "hypothesis file with --references")


def _check_recorded_score(system: SystemInput, references: Sequence[str]):
    """AnalysisError when a results JSON of SYSTEM records a sacreBLEU that its hypotheses, scored
    again against REFERENCES (equal to the JSON's own, checked before) with its tokenizer and
    case, do not give: the files are not the text it scored, or its score was edited."""
    from ..analysis.scoring import detok_sacrebleu

    for recorded, hyps in zip(system.recorded, system.runs):
        if recorded is None:
            continue
        json_path, results = recorded
        score = results.get("sacrebleu")
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            continue  # nothing recorded to check against
        tokenize = results.get("sacrebleu_tokenize") if isinstance(results.get("sacrebleu_tokenize"), str) else "13a"
        lowercase = results.get("lowercase") is True
        again, signature = detok_sacrebleu(hyps, references, tokenize, lowercase=lowercase)
        if abs(again - score) > 1e-6:
            import sacrebleu

            recorded_version = (results.get("versions") or {}).get("sacrebleu")
            versions = (f"; it was scored with sacreBLEU {recorded_version}, this is {sacrebleu.__version__}"
                        if recorded_version and recorded_version != sacrebleu.__version__ else "")
            raise AnalysisError(f"system {system.name}: {json_path} records sacreBLEU {score:.2f}, but its "
                                f"{_named_file(json_path, results['hypotheses_file'])} scores {again:.2f} against "
                                f"its references ({signature}){versions}: the files are not the text it scored; "
                                "evaluate again")


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    if len(a) != len(b):
        return f"{len(a)} lines vs {len(b)}"
    line = next(i for i, (x, y) in enumerate(zip(a, b), 1) if x != y)
    return f"first difference at line {line}"


def read_systems(specs: Sequence[Sequence[str]], references: Optional[str]):
    """(systems, reference lines, the reference file used, tokenizers the results JSONs name) of
    the --system SPECS (NAME FILE...) and --references. Every reference named must hold the same
    lines; every run must have one line per reference, of at most MAX_LINE_CHARS characters; no
    file may be two seeds of one system; a results JSON's files must be what it scored (its
    checksums, then its sacreBLEU)."""
    systems: List[SystemInput] = []
    reference_sources: List[Path] = [Path(references)] if references else []
    tokenizers = set()
    for name, *files in specs:
        system = SystemInput(name, [Path(f) for f in files])
        for path in system.inputs:
            if path.suffix == ".json":
                results = _load_results(path)
                system.hypotheses_files.append(_named_file(path, results["hypotheses_file"]))
                system.recorded.append((path, results))
                reference_sources.append(_named_file(path, results["references_file"]))
                if isinstance(results.get("sacrebleu_tokenize"), str):
                    tokenizers.add(results["sacrebleu_tokenize"])
            else:
                if references is None:
                    raise AnalysisError(f"system {name}: {path} is a hypothesis file (not .json): give the "
                                        "reference with --references FILE")
                system.hypotheses_files.append(path)
                system.recorded.append(None)
        _refuse_one_file_as_two_seeds(system)
        systems.append(system)
    for system in systems:  # before anything is read: the file named, not a consequence of it
        _check_checksums(system)

    reference_file = reference_sources[0]
    lines = _read_text(reference_file, "references")
    for other in reference_sources[1:]:
        if other.resolve() != reference_file.resolve():
            other_lines = _read_text(other, "references")
            if other_lines != lines:
                raise AnalysisError(f"the systems are not scored against one reference: {other} differs from "
                                    f"{reference_file} ({_first_difference(other_lines, lines)})")
    for system in systems:
        for path in system.hypotheses_files:
            hyps = _read_text(path, f"system {system.name}")
            if len(hyps) != len(lines):
                raise AnalysisError(f"system {system.name}: {path} has {len(hyps)} lines but the reference "
                                    f"{reference_file} has {len(lines)}; one hypothesis per reference sentence, "
                                    "in test-set order")
            system.runs.append(hyps)
    if not lines:
        raise AnalysisError(f"the reference {reference_file} is empty: no sentences to compare")
    for system in systems:
        _check_recorded_score(system, lines)
    return systems, lines, reference_file, tokenizers


def _check_json_output(path: Path):
    """Refuse --json OUT when OUT exists and this command did not write it (before any work)."""
    check_output_file(path, "--json", error=AnalysisError)
    if not path.exists():
        return
    try:
        written_by = json.loads(path.read_text(encoding="utf-8")).get("written_by")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        written_by = None
    if written_by != WRITTEN_BY:
        raise AnalysisError(f"--json {path} exists and was not written by {PROG}; give another file, or "
                            "remove it yourself")


def _check_json_writable(path: Path):
    """Refuse --json OUT, before any work, when no file can be created in its folder (created if
    need be, as the write at the end does): probed by creating and removing the temporary that
    write uses (``atomic_files``' ``.NAME.tmp-PID``). The lock taken next is no such probe: it
    may be taken without writing (another user's lock file, a folder's own identity)."""
    probe = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        os.unlink(probe)
    except OSError as e:  # a read-only folder, a parent that is a file, no permission
        raise AnalysisError(f"--json {path} is not writable (cannot create {probe}: {e.strerror or e}); give a "
                            "folder you can write to") from None


# ------------------------------------------------------------------ the report
def _number(value: float) -> str:
    return f"{value:.2f}"


def table(systems: Sequence[SystemInput], results: Dict[str, MetricComparison]) -> str:
    """One row per metric and system: score, and for systems after the baseline the difference
    with its 95 % interval, p-value and verdict."""
    header = ("metric", "system", "seeds", "score", "Δ [95 % CI]", "p", "verdict")
    rows = []
    for metric, result in results.items():
        label = METRIC_LABELS[metric]
        for system in systems:
            cells = [label, system.name, str(len(system.runs)), _number(result.scores[system.name])]
            c = result.comparisons.get(system.name)
            if c is None:
                cells += ["(baseline)", "", ""]
            else:
                verdict = f"{c.verdict} (identical)" if c.identical else c.verdict
                cells += [f"{c.delta:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}]", f"{c.p_value:.4f}", verdict]
            rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3}  # numbers aligned right

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    if "ter" in results:
        lines.append("TER counts edits: lower is better, so a negative difference is an improvement")
    if any(c.identical for result in results.values() for c in result.comparisons.values()):
        lines.append("identical: the same score as the baseline on the test set and on every resample (the "
                     "same translations, or ones the metric cannot tell apart), so p = 1")
    return "\n".join(lines)


def report(systems: Sequence[SystemInput], results: Dict[str, MetricComparison], settings: Dict) -> Dict:
    import sacrebleu

    return {
        "written_by": WRITTEN_BY,
        "baseline": systems[0].name,
        "systems": [{"name": s.name, "inputs": [str(p.resolve()) for p in s.inputs],
                     "hypotheses_files": [str(p.resolve()) for p in s.hypotheses_files], "seeds": len(s.runs)}
                    for s in systems],
        **settings,
        "metrics": {metric: result.as_dict() for metric, result in results.items()},
        "versions": {"sacrebleu": sacrebleu.__version__, "python": sys.version.split()[0]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def run_comparison(args) -> int:
    output = Path(args.json) if args.json else None
    if output is None:
        return _compare(args, None)
    _check_json_output(output)
    _check_json_writable(output)  # here, not after the bootstrap
    # the lock held to the end, so no other compare writes OUT meanwhile
    with exclusive_use(output, error=AnalysisError, what="--json"):
        _check_json_output(output)  # again under the lock: another command may have written it meanwhile
        return _compare(args, output)


def _compare(args, output: Optional[Path]) -> int:
    from ..analysis.scoring import LOWERCASE_REASON, lowercased_system

    systems, references, reference_file, tokenizers = read_systems(args.system, args.references)
    check_resample_memory(len(references), args.samples, "--samples")
    if args.tokenize is None and len(tokenizers) > 1:
        raise AnalysisError(f"the results JSONs were scored with different sacreBLEU tokenizers "
                            f"({', '.join(sorted(tokenizers))}): choose one with --tokenize")
    tokenize = args.tokenize or (tokenizers.pop() if tokenizers else "13a")
    lowered = [s.name for s in systems if lowercased_system([h for run in s.runs for h in run], references)]
    lowercase = bool(lowered) and not args.case_sensitive
    if lowered:
        said = ("warning: BLEU and chrF are case-sensitive as --case-sensitive asks" if args.case_sensitive
                else "BLEU and chrF are case-insensitive (sacreBLEU lowercase=True)")
        print(f"{said}: for {', '.join(lowered)}, {LOWERCASE_REASON}")
    metrics = list(dict.fromkeys(args.metrics))  # each once, in the order given
    results = compare_systems([(s.name, s.runs) for s in systems], references, metrics=metrics,
                              samples=args.samples, seed=args.seed, tokenize=tokenize, lowercase=lowercase)
    settings = {"references_file": str(reference_file.resolve()), "sentences": len(references),
                "samples": args.samples, "seed": args.seed, "tokenize": tokenize, "lowercase": lowercase,
                "lowercase_systems": lowered}
    print(f"{len(systems)} systems against {reference_file} ({len(references)} sentences); paired bootstrap, "
          f"{args.samples} resamples, seed {args.seed}, seeds pooled; baseline {systems[0].name}")
    print()
    print(table(systems, results))
    print()
    for metric, result in results.items():
        print(f"{METRIC_LABELS[metric]} signature: {result.signature}")
    if output is not None:
        write_json_atomically(report(systems, results, settings), output)
        print(f"comparison written to {output}")
    return 0


def compare(argv: List[str]) -> int:
    """``fairseq-modattn compare``: exit 0 on success, 1 on bad input, 2 on usage errors."""
    parser = compare_parser()
    args = parser.parse_args(argv)
    short = [spec[0] for spec in args.system if len(spec) < 2]
    if short:
        parser.error(f"--system {short[0]} names no file: give --system NAME FILE [FILE ...]")
    if len(args.system) < 2:
        parser.error("give at least two --system NAME FILE [FILE ...] (the first is the baseline)")
    if args.samples < MIN_SAMPLES:
        # one line, without argparse's usage: the flag is right, its value too small
        print(f"{PROG}: error: --samples {args.samples}: give at least {MIN_SAMPLES} resamples (with fewer the "
              "95 % interval's ends are one or two resamples' differences, and p cannot go below 0.01); "
              "sacreBLEU's default is 1000", file=sys.stderr)
        return 2
    try:
        return run_comparison(args)
    except AnalysisError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
