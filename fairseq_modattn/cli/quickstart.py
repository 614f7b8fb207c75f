"""``fairseq-modattn quickstart``: a first real run, on a CPU, in minutes.

One command that

1. prepares Multi30k de-en (``fairseq-modattn prepare multi30k``: Moses tokenisation, an 8k
   joint BPE, fairseq-preprocess) from ``--raw-dir``, downloading missing raw files unless
   ``--no-download``; or takes a prepared ``--data`` data-bin;
2. trains a small transformer and a small DMA transformer (``cli/model_recipes.py``; any of
   the recipes with ``--models``) with the real ``fairseq-train``, the same budget and flags,
   several at a time when there are cores for it;
3. evaluates each final model on ``test_2016_flickr`` (real ``fairseq-generate``, beam 5,
   fairseq's BLEU, sacreBLEU, chrF and TER) and measures the redundancy LR / HR of its attention heads;
4. prints a side-by-side table and writes ``OUTPUT_DIR/table.md`` and ``summary.json``.

Every step is resumable (``cli/runs.py``): rerun the same command after an interruption.
Default budget: 300 updates per model (about 2.4 epochs of Multi30k); on the project's 2-core
VM, with nothing else running, the whole command took 10.5 minutes (README, "First run").
"""

import argparse
import os
import shlex
import time
from pathlib import Path
from typing import Dict, List

from ..analysis import AnalysisError, scoring
from ..atomic_files import write_json_atomically
from ..help_format import DefaultsHelpFormatter
from ..models.attention_types import ATTENTION_TYPES
from . import runs
from .model_recipes import RECIPES, ModelRecipe

DEFAULT_MODELS = ["transformer", "dma"]
ATTENTIONS = ATTENTION_TYPES
#: settings whose change makes the runs in an output directory incomparable
IDENTITY_KEYS = ("data", "max_train_sentences", "bpe_size", "max_update", "max_epoch", "seed", "average_last", "beam",
                 "generate_args", "train_args")


def parser() -> argparse.ArgumentParser:
    recipes = "; ".join(f"{r.name}: {r.description}" for r in RECIPES.values())
    p = argparse.ArgumentParser(
        prog="fairseq-modattn quickstart",
        usage="fairseq-modattn quickstart [--output-dir DIR] [--raw-dir DIR | --data DATA-BIN] [--models M ...] "
              "[--max-update N] [options] [-- extra fairseq-train args]",
        description="Prepare Multi30k de-en, train a small transformer and a small DMA transformer with the same "
                    "budget, evaluate both (BLEU, attention redundancy LR / HR) and print a side-by-side table. "
                    "Resumable: rerun the same command after an interruption. Arguments after '--' go to every "
                    "fairseq-train (after the recipe's flags, so they override them).",
        epilog=f"models: {recipes}",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--output-dir", type=Path, default=Path("quickstart"),
                   help="where the data-bin, the runs, table.md and summary.json go")
    data = p.add_argument_group("data")
    data.add_argument("--raw-dir", type=Path, default=Path("raw/multi30k"),
                      help="folder with Multi30k task-1 raw files (train/val/test_2016_flickr .de/.en .gz); "
                           "missing files are downloaded into it")
    data.add_argument("--no-download", action="store_true", help="never download; stop if a raw file is missing")
    data.add_argument("--data", type=Path, default=None,
                      help="use this prepared de-en data-bin instead of preparing Multi30k")
    data.add_argument("--max-train-sentences", type=int, default=None,
                      help="prepare only the first N training pairs (quick trials)")
    data.add_argument("--bpe-size", type=int, default=8000, help="joint BPE merges when preparing the data")
    train = p.add_argument_group("training")
    train.add_argument("--models", nargs="+", default=DEFAULT_MODELS, metavar="MODEL",
                       help=f"which models to compare, from: {', '.join(RECIPES)}")
    train.add_argument("--max-update", type=int, default=300, help="training budget in updates, the same per model")
    train.add_argument("--max-epoch", type=int, default=None, help="also stop after this many epochs")
    train.add_argument("--seed", type=int, default=1, help="fairseq-train --seed")
    train.add_argument("--jobs", type=int, default=None,
                       help="models trained at the same time (default: one per CPU core on a CPU, 1 on a GPU); "
                            "the cores are split among them")
    train.add_argument("--cpu", action="store_true", help="use the CPU even when CUDA is available")
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--average-last", type=int, default=0, metavar="N",
                    help="evaluate the average of the last N epoch checkpoints instead of the final model")
    ev.add_argument("--beam", type=int, default=5, help="beam size")
    ev.add_argument("--generate-args", default="", metavar="ARGS",
                    help="extra fairseq-generate flags as one string, e.g. '--max-len-b 50'")
    return p


