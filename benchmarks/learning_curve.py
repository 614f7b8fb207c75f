"""The validation curve of a fairseq-train run, and where it has flattened.

A comparison of methods means something only at a budget where the baseline has stopped
improving: at a few hundred updates every model is still dropping fast, and the ranking says
more about how quickly a model starts than where it ends. ``benchmarks/multi30k.py --curve-updates
N`` trains each family's baseline for N updates, validating after every epoch; this module reads
those validations back and finds the first budget after which the best validation nll improves
by less than GAIN (fairseq's nll, base 2) over the next WINDOW updates.
"""

import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

Point = Tuple[int, float]

_VALID = re.compile(r"\| valid \| .*valid on '(\w+)' subset")


def validation_curve(train_log: Path, subset: str = "valid") -> List[Point]:
    """(updates, nll) of every validation of SUBSET in fairseq-train's log, in order; a run that
    was continued after an interruption repeats no update count, but the last record wins."""
    points: Dict[int, float] = {}
    text = Path(train_log).read_text(encoding="utf-8") if Path(train_log).exists() else ""
    for line in text.splitlines():
        match = _VALID.search(line)
        if not match or match.group(1) != subset:
            continue
        fields = dict(re.findall(r"\| (\w+) ([-\d.e+]+)", line))
        if "nll_loss" in fields and "num_updates" in fields:
            points[int(float(fields["num_updates"]))] = float(fields["nll_loss"])
    return sorted(points.items())


def best_so_far(points: Sequence[Point]) -> List[Point]:
    """The best (lowest) nll reached up to each point: what early stopping would keep."""
    out, best = [], float("inf")
    for updates, nll in points:
        best = min(best, nll)
        out.append((updates, best))
    return out


def flat_point(points: Sequence[Point], window: int = 1000, gain: float = 0.02) -> Optional[int]:
    """The first update count U of the curve whose best nll is within GAIN of the best nll
    reached by U + WINDOW updates (None when no point has a full window after it: the run
    was too short to tell)."""
    best = best_so_far(points)
    for updates, value in best:
        later = [v for u, v in best if u <= updates + window]
        if best[-1][0] < updates + window:
            return None
        if value - min(later) < gain:
            return updates
    return None


def curve_markdown(curves: Dict[str, Sequence[Point]], every: int = 500) -> List[str]:
    """A table of each curve's validation nll near every EVERY updates (the validation closest
    to each multiple), one column per model."""
    names = list(curves)
    top = max((p[-1][0] for p in curves.values() if p), default=0)
    lines = ["| updates | " + " | ".join(f"{n} valid nll" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for target in range(every, top + every, every):
        cells = []
        for name in names:
            near = [p for p in curves[name] if abs(p[0] - target) <= every // 2]
            cells.append(f"{min(near, key=lambda p: abs(p[0] - target))[1]:.3f}" if near else "")
        if any(cells):
            lines.append(f"| {target:,} | " + " | ".join(cells) + " |")
    return lines


def plot_curves(curves: Dict[str, Sequence[Point]], flat_at: Dict[str, int], path: Path) -> Path:
    """A PNG of each curve (validation nll against updates) with the point where it flattened
    (``flat_point``) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fairseq_modattn.atomic_files import atomic_write

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        if not points:
            continue
        line, = ax.plot([u for u, _ in points], [v for _, v in points], marker=".", label=name)
        if name in flat_at:
            ax.axvline(flat_at[name], color=line.get_color(), linestyle="--", linewidth=1,
                       label=f"{name} flattened ({flat_at[name]:,} updates)")
    ax.set_xlabel("updates")
    ax.set_ylabel("validation nll (base 2, per target token)")
    ax.set_title("Multi30k de-en: validation curves of the baselines")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return Path(path)
