#!/usr/bin/env python
"""Speed and memory of the talking-heads and TIM transformers against fairseq's transformer.

Every model is built in one process through fairseq's own registries, exactly as
``fairseq-train`` builds it (``fairseq.options`` parses ``--arch ...`` after
``import fairseq_modattn``; a real ``TranslationTask`` over a synthetic ``--dict-size``
dictionary; the same ``--seed`` for every model; criterion ``label_smoothed_cross_entropy``,
label smoothing 0.1). The models (``--models``, default all of them):

    transformer       transformer_iwslt_de_en                512/1024, 4 heads, 6+6 layers
    talking_heads     talking_heads_transformer_iwslt_de_en  the same width; talking heads in
                                                             encoder self-attention (the default)
    tim_matched       tim_transformer_iwslt_de_en_matched    TIM in encoder layers 2-4 (n_s = 2),
                                                             their FFN widened to the same
                                                             parameter count as the transformer
    tim               tim_transformer_iwslt_de_en            the same, FFN not widened (fewer
                                                             parameters than the transformer)

Talking heads is compared with the transformer of the same width (it adds only 2 h^2
parameters per module); TIM with the transformer of equal parameter count (``tim_matched``,
the paper's comparison); ``tim`` shows what the block-diagonal maps alone cost or save.

Training step (``--lengths``, default 32 128 512): as ``bench_dma.py``, with the measuring
code they share (``harness.py``): a batch of ``--tokens // L`` sentences of L random tokens, one
measured step is criterion + backward in train mode with gradients set to None beforehand;
per length each model first runs the peak-memory step (untimed), then ``--warmup`` untimed and
``--repeats`` timed steps, the models interleaved so that drifts of the machine hit all alike;
medians are reported. Peak memory is the tensor memory allocated during one step above what was
allocated before it (CUDA: ``max_memory_allocated``; CPU: the profiler's allocation events; see
``harness.py``).

Generation (skip with ``--no-generate``): every model translates the same synthetic sources
with fairseq's ``SequenceGenerator`` (beam ``--beam``, exactly ``--gen-len`` tokens + EOS per
hypothesis, checked); sentences/s and the ratio to the transformer (> 1 = faster).

Output: a table per length (ms, MB and the ratio of each model to the transformer), the
generation speeds, and a JSON file (``--json``, default benchmarks/results/bench_variants.json,
rewritten after every length).

Examples:
    python benchmarks/bench_variants.py --threads 2                # full run, CPU
    python benchmarks/bench_variants.py --models transformer tim_matched --lengths 128
    python benchmarks/bench_variants.py --device cuda --repeats 10 --warmup 3
    python benchmarks/bench_variants.py --quick                    # smoke run, seconds
"""

import argparse
import gc
import statistics
from pathlib import Path

import torch

# harness.py, beside this script, holds the measuring code shared with bench_dma.py and
# bench_rim.py; it comes first because it also puts the checkout on sys.path
from harness import (
    REPO,
    build,
    fmt,
    interleaved_step_times,
    measure_peak,
    per_length,
    prepare_run,
    ratio_cell,
    results_header,
    synthetic_dictionary,
    time_generation,
    training_sample,
    versions_line,
    write_json,
)

from fairseq_modattn.modules import TalkingHeadsAttention
from fairseq_modattn.modules.tim_layer import TIMLayerBase

DEFAULT_JSON = REPO / "benchmarks" / "results" / "bench_variants.json"
CRITERION = "label_smoothed_cross_entropy"
BASELINE = "transformer"

# name -> (--arch, what its ratio is compared against, in words)
MODELS = {
    "transformer": ("transformer_iwslt_de_en", "baseline"),
    "talking_heads": ("talking_heads_transformer_iwslt_de_en", "same width"),
    "tim_matched": ("tim_transformer_iwslt_de_en_matched", "equal parameters"),
    "tim": ("tim_transformer_iwslt_de_en", "same width, fewer parameters"),
}