def validate(args, train_extra: List[str]):
    unknown = [m for m in args.models if m not in RECIPES]
    if unknown:
        raise AnalysisError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    if len(set(args.models)) != len(args.models):
        raise AnalysisError(f"--models lists a model twice: {' '.join(args.models)}")
    for flag, value in (("--max-update", args.max_update), ("--max-epoch", args.max_epoch), ("--beam", args.beam),
                        ("--jobs", args.jobs), ("--max-train-sentences", args.max_train_sentences),
                        ("--bpe-size", args.bpe_size)):
        if value is not None and value < 1:
            raise AnalysisError(f"{flag} must be a positive integer, got {value}")
    if args.average_last < 0:
        raise AnalysisError(f"--average-last must be >= 0, got {args.average_last}")
    if args.data is not None:
        if not (args.data / "dict.de.txt").is_file() or not (args.data / "dict.en.txt").is_file():
            raise AnalysisError(f"--data {args.data} is not a prepared de-en data-bin (no dict.de.txt / dict.en.txt)")
        if args.max_train_sentences is not None:
            raise AnalysisError("--max-train-sentences prepares the data; it cannot apply to a given --data")
    owned = {"--arch", "-a", "--save-dir", "--user-dir", "--seed", "--max-epoch", "--max-update", "--cpu"}
    clash = sorted({a.split("=", 1)[0] for a in train_extra} & owned)
    if clash:
        raise AnalysisError(f"{', '.join(clash)} after '--' would override what quickstart sets itself; "
                            "use quickstart's own flags "
                            "(--models, --output-dir, --seed, --max-update, --max-epoch, --cpu)")


def prepare_data(args, log) -> Path:
    """The data-bin to train on: --data, or Multi30k prepared into OUTPUT_DIR/data-bin."""
    if args.data is not None:
        return args.data.resolve()
    from .. import data
    from ..data.errors import DataError

    dest = args.output_dir / "data-bin" / "multi30k.de-en"
    argv = ["--raw-dir", str(args.raw_dir), "--dest", str(dest), "--bpe-size", str(args.bpe_size),
            "--workers", str(max(1, os.cpu_count() or 1))]
    if args.no_download:
        argv.append("--no-download")
    if args.max_train_sentences is not None:
        argv += ["--max-train-sentences", str(args.max_train_sentences)]
    log(f"== preparing Multi30k de-en: fairseq-modattn prepare multi30k {shlex.join(argv)}")
    try:
        data.prepare("multi30k", argv)
    except DataError as e:
        raise AnalysisError(f"preparing Multi30k failed: {e}") from e
    return dest.resolve()


def compare_one(name: str, args, data: Path, train_extra: List[str], cpu: bool, log) -> Dict:
    """Train, evaluate and measure model NAME; its row of the table."""
    recipe: ModelRecipe = RECIPES[name]
    run_dir = args.output_dir / name
    command = recipe.train_command(data, run_dir / "checkpoints", seed=args.seed, max_update=args.max_update,
                                   max_epoch=args.max_epoch, keep_last_epochs=max(1, args.average_last), cpu=cpu,
                                   extra=train_extra)
    runs.train(runs.TrainingRun(name, run_dir, command), log)
    evaluation = runs.evaluate(run_dir, name, str(data), average_last=args.average_last, beam=args.beam, cpu=cpu,
                               generate_args=shlex.split(args.generate_args), log=log)
    measured = runs.redundancy(run_dir, name, evaluation["model_path"], str(data),
                               attentions=ATTENTIONS if recipe.has_attention_heads else (), cpu=cpu, log=log)
    return row_of(name, evaluation, measured, runs.training_stats(run_dir / "train.log"))


def row_of(name: str, evaluation: Dict, measured: Dict, stats: Dict) -> Dict:
    red = measured["redundancy"]
    row = {"model": name, "params": measured["parameters"], "BLEU": evaluation["bleu"],
           "sacreBLEU": evaluation["sacrebleu"], "chrF": evaluation["chrf"], "TER": evaluation["ter"],
           "sacreBLEU signature": evaluation["sacrebleu_signature"], "chrF signature": evaluation["chrf_signature"],
           "TER signature": evaluation["ter_signature"], "valid nll": stats["valid_nll_loss"],
           "updates": stats["num_updates"],
           "tokens/s": stats["wps"], "train min": None if stats["train_wall"] is None else stats["train_wall"] / 60}
    for attention in ATTENTIONS:
        row[f"LR {attention}"] = red[attention]["LR"] if attention in red else None
        row[f"HR {attention}"] = red[attention]["HR"] if attention in red else None
    return row


