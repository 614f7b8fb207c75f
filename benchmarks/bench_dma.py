#!/usr/bin/env python
"""Speed and memory of the DMA transformer against fairseq's transformer, same dimensions.

Both models are built in one process through fairseq's own registries, exactly as
``fairseq-train`` builds them: ``fairseq.options`` parses ``--arch transformer_iwslt_de_en``
and ``--arch dma_transformer_iwslt_de_en`` (after ``import fairseq_modattn``), a real
``TranslationTask`` is created over synthetic ``Dictionary`` objects (``--dict-size`` symbols,
default 10k, shared by source and target), and ``fairseq.models.build_model`` /
``fairseq.criterions.build_criterion`` build the model (same ``--seed`` for both) and the
criterion (``label_smoothed_cross_entropy`` for the transformer,
``label_smoothed_cross_entropy_with_aux`` for DMA, label smoothing 0.1). Dimensions are those
of the iwslt_de_en architectures: 512 embeddings, 1024 FFN, 4 heads, 6 + 6 layers, dropout 0.3.

Training step (``--lengths``, default 32 128 512)
    For each length L, a batch of ``--tokens // L`` sentences of L random token ids (the last
    one EOS; no padding; source and target the same length; ``prev_output_tokens`` is the
    target shifted right as fairseq's collater does). One measured step is
    ``criterion(model, sample)`` + ``loss.backward()`` in train mode, gradients set to None
    beforehand (outside the timer), as fairseq's trainer does. The DMA model gets
    ``set_num_updates(--num-updates)`` (default 4000, gamma = 0.5), so the semantic-mask
    path (two SDPA calls per attention plus the GMM posteriors) and the regularisers really
    run; the script checks that the criterion logs gamma > 0. Per length, each model first
    runs the memory step (below), so its first step at a new shape is never timed; then
    ``--warmup`` untimed steps each, then ``--repeats`` timed steps, alternately (transformer,
    DMA, transformer, ...) so that drifts of the machine hit both alike; the table shows
    medians, and as "step ratios" the range of each DMA step's time over the transformer step
    just before it (the spread over repeats). ``--repeats`` and ``--warmup`` take one value or
    one per length (e.g. ``--repeats 3 3 1``: a DMA step at length 512 is slow on a CPU).

Peak memory (MB = 2**20 bytes) is the peak of *tensor memory allocated during one training
step* above what was allocated before it (weights, inputs), measured by ``harness.py`` (whose
docstring explains the method): ``torch.cuda.max_memory_allocated`` on CUDA; on the CPU the
running total of allocated tensor bytes that torch's allocator reports to
``torch.profiler.profile(profile_memory=True)``, during one extra step. On CPU the script caps
its own address space (``--memory-limit-gb``, default 90% of MemAvailable) so that a step too
large for the machine fails with torch's catchable allocation error instead of the kernel's OOM
killer; that model is then reported as OOM at that length (no time, no ratio) and the run goes
on. The JSON is rewritten after every length, so a crash keeps the lengths already measured.

Generation (skip with ``--no-generate``)
    Both models in eval mode (random weights, DMA with the same ``--num-updates``) translate
    the same ``--gen-sentences`` synthetic sources (lengths 20-30, left-padded as fairseq's
    translation task does) with ``fairseq.sequence_generator.SequenceGenerator`` (beam
    ``--beam``, max_len_a=0, max_len_b = min_len = ``--gen-len``), so every hypothesis has
    exactly ``--gen-len`` tokens + EOS whatever the weights and both models decode the same
    number of steps (checked). Reported: sentences/s (median over ``--gen-repeats`` full passes
    after one warm-up batch) and the ratio DMA / transformer (> 1 means DMA is faster).
    SequenceGenerator sets the beam size on models that have ``set_beam_size``: this package's
    models do, and their encoder-decoder attention then reads one copy of each sentence's
    encoder keys for its beams; fairseq 0.12's ``TransformerModel`` has no such method, so its
    attention reads one copy per beam. The transformer therefore also runs with its own
    attention's beam-shared keys switched on (``transformer_shared_keys``, the same
    translations, checked), and the ratio against it is reported beside the first.

Results depend on the plugin sources of the checkout; the JSON records the git commit, whether
fairseq_modattn/ has uncommitted changes, and a hash of its sources.

Output: the table (length, batch, ms, ratios, MB), a note on how the time ratio grows with
length compared with a cost that scales like attention, the generation speeds, and a JSON file
(``--json``, default benchmarks/results/bench_dma.json). ``--profile L`` additionally prints
the top ops by self CPU time of the DMA training step at length L (torch.profiler), and the
same time and kernel ops by issuing function. ``--count-ops`` prints, per length, how many
kernel-running ATen ops one training step of each model dispatches (harness.py, "Kernel
launches"): what a GPU pays in launches, which a CPU's timings hide.

Examples:
    python benchmarks/bench_dma.py                                  # full run, CPU
    python benchmarks/bench_dma.py --repeats 3 --warmup 1 --threads 2
    python benchmarks/bench_dma.py --device cuda --repeats 10 --warmup 3
    python benchmarks/bench_dma.py --quick                          # smoke run, seconds
    python benchmarks/bench_dma.py --count-ops --no-train --no-generate   # GPU launches, on any device
    python benchmarks/bench_dma.py --quick --count-ops --no-train --no-generate --compile   # the same, DMA compiled
"""

