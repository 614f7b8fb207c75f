"""The measuring harness shared by the speed and memory benchmarks (``bench_dma.py``,
``bench_variants.py``, ``bench_rim.py``); it is no benchmark itself.

The scripts run as ``python benchmarks/X.py``, so this folder is ``sys.path[0]`` and they
``import harness`` directly. It provides:

Models
    ``build`` makes a model and its criterion through fairseq's own registries, exactly as
    ``fairseq-train`` does: ``fairseq.options`` parses ``--arch ...`` (after
    ``import fairseq_modattn``), a real ``TranslationTask`` is created over a synthetic
    ``Dictionary``, and ``fairseq.models.build_model`` / ``fairseq.criterions.build_criterion``
    build both, the model after ``torch.manual_seed(--seed)`` so that every model of a run starts
    from the same initialisation stream. DMA models get ``set_num_updates(--num-updates)``.

Training steps
    ``training_sample`` is a batch of random token ids in fairseq's collater layout (the last
    token EOS, no padding, ``prev_output_tokens`` the target shifted right). One step is
    ``criterion(model, sample)`` + ``loss.backward()`` with the gradients set to None beforehand
    (outside the timer), as fairseq's trainer runs it; ``timed_step`` times it with the device
    synchronised on both sides. ``interleaved_step_times`` runs the warm-up and timed steps of
    several models alternately (A, B, A, B, ...) so that drifts of the machine hit all alike.

Peak memory (MB = 2**20 bytes)
    The peak of tensor memory allocated during one training step above what was allocated
    before it (weights, inputs): activations kept for backward, temporaries, and the gradients
    (allocated inside the step because they are None before it).

    * CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` around the step, after
      ``reset_peak_memory_stats``.
    * CPU: one step under ``torch.profiler.profile(profile_memory=True)``. While memory
      profiling is on, torch's CPU allocator reports every allocation and free of tensor
      storage to the profiler together with its running total of allocated bytes
      (``total_allocated`` of the profiler's Allocation events, the CPU counterpart of the CUDA
      caching allocator's statistic). The peak is the maximum of that running total over the
      step minus its value just before the step's first allocation. This counts exactly the
      bytes that tensors occupy (no malloc arenas, fragmentation, Python objects or shared
      libraries, which blur ``ru_maxrss``; ``tracemalloc`` would not see torch at all), and is
      deterministic. Memory freed during the step that was allocated before it is not
      subtracted (the allocator only tracks blocks allocated while profiling), which can only
      overstate the peak; with gradients set to None beforehand a training step normally
      frees no such block.

    On the CPU ``prepare_run`` caps the process's address space (``--memory-limit-gb``, default
    90% of MemAvailable) so that a step too large for the machine fails with torch's catchable
    allocation error instead of the kernel's OOM killer; ``measure_peak`` reports such a step as
    out of memory, and the scripts then give that model no time at that length and go on.

Kernel launches
    ``kernel_op_counts`` counts the kernel launches of one training step with
    ``kernel_calls.count_kernel_calls`` (whose docstring gives the rule: the ATen ops called
    from Python or by the autograd engine that run a kernel, and every compiled kernel). On a
    GPU each call launches at least one kernel, and a step made of many small calls runs at the
    speed of those launches (several microseconds each), not at the speed of its arithmetic.
    The calls are the same on every device, so a CPU, where arithmetic dominates and the
    launches do not show, still measures this GPU cost.

Generation
    ``time_generation`` translates the same synthetic, left-padded sources with
    ``fairseq.sequence_generator.SequenceGenerator`` (min_len = max_len_b = ``--gen-len``, so
    every hypothesis has exactly that many tokens + EOS and every model decodes the same steps,
    checked), and also runs the transformer with fairseq's own beam-shared encoder keys switched
    on (``transformer_shared_keys``; the same translations, checked).

Run setup and records
    ``prepare_run`` applies ``--quick``, ``--threads``, the device and the memory cap;
    ``versions_line`` describes the machine in one line; ``results_header`` is the JSON's
    config, environment and provenance (git commit, whether ``fairseq_modattn/`` has
    uncommitted changes, a hash of its sources: results depend on the checkout's plugin code);
    ``fmt`` and ``ratio_cell`` print the tables' numbers and ratios.
"""

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict

