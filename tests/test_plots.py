"""fairseq_modattn.analysis.plots: PNG files of the documented pixel size, input validation,
atomic writes, and the 2-D projections."""

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from conftest import PNG_SIGNATURE, png_size
from fairseq_modattn.analysis import AnalysisError
from fairseq_modattn.analysis import plots as P

WORDS = ("a man in a blue shirt is stand@@ ing on a ladder clean@@ ing windows while two "
         "kids watch from the $5 sidewalk next to a very_long_subword_token_indeed and a dog .").split()


def check_png(path, expected_size):
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert path.stat().st_size > 5_000, f"{path} is suspiciously small"
    assert png_size(path) == tuple(expected_size)
    pixels = imread(str(path))
    assert pixels.shape[:2] == (expected_size[1], expected_size[0])
    assert float(pixels[..., :3].var()) > 1e-3, f"{path} is (nearly) a single colour"
    # nothing but the PNG itself is left in the folder (no temporary file)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def redundancy(layers=3, heads=4, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.dirichlet(np.ones(8), size=layers * heads)
    m = 1 - 0.5 * np.abs(a[:, None] - a[None]).sum(-1)
    np.fill_diagonal(m, 1.0)
    labels = [f"L{layer + 1}H{h + 1}" for layer in range(layers) for h in range(heads)]
    return m, labels


# --------------------------------------------------------------------------- sizes


def test_figure_size_formulas_grow_and_are_capped():
    small = P.figure_size_px("head_redundancy", n=4)
    assert small == (660, 560)  # clip(2 + 0.8, 5, 18) = 5 -> (5 + 1.6, 5 + 0.6) in at 100 dpi
    assert P.figure_size_px("head_redundancy", n=48) == (1320, 1220)
    assert P.figure_size_px("head_redundancy", n=1000) == (1960, 1860)  # capped at 18 in
    assert P.figure_size_px("head_redundancy", dpi=50, n=48) == (660, 610)

    assert P.figure_size_px("sentence_clusters", t=4, c=2, s=4) == (800, 450)  # minima
    w40, h40 = P.figure_size_px("sentence_clusters", t=40, c=8, s=40)
    assert (w40, h40) == (1710, 1100)
    assert P.figure_size_px("sentence_clusters", t=500, c=64, s=500) == (2400, 1800)

    assert P.figure_size_px("competition", t=40, sizes=[2] * 6) == (1300, 936)
    assert P.figure_size_px("rim_activation", t=40, sizes=[6, 6]) == P.figure_size_px(
        "competition", t=40, sizes=[6, 6])
    assert P.figure_size_px("competition", t=10_000, sizes=[64] * 10) == (2120, 3000)

    assert P.figure_size_px("cluster_top_tokens", n_clusters=8, top_k=10) == (1400, 720)
    assert P.figure_size_px("cluster_top_tokens", n_clusters=3, top_k=0) == (1060, 174)
    assert P.figure_size_px("cluster_top_tokens", n_clusters=400, top_k=50)[0] <= 2400
    assert P.figure_size_px("query_projection", n_heads=8) == (800, 650)
    assert P.figure_size_px("query_projection", n_heads=1000) == (1240, 650)
    assert P.figure_size_px("ablation", dpi=200) == (1500, 960)


@pytest.mark.parametrize("kind, shape, message", [
    ("nope", {}, "unknown kind"),
    ("head_redundancy", {}, "missing shape keyword"),
    ("head_redundancy", {"n": 0}, "n must be an integer >= 1"),
    ("competition", {"t": 3, "sizes": []}, "at least one layer"),
])
def test_figure_size_rejects_bad_arguments(kind, shape, message):
    with pytest.raises(AnalysisError, match=message):
        P.figure_size_px(kind, **shape)
    with pytest.raises(AnalysisError, match="dpi"):
        P.figure_size_px("ablation", dpi=0)


# --------------------------------------------------------------------------- head redundancy


def test_head_redundancy_png(tmp_path):
    m, labels = redundancy(6, 8)
    out = P.plot_head_redundancy(m, labels, tmp_path / "sub" / "dir" / "red.png", group_size=8)
    assert out == tmp_path / "sub" / "dir" / "red.png"
    check_png(out, P.figure_size_px("head_redundancy", n=48))


def test_head_redundancy_exact_size_at_odd_dpi(tmp_path):
    m, labels = redundancy(1, 7)
    out = P.plot_head_redundancy(m, labels, tmp_path / "r.png", title="x", dpi=73)
    check_png(out, P.figure_size_px("head_redundancy", dpi=73, n=7))