import argparse
import contextlib
import gc
import math
import statistics
from pathlib import Path

import torch

# harness.py, beside this script, holds the measuring code shared with bench_variants.py and
# bench_rim.py; importing it also registers the plugin's architectures with fairseq
from harness import (
    LIMIT_NOTE,
    REPO,
    SHARED_BASELINE,
    build,
    decoding_step_op_counts,
    fmt,
    interleaved_step_times,
    kernel_op_counts,
    measure_peak,
    per_length,
    prepare_run,
    ratio_cell,
    results_header,
    sync,
    synthetic_dictionary,
    time_generation,
    timed_step,
    train_step,
    training_sample,
    versions_line,
    write_json,
    zero_grad,
)
from kernel_calls import runs_kernel

from fairseq_modattn.modules import device_paths

DEFAULT_JSON = REPO / "benchmarks" / "results" / "bench_dma.json"

# (name, --arch, --criterion)
MODELS = (
    ("transformer", "transformer_iwslt_de_en", "label_smoothed_cross_entropy"),
    ("dma", "dma_transformer_iwslt_de_en", "label_smoothed_cross_entropy_with_aux"),
)

# --quick: tiny model and batches, only to check that the whole pipeline runs.
QUICK_MODEL_ARGS = [
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-layers", "2", "--decoder-layers", "2",
]
QUICK = dict(lengths=[8, 32], tokens=256, repeats=[2], warmup=[1], dict_size=1000,
             gen_sentences=8, gen_batch_size=4, gen_len=8, gen_repeats=1)


