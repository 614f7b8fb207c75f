"""``fairseq-modattn redundancy`` and ``fairseq-modattn plot``: attention analysis of a checkpoint.

Both load any checkpoint of this package's models or a plain fairseq model (so a DMA model
can be compared with the user's own transformer), run its teacher-forced forward over a split
of a data-bin and report or draw what the DMA paper reports and draws (section 5).
"""

import argparse
import contextlib
import datetime
import sys
from pathlib import Path
from typing import Dict, List, Optional

from ..analysis import AnalysisError
from ..atomic_files import write_json_atomically
from ..help_format import DefaultsHelpFormatter
from ..models.attention_types import ATTENTION_TYPES

PLOT_KINDS = {
    "redundancy": "head-redundancy matrix (1 - JS between every pair of heads) heatmap, paper Fig. 3",
    "clusters": "the top tokens of each DMA cluster of one head, paper Fig. 4",
    "sentence": "one sentence's DMA cluster probabilities and semantic mask, paper Fig. 5",
    "queries": "2-D projection (t-SNE or PCA) of one layer's queries coloured by head, paper Fig. 6",
    "competition": "one sentence's TIM competition per token and layer",
    "rim": "one sentence's RIM activation per token and layer",
}


def log(message: str):
    print(message, flush=True)


def add_model_args(parser: argparse.ArgumentParser):
    parser.add_argument("data", help="the fairseq data-bin folder (as for fairseq-generate)")
    parser.add_argument("--path", required=True,
                        help="checkpoint file (.pt) of any model of this package or of fairseq")
    parser.add_argument("--gen-subset", default="test", help="data split to analyse")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is available")


# ----------------------------------------------------------------------------- redundancy
def redundancy_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn redundancy",
        description="Attention redundancy LR (within layers) and HR (between all heads) of a checkpoint "
        'over a data split, as defined in docs/design.md, "Evaluation definitions"; lower is less redundant.',
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--attention", default="enc_self",
                   help=f"comma-separated attention types ({', '.join(ATTENTION_TYPES)}) or 'all'")
    p.add_argument("--max-tokens", type=int, default=4000, help="tokens per batch")
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop after this many batches (default: the whole split)")
    p.add_argument("--output", type=Path, default=None,
                   help="write the results as JSON to this file (a directory is refused)")
    p.add_argument("--plot", type=Path, default=None,
                   help="also draw the head-redundancy matrix of the first attention type to this PNG file "
                        "(a directory is refused)")
    return p


def parse_attention_types(value: str) -> List[str]:
    types = list(ATTENTION_TYPES) if value == "all" else [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in types if t not in ATTENTION_TYPES]
    if unknown or not types:
        raise AnalysisError(f"--attention: expected a comma-separated subset of {', '.join(ATTENTION_TYPES)} "
                            f"or 'all', got {value!r}")
    return types


def redundancy(argv: List[str]) -> int:
    args = redundancy_parser().parse_args(argv)
    return run_reporting_errors("redundancy", lambda: _redundancy(args), outputs={"--output": args.output,
                                                                              "--plot": args.plot})


def refuse_directory_outputs(**flags):
    """AnalysisError '--FLAG X is a directory; give a file path' for an output file flag that
    names an existing folder, checked before the model is loaded (a folder is never replaced)."""
    from ..atomic_files import check_output_file

    for flag, path in flags.items():
        check_output_file(path, "--" + flag.replace("_", "-"), error=AnalysisError)


def _redundancy(args) -> int:
    from ..analysis.extract import measure_redundancy
    from ..analysis.loading import load_model, model_name, split_size

    refuse_directory_outputs(output=args.output, plot=args.plot)
    types = parse_attention_types(args.attention)
    model, task, cfg = load_model(args.path, args.data, cpu=args.cpu)
    sentences = split_size(task, args.gen_subset)
    log(f"{args.path}: {model_name(model)} ({getattr(cfg.model, 'arch', '?')}), "
        f"{sentences} sentences in {args.gen_subset!r}")
    results = {}
    for attention_type in types:
        result = measure_redundancy(model, task, args.gen_subset, attention_type, args.max_tokens, args.max_batches,
                                    log=log)
        results[attention_type] = result
        log(f"{attention_type}: LR {result.lr:.4f}  HR {result.hr:.4f}  "
            f"({len(result.lr_per_layer)} layers x {result.heads_per_layer} heads, {result.rows} query rows)")
    report = {
        "checkpoint": str(args.path), "model": model_name(model), "arch": getattr(cfg.model, "arch", None),
        "data": str(args.data), "subset": args.gen_subset, "sentences": sentences,
        "max_batches": args.max_batches, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "results": {t: r.as_dict() for t, r in results.items()},
    }
    if args.output is not None:
        write_json_atomically(report, args.output)
        log(f"wrote {args.output}")
    if args.plot is not None:
        draw_redundancy(results[types[0]], types[0], args.plot)
        log(f"wrote {args.plot}")
    return 0


def draw_redundancy(result, attention_type: str, path: Path, **kwargs):
    """The head-redundancy matrix of ``result`` (a RedundancyResult) as a heatmap PNG."""
    from ..analysis.plots import plot_head_redundancy

    plot_head_redundancy(result.matrix_array(), result.labels, path, group_size=result.heads_per_layer,
                         title=f"head redundancy ({attention_type}), HR {result.hr:.3f}, LR {result.lr:.3f}", **kwargs)


