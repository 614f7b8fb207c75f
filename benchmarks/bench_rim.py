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
at most 4 x the LSTM encoder's on the 2-core CPU. ``--no-train`` skips this timing.

Kernel calls per encoder time step (``--count-ops``)
    What a GPU pays in kernel launches, counted on any device by ``kernel_calls.py`` (every
    ATen op that runs a kernel, called from Python or by the autograd engine, and every
    inductor-compiled kernel; off CUDA the plugin's code takes its CUDA path,
    ``device_paths.emulate``, as in ``bench_dma.py --count-ops``). For each encoder, through
    its public forward only, in train mode: (a) the calls of the encoder's forward alone and
    (b) those of forward + backward of the encoder step's loss above (``encoder_loss``), at
    the shortest and the longest of ``--lengths``, L1 < L2, with the same batch of
    ``--tokens // L2`` sentences, each count after one untimed warm-up step at its shape.
    Per time step = (count(L2) - count(L1)) / (L2 - L1), so what the encoder pays once per
    batch whatever its length (embedding, projections, the loss) cancels; backward per step =
    (b) per step - (a) per step; the fixed part is count(L1) - L1 x per step. Printed: a
    table of forward, backward and total (forward + backward) calls per step and the totals
    at L1 and L2 for both encoders, with the ratios RIM / LSTM ('-' where the LSTM's count is
    0), and the RIM encoder's 8 most frequent calls per step (forward + backward). fairseq's
    LSTMEncoder runs the whole sequence as one ``aten::lstm`` call (cuDNN on a GPU, a oneDNN
    kernel on the CPU) and its backward as one call per layer and direction, so its calls per
    step are 0 and only the ratios of the totals are defined. Needs two different
    ``--lengths``; with ``--no-train`` only the counting runs (``--no-model`` does not matter
    to it). JSON ``kernel_ops``: ``lengths`` [L1, L2], ``batch``, and per encoder (``rim_lstm_encoder``,
    ``lstm_encoder``) ``calls`` {forward, total: [at L1, at L2]}, ``per_step`` {forward,
    backward, total} and ``fixed`` {forward, total}; ``ratios`` RIM / LSTM (``per_step``, null
    where the LSTM's is 0; ``calls`` at L1 and L2) and ``rim_top_ops_per_step``. When the RIM
    encoder ran the fused loop (``--rim-recurrence``), the same encoder is counted again on the
    step-by-step loop, the baseline of the cut: ``stepwise_loop`` (a record like the encoders'),
    and a line gives the two loops' calls per step and their ratio.

Which recurrence runs: the model's ``--rim-recurrence`` (default ``auto``: the step-by-step
loop on the CPU, the fused one on a GPU, and so the fused one under ``--count-ops``'s
emulation of the CUDA path); ``--rim-args="--rim-recurrence fused"`` times the fused loop on
the CPU. ``--compile`` adds ``--rim-compile`` (``rim_compile_failed`` in the JSON says whether
compiling failed and the loop ran eagerly).

Output: the table(s) and a JSON file (``--json``, default benchmarks/results/bench_rim.json,
rewritten after every timed length) with per-repeat times (``train``), the kernel calls
(``kernel_ops``), parameter counts, versions and the git commit / plugin source hash
(``harness.provenance``).

Examples:
    python benchmarks/bench_rim.py --threads 2                          # full run, CPU
    python benchmarks/bench_rim.py --rim-args="--rim-cell gru" --lengths 128
    python benchmarks/bench_rim.py --rim-args="--rim-bidirectional --rim-layers 2" --no-model
    python benchmarks/bench_rim.py --device cuda --repeats 10 --warmup 3
    python benchmarks/bench_rim.py --quick                              # smoke run, seconds
    python benchmarks/bench_rim.py --count-ops --no-train               # kernel calls per time step only
    python benchmarks/bench_rim.py --count-ops --no-train --rim-args="--rim-recurrence stepwise"
    python benchmarks/bench_rim.py --count-ops --no-train --compile     # the fused steps compiled (minutes)
"""

import argparse
import contextlib
import shlex
import statistics
from pathlib import Path

import torch
from fairseq.models.lstm import LSTMEncoder

# harness.py, beside this script, holds the measuring code shared with bench_dma.py and
# bench_variants.py; it comes first because it also puts the checkout on sys.path
from harness import (
    REPO,
    build,
    kernel_op_counts,
    parse_fairseq_args,
    per_length,
    prepare_run,
    ratio_cell,
    results_header,
    synthetic_dictionary,
    timed_step,
    train_step,
    training_sample,
    versions_line,
    write_json,
    zero_grad,
)
from kernel_calls import count_kernel_calls

from fairseq_modattn.models.rim_lstm import RIMEncoder
from fairseq_modattn.modules import device_paths

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


COUNT_TOP = 8  # the RIM encoder's most frequent calls per step that --count-ops reports


def count_lengths(lengths):
    """(L1, L2) of --count-ops: the shortest and the longest of --lengths."""
    l1, l2 = min(lengths), max(lengths)
    if l1 == l2:
        raise SystemExit(f"--count-ops needs two different --lengths (calls per step = the difference "
                         f"of two lengths' counts), got {' '.join(map(str, lengths))}")
    return l1, l2


def per_step(counts, l1, l2):
    """{name: calls per time step} from {length: {name: calls}} at L1 < L2."""
    names = set(counts[l1]) | set(counts[l2])
    return {k: (counts[l2].get(k, 0) - counts[l1].get(k, 0)) / (l2 - l1) for k in names}


def encoder_op_counts(entry, samples, math_sdpa_as_fused):
    """({length: {op: calls}} of the encoder's forward alone, the same of forward + backward of
    ``encoder_loss``), each counted after one untimed warm-up step at its shape."""
    encoder = entry["model"]
    encoder.train()
    forward, total = {}, {}
    for length, sample in samples.items():
        zero_grad(encoder)
        train_step(entry, sample)  # warm-up: the first step at a shape may take other paths
        zero_grad(encoder)
        net_input = sample["net_input"]
        forward[length] = count_kernel_calls(lambda: encoder(net_input["src_tokens"], net_input["src_lengths"]),
                                             math_sdpa_as_fused)
        total[length] = kernel_op_counts(entry, sample, math_sdpa_as_fused)
    return forward, total


def encoder_call_record(forward, total, l1, l2):
    """One encoder's JSON record: calls at L1 and L2, per time step and fixed (module docstring)."""
    calls = {"forward": [sum(forward[n].values()) for n in (l1, l2)],
             "total": [sum(total[n].values()) for n in (l1, l2)]}
    step = {kind: (c[1] - c[0]) / (l2 - l1) for kind, c in calls.items()}
    step["backward"] = step["total"] - step["forward"]
    return {"calls": calls, "per_step": {k: step[k] for k in ("forward", "backward", "total")},
            "fixed": {kind: c[0] - l1 * step[kind] for kind, c in calls.items()}}


def stepwise_loop_record(entry, samples, emulating, l1, l2):
    """``encoder_call_record`` of the RIM encoder with every layer on the step-by-step loop
    (``--rim-recurrence stepwise``), the layers' own setting restored afterwards."""
    layers = entry["model"].layers
    settings = [layer.recurrence for layer in layers]
    try:
        for layer in layers:
            layer.recurrence = "stepwise"
        forward, total = encoder_op_counts(entry, samples, math_sdpa_as_fused=emulating)
    finally:
        for layer, setting in zip(layers, settings):
            layer.recurrence = setting
    return encoder_call_record(forward, total, l1, l2)


def count_ops(encoders, cfg, d, device):
    """Kernel calls per encoder time step, forward and backward, of each encoder entry
    (``encoder_entry``), and the RIM / LSTM ratios (module docstring)."""
    l1, l2 = count_lengths(cfg.lengths)
    bsz = max(cfg.tokens // l2, 1)
    emulating = device.type != "cuda"
    gen = torch.Generator().manual_seed(cfg.seed)
    samples = {length: training_sample(length, bsz, d, gen, device) for length in (l1, l2)}
    record = {"path": "cuda, emulated on the cpu" if emulating else "cuda", "lengths": [l1, l2], "batch": bsz,
              "encoders": {}}
    with device_paths.emulate("cuda") if emulating else contextlib.nullcontext():
        for e in encoders:
            forward, total = encoder_op_counts(e, samples, math_sdpa_as_fused=emulating)
            record["encoders"][e["name"]] = encoder_call_record(forward, total, l1, l2)
            if e["name"] == "rim_lstm_encoder":
                top = sorted(per_step(total, l1, l2).items(), key=lambda kv: (-kv[1], kv[0]))[:COUNT_TOP]
                record["rim_top_ops_per_step"] = dict(top)
                if any(layer.recurrence != "stepwise" for layer in e["model"].layers):
                    # the baseline of the loop's cut: the same encoder on the step-by-step loop
                    record["stepwise_loop"] = stepwise_loop_record(e, samples, emulating, l1, l2)
    rim, lstm = record["encoders"]["rim_lstm_encoder"], record["encoders"]["lstm_encoder"]
    record["ratios"] = {
        "per_step": {k: rim["per_step"][k] / lstm["per_step"][k] if lstm["per_step"][k] > 0 else None
                     for k in rim["per_step"]},
        "calls": {k: [r / s for r, s in zip(rim["calls"][k], lstm["calls"][k])] for k in rim["calls"]},
    }
    return record


def format_count_table(counted):
    """The --count-ops table: calls per step, totals at L1 and L2, ratios; the RIM's top calls."""
    l1, l2 = counted["lengths"]
    header = (f"{'encoder':<8} {'forward/step':>12} {'backward/step':>13} {'total/step':>10} "
              f"{f'fwd L={l1}':>10} {f'total L={l1}':>12} {f'fwd L={l2}':>10} {f'total L={l2}':>12}")
    lines = [header, "-" * len(header)]
    for label, name in (("LSTM", "lstm_encoder"), ("RIM", "rim_lstm_encoder")):
        e = counted["encoders"][name]
        step, calls = e["per_step"], e["calls"]
        lines.append(f"{label:<8} {step['forward']:>12.2f} {step['backward']:>13.2f} {step['total']:>10.2f} "
                     f"{calls['forward'][0]:>10d} {calls['total'][0]:>12d} {calls['forward'][1]:>10d} "
                     f"{calls['total'][1]:>12d}")
    x_step, x_calls = counted["ratios"]["per_step"], counted["ratios"]["calls"]
    lines.append(f"{'RIM/LSTM':<8} {ratio_cell(x_step['forward'], 12)} {ratio_cell(x_step['backward'], 13)} "
                 f"{ratio_cell(x_step['total'], 10)} {ratio_cell(x_calls['forward'][0], 10)} "
                 f"{ratio_cell(x_calls['total'][0], 12)} {ratio_cell(x_calls['forward'][1], 10)} "
                 f"{ratio_cell(x_calls['total'][1], 12)}")
    lines.append(f"per step = (calls at L={l2} - calls at L={l1}) / {l2 - l1}, batch {counted['batch']}; "
                 "total = forward + backward of the encoder loss;\nbackward = total - forward; "
                 "RIM/LSTM '-' where the LSTM's count is 0")
    if counted["encoders"]["lstm_encoder"]["per_step"]["total"] <= 0:
        lines.append("the LSTM encoder's calls do not grow with length: fairseq's LSTMEncoder runs the whole "
                     "sequence as one aten::lstm\ncall (cuDNN on a GPU) and its backward as one call per layer "
                     "and direction; compare the totals")
    stepwise = counted.get("stepwise_loop")
    if stepwise is not None:
        before, now = stepwise["per_step"]["total"], counted["encoders"]["rim_lstm_encoder"]["per_step"]["total"]
        lines.append(f"the RIM loop against the step-by-step loop (--rim-recurrence stepwise), calls per step: "
                     f"{before:.2f} / {now:.2f} = {before / now:.2f} x fewer")
    top = counted["rim_top_ops_per_step"]
    lines.append(f"the RIM encoder's {len(top)} most frequent calls per step (forward + backward):\n  "
                 + ", ".join(f"{name[6:] if name.startswith('aten::') else name} {n:.2f}" for name, n in top.items()))
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
    p.add_argument("--no-train", action="store_true", help="skip the timing (e.g. to only --count-ops)")
    p.add_argument("--count-ops", action="store_true",
                   help="also count the kernel calls (what a GPU pays in launches; on any device) per encoder "
                        "time step, forward and backward, of both encoders, from the shortest and the longest "
                        "of --lengths on a batch of --tokens // the longest")
    p.add_argument("--dict-size", type=int, default=10000, help="symbols of the synthetic dictionary")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="CPU: cap the address space (default 90%% of MemAvailable, 0 = no cap)")
    p.add_argument("--quick", action="store_true", help="tiny models and batches: a smoke run")
    p.add_argument("--compile", action="store_true",
                   help="build the RIM model with --rim-compile (the fused recurrence's steps compiled by "
                        "torch.compile; inductor's kernels then record profiler events, so that --count-ops "
                        "counts them)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    return p


def main(argv=None):
    cfg = get_parser().parse_args(argv)
    device = prepare_run(cfg, argv, QUICK, QUICK_MODEL_ARGS)
    if cfg.quick:
        cfg.rim_args = QUICK_RIM_ARGS + cfg.rim_args
    if cfg.count_ops:
        count_lengths(cfg.lengths)  # before anything runs
    if cfg.compile:
        cfg.rim_args = cfg.rim_args + ["--rim-compile"]
        # before anything compiles: the kernels' profiler events are written into their code
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True

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

    encoders = [encoder_entry(lstm), encoder_entry(rim)]
    steps = list(encoders)
    if not cfg.no_model:
        steps += [lstm, rim]
    results = {
        **results_header(cfg, device),
        "models": {e["name"]: {"arch": e["arch"], "flags": e["flags"], "params": e["params"],
                               "encoder_params": e["encoder_params"],
                               "encoder_output_units": e["model"].encoder.output_units}
                   for e in (lstm, rim)},
    }

    if not cfg.no_train:
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

    if cfg.count_ops:
        l1, l2 = count_lengths(cfg.lengths)
        print(f"\nkernel calls per encoder time step (benchmarks/kernel_calls.py; the CUDA code path, "
              f"{'emulated on the CPU' if device.type != 'cuda' else 'on this GPU'}), train mode, "
              f"L = {l1} and {l2}, batch {max(cfg.tokens // l2, 1)}:", flush=True)
        results["kernel_ops"] = count_ops(encoders, cfg, d, device)
        for line in format_count_table(results["kernel_ops"]):
            print(line)
    if cfg.compile:
        from fairseq_modattn.modules import rim_recurrence

        results["rim_compile_failed"] = rim_recurrence.compile_failed()
        if results["rim_compile_failed"]:
            print("\n--compile: torch.compile failed, the RIM recurrence ran eagerly (from the first failure on)")
    write_json(cfg.json, results)
    print(f"\nresults written to {cfg.json}")
    return results


if __name__ == "__main__":
    main()