@pytest.mark.parametrize("mutate, message", [
    (lambda m, names: (m[:, :-1], names), "square"),
    (lambda m, names: (np.where(np.eye(len(names), dtype=bool), np.nan, m), names), "finite"),
    (lambda m, names: (m, names[:-1]), "expected 12 labels"),
    (lambda m, names: (m * 3, names), r"values in \[0.0, 1.0\]"),
    (lambda m, names: (m[0], names), "2-D array"),
])
def test_head_redundancy_validation(tmp_path, mutate, message):
    m, labels = redundancy()
    m, labels = mutate(m, labels)
    with pytest.raises(AnalysisError, match=message):
        P.plot_head_redundancy(m, labels, tmp_path / "r.png")
    assert list(tmp_path.iterdir()) == []


def test_head_redundancy_group_size_must_divide(tmp_path):
    m, labels = redundancy(3, 4)
    with pytest.raises(AnalysisError, match="group_size"):
        P.plot_head_redundancy(m, labels, tmp_path / "r.png", group_size=5)


def test_output_must_be_png(tmp_path):
    m, labels = redundancy()
    with pytest.raises(AnalysisError, match=r"\.png"):
        P.plot_head_redundancy(m, labels, tmp_path / "r.pdf")
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    m, labels = redundancy()
    target = tmp_path / "r.png"
    target.write_bytes(b"old")

    def broken_savefig(self, fh, **kwargs):
        fh.write(PNG_SIGNATURE + b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(RuntimeError, match="disk full"):
        P.plot_head_redundancy(m, labels, target)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.png"]


# --------------------------------------------------------------------------- clusters


def test_cluster_top_tokens_png(tmp_path):
    rng = np.random.default_rng(1)
    clusters = []
    for _ in range(7):
        scores = np.sort(rng.random(10))[::-1]
        clusters.append([(w, float(s)) for w, s in zip(rng.choice(WORDS, 10, replace=False), scores)])
    clusters.append([])  # an empty cluster is drawn as a "no tokens" panel
    out = P.plot_cluster_top_tokens(clusters, tmp_path / "top.png", cluster_ids=list("ABCDEFGH"))
    check_png(out, P.figure_size_px("cluster_top_tokens", n_clusters=8, top_k=10))


@pytest.mark.parametrize("clusters, kwargs, message", [
    ([], {}, "non-empty list"),
    ([[("a", 1.0)], "abc"], {}, r"clusters\[1\]: expected a list"),
    ([[("a", 1.0, 2)]], {}, r"clusters\[0\]\[0\]: expected a \(token, score\) pair"),
    ([[("a", float("nan"))]], {}, "finite score"),
    ([[("a", "high")]], {}, "numeric score"),
    ([[("a", 1.0)], []], {"cluster_ids": [1]}, "expected 2 ids"),
])
def test_cluster_top_tokens_validation(tmp_path, clusters, kwargs, message):
    with pytest.raises(AnalysisError, match=message):
        P.plot_cluster_top_tokens(clusters, tmp_path / "top.png", **kwargs)
    assert list(tmp_path.iterdir()) == []


def sentence(t=None, c=8, seed=2):
    t = len(WORDS) if t is None else t
    rng = np.random.default_rng(seed)
    post = rng.dirichlet(np.full(c, 0.3), size=t)
    return WORDS[:t], post


def test_sentence_clusters_png_self_and_cross(tmp_path):
    tokens, post = sentence()
    assert len(tokens) == 31
    out = P.plot_sentence_clusters(tokens, post, post @ post.T, tmp_path / "a" / "self.png")
    check_png(out, P.figure_size_px("sentence_clusters", t=31, c=8, s=31))
    keys, post_k = sentence(t=12, seed=3)
    out = P.plot_sentence_clusters(tokens, post, post @ post_k.T, tmp_path / "b" / "cross.png",
                                   key_tokens=keys, title="cross-attention mask")
    check_png(out, P.figure_size_px("sentence_clusters", t=31, c=8, s=12))


def test_sentence_clusters_validation(tmp_path):
    tokens, post = sentence(t=10)
    mask = post @ post.T
    with pytest.raises(AnalysisError, match=r"posteriors: expected shape \(T=9, C\)"):
        P.plot_sentence_clusters(tokens[:9], post, mask, tmp_path / "s.png")
    with pytest.raises(AnalysisError, match=r"mask: expected shape \(T=10, S=4\).*key_tokens"):
        P.plot_sentence_clusters(tokens, post, mask, tmp_path / "s.png", key_tokens=tokens[:4])
    with pytest.raises(AnalysisError, match=r"mask: expected shape \(T=10, S=10\)"):
        P.plot_sentence_clusters(tokens, post, mask[:, :5], tmp_path / "s.png")
    bad = post.copy()
    bad[3, 1] = np.inf
    with pytest.raises(AnalysisError, match=r"posteriors: expected finite values.*\[3, 1\]"):
        P.plot_sentence_clusters(tokens, bad, mask, tmp_path / "s.png")
    with pytest.raises(AnalysisError, match="tokens: expected at least one token"):
        P.plot_sentence_clusters([], post, mask, tmp_path / "s.png")
    with pytest.raises(AnalysisError, match="tokens: expected a list of token strings"):
        P.plot_sentence_clusters("a b c", post, mask, tmp_path / "s.png")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- projections


def test_project_2d_pca_keeps_a_line_a_line():
    rng = np.random.default_rng(4)
    t = rng.normal(size=40)
    origin, direction = rng.normal(size=5), rng.normal(size=5)
    points = origin + t[:, None] * direction
    out = P.project_2d(points, method="pca")
    assert out.shape == (40, 2) and out.dtype == np.float64
    centred = out - out.mean(axis=0)
    sv = np.linalg.svd(centred, compute_uv=False)
    assert sv[1] <= 1e-9 * sv[0]  # collinear
    assert np.allclose(out[:, 1], 0.0, atol=1e-9)
    assert abs(np.corrcoef(out[:, 0], t)[0, 1]) > 1 - 1e-9
    # distances along the line are preserved (an isometry of the line)
    assert np.allclose(np.abs(out[:, 0] - out[0, 0]), np.abs(t - t[0]) * np.linalg.norm(direction))


def test_project_2d_pca_orders_components_by_variance():
    rng = np.random.default_rng(5)
    points = rng.normal(size=(200, 3)) * np.array([5.0, 2.0, 0.1])
    out = P.project_2d(points, method="pca")
    assert out[:, 0].var() > out[:, 1].var() > 1.0
    assert np.allclose(out.mean(axis=0), 0.0, atol=1e-9)


def test_project_2d_tsne_is_finite_and_seeded(monkeypatch):
    # scikit-learn sizes its OpenMP thread pool by the physical cores, which joblib counts by
    # running lscpu, unless OMP_NUM_THREADS is set: set, the t-SNE starts no process
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(6)
    points = np.concatenate([rng.normal(k * 4, 1, size=(10, 6)) for k in range(3)])
    a = P.project_2d(points, method="tsne", seed=3)
    b = P.project_2d(points, method="tsne", seed=3)
    assert a.shape == (30, 2) and np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)
    tiny = P.project_2d(points[:3], method="tsne")  # perplexity clipped for N = 3
    assert tiny.shape == (3, 2) and np.all(np.isfinite(tiny))