# ----------------------------------------------------------------------------- plots
def plot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairseq-modattn plot",
        description="Draw an analysis figure of a checkpoint to a PNG.",
        formatter_class=DefaultsHelpFormatter,
    )
    kinds = p.add_subparsers(dest="kind", metavar="KIND", required=True,
                             help="; ".join(f"{k}: {v}" for k, v in PLOT_KINDS.items()))
    for kind, help_text in PLOT_KINDS.items():
        k = kinds.add_parser(kind, help=help_text, description=help_text,
                             formatter_class=DefaultsHelpFormatter)
        add_model_args(k)
        k.add_argument("--output", type=Path, required=True, help="PNG file to write (a directory is refused)")
        k.add_argument("--dpi", type=int, default=100, help="resolution of the PNG")
        if kind in ("sentence", "competition", "rim"):
            k.add_argument("--sentence", type=int, default=0, help="index of the sentence in the split")
        if kind in ("redundancy", "clusters", "sentence", "queries"):
            default = "dec_self" if kind == "queries" else "enc_self"
            k.add_argument("--attention", default=default, choices=list(ATTENTION_TYPES), help="attention type")
        if kind in ("clusters", "sentence", "queries"):
            k.add_argument("--layer", type=int, default=None, help="layer, 1-based (default: the last)")
        if kind in ("clusters", "sentence"):
            k.add_argument("--head", type=int, default=1, help="head, 1-based")
        if kind in ("redundancy", "clusters", "queries"):
            k.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
        if kind == "redundancy":
            k.add_argument("--max-tokens", type=int, default=4000, help="tokens per batch")
        if kind == "clusters":
            k.add_argument("--top-k", type=int, default=10, help="tokens shown per cluster")
            k.add_argument("--min-count", type=int, default=3, help="ignore tokens seen fewer times in the split")
        if kind == "queries":
            k.add_argument("--projection", choices=("tsne", "pca"), default="tsne", help="2-D projection")
            k.add_argument("--max-points", type=int, default=2000, help="queries (positions x heads) projected")
        if kind == "competition":
            k.add_argument("--side", choices=("encoder", "decoder"), default="encoder", help="which TIM layers")
    return p


def plot(argv: List[str]) -> int:
    args = plot_parser().parse_args(argv)
    return run_reporting_errors("plot", lambda: _plot(args), outputs={"--output": args.output})


def _plot(args) -> int:
    from ..analysis import extract, plots
    from ..analysis.loading import load_model, model_name

    refuse_directory_outputs(output=args.output)
    model, task, cfg = load_model(args.path, args.data, cpu=args.cpu)
    log(f"{args.path}: {model_name(model)} ({getattr(cfg.model, 'arch', '?')})")
    common = {"dpi": args.dpi}
    if args.kind == "redundancy":
        r = extract.measure_redundancy(model, task, args.gen_subset, args.attention, args.max_tokens,
                                       args.max_batches, log=log)
        draw_redundancy(r, args.attention, args.output, **common)
    elif args.kind == "clusters":
        clusters, where = extract.cluster_top_tokens(model, task, args.gen_subset, args.attention, args.layer,
                                                     args.head, args.top_k, args.min_count, args.max_batches)
        plots.plot_cluster_top_tokens(clusters, args.output, title=f"top tokens per cluster: {where}",
                                      cluster_ids=list(range(1, len(clusters) + 1)),
                                      score_label="mean p(cluster | token)", **common)
    elif args.kind == "sentence":
        s = extract.sentence_clusters(model, task, args.gen_subset, args.sentence, args.attention, args.layer,
                                      args.head)
        plots.plot_sentence_clusters(s["tokens"], s["posteriors"], s["mask"], args.output, key_tokens=s["key_tokens"],
                                     title=f"sentence {args.sentence}: {s['module']}", **common)
    elif args.kind == "queries":
        points, heads, where = extract.layer_queries(model, task, args.gen_subset, args.attention, args.layer,
                                                     args.max_points, args.max_batches)
        label = {"tsne": "t-SNE", "pca": "PCA"}[args.projection]
        plots.plot_query_projection(plots.project_2d(points, args.projection), heads, args.output,
                                    title=f"queries of {where} ({len(points)} points)", method_label=label, **common)
    elif args.kind == "competition":
        c = extract.tim_competition(model, task, args.gen_subset, args.sentence, args.side)
        plots.plot_competition(c["tokens"], c["competition"], args.output,
                               title=f"TIM competition, sentence {args.sentence}", **common)
    elif args.kind == "rim":
        a = extract.rim_activation(model, task, args.gen_subset, args.sentence)
        plots.plot_rim_activation(a["tokens"], a["activation"], args.output,
                                  title=f"RIM activation, sentence {args.sentence}", **common)
    log(f"wrote {args.output}")
    return 0


def run_reporting_errors(command: str, body, outputs: Optional[Dict[str, Optional[Path]]] = None) -> int:
    """Run ``body`` holding the locks of its OUTPUTS ({flag: file or None}; a second command
    writing the same file is refused: ``folder_lock``); an AnalysisError becomes
    'fairseq-modattn COMMAND: error: ...' and exit 1."""
    from ..folder_lock import exclusive_use

    try:
        with contextlib.ExitStack() as stack:
            for flag, path in (outputs or {}).items():
                if path is not None:
                    stack.enter_context(exclusive_use(path, error=AnalysisError, what=flag))
            return body()
    except AnalysisError as e:
        print(f"fairseq-modattn {command}: error: {e}", file=sys.stderr)
        return 1
