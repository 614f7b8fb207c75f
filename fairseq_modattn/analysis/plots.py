"""Headless matplotlib figures (PNG) for the analysis of DMA, TIM and RIM models.

Pure functions from numpy arrays / Python lists to PNG files: no fairseq, no model code.
Figures are built with :class:`matplotlib.figure.Figure` and
:class:`~matplotlib.backends.backend_agg.FigureCanvasAgg` (never ``pyplot``), so plotting is
headless, thread-safe and leaves no global state behind.

Every ``plot_*`` function

* validates its input and raises :class:`~fairseq_modattn.analysis.AnalysisError` naming the
  argument and what was expected (nothing is written then);
* writes the PNG atomically (a temporary file in the target folder, then ``os.replace``;
  missing parent folders are created) and returns the :class:`pathlib.Path` written;
* produces an image of exactly ``figure_size_px(kind, dpi=dpi, **shape)`` pixels
  (width, height).  Sizes are defined in inches and multiplied by ``dpi``, so a figure looks
  the same at any ``dpi``; they grow with the number of tokens / heads / clusters and are capped
  (the caps, in inches, are in the per-function docs and in :func:`figure_size_in`).

Size formulas (inches; ``clip(x, lo, hi) = min(max(x, lo), hi)``), by ``kind`` and its shape
keywords:

* ``head_redundancy(n)``: width ``clip(2 + 0.2 n, 5, 18) + 1.6``, height
  ``clip(2 + 0.2 n, 5, 18) + 0.6``.
* ``cluster_top_tokens(n_clusters, top_k)``: ``ncols = min(n_clusters, max(4, ceil(sqrt(n_clusters))))``,
  ``nrows = ceil(n_clusters / ncols)``; width ``min(0.4 + 3.4 ncols, 24)``, height
  ``min(0.6 + nrows (0.9 + 0.24 max(top_k, 1)), 30)``.
* ``sentence_clusters(t, c, s)``: width ``clip(5.5 + 0.35 c + 0.22 s, 8, 24)``, height
  ``clip(2.2 + 0.22 t, 4.5, 18)``.
* ``query_projection(n_heads)``: width ``min(8 + 1.1 (ceil(n_heads / 20) - 1), 12.4)``, height 6.5.
* ``competition(t, sizes)`` and ``rim_activation(t, sizes)`` (``sizes``: mechanisms / RIMs of each
  layer panel): width ``clip(3 + 0.22 t, 6, 20) + 1.2``, height ``min(1.8 + sum(0.7 + 0.28 n), 30)``.
* ``ablation()``: 7.5 x 4.8.

The pixel size is ``(round(width*dpi), round(height*dpi))``.  Crowded tick labels are thinned
(every k-th label is shown) rather than overlapping once a figure reaches its cap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.lines import Line2D

from ..atomic_files import atomic_path
from . import AnalysisError

__all__ = [
    "figure_size_in",
    "figure_size_px",
    "plot_head_redundancy",
    "plot_cluster_top_tokens",
    "plot_sentence_clusters",
    "project_2d",
    "plot_query_projection",
    "plot_competition",
    "plot_rim_activation",
    "plot_ablation",
]

SEQUENTIAL_CMAP = "viridis"
MASK_CMAP = "cividis"
MAX_LABEL_CHARS = 18
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_KINDS = (
    "head_redundancy", "cluster_top_tokens", "sentence_clusters", "query_projection",
    "competition", "rim_activation", "ablation",
)


# --------------------------------------------------------------------------- sizes


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _grid(n_clusters: int) -> tuple[int, int]:
    """(nrows, ncols) of the cluster panel grid."""
    n = max(int(n_clusters), 1)
    ncols = min(n, max(4, math.ceil(math.sqrt(n))))
    return math.ceil(n / ncols), ncols


def _need(shape: Mapping, *names: str) -> list:
    missing = [n for n in names if n not in shape]
    if missing:
        raise AnalysisError(f"figure size: missing shape keyword(s) {missing}; expected {list(names)}")
    return [shape[n] for n in names]


def _count(value, name: str, minimum: int = 0) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise AnalysisError(f"figure size: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def figure_size_in(kind: str, **shape) -> tuple[float, float]:
    """The (width, height) in inches of the figure of ``kind`` (see the module docstring).

    Shape keywords per kind: ``head_redundancy(n)``, ``cluster_top_tokens(n_clusters, top_k)``,
    ``sentence_clusters(t, c, s)``, ``query_projection(n_heads)``,
    ``competition(t, sizes)`` and ``rim_activation(t, sizes)`` where ``sizes`` lists the number
    of mechanisms / RIMs of each layer panel, ``ablation()``.
    """
    if kind == "head_redundancy":
        (n,) = _need(shape, "n")
        side = _clip(2.0 + 0.2 * _count(n, "n", 1), 5.0, 18.0)
        return side + 1.6, side + 0.6
    if kind == "cluster_top_tokens":
        n_clusters, top_k = _need(shape, "n_clusters", "top_k")
        nrows, ncols = _grid(_count(n_clusters, "n_clusters", 1))
        top_k = max(_count(top_k, "top_k"), 1)
        return min(0.4 + 3.4 * ncols, 24.0), min(0.6 + nrows * (0.9 + 0.24 * top_k), 30.0)
    if kind == "sentence_clusters":
        t, c, s = _need(shape, "t", "c", "s")
        t, c, s = _count(t, "t", 1), _count(c, "c", 1), _count(s, "s", 1)
        return _clip(5.5 + 0.35 * c + 0.22 * s, 8.0, 24.0), _clip(2.2 + 0.22 * t, 4.5, 18.0)
    if kind == "query_projection":
        (n_heads,) = _need(shape, "n_heads")
        legend_cols = math.ceil(_count(n_heads, "n_heads", 1) / 20)
        return min(8.0 + 1.1 * (legend_cols - 1), 12.4), 6.5
    if kind in ("competition", "rim_activation"):
        t, sizes = _need(shape, "t", "sizes")
        t = _count(t, "t", 1)
        sizes = [_count(n, "sizes[i]", 1) for n in sizes]
        if not sizes:
            raise AnalysisError("figure size: sizes must list at least one layer")
        return _clip(3.0 + 0.22 * t, 6.0, 20.0) + 1.2, min(1.8 + sum(0.7 + 0.28 * n for n in sizes), 30.0)
    if kind == "ablation":
        return 7.5, 4.8
    raise AnalysisError(f"figure size: unknown kind {kind!r}; expected one of {list(_KINDS)}")


def figure_size_px(kind: str, dpi: float = 100, **shape) -> tuple[int, int]:
    """The exact (width, height) in pixels of the PNG the ``plot_*`` function of ``kind`` writes:
    ``round(inches * dpi)`` of :func:`figure_size_in`."""
    if not (isinstance(dpi, (int, float, np.integer, np.floating)) and math.isfinite(dpi) and dpi > 0):
        raise AnalysisError(f"dpi must be a positive number, got {dpi!r}")
    w, h = figure_size_in(kind, **shape)
    return int(round(w * dpi)), int(round(h * dpi))


# --------------------------------------------------------------------------- helpers


def _new_figure(kind: str, dpi: float, **shape) -> Figure:
    w_px, h_px = figure_size_px(kind, dpi=dpi, **shape)
    # Agg truncates width*dpi to an int: a quarter pixel of slack makes the size exact.
    layout = ConstrainedLayoutEngine(w_pad=0.06, h_pad=0.06, wspace=0.04, hspace=0.04)
    fig = Figure(figsize=((w_px + 0.25) / dpi, (h_px + 0.25) / dpi), dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path, dpi: float) -> Path:
    """Write FIG as PNG to PATH atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise AnalysisError(f"{path}: expected a .png output path")
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fig.savefig(fh, format="png", dpi=dpi)
    return path


