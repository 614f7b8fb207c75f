#!/usr/bin/env python
"""Speed of the RIM encoder against fairseq's LSTM encoder of equal hidden size.

Both models are built in one process through fairseq's own registries, exactly as
``fairseq-train`` builds them (``harness.build``: ``fairseq.options`` parses the ``--arch``,
a real ``TranslationTask`` over a synthetic ``--dict-size`` dictionary, the same ``--seed``):

    rim_lstm   --arch rim_lstm_iwslt_de_en [--rim-args ...]   n = 6 RIMs of d_r = 100 (k = 4
                                                               active), 256 embeddings, fairseq's
                                                               LSTM decoder (256)
    lstm       --arch lstm_wiseman_iwslt_de_en                 the equal-size baseline: the same
               --encoder-hidden-size n*d_r                     embeddings and decoder, an LSTM
               [--encoder-layers L --encoder-bidirectional]    encoder of n * d_r = 600 units,
                                                               as many layers and directions as
                                                               the RIM encoder

(fairseq's ``lstm`` needs as many decoder as encoder layers, so with ``--rim-layers L`` in
``--rim-args`` both models get ``--decoder-layers L``.)

Measured, per length L (``--lengths``, default 32 128), on a batch of ``--tokens // L`` random
sentences of L tokens (``harness.training_sample``: no padding), in train mode:

    encoder step   the encoder alone, forward + backward of mean(outputs^2) + mean(h^2) + mean(c^2)
                   (a loss that reaches every encoder parameter through outputs and final states);
    model step     the whole model, criterion ``label_smoothed_cross_entropy`` (0.1) + backward,
                   as fairseq's trainer runs it (``harness.timed_step``); skip with ``--no-model``.

Gradients are set to None before every step (outside the timer). Per length, every step kind
first runs ``--warmup`` untimed steps, then ``--repeats`` timed ones, interleaved (lstm encoder,
RIM encoder, lstm model, rim_lstm model, lstm encoder, ...) so that drifts of the machine hit all
alike; the table shows medians and the ratios RIM / LSTM. The target: a RIM encoder step
at most 4 x the LSTM encoder's on the 2-core CPU.

Output: the table and a JSON file (``--json``, default benchmarks/results/bench_rim.json,
rewritten after every length) with per-repeat times, parameter counts, versions and the git
commit / plugin source hash (``harness.provenance``).

Examples:
    python benchmarks/bench_rim.py --threads 2                          # full run, CPU
    python benchmarks/bench_rim.py --rim-args="--rim-cell gru" --lengths 128
    python benchmarks/bench_rim.py --rim-args="--rim-bidirectional --rim-layers 2" --no-model
    python benchmarks/bench_rim.py --device cuda --repeats 10 --warmup 3
    python benchmarks/bench_rim.py --quick                              # smoke run, seconds
"""

import argparse
import shlex
import statistics
from pathlib import Path

import torch

# harness.py, beside this script, holds the measuring code shared with bench_dma.py and
# bench_variants.py; it comes first because it also puts the checkout on sys.path
from harness import (
    REPO,
    build,
    prepare_run,
    parse_fairseq_args,
    per_length,
    results_header,
    synthetic_dictionary,
    timed_step,
    train_step,
    training_sample,
    versions_line,
    write_json,
    zero_grad,
)

from fairseq.models.lstm import LSTMEncoder

from fairseq_modattn.models.rim_lstm import RIMEncoder

DEFAULT_JSON = REPO / "benchmarks" / "results" / "bench_rim.json"
CRITERION = "label_smoothed_cross_entropy"
RIM_ARCH, LSTM_ARCH = "rim_lstm_iwslt_de_en", "lstm_wiseman_iwslt_de_en"
TARGET_RATIO = 4.0  # the target for the encoder step on the 2-core CPU

# --quick: tiny widths (n = 6, k = 4 kept), tiny batches
QUICK_MODEL_ARGS = [
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--decoder-out-embed-dim", "32",
    "--decoder-hidden-size", "32",
]
QUICK_RIM_ARGS = [
    "--rim-size", "8", "--rim-input-key-size", "8", "--rim-input-value-size", "16",
    "--rim-comm-key-size", "8", "--rim-comm-value-size", "8",
]
QUICK = dict(lengths=[8, 16], tokens=128, repeats=[2], warmup=[1], dict_size=1000)


