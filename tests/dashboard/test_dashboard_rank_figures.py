"""The rank figure builders alone (pure data in, figure dicts out): which rank is odd, where each chart
reads, and how 64 ranks are drawn."""
from __future__ import annotations

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
                       "grad_zero_fraction": -1} and rank == 0 and layers == -1
    assert figures.layer_rank("grad_norm", layers, figures.ALL_RANKS) == -1
    assert figures.layer_rank("act_std", layers, figures.ALL_RANKS) == 0      # activations stay per rank
    assert figures.rank_sources(figures.ALL_RANKS, False) == ({}, 0, 0)
    assert figures.rank_sources("3", True) == ({}, 3, 3)


def test_sixty_four_ranks_are_grey_but_one_with_one_legend_entry_for_the_rest():
    rows = {r: [0.05 + 0.0001 * (r % 3)] * 400 for r in range(64)}
    rows[41] = [0.15] * 400
    fig = figures.rank_overlay_figure("Step time per rank (s)", _matrix(rows), highlight=41, why="furthest")
    lines = [t for t in fig["data"] if t["name"].startswith("rank ")]
    assert len(lines) == 64 and lines[-1]["name"] == "rank 41"          # drawn last: on top
    assert [t["name"] for t in fig["data"] if t.get("showlegend", True)] == ["other ranks", "rank 41", "NaN / Inf"]
    assert {t["line"]["color"] for t in lines[:-1]} == {figures.OTHER_RANKS_COLOUR}
    assert sum(len(t["x"]) for t in lines) <= figures.OVERLAY_POINTS    # fewer points per rank, not 64 × 400 × 2
    assert "rank 41 highlighted" in fig["layout"]["title"]["text"]
    heat = figures.rank_heatmap_figure("Step time per rank (s)", _matrix(rows), highlight=41)
    assert heat["data"][0]["y"] == list(range(64)) and heat["data"][0]["z"][41][0] == 0.15
