"""The rank figure builders alone (pure data in, figure dicts out): which rank is odd, where each chart
reads, and how 64 ranks are drawn."""
from __future__ import annotations

import math
import random

import pytest

from gradwatch.dashboard import figures


def _matrix(rows: dict[int, list], steps=None) -> dict:
    steps = steps or list(range(len(next(iter(rows.values())))))
    return {"bucket_size": 1, "steps": steps, "ranks": list(rows), "min": list(rows.values()),
            "max": list(rows.values()), "last": list(rows.values()), "nonfinite": [[0] * len(steps) for _ in rows]}


def test_the_odd_rank_is_the_one_far_from_the_median_and_only_if_it_stands_out():
    assert figures.odd_rank(_matrix({0: [0.1] * 5, 1: [0.1] * 5, 2: [0.3] * 5, 3: [0.1] * 5})) == 2
    noisy = {r: [1.0 + 0.001 * r] * 5 for r in range(8)}
    assert figures.odd_rank(_matrix(noisy)) is None            # 0.7 % apart: nobody stands out
    assert figures.odd_rank(_matrix({0: [1.0], 1: [2.0]})) is None     # two ranks: no majority
    assert figures.odd_rank(None) is None


def test_a_firing_cross_rank_alert_names_the_rank():
    alerts = [{"id": 1, "rule": "A1", "status": "firing", "rank": 0, "last_step": 9},
              {"id": 2, "rule": "F5", "status": "resolved", "rank": 1, "last_step": 8},
              {"id": 3, "rule": "F1", "status": "firing", "rank": 3, "last_step": 7}]
    assert figures.alert_rank(alerts) == 3
    assert figures.alert_rank(alerts[:2]) is None


def test_sharded_runs_read_grad_norms_from_the_combined_row_unless_a_rank_is_picked():
    sources, rank, layers = figures.rank_sources(figures.ALL_RANKS, True)
    assert sources == {"grad_norm": -1, "clip_max_norm": -1, "clipped": -1, "ema_divergence": -1,
                       "grad_zero_fraction": -1, "grad_absmax": -1} and rank == 0 and layers == -1
    assert figures.layer_rank("grad_norm", layers, figures.ALL_RANKS) == -1
    assert figures.layer_rank("act_std", layers, figures.ALL_RANKS) == 0      # activations stay per rank
    assert figures.rank_sources(figures.ALL_RANKS, False) == ({}, 0, 0)
    assert figures.rank_sources("3", True) == ({}, 3, 3)


def test_sixty_four_ranks_are_grey_but_one_with_one_legend_entry_for_the_rest():
    rows = {r: [0.05 + 0.0001 * (r % 3)] * 400 for r in range(64)}
    rows[41] = [0.15] * 400
    fig = figures.rank_overlay_figure("Step time per rank (s)", _matrix(rows), highlight=41, why="furthest")
    # one trace, one legend entry for the 63 grey lines (plotly's cost is per trace); the highlighted one on top
    assert [t["name"] for t in fig["data"]] == ["other ranks", "rank 41", "NaN / Inf"]
    grey, top = fig["data"][0], fig["data"][1]
    assert grey["line"]["color"] == figures.OTHER_RANKS_COLOUR and top["line"]["width"] > grey["line"]["width"]
    # each other rank's line is there, apart from the next one (a gap), its points named by their rank
    lines: dict = {}
    for x, y, r in zip(grey["x"], grey["y"], grey["customdata"]):
        assert (x is None) == (y is None) == (r is None)
        if r is not None:
            lines.setdefault(r, []).append(y)
    assert sorted(lines) == [r for r in range(64) if r != 41]
    assert grey["customdata"].count(None) == 62 and grey["connectgaps"] is False
    assert all(y == pytest.approx(0.05 + 0.0001 * (r % 3), rel=1e-6) for r, ys in lines.items() for y in ys)
    assert set(top["y"]) == {0.15} and "rank %{customdata}" in grey["hovertemplate"]
    n_points = sum(len(ys) for ys in lines.values()) + len(top["x"])
    assert n_points <= figures.OVERLAY_POINTS    # fewer points per rank, not 64 × 400 × 2
    assert "rank 41 highlighted" in fig["layout"]["title"]["text"]
    heat = figures.rank_heatmap_figure("Step time per rank (s)", _matrix(rows), highlight=41)
    assert heat["data"][0]["y"] == list(range(64)) and heat["data"][0]["z"][41][0] == 0.15