import torch

REPO = Path(__file__).resolve().parents[1]
# Running ``python benchmarks/X.py`` puts only benchmarks/ on the path; a checkout whose plugin is
# not installed still finds fairseq_modattn at the repository root.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

logging.disable(logging.WARNING)  # fairseq's import-time notices; errors still raise

import fairseq  # noqa: E402
from fairseq import criterions, models, options  # noqa: E402
from fairseq.data import Dictionary, data_utils  # noqa: E402
from fairseq.modules import MultiheadAttention  # noqa: E402
from fairseq.sequence_generator import SequenceGenerator  # noqa: E402
from fairseq.tasks.translation import TranslationTask  # noqa: E402
from kernel_calls import count_kernel_calls  # noqa: E402
from provenance import code_record  # noqa: E402

import fairseq_modattn  # noqa: E402  (registers the plugin's architectures and criteria)
from fairseq_modattn.modules import noise  # noqa: E402

MB = float(2 ** 20)
LIMIT_NOTE = []  # the --memory-limit-gb in force, for the tables' OOM notes

#: the transformer once more, with fairseq's own beam-shared encoder keys switched on
SHARED_BASELINE = "transformer_shared_keys"


# ----------------------------------------------------------------------------- building
def synthetic_dictionary(size: int) -> Dictionary:
    """A fairseq Dictionary of ``size`` symbols in all (4 specials + size - 4 words)."""
    d = Dictionary()
    for i in range(max(size - d.nspecial, 1)):
        d.add_symbol(f"w{i}", n=1000 - i % 1000)
    d.finalize(padding_factor=1)
    return d


def parse_fairseq_args(arch: str, criterion: str, seed: int, extra) -> argparse.Namespace:
    """fairseq-train's argument parsing for ``--arch arch`` (fills the architecture defaults)."""
    parser = options.get_training_parser()
    argv = [
        "synthetic-data-bin", "--task", "translation", "-s", "src", "-t", "tgt",
        "--arch", arch, "--criterion", criterion, "--label-smoothing", "0.1",
        "--seed", str(seed), "--max-source-positions", "1024", "--max-target-positions", "1024",
        *extra,
    ]
    return options.parse_args_and_arch(parser, input_args=argv)


def build(name, arch, criterion_name, cfg, src_dict, tgt_dict, device):
    """An entry {name, arch, model, criterion, task, args, params, ...}; ``cfg`` gives ``seed``,
    ``model_args`` (extra fairseq flags) and, for DMA models, ``num_updates``."""
    args = parse_fairseq_args(arch, criterion_name, cfg.seed, cfg.model_args)
    task = TranslationTask(args, src_dict, tgt_dict)
    torch.manual_seed(cfg.seed)  # same initialisation stream for every model
    model = models.build_model(args, task).to(device)
    criterion = criterions.build_criterion(args, task).to(device)
    if hasattr(model, "dma_modules"):
        model.set_num_updates(cfg.num_updates)
    return {"name": name, "arch": arch, "criterion_name": criterion_name, "args": args, "task": task,
            "model": model, "criterion": criterion,
            "params": sum(p.numel() for p in model.parameters())}


def training_sample(length: int, bsz: int, d: Dictionary, gen: torch.Generator, device):
    """bsz x length random tokens, last one EOS, no padding; fairseq's collater layout."""
    def tokens():
        t = torch.randint(d.nspecial, len(d), (bsz, length), generator=gen)
        t[:, -1] = d.eos()
        return t

    src, tgt = tokens(), tokens()
    prev = torch.cat([tgt.new_full((bsz, 1), d.eos()), tgt[:, :-1]], dim=1)
    sample = {
        "id": torch.arange(bsz),
        "nsentences": bsz,
        "ntokens": bsz * length,
        "net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), length, dtype=torch.long),
                      "prev_output_tokens": prev},
        "target": tgt,
    }
    return move_to(sample, device)


