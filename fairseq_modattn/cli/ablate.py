"""``fairseq-modattn ablate``: the cluster-count ablation of the DMA paper (Table 7).

For each n_c in ``--clusters`` (default 4 8 12) it trains a DMA transformer on a prepared
data-bin with the same budget and flags (the real ``fairseq-train``), evaluates it as
``fairseq-modattn evaluate`` does (average of the last epoch checkpoints, beam 5), measures the
attention redundancy LR / HR of the averaged model, and writes

    OUTPUT_DIR/table.md, table.csv    n_c, parameters, LR, HR, BLEU (+ sacreBLEU, chrF, TER, compound split)
    OUTPUT_DIR/bleu_vs_clusters.png   BLEU (and LR / HR) against n_c
    OUTPUT_DIR/summary.json           everything above, with the settings
    OUTPUT_DIR/ncN/                   checkpoints/, train.log, evaluation/, redundancy.json

Every step leaves a marker when it completes (``train.done``, ``evaluation/results.json``,
``redundancy.json``); rerunning the same command skips finished steps, and an interrupted
``fairseq-train`` continues from its ``checkpoint_last.pt``. The settings are recorded in
``OUTPUT_DIR/settings.json``; a rerun with different settings is refused rather than mixing
runs that are not comparable (more n_c values may be added to a finished ablation).
"""

import argparse
import csv
import io
import shlex
from pathlib import Path
from typing import Dict, List

from ..analysis import AnalysisError, scoring
from ..atomic_files import write_json_atomically
from ..help_format import DefaultsHelpFormatter
from ..models.attention_types import ATTENTION_TYPES
from . import runs
from .fairseq_commands import PLUGIN_DIR, fairseq_script

#: the paper's IWSLT14 training recipe (examples/iwslt14); flags after '--' override these
DEFAULT_TRAIN_ARGS = [
    "--share-decoder-input-output-embed",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
    "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
    "--dropout", "0.3", "--weight-decay", "0.0001",
    "--criterion", "label_smoothed_cross_entropy_with_aux", "--label-smoothing", "0.1",
    "--max-tokens", "4096",
]
#: settings whose change makes earlier runs incomparable
IDENTITY_KEYS = ("data", "arch", "train_args", "max_epoch", "max_update", "seed", "subset",
                 "num_epoch_checkpoints", "beam", "generate_args", "compound_split", "attention")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn ablate",
        usage="fairseq-modattn ablate DATA --output-dir DIR (--max-epoch N | --max-update N) [options] "
              "[-- extra fairseq-train args]",
        description="Train, evaluate and compare DMA transformers with different cluster counts n_c "
                    "(DMA paper, Table 7). Resumable: rerun the same command after an interruption. "
                    "Arguments after '--' go to fairseq-train (after the defaults, so they override them).",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("data", help="a prepared fairseq data-bin (fairseq-modattn prepare ...)")
    p.add_argument("--output-dir", type=Path, required=True, help="where runs, tables and the plot go")
    p.add_argument("--clusters", type=int, nargs="+", default=[4, 8, 12], help="the n_c values to compare")
    p.add_argument("--arch", default="dma_transformer_iwslt_de_en", help="a dma_transformer architecture")
    p.add_argument("--max-epoch", type=int, default=None, help="training budget in epochs (per n_c)")
    p.add_argument("--max-update", type=int, default=None, help="training budget in updates (per n_c)")
    p.add_argument("--seed", type=int, default=1, help="fairseq-train --seed, the same for every n_c")
    p.add_argument("--num-epoch-checkpoints", type=int, default=5,
                   help="average the last N epoch checkpoints (fewer when the budget has fewer epochs)")
    p.add_argument("--subset", default="test", help="split to evaluate and measure redundancy on")
    p.add_argument("--beam", type=int, default=5, help="beam size")
    p.add_argument("--generate-args", default="", metavar="ARGS",
                   help="extra fairseq-generate flags as one string, e.g. '--max-len-b 50 --lenpen 0.6'")
    p.add_argument("--compound-split", action="store_true", help="also report compound-split BLEU (WMT14 en-de)")
    p.add_argument("--attention", default="enc_self", choices=ATTENTION_TYPES,
                   help="attention type of the LR / HR columns")
    p.add_argument("--cpu", action="store_true", help="train and evaluate on the CPU")
    return p