# ----------------------------------------------------------------------------- training
def bench_training(entries, cfg, d, device, on_row=None):
    """One row per length; a model that runs out of memory at a length gets None there."""
    rows = []
    gen = torch.Generator().manual_seed(cfg.seed)
    repeats = per_length(cfg.repeats, cfg.lengths, "--repeats")
    warmups = per_length(cfg.warmup, cfg.lengths, "--warmup")
    for length in cfg.lengths:
        bsz = max(cfg.tokens // length, 1)
        sample = training_sample(length, bsz, d, gen, device)
        for e in entries:
            e["model"].train()
        # The memory step comes first, so it is also the first (untimed) step at this shape.
        peaks, gammas, oom = {}, {}, {}
        for e in entries:
            peaks[e["name"]], log, note = measure_peak(e, sample, device)
            if note is None:
                gammas[e["name"]] = float(log.get("gamma", 0.0)) / float(log["sample_size"])
            else:
                oom[e["name"]] = note
                print(f"  L={length:4d} B={bsz:4d}: {e['name']} ran out of memory: {note}", flush=True)
        if "dma" not in oom and gammas["dma"] <= 0.0:
            raise RuntimeError(f"DMA trained with gamma = {gammas['dma']}: the mask path was not exercised")
        times = interleaved_step_times(entries, sample, device, warmups[length], repeats[length], skip=oom)
        del sample
        gc.collect()

        t_ms, d_ms = (statistics.median(times[n]) if times[n] else None for n in ("transformer", "dma"))
        t_mb, d_mb = peaks["transformer"], peaks["dma"]
        # each timed DMA step against the transformer step just before it: the spread over repeats
        step_ratios = [dma / base for base, dma in zip(times["transformer"], times["dma"])]
        row = {
            "length": length, "batch": bsz, "tokens": bsz * length,
            "transformer_ms": t_ms, "dma_ms": d_ms, "time_ratio": d_ms / t_ms if t_ms and d_ms else None,
            "time_ratio_range": [min(step_ratios), max(step_ratios)] if step_ratios else None,
            "transformer_mb": t_mb, "dma_mb": d_mb, "memory_ratio": d_mb / t_mb if t_mb and d_mb else None,
            "transformer_ms_all": times["transformer"], "dma_ms_all": times["dma"],
            "repeats": max(repeats[length], 1), "warmup": warmups[length], "dma_gamma": gammas.get("dma"),
            "out_of_memory": oom,
        }
        rows.append(row)
        print(f"  L={length:4d} B={bsz:4d}: transformer {fmt(t_ms, 9, 1)} ms {fmt(t_mb, 8, 1)} MB | "
              f"DMA {fmt(d_ms, 9, 1)} ms {fmt(d_mb, 8, 1)} MB", flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def scaling_note(rows):
    """How the time ratio and DMA's extra time per token grow with length."""
    lines, fits = [], []
    rows = [r for r in rows if r["time_ratio"] is not None]
    for a, b in zip(rows, rows[1:]):
        factor = b["length"] / a["length"]
        extra_a = (a["dma_ms"] - a["transformer_ms"]) / a["tokens"]
        extra_b = (b["dma_ms"] - b["transformer_ms"]) / b["tokens"]
        base_a, base_b = a["transformer_ms"] / a["tokens"], b["transformer_ms"] / b["tokens"]
        fit = {"from": a["length"], "to": b["length"], "length_factor": factor,
               "time_ratio_factor": b["time_ratio"] / a["time_ratio"],
               "transformer_ms_per_token_factor": base_b / base_a,
               "transformer_exponent": math.log(base_b / base_a) / math.log(factor)}
        if extra_a > 0 and extra_b > 0:
            fit["dma_extra_ms_per_token_factor"] = extra_b / extra_a
            fit["dma_extra_exponent"] = math.log(extra_b / extra_a) / math.log(factor)
        fits.append(fit)
        line = (f"  L {a['length']} -> {b['length']} (x{factor:g}): time ratio {a['time_ratio']:.2f} -> "
                f"{b['time_ratio']:.2f} (x{fit['time_ratio_factor']:.2f}); transformer ms/token "
                f"x{fit['transformer_ms_per_token_factor']:.2f} (L^{fit['transformer_exponent']:.2f})")
        if "dma_extra_exponent" in fit:
            line += (f"; DMA extra ms/token x{fit['dma_extra_ms_per_token_factor']:.2f} "
                     f"(L^{fit['dma_extra_exponent']:.2f})")
        else:
            line += "; DMA extra ms/token not positive at both lengths"
        lines.append(line)
    lines.append("  Per token, plain attention scores (T x S per sentence) cost L^1 and projections/FFN/"
                 "output layer L^0: an extra DMA cost near L^1 scales like attention (log M and the "
                 "second softmax, the N x N InfoNCE critic), near L^0 like a per-token cost (GMM "
                 "posteriors, KL, L_Dqq with sampled negatives). "
                 "The ratio DMA/transformer stays flat if DMA's extra cost scales like the "
                 "transformer's own mix, and grows with length if it is more attention-heavy.")
    return lines, fits


# ----------------------------------------------------------------------------- generation
def bench_generation(entries, cfg, d, device):
    times, result = time_generation(entries, cfg, d, device)
    for name in ("transformer", SHARED_BASELINE, "dma"):
        sec = statistics.median(times[name])
        result[f"{name}_seconds"] = sec
        result[f"{name}_seconds_all"] = times[name]
        result[f"{name}_sentences_per_s"] = cfg.gen_sentences / sec
    result["sentences_per_s_ratio"] = result["dma_sentences_per_s"] / result["transformer_sentences_per_s"]
    result["sentences_per_s_ratio_shared_keys"] = (
        result["dma_sentences_per_s"] / result[f"{SHARED_BASELINE}_sentences_per_s"]
    )
    return result


# ----------------------------------------------------------------------------- profiling
def source_location(chain):
    """Innermost frame of a Python call chain in the plugin or in fairseq (e.g. an FFN matmul goes
    to fairseq's transformer layer, a GMM matmul to the plugin's gmm.py), else None."""
    for frame in reversed(chain):
        for marker in ("fairseq_modattn/", "fairseq/"):
            if marker in frame:
                return frame[frame.index(marker):]
    return None


def self_time_by_source(prof):
    """Self CPU time of every op, and the number of kernel-running operator calls (harness.py,
    "Kernel launches"), attributed
    to the Python function that issued them: [(location, self ns, kernel ops)], slowest first.

    Forward ops: the innermost plugin (else fairseq) frame of their call chain. Backward ops run
    in the autograd engine without Python frames; they go to the frame of the forward op whose
    sequence number their ``autograd::engine::evaluate_function: XBackward`` node carries.
    """
    from torch._C._profiler import _EventType

    python = (_EventType.PyCall, _EventType.PyCCall)
    forward_location, ops = {}, []  # ops: (self ns, location, backward sequence number or None)

    def walk(nodes, chain, backward_seq, inside_op=False):
        for node in nodes:
            if node.tag in python:
                walk(node.children, chain + [node.name], backward_seq, inside_op)
                continue
            if node.tag != _EventType.TorchOp:
                continue
            seq = node.extra_fields.sequence_number
            child_ns = sum(c.duration_time_ns for c in node.children if c.tag == _EventType.TorchOp or c.tag in python)
            location = source_location(chain)
            if node.name.startswith("autograd::engine::evaluate_function"):
                backward_seq = seq
            elif backward_seq is None and seq >= 0 and location is not None:
                forward_location.setdefault(seq, location)
            aten = node.name.startswith("aten::")
            call = aten and not inside_op and runs_kernel(node)
            ops.append((node.duration_time_ns - child_ns, location, backward_seq, call))
            walk(node.children, chain, backward_seq, inside_op or aten)

    walk(prof.profiler.kineto_results.experimental_event_tree(), [], None)
    totals = {}
    for self_ns, location, backward_seq, kernel in ops:
        if backward_seq is not None:
            location = forward_location.get(backward_seq, "(unattributed)") + " [backward]"
        elif location is None:
            location = "(no fairseq frame: criterion / autograd glue)"
        ns, kernels = totals.get(location, (0, 0))
        totals[location] = (ns + max(self_ns, 0), kernels + kernel)
    return sorted(((loc, ns, kernels) for loc, (ns, kernels) in totals.items()), key=lambda r: -r[1])


def gpu_busy(entry, sample, device):
    """(step ms, GPU kernel ms) of a training step on CUDA: the median wall time of 5 unprofiled
    steps and the summed durations of the kernels and copies it ran on the GPU (one profiled step).
    A kernel time far below the step's means the GPU waits for the host to issue its calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    entry["model"].train()
    zero_grad(entry["model"])
    train_step(entry, sample)  # warm-up at this shape
    step_ms = statistics.median(timed_step(entry, sample, device) for _ in range(5))  # each zeroes the gradients
    zero_grad(entry["model"])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(entry, sample)
        sync(device)
    zero_grad(entry["model"])
    kernel_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return step_ms, kernel_us / 1e3


def profile_dma(entry, cfg, d, device, length, top=15):
    """Top ops (self time) of one DMA training step, and the same time by issuing function."""
    from torch.profiler import ProfilerActivity, profile

    bsz = max(cfg.tokens // length, 1)
    sample = training_sample(length, bsz, d, torch.Generator().manual_seed(cfg.seed), device)
    entry["model"].train()
    zero_grad(entry["model"])
    train_step(entry, sample)  # warm-up at this shape
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    zero_grad(entry["model"])
    with profile(activities=activities, with_stack=True) as prof:
        train_step(entry, sample)
        sync(device)
    zero_grad(entry["model"])
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ops_table = prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=60)
    by_source = self_time_by_source(prof)
    total = sum(ns for _, ns, _ in by_source) or 1
    lines = [f"{'self CPU s':>10} {'share':>6} {'kernel ops':>10}  issuing function "
             f"(forward; [backward] = its autograd backward)"]
    for location, ns, kernels in by_source[:top]:
        lines.append(f"{ns / 1e9:>10.3f} {100.0 * ns / total:>5.1f}% {kernels:>10d}  {location}")
    lines.append(f"{'':>17} {sum(k for _, _, k in by_source):>10d}  in all")
    return ops_table, "\n".join(lines), [{"location": loc, "self_s": ns / 1e9, "kernel_ops": kernels}
                                          for loc, ns, kernels in by_source]


def warmed_up_samples(entries, cfg, d, device, batch=None):
    """(length, batch, sample) for each of ``cfg.lengths``, every model in train mode and warmed
    up by one step at that shape (the first step at a shape may take other paths: caches,
    allocation, compiling); ``batch``: the sample's sentences instead of ``cfg.tokens`` worth
    (the batch returned is still ``cfg.tokens``')."""
    gen = torch.Generator().manual_seed(cfg.seed)
    for length in cfg.lengths:
        bsz = max(cfg.tokens // length, 1)
        sample = training_sample(length, batch or bsz, d, gen, device)
        for e in entries:
            e["model"].train()
            zero_grad(e["model"])
            train_step(e, sample)
            zero_grad(e["model"])
        yield length, bsz, sample


def count_ops(entries, cfg, d, device):
    """Per length: the kernel launches of one training step of each model, and their ratio; then
    the launches of one beam-search decoding step. Off CUDA the models take the CUDA code path
    (``device_paths.emulate``) and a math-path SDPA counts as the one fused kernel it is there,
    so the count is what a GPU launches."""
    emulating = device.type != "cuda"
    context = device_paths.emulate("cuda") if emulating else contextlib.nullcontext()
    rows = []
    with context:
        for length, bsz, sample in warmed_up_samples(entries, cfg, d, device):
            counts = {e["name"]: kernel_op_counts(e, sample, math_sdpa_as_fused=emulating) for e in entries}
            t, m = (sum(counts[n].values()) for n in ("transformer", "dma"))
            top = sorted(counts["dma"].items(), key=lambda kv: -kv[1])[:5]
            rows.append({"length": length, "batch": bsz, "transformer_ops": t, "dma_ops": m, "ops_ratio": m / t,
                         "dma_top_ops": dict(top)})
            print(f"  L={length:4d} B={bsz:4d}: transformer {t:6d} | DMA {m:6d} ({m / t:.2f} x); DMA's most "
                  f"frequent: {', '.join(f'{name[6:]} {n}' for name, n in top)}", flush=True)
        decoding = {e["name"]: sum(decoding_step_op_counts(e, cfg, d, device, emulating).values()) for e in entries}
    flat = rows[-1]["dma_ops"] / rows[0]["dma_ops"] if rows else None
    if rows:
        print(f"  DMA's calls at L={rows[-1]['length']} / L={rows[0]['length']}: {flat:.3f}")
    ratio = decoding["dma"] / decoding["transformer"]
    print(f"  one beam-{cfg.beam} decoding step: transformer (beam-shared encoder keys) "
          f"{decoding['transformer']:.1f} | DMA {decoding['dma']:.1f} ({ratio:.2f} x)", flush=True)
    return {"path": "cuda, emulated on the cpu" if emulating else "cuda", "train": rows,
            "dma_calls_growth": flat, "decoding_step": {**decoding, "ratio": ratio}}


# ----------------------------------------------------------------------------- traffic
#: the floor's target (issue "DMA's GPU step as hand-written Triton kernels"): a DMA step's bytes
#: at most this many times the transformer's at L = 128
TRAFFIC_TARGET = (128, 1.3)


def traffic(entries, cfg, d, device, top=6):
    """Per length: the matmul FLOPs and the bytes of one training step of each model
    (``step_traffic.py``: each operator alone, the Triton kernels' loads and stores from their
    tiles, a compiled graph's generated kernels as inductor counts them), the CUDA code path as
    ``count_ops`` takes it, and their ratios. A compiled or "triton" DMA model's graphs are
    compiled again at each counted step's shapes (``step_traffic.compiled_graph_counting``)."""
    from step_traffic import compiled_graph_counting, count_traffic, extrapolate

    compiled = cfg.compile or cfg.dma_backend == "triton"

    def counts(sample):
        counted = {}
        for e in entries:
            zero_grad(e["model"])
            if compiled and e["name"] == "dma":
                recompile()  # inductor counts the graph at the sizes it compiles it for
            counted[e["name"]] = count_traffic(lambda: train_step(e, sample))  # noqa: B023
            zero_grad(e["model"])
        return counted

    emulating = device.type != "cuda"
    rows = []
    small = cfg.traffic_sentences
    with device_paths.emulate("cuda") if emulating else contextlib.nullcontext(), \
            compiled_graph_counting() if compiled else contextlib.nullcontext() as recompile:
        for length, bsz, sample in warmed_up_samples(entries, cfg, d, device, batch=small and small[0]):
            if small:  # two small batches, extrapolated to the bench's (step_traffic.extrapolate)
                gen = torch.Generator().manual_seed(cfg.seed)
                first, second = (counts(training_sample(length, n, d, gen, device)) for n in small)
                counted = {name: extrapolate(first[name], second[name], *small, bsz) for name in first}
            else:
                counted = counts(sample)
            t, m = counted["transformer"], counted["dma"]
            movers = sorted(m.by_op.items(), key=lambda kv: -kv[1])[:top]
            row = {"length": length, "batch": bsz, "transformer_gflops": t.flops / 1e9, "dma_gflops": m.flops / 1e9,
                   "flops_ratio": m.flops / t.flops, "transformer_gb": t.bytes / 1e9, "dma_gb": m.bytes / 1e9,
                   "bytes_ratio": m.bytes / t.bytes, "transformer_gb_once": t.once / 1e9, "dma_gb_once": m.once / 1e9,
                   "bytes_ratio_once": m.once / t.once, "dma_top_movers_gb": {k: v / 1e9 for k, v in movers}}
            rows.append(row)
            print(f"  L={length:4d} B={bsz:4d}: FLOPs transformer {row['transformer_gflops']:8.2f} G | DMA "
                  f"{row['dma_gflops']:8.2f} G ({row['flops_ratio']:.3f} x); bytes transformer "
                  f"{row['transformer_gb']:7.2f} GB | DMA {row['dma_gb']:7.2f} GB ({row['bytes_ratio']:.2f} x); "
                  f"operands once: transformer {row['transformer_gb_once']:7.2f} GB | DMA {row['dma_gb_once']:7.2f} GB "
                  f"({row['bytes_ratio_once']:.2f} x)", flush=True)
            print("        DMA's largest movers: " + ", ".join(f"{name.split('::')[-1]} {gb:.2f} GB"
                                                        for name, gb in row["dma_top_movers_gb"].items()), flush=True)
    length, target = TRAFFIC_TARGET
    at = [r for r in rows if r["length"] == length]
    if at:
        for key, rule in (("bytes_ratio_once", "every kernel's operands read once, the rule of the transformer's "
                                               "attention operator"),
                          ("bytes_ratio", "the Triton kernels' re-reads of rows another program loaded counted too, "
                                          "as a GPU without L2 hits would move them")):
            met = "met" if at[0][key] <= target else "not met"
            print(f"  floor: bytes at L={length} {at[0][key]:.2f} x the transformer's, {rule} (target <= {target} x: "
                  f"{met})", flush=True)
    return {"path": "cuda, emulated on the cpu" if emulating else "cuda", "rows": rows}


# ----------------------------------------------------------------------------- host cost
#: the host-cost models: the bench's layers and heads at a width whose arithmetic is negligible
HOST_COST_WIDTH = 16
HOST_COST_SHAPE = (8, 4)  # (length, sentences)
HOST_COST_REPEATS = 25


def host_cost(cfg, warmup=5, repeats=HOST_COST_REPEATS):
    """The host's cost of one training step of each model: Python, dispatch, autograd and
    allocation, measured on the CPU with one thread and the CUDA code path emulated, the bench's
    layers, heads and clusters at width HOST_COST_WIDTH and a dictionary of 100, a batch of
    HOST_COST_SHAPE, so that the arithmetic is negligible. On a GPU a step whose kernels are
    short runs at the pace its host issues them; this measures that pace on any machine, beside
    the number of calls (``--count-ops``). Median of ``repeats`` interleaved steps."""
    width = str(HOST_COST_WIDTH)
    small = argparse.Namespace(**{**vars(cfg), "model_args": [
        *cfg.model_args, "--encoder-embed-dim", width, "--decoder-embed-dim", width,
        "--encoder-ffn-embed-dim", str(2 * HOST_COST_WIDTH), "--decoder-ffn-embed-dim", str(2 * HOST_COST_WIDTH)]})
    cpu = torch.device("cpu")
    d = synthetic_dictionary(100)
    entries = [build(name, arch, crit, small, d, d, cpu) for name, arch, crit in MODELS]
    for e in entries:
        e["model"].train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with device_paths.emulate("cuda"):
            length, bsz = HOST_COST_SHAPE
            sample = training_sample(length, bsz, d, torch.Generator().manual_seed(cfg.seed), cpu)
            times = interleaved_step_times(entries, sample, cpu, warmup, repeats)
            calls = {e["name"]: sum(kernel_op_counts(e, sample, math_sdpa_as_fused=True).values()) for e in entries}
    finally:
        torch.set_num_threads(threads)
    rows = {e["name"]: {"ms": statistics.median(times[e["name"]]), "calls": calls[e["name"]]} for e in entries}
    for row in rows.values():
        row["us_per_call"] = 1e3 * row["ms"] / row["calls"]
    rows["ratio"] = rows["dma"]["ms"] / rows["transformer"]["ms"]
    return rows


# ----------------------------------------------------------------------------- main
def format_table(rows):
    header = (f"{'length':>6} {'batch':>5} {'transformer ms':>14} {'DMA ms':>9} {'time ratio':>10} {'step ratios':>11} "
              f"{'transformer MB':>14} {'DMA MB':>9} {'mem ratio':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = r.get("time_ratio_range")
        spread_cell = f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-"
        lines.append(f"{r['length']:>6} {r['batch']:>5} {fmt(r['transformer_ms'], 14, 1)} {fmt(r['dma_ms'], 9, 1)} "
                     f"{ratio_cell(r['time_ratio'], 10)} {spread_cell:>11} {fmt(r['transformer_mb'], 14, 1)} "
                     f"{fmt(r['dma_mb'], 9, 1)} {ratio_cell(r['memory_ratio'], 9)}")
    if any(r["out_of_memory"] for r in rows):
        limit = f" (address-space limit {LIMIT_NOTE[0]})" if LIMIT_NOTE else ""
        lines.append(f"OOM: the training step could not allocate its memory{limit}")
    return lines


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512], help="sentence lengths")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (batch = tokens // length)")
    p.add_argument("--repeats", type=int, nargs="+", default=[3],
                   help="timed training steps per model: one value, or one per length (e.g. 3 3 1)")
    p.add_argument("--warmup", type=int, nargs="+", default=[1],
                   help="untimed steps per model before timing, on top of the memory step that runs "
                        "first: one value, or one per length")
    p.add_argument("--dict-size", type=int, default=10000, help="symbols of the synthetic dictionary")
    p.add_argument("--num-updates", type=int, default=4000,
                   help="DMA set_num_updates (4000 -> gamma = 0.5, the final value)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="CPU: cap this process's address space (RLIMIT_AS), so that a step too big for the "
                        "machine fails with a catchable allocation error (reported as OOM) instead of being "
                        "killed by the kernel; default 90%% of MemAvailable at start, 0 = no cap")
    p.add_argument("--quick", action="store_true",
                   help="tiny model (64/128, 2+2 layers, 1k symbols) and batches: a smoke run")
    p.add_argument("--width", type=int, default=None, metavar="E",
                   help="both models at embedding width E (FFN 2E), the bench's layers and heads kept: for "
                        "--count-ops, whose counts do not depend on the width, at the bench's depth in a fraction "
                        "of the time (with --quick: its 2+2 layers at width E)")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    p.add_argument("--no-generate", action="store_true", help="skip the generation benchmark")
    p.add_argument("--no-train", action="store_true", help="skip the training-step benchmark")
    p.add_argument("--gen-sentences", type=int, default=64)
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=40, help="max_len_b = min_len of the generator")
    p.add_argument("--gen-repeats", type=int, default=3, help="timed passes over all sentences (median)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--count-ops", action="store_true",
                   help="also count the kernel-running ATen ops of one training step per model and length "
                        "(what a GPU pays in kernel launches; measurable on any device)")
    p.add_argument("--compile", action="store_true",
                   help="build the DMA model with --dma-compile (its training forwards compiled by torch.compile; "
                        "inductor's kernels then record profiler events, so that --count-ops counts them)")
    p.add_argument("--dma-backend", choices=("auto", "eager", "compile", "triton"), default=None,
                   help="build the DMA model with this --dma-backend ('compile' is --compile; 'triton' runs on "
                        "CUDA, or on the CPU in Triton's interpreter under TRITON_INTERPRET=1, for counting only: "
                        "each launch of its kernels records one profiler event)")
    p.add_argument("--traffic", action="store_true",
                   help="also count the matmul FLOPs and the bytes of one training step per model and length "
                        "(benchmarks/step_traffic.py: each operator alone, the Triton kernels' own loads and stores "
                        "from their tiles, a compiled graph's generated kernels as inductor counts them) and print "
                        "the ratios, with the Triton kernels' re-reads of rows another program loaded and with each "
                        f"kernel's operands read once; the target is <= {TRAFFIC_TARGET[1]} x at "
                        f"L = {TRAFFIC_TARGET[0]}")
    p.add_argument("--traffic-sentences", type=int, nargs=2, default=None, metavar=("S1", "S2"),
                   help="--traffic: count steps of S1 and S2 sentences and extrapolate linearly to --tokens' batch "
                        "(exact: at a fixed length a step's bytes are a constant plus a multiple of the batch); for "
                        "--dma-backend triton under TRITON_INTERPRET=1, whose kernels are too slow at full size. "
                        "2 <= S1 < S2: a batch of one sentence takes other paths (at L = 128, 1 and 2 sentences "
                        "extrapolate the transformer's 21.74 GB to 23.17 GB)")
    p.add_argument("--host-cost", action="store_true",
                   help="also time the host's side of a training step (Python, dispatch, autograd): both models "
                        f"at width {HOST_COST_WIDTH}, on the CPU with one thread and the CUDA path emulated, so "
                        "that the arithmetic is negligible (what a GPU waits for when its kernels are short)")
    p.add_argument("--profile", type=int, default=None, metavar="L",
                   help="also print the top 15 ops (self time) of one DMA training step at length L")
    return p


def main(argv=None):
    cfg = get_parser().parse_args(argv)
    if cfg.traffic_sentences and not 2 <= cfg.traffic_sentences[0] < cfg.traffic_sentences[1]:
        raise SystemExit(f"bench_dma: --traffic-sentences needs 2 <= S1 < S2, got {cfg.traffic_sentences}")
    device = prepare_run(cfg, argv, QUICK, QUICK_MODEL_ARGS)
    if cfg.width is not None:  # fairseq takes the last of repeated flags: these override --quick's
        widths = [str(cfg.width), str(2 * cfg.width)]
        cfg.model_args = [*cfg.model_args, *(arg for side in ("encoder", "decoder") for arg in (
            f"--{side}-embed-dim", widths[0], f"--{side}-ffn-embed-dim", widths[1]))]

    d = synthetic_dictionary(cfg.dict_size)
    if cfg.dma_backend == "compile":
        cfg.compile = True
    elif cfg.dma_backend is not None and cfg.compile:
        raise SystemExit(f"bench_dma: --compile is --dma-backend compile, not {cfg.dma_backend}")
    compiles = cfg.compile or cfg.dma_backend == "triton"  # "triton": its glue is compiled (dma_compiled)
    if compiles:
        # before anything compiles: the kernels' profiler events are written into their code
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    backend = "compile" if cfg.compile else cfg.dma_backend
    dma_cfg = cfg if backend is None else argparse.Namespace(
        **{**vars(cfg), "model_args": [*cfg.model_args, "--dma-backend", backend]})
    entries = [build(name, arch, crit, dma_cfg if name == "dma" else cfg, d, d, device)
               for name, arch, crit in MODELS]
    dma = entries[1]["model"]
    a = entries[1]["args"]
    print(versions_line(device))
    print(f"models: {a.encoder_embed_dim} emb, {a.encoder_ffn_embed_dim} FFN, {a.encoder_attention_heads} heads, "
          f"{a.encoder_layers}+{a.decoder_layers} layers, dict {len(d)}; params transformer "
          f"{entries[0]['params'] / 1e6:.2f}M, DMA {entries[1]['params'] / 1e6:.2f}M; DMA clusters "
          f"{a.dma_clusters}, {len(dma.dma_modules())} DMA attentions, backend {dma.dma_modules()[0].backend}, "
          f"gamma {dma.dma_modules()[0].gamma:.3f} "
          f"(num_updates {cfg.num_updates})", flush=True)

    memory_method = ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                     else "torch.profiler profile_memory total_allocated peak")
    results = {
        **results_header(cfg, device, memory_method=memory_method),
        "models": {e["name"]: {"arch": e["arch"], "criterion": e["criterion_name"], "params": e["params"]}
                   for e in entries},
    }

    if not cfg.no_train:
        print(f"\ntraining step (forward + backward, real criterion, train mode), ~{cfg.tokens} tokens/batch, "
              f"memory step first, then --warmup {' '.join(map(str, cfg.warmup))} untimed and --repeats "
              f"{' '.join(map(str, cfg.repeats))} timed steps (median):", flush=True)
        def save_partial(rows_so_far):
            results["train"] = rows_so_far
            write_json(cfg.json, results)

        rows = bench_training(entries, cfg, d, device, on_row=save_partial)
        results["train"] = rows
        print()
        for line in format_table(rows):
            print(line)
        note, fits = scaling_note(rows)
        results["scaling"] = fits
        if note:
            print("\ngrowth with length:")
            for line in note:
                print(line)

    if not cfg.no_generate:
        print(f"\ngeneration: SequenceGenerator beam {cfg.beam}, {cfg.gen_sentences} sentences (source "
              f"20-30 tokens), batch {cfg.gen_batch_size}, exactly {cfg.gen_len} tokens + EOS each ...",
              flush=True)
        g = bench_generation(entries, cfg, d, device)
        results["generation"] = g
        print(f"  transformer {g['transformer_sentences_per_s']:8.2f} sentences/s | DMA "
              f"{g['dma_sentences_per_s']:8.2f} sentences/s | ratio DMA/transformer "
              f"{g['sentences_per_s_ratio']:.2f}")
        print(f"  transformer with fairseq's beam-shared encoder keys {g[SHARED_BASELINE + '_sentences_per_s']:8.2f} "
              f"sentences/s | ratio DMA/that transformer {g['sentences_per_s_ratio_shared_keys']:.2f}")

    if cfg.count_ops:
        print("\nkernel launches per training step (benchmarks/kernel_calls.py; the CUDA code path, "
              f"{'emulated on the CPU' if device.type != 'cuda' else 'on this GPU'}):", flush=True)
        results["kernel_ops"] = count_ops(entries, cfg, d, device)

    if cfg.traffic:
        print("\nFLOPs and bytes per training step (benchmarks/step_traffic.py; the CUDA code path, "
              f"{'emulated on the CPU' if device.type != 'cuda' else 'on this GPU'}):", flush=True)
        results["traffic"] = traffic(entries, cfg, d, device)

    if cfg.host_cost:
        length, bsz = HOST_COST_SHAPE
        print(f"\nhost cost of a training step (CPU, one thread, CUDA path emulated, width {HOST_COST_WIDTH}, "
              f"L={length} B={bsz}, median of {HOST_COST_REPEATS}):", flush=True)
        cost = host_cost(cfg)
        results["host_cost"] = cost
        print("  " + " | ".join(f"{name} {cost[name]['ms']:.1f} ms, {cost[name]['calls']} calls, "
                                f"{cost[name]['us_per_call']:.1f} us/call" for name in ("transformer", "dma"))
              + f" | ratio {cost['ratio']:.2f}", flush=True)

    if cfg.profile is not None:
        print(f"\ntop ops of one DMA training step at length {cfg.profile}, "
              f"batch {max(cfg.tokens // cfg.profile, 1)} (torch.profiler, self time):", flush=True)
        ops_table, source_table, by_source = profile_dma(entries[1], cfg, d, device, cfg.profile)
        results["profile"] = {"length": cfg.profile, "ops_table": ops_table, "by_source": by_source}
        print(ops_table)
        print("the same self time, and the kernel ops, by the Python function that issued the op:")
        print(source_table)
        if device.type == "cuda":
            bsz = max(cfg.tokens // cfg.profile, 1)
            sample = training_sample(cfg.profile, bsz, d, torch.Generator().manual_seed(cfg.seed), device)
            busy = {}
            for e in entries:
                step_ms, kernel_ms = gpu_busy(e, sample, device)
                busy[e["name"]] = {"step_ms": step_ms, "kernel_ms": kernel_ms}
                print(f"GPU busy, {e['name']}: kernels {kernel_ms:.1f} ms of a {step_ms:.1f} ms step "
                      f"({100.0 * kernel_ms / step_ms:.0f} %)", flush=True)
            results["profile"]["gpu_busy"] = busy

    if compiles:
        from fairseq_modattn.modules import dma_compiled

        results["dma_compile_failed"] = dma_compiled.compile_failed()
        if results["dma_compile_failed"]:
            print(f"\n--dma-backend {backend}: torch.compile failed, the DMA model ran eagerly (from the first "
                  "failure on)")
    write_json(cfg.json, results)
    print(f"\nresults written to {cfg.json}")
    return results


if __name__ == "__main__":
    main()