def move_to(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: move_to(v, device) for k, v in obj.items()}
    return obj


# ----------------------------------------------------------------------------- measuring
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(entry, sample):
    """One forward + backward with the real criterion; returns the criterion's logging output."""
    loss, sample_size, logging_output = entry["criterion"](entry["model"], sample)
    loss.backward()
    return logging_output


def zero_grad(model):
    for p in model.parameters():
        p.grad = None


def timed_step(entry, sample, device) -> float:
    zero_grad(entry["model"])
    sync(device)
    start = time.perf_counter()
    train_step(entry, sample)
    sync(device)
    return (time.perf_counter() - start) * 1000.0


def interleaved_step_times(entries, sample, device, warmup: int, repeats: int, skip=()):
    """{name: [ms of each timed step]} of every entry: ``warmup`` untimed, then ``repeats`` (at
    least 1) timed training steps of each entry not named in ``skip``, the entries alternating
    so that drifts of the machine hit all alike (the skipped ones get an empty list). The
    gradients are dropped afterwards."""
    running = [e for e in entries if e["name"] not in skip]
    for _ in range(warmup):
        for e in running:
            zero_grad(e["model"])
            train_step(e, sample)
    times = {e["name"]: [] for e in entries}
    for _ in range(max(repeats, 1)):
        for e in running:
            times[e["name"]].append(timed_step(e, sample, device))
    for e in entries:
        zero_grad(e["model"])
    return times


def kernel_op_counts(entry, sample, math_sdpa_as_fused: bool = False) -> Dict[str, int]:
    """{op: calls} of the kernel launches of one training step (``kernel_calls``)."""
    zero_grad(entry["model"])
    counts = count_kernel_calls(lambda: train_step(entry, sample), math_sdpa_as_fused)
    zero_grad(entry["model"])
    return counts


def decoding_step_op_counts(entry, cfg, d, device, math_sdpa_as_fused: bool = False,
                            lengths=(6, 10)) -> Dict[str, float]:
    """{op: calls} of one beam-search decoding step: the calls of translating one batch
    (``--beam``, ``--gen-batch-size`` sentences) to ``lengths[1]`` tokens less those to
    ``lengths[0]``, per added step (the encoder and the setup cancel; a step's calls do not depend
    on the batch's size). The transformer runs with fairseq's own beam-shared encoder keys, as
    the package's models do."""
    model = entry["model"]
    model.eval()
    shared = fairseq_beam_shared_keys(model, cfg.beam) if entry["name"] == "transformer" else contextlib.nullcontext()
    counts = []
    with shared:
        for n in lengths:
            batch = generation_batches(argparse.Namespace(**{**vars(cfg), "gen_len": n}), d, device)[0][0]
            generator = SequenceGenerator([model], entry["task"].target_dictionary, beam_size=cfg.beam,
                                          max_len_a=0, max_len_b=n, min_len=n)
            generator.generate([model], batch)  # warm-up (first-call paths)
            counts.append(count_kernel_calls(lambda: generator.generate([model], batch), math_sdpa_as_fused))
    per = lengths[1] - lengths[0]
    names = set(counts[0]) | set(counts[1])
    return {k: (counts[1].get(k, 0) - counts[0].get(k, 0)) / per for k in names}