@pytest.mark.parametrize("points, method, message", [
    (np.zeros((2, 4)), "pca", "at least 3 points"),
    (np.array([[0.0, 1.0], [np.nan, 2.0], [3.0, 4.0]]), "tsne", "finite"),
    (np.zeros(5), "pca", "2-D array"),
    (np.random.default_rng(0).normal(size=(5, 3)), "umap", "'pca' or 'tsne'"),
])
def test_project_2d_validation(points, method, message):
    with pytest.raises(AnalysisError, match=message):
        P.project_2d(points, method=method)


def test_query_projection_png(tmp_path):
    rng = np.random.default_rng(7)
    heads = np.repeat(np.arange(8), 25)
    points = rng.normal(size=(200, 2)) + heads[:, None] * 3.0
    out = P.plot_query_projection(points, heads, tmp_path / "q.png", method_label="PCA")
    check_png(out, P.figure_size_px("query_projection", n_heads=8))


def test_query_projection_many_heads(tmp_path):
    rng = np.random.default_rng(8)
    heads = np.arange(120) % 24
    out = P.plot_query_projection(rng.normal(size=(120, 2)), heads.tolist(), tmp_path / "q.png")
    check_png(out, P.figure_size_px("query_projection", n_heads=24))


def test_query_projection_validation(tmp_path):
    pts = np.zeros((6, 2))
    with pytest.raises(AnalysisError, match=r"points_2d: expected shape \(N, 2\)"):
        P.plot_query_projection(np.zeros((6, 3)), [0] * 6, tmp_path / "q.png")
    with pytest.raises(AnalysisError, match="expected 6 head indices"):
        P.plot_query_projection(pts, [0] * 5, tmp_path / "q.png")
    with pytest.raises(AnalysisError, match="integer"):
        P.plot_query_projection(pts, [0.5] * 6, tmp_path / "q.png")
    with pytest.raises(AnalysisError, match="non-negative"):
        P.plot_query_projection(pts, [-1] * 6, tmp_path / "q.png")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- TIM / RIM