def validate(args, train_extra: List[str]):
    if not Path(args.data).is_dir():
        raise AnalysisError(f"data-bin {args.data} does not exist (prepare it with fairseq-modattn prepare)")
    if args.max_epoch is None and args.max_update is None:
        raise AnalysisError("give a training budget: --max-epoch N and/or --max-update N")
    if any(n < 1 for n in args.clusters) or len(set(args.clusters)) != len(args.clusters):
        raise AnalysisError(f"--clusters must be distinct positive integers, got {args.clusters}")
    if args.num_epoch_checkpoints < 1:
        raise AnalysisError("--num-epoch-checkpoints must be >= 1")
    from fairseq.models import ARCH_MODEL_REGISTRY

    import fairseq_modattn  # noqa: F401  (registers the architectures)

    model = ARCH_MODEL_REGISTRY.get(args.arch)
    if model is None or model.__name__ != "DMATransformerModel":
        dma = sorted(a for a, m in ARCH_MODEL_REGISTRY.items() if m.__name__ == "DMATransformerModel")
        raise AnalysisError(f"--arch {args.arch} is not a DMA architecture; choose from {', '.join(dma)}")
    owned = {"--dma-clusters", "--arch", "-a", "--save-dir", "--user-dir", "--seed", "--max-epoch", "--max-update"}
    clash = sorted({a.split("=", 1)[0] for a in train_extra} & owned)
    if clash:
        raise AnalysisError(f"{', '.join(clash)} after '--' would override what ablate sets itself; "
                            "use ablate's own flags "
                            "(--clusters, --arch, --output-dir, --seed, --max-epoch/--max-update)")


def settings_of(args, train_extra: List[str]) -> Dict:
    return {
        "data": str(Path(args.data).resolve()), "arch": args.arch,
        "train_args": DEFAULT_TRAIN_ARGS + list(train_extra),
        "max_epoch": args.max_epoch, "max_update": args.max_update, "seed": args.seed,
        "subset": args.subset, "num_epoch_checkpoints": args.num_epoch_checkpoints, "beam": args.beam,
        "generate_args": shlex.split(args.generate_args),
        "compound_split": args.compound_split, "attention": args.attention,
    }


def training_run(run_dir: Path, clusters: int, args, settings: Dict) -> runs.TrainingRun:
    """fairseq-train for one n_c (continued from checkpoint_last.pt if there is one)."""
    command = [fairseq_script("fairseq-train"), settings["data"], "--user-dir", str(PLUGIN_DIR), "--arch", args.arch,
               "--dma-clusters", str(clusters), "--save-dir", str(run_dir / "checkpoints"),
               "--seed", str(args.seed), "--keep-last-epochs", str(args.num_epoch_checkpoints),
               *settings["train_args"]]
    if args.max_epoch is not None:
        command += ["--max-epoch", str(args.max_epoch)]
    if args.max_update is not None:
        command += ["--max-update", str(args.max_update)]
    if args.cpu:
        command.append("--cpu")
    return runs.TrainingRun(f"n_c={clusters}", run_dir, command)


COLUMNS = ["n_c", "params", "LR", "HR", "BLEU", "sacreBLEU", "chrF", "TER", "compound-split BLEU",
           "checkpoints averaged"]