def cpu_peak_step_bytes(entry, sample) -> int:
    """Peak tensor bytes allocated during one CPU training step (see the module docstring)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    zero_grad(entry["model"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        log = train_step(entry, sample)
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields))
        stack.extend(node.children)
    if not events:
        raise RuntimeError("the profiler reported no CPU allocation events")
    events.sort(key=lambda e: e[0])
    first = events[0][1]
    baseline = first.total_allocated - first.alloc_size
    return max(e.total_allocated for _, e in events) - baseline, log


def cuda_peak_step_bytes(entry, sample, device) -> int:
    zero_grad(entry["model"])
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    log = train_step(entry, sample)
    sync(device)
    return torch.cuda.max_memory_allocated(device) - before, log


def peak_step_mb(entry, sample, device):
    """(peak MB of one training step, the criterion's logging output of that step)."""
    if device.type == "cuda":
        peak, log = cuda_peak_step_bytes(entry, sample, device)
    else:
        peak, log = cpu_peak_step_bytes(entry, sample)
    return peak / MB, log


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA OOM, or on CPU (under --memory-limit-gb) torch's allocator error."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def measure_peak(entry, sample, device):
    """``peak_step_mb`` that survives running out of memory: (peak MB, the step's logging output,
    None), or (None, None, a one-line description of the failed allocation). Any other error
    propagates."""
    try:
        peak, log = peak_step_mb(entry, sample, device)
        return peak, log, None
    except Exception as exc:  # noqa: BLE001  (only allocation failures are absorbed)
        if not is_out_of_memory(exc):
            raise
        note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    # Past the except block the exception and its traceback, which hold the failed step's
    # tensors, are gone, so collecting now gives their memory back before the next model runs.
    zero_grad(entry["model"])
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None, None, note


def per_length(values, lengths, option):
    """--repeats / --warmup: one value for every length, or one per length."""
    if len(values) == 1:
        return {length: values[0] for length in lengths}
    if len(values) != len(lengths):
        raise SystemExit(f"{option}: give one value or one per length ({len(lengths)}), got {values}")
    return dict(zip(lengths, values))


# ----------------------------------------------------------------------------- generation
def generation_batches(cfg, d: Dictionary, device):
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    lengths = torch.randint(20, 31, (cfg.gen_sentences,), generator=gen).tolist()
    sentences = []
    for n in lengths:
        t = torch.randint(d.nspecial, len(d), (n,), generator=gen)
        t[-1] = d.eos()
        sentences.append(t)
    batches = []
    for i in range(0, len(sentences), cfg.gen_batch_size):
        chunk = sentences[i:i + cfg.gen_batch_size]
        src = data_utils.collate_tokens(chunk, d.pad(), d.eos(), left_pad=True)
        batches.append(move_to({
            "id": torch.arange(i, i + len(chunk)),
            "net_input": {"src_tokens": src, "src_lengths": torch.tensor([len(t) for t in chunk])},
        }, device))
    return batches, lengths


@contextlib.contextmanager
def fairseq_beam_shared_keys(model, beam: int):
    """fairseq's MultiheadAttention keeps one copy of each sentence's encoder keys for its beams
    when its beam size is set (``set_beam_size``), but fairseq 0.12's SequenceGenerator sets it
    only on models that have ``set_beam_size``, which ``TransformerModel`` has not; this
    package's models have it (``TransformerVariantModel.set_beam_size``). Set it on the
    transformer's own attention modules for the block."""
    modules = [m for m in model.modules() if isinstance(m, MultiheadAttention)]
    for m in modules:
        m.set_beam_size(beam)
    try:
        yield
    finally:
        for m in modules:
            m.set_beam_size(1)


def time_generation(entries, cfg, d, device):
    """Seconds per full pass of every model over the same sources (``--gen-repeats`` passes each,
    models interleaved, after one warm-up batch), and what was decoded. Checks that every
    hypothesis has exactly ``--gen-len`` tokens + EOS, so all models decode the same steps, and
    that the transformer translates alike with and without beam-shared encoder keys."""
    batches, src_lengths = generation_batches(cfg, d, device)
    generators = {}
    for e in entries:
        e["model"].eval()
        zero_grad(e["model"])
        generators[e["name"]] = SequenceGenerator(
            [e["model"]], e["task"].target_dictionary, beam_size=cfg.beam,
            max_len_a=0, max_len_b=cfg.gen_len, min_len=cfg.gen_len,
        )
    baseline = next(e for e in entries if e["name"] == "transformer")
    runs = [(e["name"], e, contextlib.nullcontext) for e in entries]
    runs.append((SHARED_BASELINE, baseline, lambda: fairseq_beam_shared_keys(baseline["model"], cfg.beam)))

    def run_pass(e, subset):
        return [hypos[0]["tokens"] for sample in subset
                for hypos in generators[e["name"]].generate([e["model"]], sample)]

    for _, e, context in runs:  # warm-up: one batch
        with context():
            run_pass(e, batches[:1])
    times = {name: [] for name, _, _ in runs}
    outputs = {}
    for _ in range(cfg.gen_repeats):
        for name, e, context in runs:
            with context():
                sync(device)
                start = time.perf_counter()
                outputs[name] = run_pass(e, batches)
                sync(device)
                times[name].append(time.perf_counter() - start)
    expected = cfg.gen_len + 1
    for name, tokens in outputs.items():
        lens = {len(t) for t in tokens}
        if lens != {expected}:
            raise RuntimeError(f"{name}: hypotheses of lengths {sorted(lens)}, expected all {expected}")
    if not all(torch.equal(a, b) for a, b in zip(outputs["transformer"], outputs[SHARED_BASELINE])):
        raise RuntimeError("the transformer's translations changed with beam-shared encoder keys")
    meta = {"sentences": cfg.gen_sentences, "batch_size": cfg.gen_batch_size, "beam": cfg.beam,
            "max_len_a": 0, "max_len_b": cfg.gen_len, "min_len": cfg.gen_len,
            "output_tokens_per_hypothesis": expected,
            "source_lengths": [min(src_lengths), max(src_lengths)]}
    return times, meta


# ----------------------------------------------------------------------------- printing
def fmt(value, width, digits):
    """A measurement right-aligned in ``width``, or OOM where the step could not allocate."""
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'OOM':>{width}}"