# --quick: tiny models; 4 encoder layers so that 'auto' puts a TIM layer at index 2
QUICK_MODEL_ARGS = [
    "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-layers", "4", "--decoder-layers", "2",
]
# --quick, TIM models only: the inter-mechanism attention's head width scaled with the tiny width
# (the default 2 x 32 units is 1/4 of the paper's d_m = 256; here d_m = 32, so 2 x 4), else its
# per-mechanism projections would outweigh what the block-diagonal maps save
QUICK_TIM_MODEL_ARGS = ["--tim-mechanism-attention-head-dim", "4"]
QUICK = dict(lengths=[8, 32], tokens=256, repeats=[2], warmup=[1], dict_size=1000,
             gen_sentences=8, gen_batch_size=4, gen_len=8, gen_repeats=1)


def variant_modules(model) -> dict:
    """How many of the plugin's modules a model holds (the smoke test checks they are there)."""
    return {"talking_heads_attention": sum(isinstance(m, TalkingHeadsAttention) for m in model.modules()),
            "tim_layers": sum(isinstance(m, TIMLayerBase) for m in model.modules())}


def bench_training(entries, cfg, d, device, on_row=None):
    """One row per length: per model ms (median), peak MB, and both ratios to the transformer."""
    rows = []
    gen = torch.Generator().manual_seed(cfg.seed)
    repeats = per_length(cfg.repeats, cfg.lengths, "--repeats")
    warmups = per_length(cfg.warmup, cfg.lengths, "--warmup")
    for length in cfg.lengths:
        bsz = max(cfg.tokens // length, 1)
        sample = training_sample(length, bsz, d, gen, device)
        peaks, oom = {}, {}
        for e in entries:
            e["model"].train()
            peaks[e["name"]], _, note = measure_peak(e, sample, device)
            if note is not None:
                oom[e["name"]] = note
        times = interleaved_step_times(entries, sample, device, warmups[length], repeats[length], skip=oom)
        del sample
        gc.collect()

        row = {"length": length, "batch": bsz, "tokens": bsz * length, "repeats": max(repeats[length], 1),
               "warmup": warmups[length], "out_of_memory": oom, "models": {}}
        base_ms = statistics.median(times[BASELINE]) if times[BASELINE] else None
        base_mb = peaks[BASELINE]
        for e in entries:
            ms = statistics.median(times[e["name"]]) if times[e["name"]] else None
            mb = peaks[e["name"]]
            row["models"][e["name"]] = {
                "ms": ms, "mb": mb, "ms_all": times[e["name"]],
                "time_ratio": ms / base_ms if ms and base_ms else None,
                "memory_ratio": mb / base_mb if mb and base_mb else None,
            }
        rows.append(row)
        print(f"  L={length:4d} B={bsz:4d}: " + " | ".join(
            f"{name} {fmt(m['ms'], 0, 1)} ms {fmt(m['mb'], 0, 1)} MB" for name, m in row["models"].items()), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def bench_generation(entries, cfg, d, device):
    times, result = time_generation(entries, cfg, d, device)
    base = cfg.gen_sentences / statistics.median(times[BASELINE])
    result["models"] = {}
    for name, seconds in times.items():
        speed = cfg.gen_sentences / statistics.median(seconds)
        result["models"][name] = {"sentences_per_s": speed, "seconds_all": seconds,
                                  "sentences_per_s_ratio": speed / base}
    return result


def format_table(rows, names):
    others = [n for n in names if n != BASELINE]
    header = f"{'length':>6} {'batch':>5} {'transformer ms':>14} " + " ".join(
        f"{n + ' ms':>16} {'x':>5}" for n in others)
    header += f" {'transformer MB':>14} " + " ".join(f"{n + ' MB':>16} {'x':>5}" for n in others)
    lines = [header, "-" * len(header)]
    for r in rows:
        m = r["models"]
        line = f"{r['length']:>6} {r['batch']:>5} {fmt(m[BASELINE]['ms'], 14, 1)} "
        line += " ".join(f"{fmt(m[n]['ms'], 16, 1)} {ratio_cell(m[n]['time_ratio'], 5)}" for n in others)
        line += f" {fmt(m[BASELINE]['mb'], 14, 1)} "
        line += " ".join(f"{fmt(m[n]['mb'], 16, 1)} {ratio_cell(m[n]['memory_ratio'], 5)}" for n in others)
        lines.append(line)
    lines.append("x = ratio to the transformer (time, then peak memory); OOM = the step could not allocate")
    return lines


def get_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                   help="models to measure (the transformer is always included)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512], help="sentence lengths")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (batch = tokens // length)")
    p.add_argument("--repeats", type=int, nargs="+", default=[3],
                   help="timed training steps per model: one value, or one per length")
    p.add_argument("--warmup", type=int, nargs="+", default=[1],
                   help="untimed steps per model before timing (after the memory step): one value, or one per length")
    p.add_argument("--dict-size", type=int, default=10000, help="symbols of the synthetic dictionary")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="CPU: cap the address space so an oversized step is reported as OOM "
                        "(default 90%% of MemAvailable, 0 = no cap)")
    p.add_argument("--quick", action="store_true", help="tiny models and batches: a smoke run")
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    p.add_argument("--no-generate", action="store_true", help="skip the generation benchmark")
    p.add_argument("--no-train", action="store_true", help="skip the training-step benchmark")
    p.add_argument("--gen-sentences", type=int, default=64)
    p.add_argument("--gen-batch-size", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=40, help="max_len_b = min_len of the generator")
    p.add_argument("--gen-repeats", type=int, default=3, help="timed passes over all sentences (median)")
    p.add_argument("--beam", type=int, default=5)
    return p