def table_rows(results: Dict[int, Dict]) -> List[Dict]:
    rows = []
    for clusters in sorted(results):
        ev, red = results[clusters]["evaluation"], results[clusters]["redundancy"]
        (measured,) = red["redundancy"].values()
        rows.append({
            "n_c": clusters, "params": red["parameters"], "LR": measured["LR"], "HR": measured["HR"],
            "BLEU": ev["bleu"],
            "sacreBLEU": ev["sacrebleu"], "chrF": ev["chrf"], "TER": ev["ter"],
            "compound-split BLEU": ev["compound_split_bleu"], "checkpoints averaged": len(ev["checkpoints"]),
            # in summary.json and the table's caption, not columns of table.csv
            "signatures": {key: ev[f"{key}_signature"] for _, key in scoring.METRICS},
        })
    return rows


def markdown_table(rows: List[Dict], settings: Dict) -> str:
    columns = [c for c in COLUMNS if any(r[c] is not None for r in rows)]

    def cell(row, column):
        value = row[column]
        if column == "params":
            return f"{value:,}"
        if column in ("LR", "HR"):
            return f"{value:.3f}"
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    budget = ", ".join(f"{k} {settings[k]}" for k in ("max_epoch", "max_update") if settings[k] is not None)
    lines = [
        f"# Cluster-count ablation ({settings['arch']})",
        "",
        f"Data `{settings['data']}`, split `{settings['subset']}`, budget {budget}, seed {settings['seed']}; "
        f"BLEU of the average of the last {settings['num_epoch_checkpoints']} epoch checkpoints (beam "
        f"{settings['beam']}); LR / HR over {settings['attention']} attention (lower is less redundant). "
        "sacreBLEU, chrF and TER (lower is better) score the detokenized translations, with the signatures "
        + scoring.signatures_text([{f"{k}_signature": v for k, v in r["signatures"].items()} for r in rows]) + ".",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    lines += ["", f"Training flags: `{shlex.join(settings['train_args'])}`", ""]
    return "\n".join(lines)


def csv_table(rows: List[Dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buffer.getvalue()


def write_outputs(output_dir: Path, results: Dict[int, Dict], settings: Dict, log) -> List[Dict]:
    from ..analysis.plots import plot_ablation
    from ..atomic_files import atomic_write

    rows = table_rows(results)
    for name, text in (("table.md", markdown_table(rows, settings)), ("table.csv", csv_table(rows))):
        atomic_write(output_dir / name, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
    write_json_atomically({"settings": settings, "rows": rows}, output_dir / "summary.json")
    plot_ablation([{"n_c": r["n_c"], "bleu": r["BLEU"], "lr": r["LR"], "hr": r["HR"]} for r in rows],
                  output_dir / "bleu_vs_clusters.png", title=f"cluster-count ablation ({settings['arch']})")
    log(f"wrote {output_dir / 'table.md'}, table.csv, summary.json, bleu_vs_clusters.png")
    return rows


def ablate(argv: List[str]) -> int:
    train_extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_extra = argv[:cut], argv[cut + 1:]
    args = parser().parse_args(argv)

    def log(message: str):
        print(message, flush=True)

    def body() -> int:
        validate(args, train_extra)
        settings = settings_of(args, train_extra)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        runs.check_settings(args.output_dir, settings, IDENTITY_KEYS)
        results = {}
        for index, clusters in enumerate(args.clusters, 1):
            log(f"== n_c = {clusters} ({index}/{len(args.clusters)})")
            run_dir = args.output_dir / f"nc{clusters}"
            label = f"n_c={clusters}"
            runs.train(training_run(run_dir, clusters, args, settings), log)
            evaluation = runs.evaluate(
                run_dir, label, args.data, average_last=args.num_epoch_checkpoints, subset=args.subset,
                beam=args.beam, cpu=args.cpu, compound_split=args.compound_split,
                generate_args=shlex.split(args.generate_args), log=log)
            measured = runs.redundancy(run_dir, label, evaluation["model_path"], args.data, subset=args.subset,
                                       attentions=[args.attention], cpu=args.cpu, log=log)
            results[clusters] = {"evaluation": evaluation, "redundancy": measured}
        rows = write_outputs(args.output_dir, results, settings, log)
        print()
        print(markdown_table(rows, settings))
        return 0

    return runs.resumable_command("fairseq-modattn ablate", body, output_dir=args.output_dir)
