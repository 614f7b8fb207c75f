"""Compile the package's Triton kernels for a GPU on a machine without one, and report each
kernel's registers, register spills and shared memory as ptxas sees them.

    python benchmarks/triton_compile.py                 # every kernel and configuration, sm_80 and sm_90
    python benchmarks/triton_compile.py --arch 90 --head-dim 64 --clusters 4 --json out.json

``triton.compile`` with an explicit ``GPUTarget`` runs Triton's whole pipeline down to PTX
and a cubin, as it would on the GPU (the compile errors a GPU would report are reported here),
and the ``ptxas`` bundled in the triton wheel, run again with ``-v``, prints what the kernel
uses. A spill (a register's value stored to local memory and loaded back) costs memory traffic
in every iteration of a kernel's loop, so the configurations the DMA path uses must have none
(``tests/test_triton_compile.py`` fails on a spill at the bench's shapes).

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the kernels by Python): the
script refuses in one line where it is set.
"""

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: each kernel: its module, its function, and the dtypes of its pointer arguments by role ("x":
#: the inputs' dtype, "a": the accumulation's, fp32)
_KERNELS = {
    "attention_forward": ("interpolated_attention_triton", "_forward_kernel", dict(
        Q="x", K="x", V="x", PQ="a", PK="a", PAD="u8", MASK="a", GAMMA="a", OUT="x", DIFF="a", LSE="a")),
    "attention_backward_queries": ("interpolated_attention_triton", "_backward_query_kernel", dict(
        Q="x", K="x", V="x", PQ="a", PK="a", PAD="u8", MASK="a", GAMMA="a", OUT="x", DIFF="a", LSE="a", DO="x", DQ="x",
        DPQ="a", R="a")),
    "attention_backward_keys": ("interpolated_attention_triton", "_backward_key_kernel", dict(
        Q="x", K="x", V="x", PQ="a", PK="a", PAD="u8", MASK="a", GAMMA="a", LSE="a", DO="x", R="a", DK="x", DV="x",
        DPK="a")),
    # the GMMs run in fp32 whatever the model's dtype: their points are "a"
    "gmm_forward": ("mixture_triton", "_forward_kernel", dict(
        X="a", Z="a", IV="a", SM="a", LN="a", OFF="a", J="a", LP="a", P="a", KL="a", TERMS="a")),
    "gmm_backward": ("mixture_triton", "_backward_kernel", dict(
        X="a", Z="a", IV="a", SM="a", P="a", TERMS="a", GJ="a", GLP="a", GP="a", GKL="a", OUT_A="a", OUT_B="a",
        WEIGHT="a", KL_WEIGHT="a", FIRST="a", SECOND="a")),
    # L_Dxq's critic over the query posteriors (fp32 like the GMMs)
    "infonce_forward": ("infonce_triton", "_scores_kernel", dict(Q="a", VALID="u8", SCORES="a", LSE="a")),
    "infonce_backward": ("infonce_triton", "_gradient_kernel", dict(Q="a", VALID="u8", LSE="a", G="a", DQ="a")),
}
_FLOAT_SCALARS = ("scale", "dropout_p", "keep_scale", "kl_const", "kl_shift")
_TYPE_NAMES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


class Variant(NamedTuple):
    kernel: str
    arch: int
    dtype: str  # "float32", "float16" or "bfloat16"
    head_dim: int
    clusters: int
    has_pad: bool
    has_mask: bool
    causal: bool
    dropout: bool


class Report(NamedTuple):
    variant: Variant
    block_m: int
    block_n: int
    num_warps: int
    registers: int
    spill_bytes: int  # spill stores + spill loads
    shared_bytes: int
    seconds: float
    error: str


def variants(archs: List[int], dtypes: List[str], head_dims: List[int], clusters: List[int],
             all_flags: bool) -> Iterator[Variant]:
    """Every kernel at every asked configuration. The attention's flags: all combinations, or
    (default) the heaviest one (padding, causal, dropout: the decoder's self-attention in
    training) and the generic 2-D mask. The GMM and InfoNCE kernels run in fp32 only, the GMM's
    with every gradient and output their backward can take (the flags do not apply: they are
    reported as False)."""
    flag_sets = (list(itertools.product((False, True), repeat=4)) if all_flags
                 else [(True, False, True, True), (True, True, False, True)])
    for kernel, arch, dtype, head_dim, count, flags in itertools.product(
            _KERNELS, archs, dtypes, head_dims, clusters, flag_sets):
        has_pad, has_mask, causal, dropout = flags
        if has_mask and causal:
            continue  # the path passes one or the other
        if kernel.startswith(("gmm", "infonce")):
            if dtype != dtypes[0] or flags != flag_sets[0]:
                continue
            yield Variant(kernel, arch, "float32", head_dim, count, False, False, False, False)
            continue
        yield Variant(kernel, arch, dtype, head_dim, count, has_pad, has_mask, causal, dropout)


def compile_variant(variant: Variant, override=None) -> Report:
    """Compile one variant for its sm_<arch> and read ptxas's report (module docstring);
    ``override``: a ``BlockConfig`` to try instead of the path's own."""
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fairseq_modattn.modules import infonce_triton, mixture_triton
    from fairseq_modattn.modules import interpolated_attention_triton as attention

    module_name, function, pointers = _KERNELS[variant.kernel]
    modules = {"interpolated_attention_triton": attention, "mixture_triton": mixture_triton,
               "infonce_triton": infonce_triton}
    fn = getattr(modules[module_name], function)
    dtype = getattr(torch, variant.dtype)
    names = {"x": _TYPE_NAMES[variant.dtype], "a": "fp32", "u8": "u8"}
    block_c = max(2, triton.next_power_of_2(variant.clusters))
    if variant.kernel.startswith("infonce"):
        warps = infonce_triton.WARPS["gradient" if variant.kernel == "infonce_backward" else "scores"]
        config = override if override is not None else attention.BlockConfig(infonce_triton.BLOCK,
                                                                             infonce_triton.BLOCK, warps, 2)
        constants = dict(CLUSTERS=variant.clusters, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                         HAS_VALID=True, PADDED=-1e4, ACC=tl.float32)
        if variant.kernel == "infonce_backward":
            constants["BLOCK_C"] = block_c
    elif variant.kernel.startswith("gmm"):
        points, warps = mixture_triton.block_shape(variant.head_dim)
        config = override if override is not None else attention.BlockConfig(points, 0, warps, 2)
        constants = dict(DIM=variant.head_dim, BLOCK_D=max(16, triton.next_power_of_2(variant.head_dim)),
                         CLUSTERS=variant.clusters, BLOCK_C=block_c, BLOCK_P=config.block_m, ACC=tl.float32)
        if variant.kernel == "gmm_forward":
            constants["NEED_KL"] = True
        else:
            constants.update(WITH_KL=True, HAS_GJ=True, HAS_GLP=True, HAS_GP=True, HAS_A=True, A_WITH_MEAN=True,
                             HAS_B=False, NEED_FIRST=True, NEED_SECOND=True)
    else:
        backward = variant.kernel != "attention_forward"
        tiles = attention.BACKWARD_CONFIGS if backward else attention.FORWARD_CONFIGS
        config = override if override is not None else tiles[attention.head_block(variant.head_dim)]
        constants = dict(
            HEAD_DIM=variant.head_dim, BLOCK_D=attention.head_block(variant.head_dim), CLUSTERS=variant.clusters,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, HAS_PAD=variant.has_pad, HAS_MASK=variant.has_mask,
            IS_CAUSAL=variant.causal, DROPOUT=variant.dropout, ACC=tl.float32,
            TINY=torch.finfo(torch.float32).tiny, UPCAST=False, PRECISION="tf32" if dtype == torch.float32 else "ieee",
        )
        if backward:
            constants["BLOCK_C"] = block_c
    signature: Dict[str, str] = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + names[pointers[name]]
        else:
            signature[name] = "fp32" if name in _FLOAT_SCALARS else "i32"
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", variant.arch, 32),
                                  options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    except Exception as error:  # a compile error is the report's result
        return Report(variant, config.block_m, config.block_n, config.num_warps, 0, 0, 0,
                      time.perf_counter() - start, f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
    registers, spills = _ptxas_usage(compiled.asm["ptx"], variant.arch, compiled.metadata.name)
    return Report(variant, config.block_m, config.block_n, config.num_warps, registers, spills,
                  compiled.metadata.shared, time.perf_counter() - start, "")


def _ptxas_usage(ptx: str, arch: int, name: str):
    """(registers, spill bytes) of kernel ``name`` in ``ptx``, from the bundled ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        ptxas = get_ptxas(arch).path
        result = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", path, "-o", os.path.join(folder, "k.o")],
                                capture_output=True, text=True, check=True)
    text = result.stderr
    entry = text[text.index(f"'{name}'"):]
    registers = int(re.search(r"Used (\d+) registers", entry).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry)
    return registers, int(spills.group(1)) + int(spills.group(2))


def _block_config(*values):
    from fairseq_modattn.modules.interpolated_attention_triton import BlockConfig

    return BlockConfig(*values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities (default: 80 90)")
    p.add_argument("--dtype", nargs="+", default=["float32", "float16", "bfloat16"], choices=sorted(_TYPE_NAMES)[:3],
                   help="the inputs' dtypes (default: all three)")
    p.add_argument("--head-dim", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="head widths (default: 16 32 64 128)")
    p.add_argument("--clusters", type=int, nargs="+", default=[4, 16], help="cluster counts (default: 4 16)")
    p.add_argument("--all-flags", action="store_true", help="every combination of padding, mask, causal and dropout")
    p.add_argument("--tile", type=int, nargs=4, default=None, metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                   help="try this tile and launch shape for every kernel instead of the path's own")
    p.add_argument("--json", type=Path, default=None, help="also write the reports here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("triton_compile: unset TRITON_INTERPRET (the interpreter compiles nothing)", file=sys.stderr)
        return 2
    reports = []
    print(f"{'kernel':24} {'sm':>3} {'dtype':9} {'d':>4} {'C':>3} {'pad mask causal drop':21} "
          f"{'tile':>7} {'warps':>5} {'regs':>5} {'spill B':>7} {'smem B':>7} {'s':>5}", flush=True)
    failed = False
    for variant in variants(args.arch, args.dtype, args.head_dim, args.clusters, args.all_flags):
        report = compile_variant(variant, None if args.tile is None else _block_config(*args.tile))
        reports.append(report)
        flags = " ".join("y" if f else "-"
                         for f in (variant.has_pad, variant.has_mask, variant.causal, variant.dropout))
        line = (f"{variant.kernel:24} {variant.arch:>3} {variant.dtype:9} {variant.head_dim:>4} {variant.clusters:>3} "
                f"{flags:21} {report.block_m:>3}x{report.block_n:<3} {report.num_warps:>5} ")
        if report.error:
            failed = True
            print(line + "FAILED " + report.error, flush=True)
        else:
            print(line + f"{report.registers:>5} {report.spill_bytes:>7} {report.shared_bytes:>7} "
                  f"{report.seconds:>5.1f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([{**r._asdict(), "variant": r.variant._asdict()} for r in reports], indent=1))
    spilled = sum(1 for r in reports if r.spill_bytes)
    print(f"{len(reports)} variants, {sum(1 for r in reports if r.error)} failed to compile, {spilled} spill")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