def _label(token) -> str:
    """A tick label: str, ``$`` escaped (no mathtext), long tokens shortened with an ellipsis."""
    text = str(token)
    if len(text) > MAX_LABEL_CHARS:
        text = text[: MAX_LABEL_CHARS - 1] + "\u2026"
    return text.replace("$", r"\$")


def _tokens(tokens, name: str) -> list[str]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence) and not isinstance(tokens, np.ndarray):
        raise AnalysisError(f"{name}: expected a list of token strings, got {type(tokens).__name__}")
    tokens = list(tokens)
    if not tokens:
        raise AnalysisError(f"{name}: expected at least one token, got an empty list")
    return [str(t) for t in tokens]


def _array(value, name: str, ndim: int | None = None, lo: float | None = None, hi: float | None = None,
           tol: float = 1e-3) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise AnalysisError(f"{name}: expected a numeric array ({exc})") from None
    if ndim is not None and arr.ndim != ndim:
        raise AnalysisError(f"{name}: expected a {ndim}-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise AnalysisError(f"{name}: expected a non-empty array, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0].tolist()
        raise AnalysisError(f"{name}: expected finite values, found {arr[tuple(bad)]} at index {bad}")
    if lo is not None and arr.min() < lo - tol:
        raise AnalysisError(f"{name}: expected values in [{lo}, {hi}], found minimum {arr.min():.4g}")
    if hi is not None and arr.max() > hi + tol:
        raise AnalysisError(f"{name}: expected values in [{lo}, {hi}], found maximum {arr.max():.4g}")
    if lo is not None or hi is not None:
        arr = np.clip(arr, lo if lo is not None else -np.inf, hi if hi is not None else np.inf)
    return arr