def encoder_loss(encoder, sample):
    """The encoder-only 'criterion': mean squares of the outputs and the final states."""
    net_input = sample["net_input"]
    outputs, hiddens, cells, _ = encoder(net_input["src_tokens"], net_input["src_lengths"])
    loss = outputs.pow(2).mean() + hiddens.pow(2).mean() + cells.pow(2).mean()
    return loss, 1, {}


def build_pair(cfg, d, device):
    """(rim_lstm entry, lstm entry), the LSTM sized from the RIM model's parsed flags."""
    rim_flags = cfg.model_args + cfg.rim_args
    a = parse_fairseq_args(RIM_ARCH, CRITERION, cfg.seed, rim_flags)
    lstm_flags = cfg.model_args + ["--encoder-hidden-size", str(a.rim_num * a.rim_size),
                                   "--encoder-layers", str(a.rim_layers), "--decoder-layers", str(a.rim_layers)]
    if a.rim_bidirectional:
        lstm_flags.append("--encoder-bidirectional")
    if a.rim_layers != a.decoder_layers:  # fairseq's lstm needs equal counts: both get L decoder layers
        rim_flags = rim_flags + ["--decoder-layers", str(a.rim_layers)]
    entries = []
    for name, arch, flags, kind in (("rim_lstm", RIM_ARCH, rim_flags, RIMEncoder),
                                    ("lstm", LSTM_ARCH, lstm_flags, LSTMEncoder)):
        e = build(name, arch, CRITERION, argparse.Namespace(seed=cfg.seed, model_args=flags), d, d, device)
        assert isinstance(e["model"].encoder, kind), type(e["model"].encoder)
        e["flags"] = flags
        e["encoder_params"] = sum(p.numel() for p in e["model"].encoder.parameters())
        entries.append(e)
    return entries


def encoder_entry(entry):
    """An entry whose model is the encoder and whose criterion is ``encoder_loss``."""
    return {**entry, "name": entry["name"] + "_encoder", "model": entry["model"].encoder, "criterion": encoder_loss}


def bench(steps, cfg, d, device, on_row=None):
    """One row per length: median ms of each step kind and the RIM / LSTM ratios."""
    rows = []
    gen = torch.Generator().manual_seed(cfg.seed)
    repeats = per_length(cfg.repeats, cfg.lengths, "--repeats")
    warmups = per_length(cfg.warmup, cfg.lengths, "--warmup")
    for length in cfg.lengths:
        bsz = max(cfg.tokens // length, 1)
        sample = training_sample(length, bsz, d, gen, device)
        for e in steps:
            e["model"].train()
            for _ in range(warmups[length]):
                zero_grad(e["model"])
                train_step(e, sample)
        times = {e["name"]: [] for e in steps}
        for _ in range(max(repeats[length], 1)):
            for e in steps:
                times[e["name"]].append(timed_step(e, sample, device))
        for e in steps:
            zero_grad(e["model"])
        ms = {name: statistics.median(t) for name, t in times.items()}
        ratios = {"encoder": ms["rim_lstm_encoder"] / ms["lstm_encoder"]}
        if "rim_lstm" in ms:
            ratios["model"] = ms["rim_lstm"] / ms["lstm"]
        rows.append({"length": length, "batch": bsz, "tokens": bsz * length, "repeats": max(repeats[length], 1),
                     "warmup": warmups[length], "ms": ms, "ms_all": times, "time_ratio": ratios})
        print(f"  L={length:4d} B={bsz:4d}: " + " | ".join(f"{n} {v:.1f} ms" for n, v in ms.items()), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def format_table(rows):
    with_model = "model" in rows[0]["time_ratio"]
    header = f"{'length':>6} {'batch':>5} {'LSTM enc ms':>12} {'RIM enc ms':>11} {'x':>5}"
    if with_model:
        header += f" {'lstm model ms':>14} {'rim_lstm model ms':>18} {'x':>5}"
    lines = [header, "-" * len(header)]
    for r in rows:
        m, x = r["ms"], r["time_ratio"]
        line = (f"{r['length']:>6} {r['batch']:>5} {m['lstm_encoder']:>12.1f} {m['rim_lstm_encoder']:>11.1f} "
                f"{x['encoder']:>5.2f}")
        if with_model:
            line += f" {m['lstm']:>14.1f} {m['rim_lstm']:>18.1f} {x['model']:>5.2f}"
        lines.append(line)
    lines.append("x = RIM / LSTM time (forward + backward, median)")
    worst = max(r["time_ratio"]["encoder"] for r in rows)
    verdict = "met" if worst <= TARGET_RATIO else "NOT met"
    lines.append(f"target: RIM encoder <= {TARGET_RATIO:g} x the LSTM encoder: {verdict} (worst {worst:.2f} x)")
    return lines


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128], help="sentence lengths")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (batch = tokens // length)")
    p.add_argument("--repeats", type=int, nargs="+", default=[5],
                   help="timed steps per step kind: one value, or one per length")
    p.add_argument("--warmup", type=int, nargs="+", default=[1],
                   help="untimed steps per step kind before timing: one value, or one per length")
    p.add_argument("--rim-args", type=shlex.split, default=[],
                   help="extra rim_lstm flags, e.g. --rim-args='--rim-cell gru' (the LSTM follows "
                        "--rim-layers and --rim-bidirectional)")
    p.add_argument("--no-model", action="store_true", help="time the encoders only, not the whole models")
    p.add_argument("--dict-size", type=int, default=10000, help="symbols of the synthetic dictionary")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="CPU: cap the address space (default 90%% of MemAvailable, 0 = no cap)")
    p.add_argument("--quick", action="store_true", help="tiny models and batches: a smoke run")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    return p


