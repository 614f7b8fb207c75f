"""``fairseq-modattn redundancy`` and ``fairseq-modattn plot`` on tiny models trained by the real
fairseq-train (conftest.tiny_checkpoints), for this package's models and a plain transformer."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import MODATTN, png_size, run_cli
from fairseq_modattn.analysis.plots import figure_size_px


def modattn(*args, check=True):
    return run_cli([MODATTN, *args], check=check)


def split_sizes(data, split: str, lang: str):
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(str(Path(data) / f"{split}.de-en.{lang}"), None)
    return [int(s) for s in dataset.sizes]


@pytest.mark.parametrize("family", ["transformer", "dma"])
def test_redundancy_json_and_heatmap(family, tiny_checkpoints, multi30k_bin, tmp_path):
    out, fig = tmp_path / "r.json", tmp_path / "r.png"
    _, log = modattn("redundancy", multi30k_bin, "--path", tiny_checkpoints[family], "--attention", "all",
                     "--output", out, "--plot", fig)
    report = json.loads(out.read_text())
    assert report["sentences"] == 300 and report["subset"] == "test"
    source_tokens = sum(split_sizes(multi30k_bin, "test", "de"))
    target_tokens = sum(split_sizes(multi30k_bin, "test", "en"))
    for attention_type, rows in (("enc_self", source_tokens), ("dec_self", target_tokens), ("enc_dec", target_tokens)):
        r = report["results"][attention_type]
        assert r["query_rows"] == rows  # every real query of every test sentence, no padding
        assert 0.0 <= r["LR"] <= 1.0 and 0.0 <= r["HR"] <= 1.0
        assert r["layers"] == 2 and r["heads_per_layer"] == 4 and len(r["LR_per_layer"]) == 2
        matrix = torch.tensor(r["head_redundancy_matrix"], dtype=torch.float64)
        assert matrix.shape == (8, 8)
        assert torch.allclose(matrix, matrix.T, atol=1e-9)
        assert torch.allclose(matrix.diagonal(), torch.ones(8, dtype=torch.float64), atol=1e-9)
        off = matrix[~torch.eye(8, dtype=torch.bool)]
        assert r["HR"] == pytest.approx(float(off.mean()), abs=1e-9)
        assert f"{attention_type}: LR {r['LR']:.4f}  HR {r['HR']:.4f}" in log
    assert png_size(fig) == figure_size_px("head_redundancy", n=8)


def test_recording_leaves_the_model_output_unchanged(tiny_checkpoints, multi30k_bin):
    from fairseq_modattn.analysis.capture import record_attention
    from fairseq_modattn.analysis.loading import iterate_batches, load_model

    for family in ("transformer", "dma", "tim"):
        model, task, _ = load_model(tiny_checkpoints[family], multi30k_bin)
        sample = next(iterate_batches(task, model, "test", max_batches=1))
        with torch.no_grad():
            expected = model(**sample["net_input"])[0]
            with record_attention(model, "enc_self"), record_attention(model, "dec_self"), \
                    record_attention(model, "enc_dec"):
                recorded = model(**sample["net_input"])[0]
        assert torch.allclose(recorded, expected, atol=1e-5), family


def test_dma_cluster_sentence_and_query_plots(tiny_checkpoints, multi30k_bin, tmp_path):
    ckpt = tiny_checkpoints["dma"]
    modattn("plot", "clusters", multi30k_bin, "--path", ckpt, "--output", tmp_path / "clusters.png",
            "--top-k", "6", "--layer", "1", "--head", "2")
    assert png_size(tmp_path / "clusters.png") == figure_size_px("cluster_top_tokens", n_clusters=4, top_k=6)

    modattn("plot", "sentence", multi30k_bin, "--path", ckpt, "--output", tmp_path / "sentence.png", "--sentence", "5")
    t = split_sizes(multi30k_bin, "test", "de")[5]
    assert png_size(tmp_path / "sentence.png") == figure_size_px("sentence_clusters", t=t, c=4, s=t)

    modattn("plot", "queries", multi30k_bin, "--path", ckpt, "--output", tmp_path / "queries.png",
            "--projection", "pca", "--max-points", "400")
    assert png_size(tmp_path / "queries.png") == figure_size_px("query_projection", n_heads=4)


def test_tim_competition_and_rim_activation_plots(tiny_checkpoints, multi30k_bin, tmp_path):
    t = split_sizes(multi30k_bin, "test", "de")[0]
    modattn("plot", "competition", multi30k_bin, "--path", tiny_checkpoints["tim"], "--output", tmp_path / "c.png")
    # 4 encoder layers with --tim-encoder-layers auto: only layer 3 (index 2) is a TIM layer, n_s = 2
    assert png_size(tmp_path / "c.png") == figure_size_px("competition", t=t, sizes=[2])
    modattn("plot", "rim", multi30k_bin, "--path", tiny_checkpoints["rim"], "--output", tmp_path / "r.png")
    assert png_size(tmp_path / "r.png") == figure_size_px("rim_activation", t=t, sizes=[6])


def test_in_process_extraction_is_consistent(tiny_checkpoints, multi30k_bin):
    from fairseq_modattn.analysis import extract
    from fairseq_modattn.analysis.loading import load_model

    model, task, _ = load_model(tiny_checkpoints["dma"], multi30k_bin)
    s = extract.sentence_clusters(model, task, "test", 3, "enc_dec", layer=2, head=4)
    assert s["posteriors"].shape == (len(s["tokens"]), 4)
    assert s["mask"].shape == (len(s["tokens"]), len(s["key_tokens"]))
    assert s["tokens"][0] == "</s>" and s["key_tokens"][-1] == "</s>"  # decoder input, source
    clusters, where = extract.cluster_top_tokens(model, task, "test", top_k=5, min_count=2)
    assert len(clusters) == 4 and all(len(c) == 5 for c in clusters)
    assert all(0.0 <= score <= 1.0 for c in clusters for _, score in c)
    assert all(a[1] >= b[1] for c in clusters for a, b in zip(c, c[1:]))  # best first
    points, heads, _ = extract.layer_queries(model, task, "test", "enc_self", layer=1, max_points=101)
    assert points.shape == (101, 16) and set(heads.tolist()) == {0, 1, 2, 3}

    model, task, _ = load_model(tiny_checkpoints["tim"], multi30k_bin)
    c = extract.tim_competition(model, task, "test", 0)
    (comp,) = c["competition"].values()
    assert comp.shape == (len(c["tokens"]), 2)
    assert torch.allclose(torch.tensor(comp).sum(-1), torch.ones(len(c["tokens"])), atol=1e-5)

    model, task, _ = load_model(tiny_checkpoints["rim"], multi30k_bin)
    a = extract.rim_activation(model, task, "test", 0)
    (act,) = a["activation"].values()
    assert act.shape == (len(a["tokens"]), 6)
    assert (act.sum(-1) == 4).all()  # exactly k = 4 of n = 6 RIMs active at every real token


def empty_test_split(data: Path, dest: Path) -> Path:
    """A copy of the data-bin's dictionaries and train split with an empty test split."""
    from fairseq.data import indexed_dataset

    dest.mkdir()
    for f in data.iterdir():
        if f.name.startswith(("dict.", "train.")):
            shutil.copy(f, dest / f.name)
    for lang in ("de", "en"):
        prefix = dest / f"test.de-en.{lang}"
        builder = indexed_dataset.make_builder(f"{prefix}.bin", impl="mmap", vocab_size=10_000)
        builder.finalize(f"{prefix}.idx")
    return dest


