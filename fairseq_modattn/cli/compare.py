"""``fairseq-modattn compare``: is one system better than another on this test set, by BLEU, chrF and TER?

Two or more systems, the first the baseline, each given by one or more ``evaluate`` results JSONs
(several are the seeds of one system; the JSON names its detokenised ``hyp.txt`` and ``ref.txt``
under ``"hypotheses_file"`` and ``"references_file"``) or by plain hypothesis files (one
detokenised sentence a line, with ``--references``). Every system is scored against the same
reference; each difference to the baseline gets the paired bootstrap's 95 % interval, p-value and
verdict (analysis/significance.py, seeds pooled sentence by sentence), printed as a table and
optionally written to a JSON file.
"""

import argparse
import datetime
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..analysis import AnalysisError
from ..analysis.significance import METRIC_LABELS, METRICS, SACREBLEU_SEED, MetricComparison, compare_systems
from ..atomic_files import check_output_file, write_json_atomically
from ..folder_lock import exclusive_use
from ..help_format import DefaultsHelpFormatter

PROG = "fairseq-modattn compare"
#: the mark of a --json file this command wrote, the only kind it overwrites
WRITTEN_BY = PROG


@dataclass
class SystemInput:
    """One system: its name, the files given for it, and each run's (seed's) hypotheses."""

    name: str
    inputs: List[Path]
    hypotheses_files: List[Path] = field(default_factory=list)
    runs: List[List[str]] = field(default_factory=list)


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
               "paired bootstrap p-value (sacrebleu --paired-bs) on the same resamples. docs/analysis.md, "
               "'Comparing systems', says how to read the table.",
    )
    p.add_argument("--system", nargs="+", action="append", metavar=("NAME FILE", "FILE"), required=True,
                   help="a system: its name, then one or more files, one per training seed: results JSONs of "
                        "fairseq-modattn evaluate (ending in .json; their \"hypotheses_file\" and "
                        "\"references_file\" are read) or detokenised hypothesis files (one sentence a line, in "
                        "test-set order; needs --references). Repeat for every system; the first is the baseline")
    p.add_argument("--references", metavar="FILE",
                   help="the detokenised reference, one sentence a line, in test-set order: required with "
                        "hypothesis files; with results JSONs it must equal their references")
    p.add_argument("--metrics", nargs="+", choices=METRICS, default=list(METRICS), metavar="METRIC",
                   help=f"the metrics to compare, from: {', '.join(METRICS)}")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples of the test set")
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
                        "this command wrote it)")
    return p


# ------------------------------------------------------------------ reading the inputs
def _read_text(path: Path, what: str) -> List[str]:
    from ..data.errors import DataError
    from ..data.readers import read_lines

    try:
        return read_lines(path, allow_empty=True)
    except DataError as e:
        raise AnalysisError(f"{what}: {e}") from None


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


def _first_difference(a: Sequence[str], b: Sequence[str]) -> str:
    if len(a) != len(b):
        return f"{len(a)} lines vs {len(b)}"
    line = next(i for i, (x, y) in enumerate(zip(a, b), 1) if x != y)
    return f"first difference at line {line}"


def read_systems(specs: Sequence[Sequence[str]], references: Optional[str]):
    """(systems, reference lines, the reference file used, tokenizers the results JSONs name) of
    the --system SPECS (NAME FILE...) and --references. Every reference named must hold the same
    lines; every run must have one line per reference."""
    systems: List[SystemInput] = []
    reference_sources: List[Path] = [Path(references)] if references else []
    tokenizers = set()
    for name, *files in specs:
        system = SystemInput(name, [Path(f) for f in files])
        for path in system.inputs:
            if path.suffix == ".json":
                results = _load_results(path)
                system.hypotheses_files.append(_named_file(path, results["hypotheses_file"]))
                reference_sources.append(_named_file(path, results["references_file"]))
                if isinstance(results.get("sacrebleu_tokenize"), str):
                    tokenizers.add(results["sacrebleu_tokenize"])
            else:
                if references is None:
                    raise AnalysisError(f"system {name}: {path} is a hypothesis file (not .json): give the "
                                        "reference with --references FILE")
                system.hypotheses_files.append(path)
        systems.append(system)

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
                cells += [f"{c.delta:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}]", f"{c.p_value:.4f}", c.verdict]
            rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {2, 3}  # numbers aligned right

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
    if "ter" in results:
        lines.append("TER counts edits: lower is better, so a negative difference is an improvement")
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
    from ..analysis.scoring import LOWERCASE_REASON, lowercased_system

    output = Path(args.json) if args.json else None
    if output is not None:
        _check_json_output(output)
    systems, references, reference_file, tokenizers = read_systems(args.system, args.references)
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
        with exclusive_use(output, error=AnalysisError, what="--json"):
            _check_json_output(output)  # again under the lock: another command may have written it meanwhile
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
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    try:
        return run_comparison(args)
    except AnalysisError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