def test_competition_png_with_40_tokens(tmp_path):
    rng = np.random.default_rng(9)
    tokens = (WORDS * 2)[:40]
    comp = {f"encoder.layers.{i}": rng.dirichlet(np.ones(2), size=40) for i in range(6)}
    out = P.plot_competition(tokens, comp, tmp_path / "comp.png")
    check_png(out, P.figure_size_px("competition", t=40, sizes=[2] * 6))


def test_competition_validation(tmp_path):
    rng = np.random.default_rng(10)
    tokens = WORDS[:5]
    with pytest.raises(AnalysisError, match=r"\['l1'\]: expected shape \(T=5, n\)"):
        P.plot_competition(tokens, {"l1": rng.dirichlet(np.ones(2), size=6)}, tmp_path / "c.png")
    with pytest.raises(AnalysisError, match="values in"):
        P.plot_competition(tokens, {"l1": np.full((5, 2), 1.5)}, tmp_path / "c.png")
    with pytest.raises(AnalysisError, match="non-empty mapping"):
        P.plot_competition(tokens, {}, tmp_path / "c.png")
    with pytest.raises(AnalysisError, match="non-empty mapping"):
        P.plot_competition(tokens, [np.ones((5, 2))], tmp_path / "c.png")
    nan = np.full((5, 2), 0.5)
    nan[2, 0] = np.nan
    with pytest.raises(AnalysisError, match="finite"):
        P.plot_competition(tokens, {"l1": nan}, tmp_path / "c.png")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("as_bool", [True, False])
def test_rim_activation_png(tmp_path, as_bool):
    rng = np.random.default_rng(11)
    tokens = WORDS[:30]
    act = {f"rim layer {i}": rng.random((30, 6)) for i in range(2)}
    if as_bool:
        act = {k: v < 0.5 for k, v in act.items()}
    out = P.plot_rim_activation(tokens, act, tmp_path / "rim.png", title="RIMs")
    check_png(out, P.figure_size_px("rim_activation", t=30, sizes=[6, 6]))


def test_rim_activation_validation(tmp_path):
    with pytest.raises(AnalysisError, match=r"expected shape \(T=3, n\)"):
        P.plot_rim_activation(["a", "b", "c"], {"l": np.ones((4, 6), dtype=bool)}, tmp_path / "r.png")
    with pytest.raises(AnalysisError, match="2-D array"):
        P.plot_rim_activation(["a", "b", "c"], {"l": np.ones(3)}, tmp_path / "r.png")


# --------------------------------------------------------------------------- ablation


def test_ablation_png(tmp_path):
    rows = [{"n_c": n, "bleu": b, "lr": low, "hr": high} for n, b, low, high in
            [(16, 34.8, .33, .44), (2, 34.1, .41, .52), (4, 34.6, .38, .49), (8, 35.0, .35, .45)]]
    out = P.plot_ablation(rows, tmp_path / "abl.png")
    check_png(out, P.figure_size_px("ablation"))
    out = P.plot_ablation([{"n_c": 2, "bleu": 30.0}, {"n_c": 3, "bleu": 31.5}], tmp_path / "x" / "b.png")
    check_png(out, P.figure_size_px("ablation"))


@pytest.mark.parametrize("rows, message", [
    ([], "non-empty list"),
    ([{"n_c": 2}], r"rows\[0\]: expected a dict with keys 'n_c' and 'bleu'"),
    ([{"n_c": 0, "bleu": 1.0}], "positive integer"),
    ([{"n_c": 2, "bleu": 1.0}, {"n_c": 2, "bleu": 2.0}], "distinct n_c"),
    ([{"n_c": 2, "bleu": float("nan")}], "finite"),
    ([{"n_c": 2, "bleu": 1.0, "lr": "low"}], r"rows\[0\]\['lr'\]: expected a number"),
])
def test_ablation_validation(tmp_path, rows, message):
    with pytest.raises(AnalysisError, match=message):
        P.plot_ablation(rows, tmp_path / "a.png")
    assert list(tmp_path.iterdir()) == []


def test_module_never_uses_pyplot():
    import inspect

    source = inspect.getsource(P)
    assert "matplotlib.pyplot" not in source and "import pyplot" not in source