def main(argv=None):
    cfg = get_parser().parse_args(argv)
    device = prepare_run(cfg, argv, QUICK, QUICK_MODEL_ARGS)
    if cfg.quick:
        cfg.rim_args = QUICK_RIM_ARGS + cfg.rim_args

    d = synthetic_dictionary(cfg.dict_size)
    rim, lstm = build_pair(cfg, d, device)
    a = rim["args"]
    print(versions_line(device))
    print(f"  rim_lstm --arch {RIM_ARCH} {' '.join(rim['flags'])}\n"
          f"           n={a.rim_num} k={a.rim_top_k} d_r={a.rim_size} layers={a.rim_layers} "
          f"bidirectional={a.rim_bidirectional} cell={a.rim_cell} -> {rim['model'].encoder.output_units} "
          f"encoder units; encoder {rim['encoder_params'] / 1e6:.3f}M, model {rim['params'] / 1e6:.3f}M params")
    print(f"  lstm     --arch {LSTM_ARCH} {' '.join(lstm['flags'])}\n"
          f"           {lstm['model'].encoder.output_units} encoder units; encoder "
          f"{lstm['encoder_params'] / 1e6:.3f}M, model {lstm['params'] / 1e6:.3f}M params", flush=True)

    steps = [encoder_entry(lstm), encoder_entry(rim)]
    if not cfg.no_model:
        steps += [lstm, rim]
    results = {
        **results_header(cfg, device),
        "models": {e["name"]: {"arch": e["arch"], "flags": e["flags"], "params": e["params"],
                               "encoder_params": e["encoder_params"],
                               "encoder_output_units": e["model"].encoder.output_units}
                   for e in (lstm, rim)},
    }

    print(f"\nforward + backward, train mode, ~{cfg.tokens} tokens/batch, --warmup "
          f"{' '.join(map(str, cfg.warmup))} untimed and --repeats {' '.join(map(str, cfg.repeats))} "
          "timed steps each, interleaved (median):", flush=True)

    def save_partial(rows_so_far):
        results["train"] = rows_so_far
        write_json(cfg.json, results)

    results["train"] = bench(steps, cfg, d, device, on_row=save_partial)
    print()
    for line in format_table(results["train"]):
        print(line)
    write_json(cfg.json, results)
    print(f"\nresults written to {cfg.json}")
    return results


if __name__ == "__main__":
    main()
