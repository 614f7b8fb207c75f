"""benchmarks/gpu_check.py, the first command of a session with a GPU, and
benchmarks/triton_tiles.py, its autotuning step: what can be checked without a GPU (the plan and
its order, the headlines against the targets, the refusals)."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_check
        import triton_tiles

        yield gpu_check, triton_tiles
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_plan_puts_dma_first_and_the_fp16_step_needs_data(scripts, tmp_path, capsys):
    gpu_check, _ = scripts
    names = [s["name"] for s in gpu_check.steps(tmp_path, None)]
    assert names == ["kernels", "tiles", "dma_eager", "dma_triton", "dma_compile", "rim", "rim_compile", "variants"]
    with_data = gpu_check.steps(tmp_path, tmp_path / "data-bin")
    assert [s["name"] for s in with_data][-1] == "fp16"
    # 8 minutes in all on an H200 without the data step, each step within its own limit
    assert sum(s["seconds"] for s in gpu_check.steps(tmp_path, None)) <= 480
    assert sum(s["seconds"] for s in with_data) <= 540
    assert gpu_check.main(["--out", str(tmp_path / "new"), "--list"]) == 0
    assert "dma_triton" in capsys.readouterr().out
    assert not (tmp_path / "new").exists()


def test_dma_headline_reads_bench_dma_against_the_targets(scripts):
    gpu_check, _ = scripts
    results = {"train": [{"length": 128, "time_ratio": 1.1, "memory_ratio": 1.2},
                         {"length": 512, "time_ratio": 1.3, "memory_ratio": 1.0},
                         {"length": 32, "time_ratio": None, "memory_ratio": None}],
               "generation": {"sentences_per_s_ratio": 0.97}}
    line = gpu_check.dma_headline(results)
    assert line == ("L=128: step 1.10 x (met, <= 1.15), memory 1.20 x (not met); "
                    "L=512: step 1.30 x (not met, <= 1.25), memory 1.00 x (met); L=32: out of memory; "
                    "generation 0.97 x (met, >= 0.95)")
    rim = gpu_check.rim_headline({"train": [{"length": 32, "time_ratio": {"encoder": 4.5}}]})
    assert rim == "L=32: encoder 4.50 x cuDNN (not met, <= 4.0)"


def test_report_is_one_markdown_table_and_one_json(scripts, tmp_path):
    gpu_check, _ = scripts
    records = [dict(name="dma_eager", exit=0, seconds=41.2, headline="L=32: step 4.10 x | x", command=["x"]),
               dict(name="dma_triton", exit="timeout", seconds=60.0, headline="", command=["y"])]
    gpu_check.write_report(tmp_path, records, "NVIDIA H200")
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert table[0] == "# gpu_check on NVIDIA H200"
    assert table[4:] == ["| dma_eager | 0 | 41 | L=32: step 4.10 x / x |", "| dma_triton | timeout | 60 |  |"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["steps"][1]["exit"] == "timeout"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_refusals_without_a_gpu_or_with_a_used_folder(scripts, tmp_path, capsys):
    gpu_check, triton_tiles = scripts
    used = tmp_path / "used"
    used.mkdir()
    (used / "note.txt").write_text("mine")
    assert gpu_check.main(["--out", str(used)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert (used / "note.txt").read_text() == "mine" and len(list(used.iterdir())) == 1
    assert gpu_check.main(["--out", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip() == "gpu_check: torch sees no CUDA device here"
    assert not (tmp_path / "new").exists()
    assert triton_tiles.main(["--device", "cpu"]) == 2
    assert "pass --device cuda" in capsys.readouterr().err
