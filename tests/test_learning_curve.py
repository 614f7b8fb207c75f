"""benchmarks/learning_curve.py: reading validations out of a fairseq-train log and the flatness rule."""

import importlib.util

import pytest

from conftest import REPO


def _load():
    spec = importlib.util.spec_from_file_location("learning_curve", REPO / "benchmarks" / "learning_curve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


curve = _load()


def valid_line(updates, nll, subset="valid"):
    return (f"2026-11-25 17:39:26 | INFO | valid | epoch 008 | valid on '{subset}' subset | loss 4.631 | "
            f"nll_loss {nll} | ppl 8.24 | wps 3988.7 | num_updates {updates} | best_loss 4.631")


def test_validation_curve_reads_each_validation_once(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join([
        "2026-11-25 | INFO | train_inner | epoch 001:  25 / 123 loss=9.1, nll_loss=8.9, num_updates=25",
        valid_line(123, 6.856), valid_line(123, 6.5, subset="test"), valid_line(246, 4.877),
        "some traceback line | valid | without the record",
        valid_line(246, 4.870),  # a continued run validated the same update again: the last wins
        valid_line(369, 3.984)]) + "\n")
    assert curve.validation_curve(log) == [(123, 6.856), (246, 4.870), (369, 3.984)]
    assert curve.validation_curve(log, subset="test") == [(123, 6.5)]
    assert curve.validation_curve(tmp_path / "missing.log") == []


def test_flat_point_is_the_first_budget_whose_next_window_gains_less_than_the_threshold():
    points = [(500, 4.0), (1000, 3.0), (1500, 2.5), (2000, 2.3), (2500, 2.29), (3000, 2.295), (3500, 2.28),
              (4000, 2.275)]
    # best so far: 4.0 3.0 2.5 2.3 2.29 2.29 2.28 2.275; 2000 -> best by 3000 is 2.29: gain 0.01
    assert curve.flat_point(points, window=1000, gain=0.02) == 2000
    # every full window (2000, 2500, 3000) gains at least 0.01
    assert curve.flat_point(points, window=1000, gain=0.005) is None
    slower = points[:6] + [(3500, 2.289), (4000, 2.288)]  # from 2500 on, 0.001 in the next window
    assert curve.flat_point(slower, window=1000, gain=0.005) == 2500
    assert curve.flat_point(points[:3], window=1000, gain=10) == 500
    assert curve.flat_point(points[:2], window=1000, gain=10) is None  # no full window after any point
    assert curve.best_so_far([(1, 3.0), (2, 3.5), (3, 2.0)]) == [(1, 3.0), (2, 3.0), (3, 2.0)]


def test_curve_table_and_plot(tmp_path):
    curves = {"transformer": [(123, 6.9), (492, 3.6), (984, 2.97), (1476, 2.8)], "lstm": [(123, 7.7), (984, 4.1)]}
    lines = curve.curve_markdown(curves, every=500)
    assert lines[0] == "| updates | transformer valid nll | lstm valid nll |"
    assert lines[2:] == ["| 500 | 3.600 |  |", "| 1,000 | 2.970 | 4.100 |", "| 1,500 | 2.800 |  |"]
    png = curve.plot_curves(curves, {"transformer": 984}, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("points", [[], [(100, 5.0)]])
def test_flat_point_of_short_curves(points):
    assert curve.flat_point(points) is None