def _reference_lines(m: dict, factor: int) -> dict:
    """Each rank's line drawn the way a series is (figures.bucket_points / nonfinite_steps over the rank's
    cells merged ``factor`` at a time), one cell at a time in plain Python."""
    def num(v):
        return None if v is None else float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}.get(v, v))
    out = {}
    bucket = m["bucket_size"] * factor
    for row, r in enumerate(m["ranks"]):
        buckets = []
        for g in range(0, len(m["steps"]), factor):
            idx = [j for j in range(g, min(g + factor, len(m["steps"])))
                   if m["last"][row][j] is not None or m["max"][row][j] is not None]
            if not idx:
                continue
            lo = [num(m["min"][row][j]) for j in idx if num(m["min"][row][j]) is not None
                  and not math.isnan(num(m["min"][row][j]))]
            hi = [num(m["max"][row][j]) for j in idx if num(m["max"][row][j]) is not None
                  and not math.isnan(num(m["max"][row][j]))]
            buckets.append({"step": m["steps"][g], "min": min(lo) if lo else None, "max": max(hi) if hi else None,
                            "last": m["last"][row][idx[-1]], "count": len(idx) * factor,
                            "nonfinite": sum(m["nonfinite"][row][j] for j in idx)})
        xs, ys = figures.bucket_points(buckets, bucket if bucket > 1 else 1)
        out[f"rank {r}"] = (xs, ys, figures.nonfinite_steps(buckets))
    return out


def test_rank_lines_are_drawn_as_series_are_nan_inf_and_gaps_included():
    rng = random.Random(3)
    pick = [None, math.nan, math.inf, -math.inf, "NaN", "Infinity", 0.0, 3, -2.5]
    for trial in range(60):
        n_ranks, width = rng.choice([3, 9, 64]), rng.choice([1, 5, 130])
        def cell():
            return rng.choice(pick) if rng.random() < 0.3 else rng.lognormvariate(0, 1)
        m = {"bucket_size": rng.choice([1, 16, 512]), "steps": [16 * j for j in range(width)],
             "ranks": list(range(n_ranks)), **{k: [[cell() for _ in range(width)] for _ in range(n_ranks)]
                                                  for k in ("min", "max", "last")},
             "nonfinite": [[rng.choice([0, 0, 1]) for _ in range(width)] for _ in range(n_ranks)]}
        highlight = rng.choice([None, 0, n_ranks - 1])
        fig = figures.rank_overlay_figure("t", m, highlight=highlight)
        factor = max(1, math.ceil(2 * width * n_ranks / figures.OVERLAY_POINTS))
        want = _reference_lines(m, factor)
        got = {}
        for t in fig["data"]:
            if t["name"] == "other ranks":
                for x, y, r in zip(t["x"], t["y"], t["customdata"]):
                    if r is not None:
                        got.setdefault(f"rank {r}", ([], [], []))[0].append(x)
                        got[f"rank {r}"][1].append(y)
            elif t["name"].startswith("rank "):
                got[t["name"]] = (t["x"], t["y"], [])
        nan = [t for t in fig["data"] if t["name"] == "NaN / Inf"][0]
        for name, (xs, ys, bad) in want.items():
            gx, gy, _ = got.get(name, ([], [], []))
            assert gx == xs, (trial, name)
            assert [None if y is None else pytest.approx(y, rel=1e-6) for y in ys] == gy, (trial, name)
            assert [x for x, text in zip(nan["x"], nan["text"]) if text == name] == bad, (trial, name)