def _title(title, default: str) -> str:
    return default if title is None else str(title)


def _set_ticks(ax, axis: str, labels: Sequence[str], length_in: float, fontsize: float = 8.0,
               rotation: float = 0.0) -> None:
    """Token tick labels on AXIS ('x' or 'y'), thinned to every k-th one when they would overlap
    on an axis LENGTH_IN inches long (fontsize shrinks to 6 pt first)."""
    n = len(labels)
    pitch = max(length_in, 1e-3) / max(n, 1)
    size = _clip(pitch * 72 / 1.35, 6.0, fontsize)
    step = max(1, math.ceil(size * 1.35 / 72 / pitch))
    idx = np.arange(0, n, step)
    shown = [_label(labels[i]) for i in idx.tolist()]
    if axis == "x":
        ax.set_xticks(idx, shown, fontsize=size, rotation=rotation,
                      ha="right" if 0 < rotation < 90 else "center", rotation_mode="anchor"
                      if 0 < rotation < 90 else "default")
    else:
        ax.set_yticks(idx, shown, fontsize=size, rotation=rotation)


def _check_dpi(dpi) -> float:
    if isinstance(dpi, bool) or not isinstance(dpi, (int, float, np.integer, np.floating)) \
            or not math.isfinite(dpi) or dpi <= 0:
        raise AnalysisError(f"dpi must be a positive number, got {dpi!r}")
    return float(dpi)


# --------------------------------------------------------------------------- plots


def plot_head_redundancy(matrix, labels, path, title=None, group_size=None, *, dpi=100,
                         value_label="1 \u2212 JS divergence (bits)") -> Path:
    """Heatmap of an N x N head-redundancy matrix (paper Fig. 3), values in [0, 1].

    ``matrix[a, b]`` = 1 - JS2(A^a, A^b) between heads a and b of the whole model (1 on the
    diagonal); ``labels`` names the N heads (e.g. ``"L1H2"``); ``group_size`` (heads per layer,
    must divide N) draws white lines between layers.  Colour range fixed to [0, 1] (viridis).

    Size: ``figure_size_px("head_redundancy", dpi=dpi, n=N)``, i.e. width
    ``clip(2 + 0.2 N, 5, 18) + 1.6`` in, height ``clip(2 + 0.2 N, 5, 18) + 0.6`` in.
    """
    dpi = _check_dpi(dpi)
    m = _array(matrix, "head-redundancy matrix", ndim=2, lo=0.0, hi=1.0)
    if m.shape[0] != m.shape[1]:
        raise AnalysisError(f"head-redundancy matrix: expected a square N x N matrix, got shape {m.shape}")
    n = m.shape[0]
    labels = _tokens(labels, "head labels")
    if len(labels) != n:
        raise AnalysisError(f"head labels: expected {n} labels (one per row of the {n} x {n} matrix), "
                            f"got {len(labels)}")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1 \
                or n % group_size:
            raise AnalysisError(f"group_size: expected a positive integer dividing N={n} (heads per layer), "
                                f"got {group_size!r}")
    fig = _new_figure("head_redundancy", dpi, n=n)
    ax = fig.add_subplot()
    im = ax.imshow(m, cmap=SEQUENTIAL_CMAP, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="equal")
    side = figure_size_in("head_redundancy", n=n)[1] - 1.6
    _set_ticks(ax, "x", labels, side, rotation=90)
    _set_ticks(ax, "y", labels, side)
    if group_size is not None and group_size < n:
        for k in range(group_size, n, group_size):
            ax.axhline(k - 0.5, color="white", linewidth=1.2)
            ax.axvline(k - 0.5, color="white", linewidth=1.2)
    ax.set_xlabel("head")
    ax.set_ylabel("head")
    ax.set_title(_title(title, "Head-redundancy matrix"))
    cbar = fig.colorbar(im, ax=ax, shrink=0.85)
    cbar.set_label(value_label)
    return _save(fig, path, dpi)