def markdown_table(rows: List[Dict]) -> str:
    columns = ["model", "params", "BLEU", "sacreBLEU", "chrF", "TER", "LR / HR enc self", "LR / HR dec self",
               "LR / HR enc-dec", "valid nll", "tokens/s", "train min"]

    def cell(row, column):
        if column.startswith("LR / HR"):
            key = {"enc self": "enc_self", "dec self": "dec_self", "enc-dec": "enc_dec"}[column[len("LR / HR "):]]
            lr, hr = row[f"LR {key}"], row[f"HR {key}"]
            return "n/a" if lr is None else f"{lr:.3f} / {hr:.3f}"
        value = row[column]
        if value is None:
            return "n/a"
        if column == "params":
            return f"{value:,}"
        formats = {"BLEU": "{:.2f}", "sacreBLEU": "{:.2f}", "chrF": "{:.2f}", "TER": "{:.2f}", "valid nll": "{:.3f}",
                   "tokens/s": "{:.0f}", "train min": "{:.1f}"}
        return formats.get(column, "{}").format(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _budget(settings: Dict) -> str:
    return f"{settings['max_update']} updates" + (
        f" (at most {settings['max_epoch']} epochs)" if settings["max_epoch"] else "")


def smoke_run_note(settings: Dict) -> str:
    """What the table is: a first run's numbers were read as a verdict on the methods (after 300
    updates DMA scored 4 BLEU below the transformer, with 23 of 1,000 translations repeating a
    word up to the length limit), which one seed at a budget that short cannot give."""
    return (f"A smoke run, not a comparison: one seed and {_budget(settings)} per model show that every step "
            "works, not which model translates better. At the default budget the models are far from trained: "
            "differences of several BLEU and translations that repeat a word up to the length limit are "
            "expected. docs/results.md compares the methods: trained to the baselines' flat validation loss, "
            "3 seeds, paired-bootstrap intervals.")


def report(rows: List[Dict], settings: Dict) -> str:
    budget = _budget(settings)
    model = ("the average of the last {} epoch checkpoints".format(settings["average_last"])
             if settings["average_last"] else "the final model")
    signatures = scoring.signatures_text([{f"{key}_signature": r.get(f"{name} signature")
                                           for name, key in scoring.METRICS} for r in rows])
    return "\n".join([
        "# fairseq-modattn quickstart",
        "",
        f"Data `{settings['data']}`; every model trained for {budget}, seed {settings['seed']}; {model} "
        f"translates the test split (beam {settings['beam']}; BLEU is fairseq's tokenized BLEU; sacreBLEU, chrF "
        "and TER (lower is better) score the detokenized translations against the detokenized references, "
        f"with the signatures {signatures}). LR / HR: "
        "redundancy of the attention heads (mean over layers of the pairwise head similarity; lower is less "
        "redundant, n/a for models without multi-head attention). tokens/s: fairseq's training wps.",
        "",
        smoke_run_note(settings),
        "",
        markdown_table(rows),
        "",
    ])


def quickstart(argv: List[str]) -> int:
    train_extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)
    started = time.monotonic()

    def log(message: str):
        print(f"[{(time.monotonic() - started) / 60:5.1f} min] {message}", flush=True)

    def body() -> int:
        import torch

        validate(args, train_extra)
        cpu = args.cpu or not torch.cuda.is_available()
        cores = os.cpu_count() or 1
        jobs = args.jobs or (min(len(args.models), cores) if cpu else 1)
        threads = max(1, cores // jobs) if cpu else None
        if threads:
            runs.limit_threads(threads)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        # settings.json (what makes runs comparable) records prepared data in the words earlier
        # versions used, so that their folders still continue; table.md and summary.json name the path
        settings = {
            "data": str(args.data.resolve()) if args.data else "multi30k prepared into OUTPUT_DIR/data-bin",
            "max_train_sentences": args.max_train_sentences, "bpe_size": args.bpe_size, "models": args.models,
            "max_update": args.max_update, "max_epoch": args.max_epoch, "seed": args.seed,
            "average_last": args.average_last, "beam": args.beam,
            "generate_args": shlex.split(args.generate_args), "train_args": train_extra,
        }
        runs.check_settings(args.output_dir, settings, IDENTITY_KEYS)
        data = prepare_data(args, log)
        log(f"== training and evaluating {len(args.models)} model(s), {args.max_update} updates each, "
            f"{jobs} at a time{f' with {threads} thread(s) each' if threads else ''} on {'CPU' if cpu else 'GPU'}")
        rows = runs.run_concurrently(lambda name: compare_one(name, args, data, train_extra, cpu, log),
                                     args.models, jobs)
        reported = {**settings, "data": str(data)}  # the data-bin the models were trained on
        text = report(rows, reported)
        (args.output_dir / "table.md").write_text(text, encoding="utf-8")
        write_json_atomically({"settings": reported, "rows": rows}, args.output_dir / "summary.json")
        print()
        print(markdown_table(rows))
        print()
        print(smoke_run_note(reported))
        print()
        log(f"done: {args.output_dir / 'table.md'}, {args.output_dir / 'summary.json'}")
        shown = "dma" if "dma" in args.models else args.models[0]
        log(f"to translate with {shown} and see its attention in a browser: fairseq-modattn serve "
            f"--path {args.output_dir / shown / 'checkpoints' / 'checkpoint_last.pt'} --data {data}")
        return 0

    return runs.resumable_command("fairseq-modattn quickstart", body, output_dir=args.output_dir)
