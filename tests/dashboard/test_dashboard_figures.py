"""The pure figure builders: buckets in, Plotly figure dicts out (no browser, no server)."""
from __future__ import annotations

import math

from gradwatch.dashboard import figures
from gradwatch.dashboard.figures import PANELS_BY_KEY


def _b(step, lo, hi=None, last=None, count=1, nonfinite=0):
    hi = lo if hi is None else hi
    return {"step": step, "min": lo, "max": hi, "last": hi if last is None else last, "count": count,
            "nonfinite": nonfinite}


def test_non_finite_values_arrive_as_strings_or_floats():
    for nan in ("NaN", math.nan):
        assert figures.finite(nan) is None and figures.is_nonfinite(nan)
    for inf in ("Infinity", "-Infinity", math.inf, -math.inf):
        assert figures.finite(inf) is None and figures.is_nonfinite(inf)
    assert figures.finite(2) == 2.0 and not figures.is_nonfinite(None)
    assert figures.format_number("NaN") == "NaN" and figures.format_number(math.inf) == "Inf"
    assert figures.format_number(None) == "—"


def test_a_bucket_is_drawn_as_its_max_then_min_so_spikes_survive():
    buckets = [_b(0, 1.0, 2.0, count=100), _b(100, 0.9, 57.0, count=100), _b(200, 0.8, count=1)]
    xs, ys = figures.bucket_points(buckets, bucket_size=100)
    assert xs == [0, 50, 100, 150, 200]
    assert ys == [2.0, 1.0, 57.0, 0.9, 0.8]


def test_unmeasured_steps_are_skipped_and_nan_steps_are_gaps_with_markers():
    buckets = [_b(0, 1.0), {"step": 1, "min": None, "max": None, "last": None, "count": 0, "nonfinite": 0},
               _b(2, "NaN", count=1, nonfinite=1), _b(3, 2.0)]
    xs, ys = figures.bucket_points(buckets)
    assert xs == [0, 2, 3] and ys == [1.0, None, 2.0]
    assert figures.nonfinite_steps(buckets) == [2]


def test_loss_scale_chart_is_log_with_overflow_markers_on_the_curve():
    series = {"loss_scale": {"bucket_size": 1, "steps": [_b(0, 65536.0), _b(1, 65536.0), _b(2, 32768.0)]},
              "overflow": {"bucket_size": 1, "steps": [_b(0, 0), _b(1, 1), _b(2, 0)]}}
    fig, _ = figures.series_figure(PANELS_BY_KEY["loss_scale"], series,
                                   alerts=[{"id": 1, "rule": "A5", "severity": "warning", "first_step": 1}])
    assert fig["layout"]["yaxis"]["type"] == "log"
    names = [t["name"] for t in fig["data"]]
    flags = fig["data"][names.index("overflow (skipped step)")]
    assert flags["x"] == [1] and flags["y"] == [65536.0]
    assert [s["x0"] for s in fig["layout"]["shapes"]] == [1]


def test_live_append_continues_the_figure_trace_by_trace():
    panel = PANELS_BY_KEY["loss"]
    first = {"loss": {"bucket_size": 1, "steps": [_b(i, 3.0 - i * 0.1) for i in range(5)]}}
    fig, state = figures.series_figure(panel, first, smoothing=0.6)
    new = {"loss": {"bucket_size": 1, "steps": [_b(5, 2.5), _b(6, "NaN", nonfinite=1)]}}
    ext, state2 = figures.series_append(panel, new, smoothing=0.6, state=state)
    names = panel.trace_names()
    assert ext[names.index("loss")] == ([5, 6], [2.5, None])
    assert ext[names.index("NaN / Inf")][0] == [6]
    # The smoothed line continues exactly as if the whole series had been smoothed at once.
    whole, _ = figures.smooth([3.0, 2.9, 2.8, 2.7, 2.6, 2.5], 0.6)
    assert math.isclose(ext[names.index("loss (smoothed)")][1][0], whole[-1])


def test_heatmap_rows_are_layers_in_log10_with_nan_cells_marked():
    matrix = {"steps": [0, 10], "names": ["a.weight", "b.weight"], "values": [[1.0, 10.0], [100.0, math.nan]]}
    fig = figures.heatmap_figure("grad norm", matrix, highlight="b.weight")
    heat, bad = fig["data"]
    assert heat["y"] == ["a.weight", "b.weight"] and heat["x"] == [0, 10]
    assert heat["z"] == [[0.0, 1.0], [2.0, None]]
    assert bad["x"] == [10] and bad["y"] == ["b.weight"]
    assert any(s["type"] == "rect" for s in fig["layout"]["shapes"])


def test_compare_overlays_one_trace_per_run():
    runs = [("a", {"bucket_size": 1, "steps": [_b(0, 1.0), _b(1, 0.5)]}),
            ("b", {"bucket_size": 1, "steps": [_b(0, 2.0), _b(1, "Infinity", nonfinite=1)]})]
    fig = figures.compare_figure("loss", "Loss", runs)
    assert [t["name"] for t in fig["data"]] == ["a", "b", "NaN / Inf"]
    assert fig["data"][2]["x"] == [1] and fig["data"][2]["text"] == ["b"]