def plot_cluster_top_tokens(clusters, path, title=None, cluster_ids=None, *, dpi=100,
                            score_label="score") -> Path:
    """One horizontal bar panel per DMA cluster with its top tokens, best on top (paper Fig. 4).

    ``clusters``: a list (one entry per cluster) of lists of ``(token, score)`` pairs, best first;
    an empty list gives a panel saying "no tokens".  ``cluster_ids`` (same length) names the
    panels (default ``0..C-1``).

    Size: ``figure_size_px("cluster_top_tokens", dpi=dpi, n_clusters=C, top_k=K)`` with K the
    longest list: ``ncols = min(C, max(4, ceil(sqrt C)))``, ``nrows = ceil(C / ncols)``,
    width ``min(0.4 + 3.4 ncols, 24)`` in, height ``min(0.6 + nrows (0.9 + 0.24 max(K, 1)), 30)`` in.
    """
    dpi = _check_dpi(dpi)
    if isinstance(clusters, (str, bytes)) or not isinstance(clusters, Sequence) or not clusters:
        raise AnalysisError("clusters: expected a non-empty list (one per cluster) of lists of (token, score)")
    parsed = []
    for c, items in enumerate(clusters):
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise AnalysisError(f"clusters[{c}]: expected a list of (token, score) pairs, "
                                f"got {type(items).__name__}")
        rows = []
        for i, pair in enumerate(items):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise AnalysisError(f"clusters[{c}][{i}]: expected a (token, score) pair, got {pair!r}")
            try:
                score = float(pair[1])
            except (TypeError, ValueError):
                raise AnalysisError(f"clusters[{c}][{i}]: expected a numeric score, got {pair[1]!r}") from None
            if not math.isfinite(score):
                raise AnalysisError(f"clusters[{c}][{i}]: expected a finite score, got {score}")
            rows.append((str(pair[0]), score))
        parsed.append(rows)
    if cluster_ids is None:
        cluster_ids = list(range(len(parsed)))
    elif isinstance(cluster_ids, (str, bytes)) or len(cluster_ids) != len(parsed):
        raise AnalysisError(f"cluster_ids: expected {len(parsed)} ids (one per cluster), got {cluster_ids!r}")
    top_k = max(1, max(len(r) for r in parsed))
    nrows, ncols = _grid(len(parsed))
    fig = _new_figure("cluster_top_tokens", dpi, n_clusters=len(parsed), top_k=top_k)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    _, h_in = figure_size_in("cluster_top_tokens", n_clusters=len(parsed), top_k=top_k)
    panel_h = (h_in - 0.6) / nrows - 0.6
    colour = "#3b528b"  # viridis(0.25): dark enough for the white-background bars
    for k, ax in enumerate(axes.flat):
        if k >= len(parsed):
            ax.set_axis_off()
            continue
        rows = parsed[k]
        ax.set_title(f"cluster {cluster_ids[k]}", fontsize=10)
        if not rows:
            ax.text(0.5, 0.5, "no tokens", ha="center", va="center", transform=ax.transAxes,
                    fontsize=10, color="0.4", style="italic")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        y = np.arange(len(rows))
        scores = np.array([s for _, s in rows])
        ax.barh(y, scores, color=colour, height=0.75)
        _set_ticks(ax, "y", [t for t, _ in rows], max(panel_h, 0.3) * len(rows) / top_k)
        ax.set_ylim(top_k - 0.5, -0.5)  # best on top; panels share the row pitch
        ax.tick_params(axis="x", labelsize=8)
        lo = min(0.0, float(scores.min()))
        hi = max(0.0, float(scores.max()))
        ax.set_xlim(lo - 0.02 * (hi - lo or 1), hi + 0.05 * (hi - lo or 1))
        if k // ncols == nrows - 1 or k + ncols >= len(parsed):
            ax.set_xlabel(score_label, fontsize=9)
    fig.suptitle(_title(title, "Top tokens per DMA cluster"))
    return _save(fig, path, dpi)