def test_bad_input_gives_clear_errors(tiny_checkpoints, multi30k_bin, tmp_path, capsys):
    cases = [
        (["redundancy", multi30k_bin, "--path", tmp_path / "missing.pt"], "missing.pt does not exist"),
        (["plot", "clusters", multi30k_bin, "--path", tiny_checkpoints["transformer"], "--output", tmp_path / "x.png"],
         "this transformer model has no DMA enc_self attention"),
        (["plot", "competition", multi30k_bin, "--path", tiny_checkpoints["dma"], "--output", tmp_path / "x.png"],
         "has no TIM layers"),
        (["plot", "rim", multi30k_bin, "--path", tiny_checkpoints["tim"], "--output", tmp_path / "x.png"],
         "has no RIM encoder"),
        (["redundancy", multi30k_bin, "--path", tiny_checkpoints["rim"]], "has no multi-head enc_self attention"),
        (["plot", "sentence", multi30k_bin, "--path", tiny_checkpoints["dma"], "--output", tmp_path / "x.png",
          "--sentence", "300"], "--sentence 300 is out of range: split 'test' has 300 sentences"),
        (["plot", "sentence", multi30k_bin, "--path", tiny_checkpoints["dma"], "--output", tmp_path / "x.png",
          "--layer", "3"], "--layer 3 is out of range"),
        (["redundancy", empty_test_split(multi30k_bin, tmp_path / "empty"), "--path", tiny_checkpoints["dma"]],
         "split 'test' of the data-bin is empty"),
        (["redundancy", multi30k_bin, "--path", tiny_checkpoints["dma"], "--gen-subset", "nosuch"],
         "split 'nosuch' not found"),
        (["redundancy", multi30k_bin, "--path", tiny_checkpoints["dma"], "--attention", "enc_enc"],
         "--attention: expected a comma-separated subset"),
    ]
    # in-process (the commands' own functions), as the console script is checked above
    from fairseq_modattn.cli import analyze

    for args, message in cases:
        command = getattr(analyze, args[0])
        assert command([str(a) for a in args[1:]]) == 1, args
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith(f"fairseq-modattn {args[0]}: error: ")]
        assert len(errors) == 1 and message in errors[0], (message, err[-2000:])
    assert not (tmp_path / "x.png").exists()
    # and once through the console script: exit status 1, the message, no traceback
    code, out = modattn(*cases[0][0], check=False)
    assert code == 1 and cases[0][1] in out and "Traceback" not in out, out[-2000:]