def ratio_cell(value, width):
    """A ratio right-aligned in ``width`` with 2 decimals, or '-' where a side is missing."""
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


# ----------------------------------------------------------------------------- run setup
def limit_address_space(limit_gb):
    """Set RLIMIT_AS (Linux); returns the limit in GB actually set, or None."""
    try:
        import resource
    except ImportError:
        return None
    if limit_gb is None:
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) for line in f}
        except (OSError, ValueError):
            return None
        limit_gb = 0.9 * info["MemAvailable"] * 1024 / 1e9
    if limit_gb <= 0:
        return None
    limit = int(limit_gb * 1e9)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    LIMIT_NOTE.append(f"{limit / 1e9:.1f} GB")
    return limit / 1e9


def prepare_run(cfg, argv, quick_overrides, quick_model_args):
    """What every benchmark script does with its parsed options before building models:
    ``--quick`` fills ``quick_overrides`` for the options not given on the command line and sets
    ``cfg.model_args``; ``--threads``; the device (CUDA falls back to the CPU, saying so); on
    the CPU the address-space cap (``--memory-limit-gb``). Returns the torch device."""
    cfg.model_args = []
    if cfg.quick:
        given = {a.split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
        for key, value in quick_overrides.items():
            if "--" + key.replace("_", "-") not in given:
                setattr(cfg, key, value)
        cfg.model_args = quick_model_args
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; running on CPU", flush=True)
        device = torch.device("cpu")
    cfg.device = str(device)
    if device.type == "cpu":
        cfg.memory_limit_gb = limit_address_space(cfg.memory_limit_gb)
    return device


# ----------------------------------------------------------------------------- records
def provenance():
    """The checkout's commit and the plugin sources actually benchmarked (``provenance.py``)."""
    record = code_record()
    info = {"plugin_sources_sha256": record["plugin_sources_sha256"], "plugin_file": fairseq_modattn.__file__}
    if record["git_commit"] is not None:
        info.update(git_commit=record["git_commit"], plugin_dirty=record["plugin_dirty"])
    return info


def write_json(path: Path, results):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def versions_line(device) -> str:
    line = (f"fairseq {fairseq.__version__}, torch {torch.__version__}, device {device}, "
            f"threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    if torch.device(device).type == "cpu":
        line += f", DMA noise {noise.cpu_generator()}"
    return line


def results_header(cfg, device, **env_extra) -> dict:
    """The JSON's config, env and provenance sections."""
    env = {"fairseq": fairseq.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "cpu_noise_generator": noise.cpu_generator(), **env_extra}
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
            "env": env, "provenance": provenance()}