def plot_sentence_clusters(tokens, posteriors, mask, path, key_tokens=None, title=None, *, dpi=100) -> Path:
    """Cluster probabilities and semantic mask of one sentence (paper Fig. 5), side by side.

    Left: ``posteriors`` (T x C, P_ic) with the T query tokens on the y axis and clusters
    ``c1..cC`` on the x axis.  Right: ``mask`` (T x S, M_ij = sum_c P^q_ic P^k_jc) with query
    tokens on y and ``key_tokens`` (default: ``tokens``, then S = T) on x.  Colour range [0, 1].

    Size: ``figure_size_px("sentence_clusters", dpi=dpi, t=T, c=C, s=S)``: width
    ``clip(5.5 + 0.35 C + 0.22 S, 8, 24)`` in, height ``clip(2.2 + 0.22 T, 4.5, 18)`` in.
    """
    dpi = _check_dpi(dpi)
    tokens = _tokens(tokens, "tokens")
    keys = tokens if key_tokens is None else _tokens(key_tokens, "key_tokens")
    p = _array(posteriors, "posteriors", ndim=2, lo=0.0, hi=1.0)
    m = _array(mask, "mask", ndim=2, lo=0.0, hi=1.0)
    t, s = len(tokens), len(keys)
    if p.shape[0] != t:
        raise AnalysisError(f"posteriors: expected shape (T={t}, C) with one row per token, got {p.shape}")
    if m.shape != (t, s):
        which = "tokens" if key_tokens is None else "key_tokens"
        raise AnalysisError(f"mask: expected shape (T={t}, S={s}) (len(tokens), len({which})), got {m.shape}")
    c = p.shape[1]
    fig = _new_figure("sentence_clusters", dpi, t=t, c=c, s=s)
    w_in, h_in = figure_size_in("sentence_clusters", t=t, c=c, s=s)
    gs = fig.add_gridspec(1, 2, width_ratios=[max(0.35 * c, 0.9), max(0.22 * s, 1.5)])
    ax_p = fig.add_subplot(gs[0, 0])
    ax_m = fig.add_subplot(gs[0, 1])
    im_p = ax_p.imshow(p, cmap=SEQUENTIAL_CMAP, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    im_m = ax_m.imshow(m, cmap=MASK_CMAP, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    rows_len = h_in - 1.9
    _set_ticks(ax_p, "y", tokens, rows_len)
    _set_ticks(ax_m, "y", tokens, rows_len)
    _set_ticks(ax_p, "x", [f"c{i + 1}" for i in range(c)], max(0.35 * c, 0.9) * (w_in - 5.5) /
               max(0.35 * c + 0.22 * s, 1e-3), rotation=90 if c > 12 else 0)
    _set_ticks(ax_m, "x", keys, max(0.22 * s, 1.5) * (w_in - 5.5) / max(0.35 * c + 0.22 * s, 1e-3),
               rotation=90)
    ax_p.set_xlabel("cluster")
    ax_p.set_ylabel("query token")
    ax_p.set_title("cluster probabilities $P$", fontsize=11)
    ax_m.set_xlabel("key token")
    ax_m.set_ylabel("query token")
    ax_m.set_title("semantic mask $M = P^q (P^k)^\\top$", fontsize=11)
    fig.colorbar(im_p, ax=ax_p, shrink=0.9, pad=0.02).set_label("probability")
    fig.colorbar(im_m, ax=ax_m, shrink=0.9, pad=0.02).set_label("mask value")
    fig.suptitle(_title(title, "DMA clusters of a sentence"))
    return _save(fig, path, dpi)


def project_2d(points, method="tsne", seed=0) -> np.ndarray:
    """Project N points (N x D) to 2-D: an (N, 2) float64 array.

    ``"pca"``: the centred points times their first two right singular vectors (numpy SVD; the
    sign of each component is fixed so its largest-magnitude loading is positive; components
    beyond the rank are zero).  ``"tsne"``: :class:`sklearn.manifold.TSNE` with
    ``init="pca"``, ``random_state=seed`` and perplexity ``min(30, max(1, (N - 1) / 3))`` so that
    small N works.  Fewer than 3 points or non-finite values raise AnalysisError.
    """
    x = _array(points, "points", ndim=2)
    n, d = x.shape
    if n < 3:
        raise AnalysisError(f"points: expected at least 3 points (N x D) to project, got shape {x.shape}")
    if method not in ("pca", "tsne"):
        raise AnalysisError(f"method: expected 'pca' or 'tsne', got {method!r}")
    if d < 2:
        x = np.concatenate([x, np.zeros((n, 2 - d))], axis=1)
    if method == "pca":
        xc = x - x.mean(axis=0, keepdims=True)
        _, sv, vt = np.linalg.svd(xc, full_matrices=False)
        comps = vt[:2].copy()
        for i in range(comps.shape[0]):
            if comps[i, np.argmax(np.abs(comps[i]))] < 0:
                comps[i] = -comps[i]
        out = xc @ comps.T
        rank_tol = sv.max(initial=0.0) * max(n, d) * np.finfo(np.float64).eps
        out[:, sv[:2] <= rank_tol] = 0.0
        return np.ascontiguousarray(out, dtype=np.float64)
    from sklearn.manifold import TSNE

    perplexity = min(30.0, max(1.0, (n - 1) / 3.0))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=int(seed),
                learning_rate="auto")
    out = np.asarray(tsne.fit_transform(x), dtype=np.float64)
    if not np.all(np.isfinite(out)):
        raise AnalysisError("points: t-SNE produced non-finite coordinates (degenerate input?)")
    return out


def plot_query_projection(points_2d, head_ids, path, title=None, method_label="t-SNE", *, dpi=100,
                          n_heads=None) -> Path:
    """Scatter of 2-D projected queries coloured (and shaped) by head (paper Fig. 6).

    ``points_2d`` (N x 2, e.g. from :func:`project_2d`); ``head_ids`` (N ints, 0-based head
    index) -- the legend reads "head 1..H", H = ``n_heads`` or ``max(head_ids) + 1``.
    Colours: tab10 for H <= 10, tab20 beyond (cycled past 20, with varying markers).

    Size: ``figure_size_px("query_projection", dpi=dpi, n_heads=H)``: width
    ``min(8 + 1.1 (ceil(H / 20) - 1), 12.4)`` in, height 6.5 in.
    """
    dpi = _check_dpi(dpi)
    pts = _array(points_2d, "points_2d", ndim=2)
    if pts.shape[1] != 2:
        raise AnalysisError(f"points_2d: expected shape (N, 2), got {pts.shape}")
    try:
        heads = np.asarray(head_ids)
    except (TypeError, ValueError):
        raise AnalysisError("head_ids: expected a list of integer head indices") from None
    if heads.ndim != 1 or heads.shape[0] != pts.shape[0]:
        raise AnalysisError(f"head_ids: expected {pts.shape[0]} head indices (one per point), got shape "
                            f"{heads.shape}")
    if heads.dtype.kind not in "iu" or heads.min() < 0:
        raise AnalysisError(f"head_ids: expected non-negative integer (0-based) head indices, got dtype "
                            f"{heads.dtype} with minimum {heads.min()!r}")
    h = int(heads.max()) + 1 if n_heads is None else int(n_heads)
    if h < int(heads.max()) + 1:
        raise AnalysisError(f"n_heads={h}: head_ids contain index {int(heads.max())}")
    fig = _new_figure("query_projection", dpi, n_heads=h)
    ax = fig.add_subplot()
    cmap = colormaps["tab10" if h <= 10 else "tab20"]
    period = 10 if h <= 10 else 20
    size = float(_clip(12000.0 / max(pts.shape[0], 1), 10.0, 40.0))
    handles = []
    for k in range(h):
        sel = heads == k
        colour = cmap(k % period)
        marker = _MARKERS[(k // period + k) % len(_MARKERS)] if h > 10 else _MARKERS[k % len(_MARKERS)]
        if sel.any():
            ax.scatter(pts[sel, 0], pts[sel, 1], s=size, color=colour, marker=marker, alpha=0.75,
                       linewidths=0)
        handles.append(Line2D([], [], linestyle="", marker=marker, color=colour, markersize=7,
                              label=f"head {k + 1}"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncols=math.ceil(h / 20),
              frameon=False, fontsize=9, title="head", borderaxespad=0.0)
    ax.set_xlabel(f"{method_label} dimension 1")
    ax.set_ylabel(f"{method_label} dimension 2")
    ax.set_title(_title(title, f"Queries ({method_label}) coloured by head"))
    return _save(fig, path, dpi)


def _layer_panels(kind: str, tokens, layers, path, title, default_title: str, y_name: str,
                  value_label: str, dpi, cmap: str, binary_labels: tuple[str, str] | None) -> Path:
    dpi = _check_dpi(dpi)
    tokens = _tokens(tokens, "tokens")
    if not isinstance(layers, Mapping) or not layers:
        raise AnalysisError(f"{kind}: expected a non-empty mapping layer name -> T x n array")
    t = len(tokens)
    arrays = {}
    is_bool = True
    for name, value in layers.items():
        raw = np.asarray(value)
        is_bool = is_bool and raw.dtype == np.bool_
        arr = _array(raw, f"{kind}[{name!r}]", ndim=2, lo=0.0, hi=1.0)
        if arr.shape[0] != t:
            raise AnalysisError(f"{kind}[{name!r}]: expected shape (T={t}, n) with one row per token "
                                f"(len(tokens)={t}), got {arr.shape}")
        arrays[str(name)] = arr
    sizes = [a.shape[1] for a in arrays.values()]
    fig = _new_figure(kind, dpi, t=t, sizes=sizes)
    w_in, _ = figure_size_in(kind, t=t, sizes=sizes)
    axes = fig.subplots(len(arrays), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [0.4 + 0.28 * n for n in sizes]})[:, 0]
    im = None
    for ax, (name, arr) in zip(axes, arrays.items()):
        n = arr.shape[1]
        im = ax.imshow(arr.T, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        _set_ticks(ax, "y", [str(i + 1) for i in range(n)], 0.28 * n, fontsize=7)
        ax.set_ylabel(y_name, fontsize=9)
        ax.set_title(name, fontsize=10, loc="left")
    _set_ticks(axes[-1], "x", tokens, w_in - 2.6, rotation=90)
    axes[-1].set_xlabel("token")
    assert im is not None  # layers is never empty: checked on entry
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.95, aspect=max(10, 6 * len(axes)), pad=0.02)
    if binary_labels is not None and is_bool:
        cbar.set_ticks([0.0, 1.0], labels=list(binary_labels))
        cbar.set_label(f"{y_name} state")
    else:
        cbar.set_label(value_label)
    fig.suptitle(_title(title, default_title))
    return _save(fig, path, dpi)


def plot_competition(tokens, competition, path, title=None, *, dpi=100) -> Path:
    """TIM mechanism competition: one heatmap panel per layer (stacked, in mapping order).

    ``competition`` maps a layer name to a T x n_s array (row t: the distribution over the n_s
    mechanisms of token t; values must lie in [0, 1]).  Tokens on the shared x axis (labels on
    the bottom panel), mechanisms 1..n_s on y, colour range [0, 1] (viridis).

    Size: ``figure_size_px("competition", dpi=dpi, t=T, sizes=[n_s of each layer])``: width
    ``clip(3 + 0.22 T, 6, 20) + 1.2`` in, height ``min(1.8 + sum(0.7 + 0.28 n_s), 30)`` in.
    """
    return _layer_panels("competition", tokens, competition, path, title, "TIM mechanism competition",
                         "mechanism", "competition weight", dpi, SEQUENTIAL_CMAP, None)


def plot_rim_activation(tokens, activation, path, title=None, *, dpi=100) -> Path:
    """RIM activation: one panel per layer (stacked), tokens on x, RIMs 1..n on y.

    ``activation`` maps a layer name to a T x n array, bool (active or not; the colour bar then
    reads inactive/active) or the fraction of directions in which the RIM was active, in [0, 1].
    Colour map cividis, range [0, 1].

    Size: ``figure_size_px("rim_activation", dpi=dpi, t=T, sizes=[n of each layer])``, the same
    formula as :func:`plot_competition`.
    """
    return _layer_panels("rim_activation", tokens, activation, path, title, "RIM activation per token",
                         "RIM", "fraction of directions active", dpi, MASK_CMAP, ("inactive", "active"))


def plot_ablation(rows, path, title=None, *, dpi=100) -> Path:
    """BLEU against the number of DMA clusters n_c (cf. the paper's Table 7 ablation).

    ``rows``: dicts with ``"n_c"`` (positive int, distinct) and ``"bleu"``, optionally ``"lr"``
    and ``"hr"`` (redundancy, drawn dashed on a secondary y axis from the rows that have them).
    The x axis is log2 when the n_c values span a factor of 8 or more; ticks at the given n_c.

    Size: ``figure_size_px("ablation", dpi=dpi)``: 7.5 x 4.8 in.
    """
    dpi = _check_dpi(dpi)
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence) or not rows:
        raise AnalysisError("rows: expected a non-empty list of dicts with keys 'n_c' and 'bleu'")
    parsed = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "n_c" not in row or "bleu" not in row:
            raise AnalysisError(f"rows[{i}]: expected a dict with keys 'n_c' and 'bleu' "
                                f"(optionally 'lr', 'hr'), got {row!r}")
        n_c = row["n_c"]
        if isinstance(n_c, bool) or not isinstance(n_c, (int, np.integer)) or n_c < 1:
            raise AnalysisError(f"rows[{i}]['n_c']: expected a positive integer, got {n_c!r}")
        vals = {}
        for key in ("bleu", "lr", "hr"):
            if key in row and row[key] is not None:
                try:
                    v = float(row[key])
                except (TypeError, ValueError):
                    raise AnalysisError(f"rows[{i}][{key!r}]: expected a number, got {row[key]!r}") from None
                if not math.isfinite(v):
                    raise AnalysisError(f"rows[{i}][{key!r}]: expected a finite number, got {v}")
                vals[key] = v
        parsed.append((int(n_c), vals))
    ncs = [n for n, _ in parsed]
    if len(set(ncs)) != len(ncs):
        raise AnalysisError(f"rows: expected distinct n_c values, got {ncs}")
    parsed.sort(key=lambda r: r[0])
    x = np.array([n for n, _ in parsed], dtype=float)
    fig = _new_figure("ablation", dpi)
    ax = fig.add_subplot()
    bleu = np.array([v["bleu"] for _, v in parsed])
    handles = ax.plot(x, bleu, marker="o", color="#21918c", linewidth=2, label="BLEU")
    for xi, yi in zip(x, bleu):
        ax.annotate(f"{yi:.2f}", (xi, yi), textcoords="offset points", xytext=(0, 7), ha="center",
                    fontsize=8)
    ax.set_ylabel("BLEU")
    ax.set_xlabel("number of clusters $n_c$")
    spread = float(bleu.max() - bleu.min()) or max(abs(float(bleu.max())) * 0.05, 0.5)
    ax.set_ylim(float(bleu.min()) - 0.15 * spread, float(bleu.max()) + 0.25 * spread)
    if len(x) > 1 and x.max() / x.min() >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(int(v)) for v in x])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    red = [(key, label, colour, marker) for key, label, colour, marker in
           (("lr", "LR", "#440154", "s"), ("hr", "HR", "#b5a32a", "^"))
           if any(key in v for _, v in parsed)]
    if red:
        ax2 = ax.twinx()
        for key, label, colour, marker in red:
            pts = [(n, v[key]) for n, v in parsed if key in v]
            handles += ax2.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="--", marker=marker,
                                color=colour, label=label)
        ax2.set_ylabel("attention redundancy (lower is better)")
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)
    else:
        ax.legend(handles=handles, loc="best", fontsize=9)
    ax.set_title(_title(title, "Cluster-count ablation"))
    return _save(fig, path, dpi)
