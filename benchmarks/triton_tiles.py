"""Time DMA's Triton attention (forward and backward) on a GPU for several tile sizes, against
the eager CUDA path (two SDPA calls with the log M bias), at the bench's shapes.

    python benchmarks/triton_tiles.py --device cuda                 # the bench's shapes, every candidate
    python benchmarks/triton_tiles.py --device cuda --json tiles.json --lengths 128

Each candidate replaces the path's tile table (``FORWARD_CONFIGS`` and ``BACKWARD_CONFIGS`` of
``interpolated_attention_triton``) for the head width; each time is the median of ``--repeats``
forward + backward passes after ``--warmup``, by CUDA events. The table says which tile is
fastest at each length and whether it spills (``benchmarks/triton_compile.py`` reports that);
the path's own tile is marked. This is the autotuning step of ``benchmarks/gpu_check.py``.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: (block_m, block_n, warps, stages) tried for every kernel
CANDIDATES = [(32, 32, 4, 2), (32, 16, 4, 2), (16, 32, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2),
              (128, 64, 8, 2), (64, 32, 8, 3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (batch = tokens // length)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--clusters", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from fairseq_modattn.modules import interpolated_attention_triton as kernels
    from fairseq_modattn.modules.interpolated_attention import log_mask

    device = torch.device(args.device)
    if device.type != "cuda":
        print("triton_tiles: times GPU kernels; pass --device cuda on a machine with one", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    block = kernels.head_block(args.head_dim)
    own = (kernels.FORWARD_CONFIGS[block], kernels.BACKWARD_CONFIGS[block])

    def timed(fn):
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    rows = []
    for length in args.lengths:
        bsz = max(args.tokens // length, 1)
        g = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape, dt=dtype):
            return torch.randn(*shape, generator=g).to(device, dt).requires_grad_()

        q, k, v = (rand(bsz, args.heads, length, args.head_dim) for _ in range(3))
        post_q, post_k = (torch.randn(bsz, args.heads, length, args.clusters, generator=g).softmax(-1).to(device)
                          .requires_grad_() for _ in range(2))
        pad = torch.zeros(bsz, length, dtype=torch.bool, device=device)
        pad[::2, -length // 4:] = True
        grad = torch.randn(bsz, args.heads, length, args.head_dim, generator=g).to(device, dtype)

        def eager():
            bias = log_mask(post_q, post_k).to(dtype).masked_fill(pad[:, None, None, :], float("-inf"))
            plain = F.scaled_dot_product_attention(q, k, v, attn_mask=(~pad)[:, None, None, :])
            masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            torch.lerp(plain, masked, 0.5).backward(grad)

        def triton():
            kernels.triton_interpolated_attention(q, k, v, post_q, post_k, pad, None, False, 0.5).backward(grad)

        row = {"length": length, "batch": bsz, "eager_ms": timed(eager), "tiles": {}}
        for candidate in CANDIDATES:
            config = kernels.BlockConfig(*candidate)
            kernels.FORWARD_CONFIGS[block], kernels.BACKWARD_CONFIGS[block] = config, config
            try:
                row["tiles"]["x".join(map(str, candidate))] = timed(triton)
            except Exception as error:  # out of shared memory, a tile the compiler refuses
                row["tiles"]["x".join(map(str, candidate))] = f"{type(error).__name__}: {str(error)[:120]}"
        kernels.FORWARD_CONFIGS[block], kernels.BACKWARD_CONFIGS[block] = own
        row["own_ms"] = timed(triton)
        rows.append(row)
        timings = {name: ms for name, ms in row["tiles"].items() if isinstance(ms, float)}
        best = min(timings, key=timings.get) if timings else None
        print(f"L={length:4d} B={bsz:4d}: eager (two SDPA calls) {row['eager_ms']:.2f} ms | Triton, the path's tiles "
              f"{row['own_ms']:.2f} ms ({row['own_ms'] / row['eager_ms']:.2f} x) | fastest tile {best} "
              f"{timings.get(best, float('nan')):.2f} ms", flush=True)
        for name, ms in row["tiles"].items():
            print(f"    {name:12} {ms:.2f} ms" if isinstance(ms, float) else f"    {name:12} {ms}")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "dtype": args.dtype,
                                         "heads": args.heads, "head_dim": args.head_dim, "clusters": args.clusters,
                                         "own_tiles": [list(c) for c in own], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