def model_cfg(cfg, name: str):
    """``cfg``, with ``QUICK_TIM_MODEL_ARGS`` added to the model args of TIM models under --quick."""
    if cfg.quick and name.startswith("tim"):
        return argparse.Namespace(**{**vars(cfg), "model_args": list(cfg.model_args) + QUICK_TIM_MODEL_ARGS})
    return cfg


def main(argv=None):
    cfg = get_parser().parse_args(argv)
    device = prepare_run(cfg, argv, QUICK, QUICK_MODEL_ARGS)
    names = [BASELINE] + [n for n in MODELS if n in cfg.models and n != BASELINE]

    d = synthetic_dictionary(cfg.dict_size)
    entries = [build(name, MODELS[name][0], CRITERION, model_cfg(cfg, name), d, d, device) for name in names]
    print(versions_line(device))
    for e in entries:
        a = e["args"]
        print(f"  {e['name']:<13} --arch {e['arch']:<38} {e['params'] / 1e6:7.3f}M params, "
              f"{a.encoder_embed_dim} emb, {a.encoder_ffn_embed_dim} FFN, {a.encoder_attention_heads} heads, "
              f"{a.encoder_layers}+{a.decoder_layers} layers, {variant_modules(e['model'])}  "
              f"({MODELS[e['name']][1]})", flush=True)

    results = {
        **results_header(cfg, device),
        "models": {e["name"]: {"arch": e["arch"], "params": e["params"], "compared_as": MODELS[e["name"]][1],
                               **variant_modules(e["model"])}
                   for e in entries},
    }

    if not cfg.no_train:
        print(f"\ntraining step (forward + backward, train mode), ~{cfg.tokens} tokens/batch, memory step "
              f"first, then --warmup {' '.join(map(str, cfg.warmup))} untimed and --repeats "
              f"{' '.join(map(str, cfg.repeats))} timed steps (median):", flush=True)

        def save_partial(rows_so_far):
            results["train"] = rows_so_far
            write_json(cfg.json, results)

        rows = bench_training(entries, cfg, d, device, on_row=save_partial)
        results["train"] = rows
        print()
        for line in format_table(rows, names):
            print(line)

    if not cfg.no_generate:
        print(f"\ngeneration: SequenceGenerator beam {cfg.beam}, {cfg.gen_sentences} sentences, batch "
              f"{cfg.gen_batch_size}, exactly {cfg.gen_len} tokens + EOS each ...", flush=True)
        g = bench_generation(entries, cfg, d, device)
        results["generation"] = g
        for name, m in g["models"].items():
            print(f"  {name:<13} {m['sentences_per_s']:8.2f} sentences/s   ratio to transformer "
                  f"{m['sentences_per_s_ratio']:.2f}")

    write_json(cfg.json, results)
    print(f"\nresults written to {cfg.json}")
    return results


if __name__ == "__main__":
    main()
