"""A run's ranks side by side: which rank each chart reads (a sharded run's combined row), the rank that stands
out, the all-ranks overlays and rank × step heatmaps."""
from __future__ import annotations

import math
from typing import Any, Collection, Optional, Sequence

import numpy as np

from gradwatch.agent import signals as table
from gradwatch.dashboard import theme
from gradwatch.dashboard.figures.heatmaps import _float_grid
from gradwatch.dashboard.figures.marks import _x_axis, alert_shapes, rewind_shapes
from gradwatch.dashboard.figures.points import NAN_RUG_Y


# what a sharded run's combined row (rank -1) holds, read there by default instead of on rank 0 (whose
# grad norm is "not measured" under FSDP by design: docs/integrations.md, "Distributed training")
COMBINED_SIGNALS: frozenset[str] = frozenset(s.name for s in table.STEP_SIGNALS if s.combined)
COMBINED_STATS: frozenset[str] = frozenset(s.name for s in table.LAYER_STATS if s.combined)
# the all-ranks overlays and rank × step heatmaps: (signal, title, log y), from the table's per_rank titles
RANK_CHARTS: tuple[tuple[str, str, bool], ...] = tuple(
    (s.name, s.per_rank, bool(s.panel and table.panel(s.panel).log_y)) for s in table.STEP_SIGNALS if s.per_rank)
# a sharded run's ranks measure only their pieces (agent/signals.py, "Sharded runs": the per-rank form the
# table declares, grad_norm_local): its per-rank chart of a combined signal draws what each rank measured,
# the combined value being one number for all ranks
SHARDED_PER_RANK: dict[str, str] = {s.name: table.PER_RANK[s.name] for s in table.STEP_SIGNALS
                                    if s.per_rank and s.combined and s.name in table.PER_RANK}
ALL_RANKS = "all"
MANY_RANKS = 8             # above this, the overlay draws one rank in colour and the others thin and grey
# line points per overlay chart, over all ranks: 64 ranks get ~125 points each (an SVG chart of 64 lines
# stays responsive and its figure ~0.3 MB instead of 1.5 MB); 8 ranks or fewer keep every column
OVERLAY_POINTS = 8_000
HIGHLIGHT_COLOUR = theme.FLAG_COLOUR
OTHER_RANKS_COLOUR = "#6e7681"
_RANK_PALETTE = [c for c in theme.PALETTE if c != HIGHLIGHT_COLOUR]   # no rank drawn like the highlighted one


def rank_sources(picked: Any, combined: bool) -> tuple[dict[str, int], int, int]:
    """Where the run page reads: (signal → rank for the combined signals, rank of every other signal, rank
    of the per-layer heatmaps). All ranks picked: rank 0, and a sharded run's combined row (-1) for the
    grad norm and per-layer norms; one rank picked: that rank for everything."""
    if picked is None or picked == ALL_RANKS:
        if combined:
            return {sig: -1 for sig in COMBINED_SIGNALS}, 0, -1
        return {}, 0, 0
    rank = int(picked)
    return {}, rank, rank


def layer_rank(stat: str, sources_layer_rank: int, picked: Any) -> int:
    """The rank a per-layer statistic is read from: the combined row only holds the combined statistics."""
    if sources_layer_rank == -1 and (picked is None or picked == ALL_RANKS) and stat not in COMBINED_STATS:
        return 0
    return sources_layer_rank


def _median(vals: Sequence[float]) -> float:
    v = sorted(vals)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def odd_rank(matrix: Optional[dict]) -> Optional[int]:
    """The rank whose typical value (median over the shown steps) is furthest from the median of the ranks,
    if it stands out: more than 6 median absolute deviations (~4 σ: among 64 healthy ranks the furthest
    one's noise alone is typically 4–5 deviations) and 5 % away. None when no rank does."""
    m = matrix or {}
    ranks = list(m.get("ranks") or [])
    rows = _rows(m, "last", len(ranks))
    if not rows:
        return None
    vals, _ = _float_grid(rows, max(len(r) for r in rows))
    vals = np.where(np.isfinite(vals), vals, np.nan)
    has = ~np.all(np.isnan(vals), axis=1)
    if int(has.sum()) < 3:
        return None
    with np.errstate(all="ignore"):
        medians = np.nanmedian(vals[has], axis=1).tolist()
    typical = dict(zip([r for r, h in zip(ranks, has.tolist()) if h], medians))
    centre = _median(list(typical.values()))
    dev = {r: abs(v - centre) for r, v in typical.items()}
    mad = _median(list(dev.values()))
    rank, far = max(dev.items(), key=lambda kv: (kv[1], -kv[0]))
    return rank if far > max(6 * mad, 0.05 * abs(centre)) else None


def alert_rank(alerts: Sequence[dict], cross_rank: Optional[Collection[str]] = None) -> Optional[int]:
    """The rank named by the latest firing cross-rank alert, if any. ``cross_rank``: the ids of the rules
    whose alert names a rank (``gateway.cross_rank_rule_ids()``, the F family, read when not given)."""
    if cross_rank is None:
        from gradwatch.dashboard import gateway    # the rule catalogue, read through the dashboard's one door
        cross_rank = gateway.cross_rank_rule_ids()
    named = [a for a in alerts if a.get("rule") in cross_rank and a.get("status") == "firing"
             and (a.get("rank") or 0) >= 0]
    if not named:
        return None
    return max(named, key=lambda a: (a.get("last_step") or 0, a.get("id") or 0)).get("rank")


def _short(v: Optional[float]) -> Optional[float]:
    """7 significant digits (float32's): a 64-rank figure's JSON is half as long as with 17."""
    return None if v is None else float(f"{v:.7g}")


def _rows(matrix: dict, key: str, n: int) -> list:
    """``matrix[key]``'s first ``n`` rows, empty ones (all missing) where it has fewer."""
    rows = list((matrix.get(key) or [])[:n])
    return rows + [[]] * (n - len(rows))


def _rank_lines(matrix: dict, factor: int) -> list[tuple[list, list, list]]:
    """Each rank's line of a rank matrix, ``factor`` columns merged into one bucket (many ranks: fewer
    points): ``(xs, ys, non-finite steps)`` per row, drawn as :func:`bucket_points` draws a series' buckets
    (a merged bucket whose min and max differ is two points, its max then its min) and marked as
    :func:`nonfinite_steps` marks them. In numpy over every rank at once: per cell in Python, a 64-rank
    run's four overlays cost ~130 ms of the rank section's request."""
    steps = list(matrix.get("steps") or [])
    n_rows, width = len(matrix.get("ranks") or []), len(steps)
    if not steps or not n_rows:
        return [([], [], []) for _ in range(n_rows)]
    groups = math.ceil(width / factor)
    pad = groups * factor - width

    def grid(key):
        vals, missing = _float_grid(_rows(matrix, key, n_rows), width)
        if pad:
            vals = np.pad(vals, ((0, 0), (0, pad)), constant_values=np.nan)
            missing = np.pad(missing, ((0, 0), (0, pad)), constant_values=True)
        return vals.reshape(n_rows, groups, factor), missing.reshape(n_rows, groups, factor)

    mins, no_min = grid("min")
    maxs, no_max = grid("max")
    lasts, no_last = grid("last")
    nfs, no_nf = grid("nonfinite")
    present = ~no_last | ~no_max                  # a column the rank measured something in
    valid = present.any(axis=2)
    # min / max over the present columns' non-NaN values (±inf kept)
    lo_ok_cell = present & ~no_min & ~np.isnan(mins)
    hi_ok_cell = present & ~no_max & ~np.isnan(maxs)
    has_lo, has_hi = lo_ok_cell.any(axis=2), hi_ok_cell.any(axis=2)
    lo = np.where(lo_ok_cell, mins, np.inf).min(axis=2)
    hi = np.where(hi_ok_cell, maxs, -np.inf).max(axis=2)
    # last: the value of the bucket's last present column, whatever it is
    at = factor - 1 - np.argmax(present[:, :, ::-1], axis=2)
    last = np.take_along_axis(lasts, at[:, :, None], axis=2)[:, :, 0]
    last_missing = np.take_along_axis(no_last, at[:, :, None], axis=2)[:, :, 0]
    count = present.sum(axis=2) * factor
    nonfinite = np.where(present & ~no_nf, nfs, 0).sum(axis=2)
    bucket = (matrix.get("bucket_size") or 1) * factor
    bucket = bucket if bucket > 1 else 1
    with np.errstate(invalid="ignore"):
        lo_f = has_lo & np.isfinite(lo)
        hi_f = has_hi & np.isfinite(hi)
        last_f = ~last_missing & np.isfinite(last)
        single = (bucket <= 1) | (count <= 1) | ~lo_f | ~hi_f | (lo == hi)
    y0 = np.where(single, np.where(last_f, last, np.where(hi_f, hi, np.where(lo_f, lo, np.nan))), hi)
    marked = valid & ((nonfinite > 0) | (~last_missing & ~np.isfinite(last)) | (has_lo & ~np.isfinite(lo))
                      | (has_hi & ~np.isfinite(hi)))
    first = [steps[g * factor] for g in range(groups)]
    mid = [s + (bucket // 2 if bucket % 2 == 0 else bucket / 2) for s in first]
    out = []
    for row in range(n_rows):
        xs, ys = [], []
        y0r, lor, singler = y0[row].tolist(), lo[row].tolist(), single[row].tolist()
        for g in np.flatnonzero(valid[row]).tolist():
            xs.append(first[g])
            ys.append(_short(None if y0r[g] != y0r[g] else y0r[g]))
            if not singler[g]:
                xs.append(mid[g])
                ys.append(_short(lor[g]))
        out.append((xs, ys, [first[g] for g in np.flatnonzero(marked[row]).tolist()]))
    return out


def rank_overlay_figure(title: str, matrix: Optional[dict], *, highlight: Optional[int] = None, why: str = "",
                        log_y: bool = False, alerts: Sequence[dict] = (),
                        x_range: Optional[Sequence[float]] = None, rewinds: Sequence[dict] = ()) -> dict:
    """Every rank's line on one chart; ``highlight`` drawn thick, on top. Up to ``MANY_RANKS`` ranks, one
    coloured trace and legend entry per rank; above, the others are thin grey lines, all in one trace
    ("other ranks", the lines apart at gaps, each point's rank in its ``customdata`` for the hover): plotly's cost is per trace,
    and 64 traces took ~35 ms a chart to draw against ~13 for one (headless Chromium, the 64-rank run)."""
    m = matrix or {}
    ranks = list(m.get("ranks") or [])
    steps = list(m.get("steps") or [])
    many = len(ranks) > MANY_RANKS
    factor = max(1, math.ceil(2 * len(steps) * max(1, len(ranks)) / OVERLAY_POINTS))
    lines = _rank_lines(m, factor)
    traces, top = [], None
    nan_x, nan_text = [], []
    has_data = any(y is not None for _, ys, _ in lines for y in ys)
    grey_x, grey_y, grey_rank = [], [], []
    for row, (r, (xs, ys, bad)) in enumerate(zip(ranks, lines)):
        for st in bad:
            nan_x.append(st)
            nan_text.append(f"rank {r}")
        if many and r != highlight:
            if grey_x:
                grey_x.append(None)       # a gap: the next rank's line starts afresh
                grey_y.append(None)
                grey_rank.append(None)
            grey_x += xs
            grey_y += ys
            grey_rank += [r] * len(xs)
            continue
        if r == highlight:
            line = {"color": HIGHLIGHT_COLOUR, "width": 2.4}
        else:
            line = {"color": _RANK_PALETTE[row % len(_RANK_PALETTE)], "width": 1.1}
        t = {"type": "scatter", "mode": "lines", "name": f"rank {r}", "x": xs, "y": ys, "line": line,
             "connectgaps": False, "legendgroup": f"rank {r}",
             "hovertemplate": f"rank {r}: %{{y:.4g}} at step %{{x}}<extra></extra>"}
        if r == highlight:
            top = t
        else:
            traces.append(t)
    if many:
        traces.append({"type": "scatter", "mode": "lines", "name": "other ranks", "x": grey_x, "y": grey_y,
                       "customdata": grey_rank, "line": {"color": OTHER_RANKS_COLOUR, "width": 0.6},
                       "opacity": 0.55, "connectgaps": False, "legendgroup": "others",
                       "hovertemplate": "rank %{customdata}: %{y:.4g} at step %{x}<extra></extra>"})
    if top is not None:
        traces.append(top)   # drawn last: on top of the others
    traces.append({"type": "scatter", "mode": "markers", "name": "NaN / Inf", "x": nan_x,
                   "y": [NAN_RUG_Y] * len(nan_x), "yaxis": "y2", "text": nan_text,
                   "marker": {"symbol": "x", "size": 9, "color": theme.NAN_COLOUR},
                   "hovertemplate": "%{text}: non-finite at step %{x}<extra></extra>"})
    shown = title if highlight is None else f"{title} · rank {highlight} highlighted{f' ({why})' if why else ''}"
    layout = theme.base_layout(shown, log_y=log_y)
    layout["xaxis"].update(_x_axis(x_range))
    layout["shapes"] = alert_shapes(alerts) + rewind_shapes(rewinds)
    layout["hovermode"] = "closest"   # "x unified" would list every one of 64 ranks
    if not has_data:
        layout["annotations"] = [{"text": "no data for this run", "xref": "paper", "yref": "paper", "x": 0.5,
                                  "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
    return {"data": traces, "layout": layout}


def rank_heatmap_figure(title: str, matrix: Optional[dict], *, log: bool = False, highlight: Optional[int] = None,
                        x_range: Optional[Sequence[float]] = None, rewinds: Sequence[dict] = ()) -> dict:
    """Rank × step: rank on y (rank 0 on top), a bucket's max as the colour (log10 for log signals), NaN / Inf
    cells a red ✕."""
    m = matrix or {}
    ranks = list(m.get("ranks") or [])
    steps = list(m.get("steps") or [])
    layout = theme.base_layout(f"{title} (log10)" if log else title, height=theme.HEATMAP_HEIGHT)
    layout["xaxis"].update(_x_axis(x_range))
    layout["yaxis"].update({"type": "linear", "autorange": "reversed", "title": {"text": "rank"}})
    if len(ranks) <= 16:
        layout["yaxis"]["dtick"] = 1
    layout["showlegend"] = False
    layout["shapes"] = rewind_shapes(rewinds)
    if not steps or not ranks:
        layout["annotations"] = [{"text": "no data for this run", "xref": "paper", "yref": "paper", "x": 0.5,
                                  "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
        return {"data": [{"type": "heatmap", "x": [], "y": [], "z": [], "showscale": False, "name": title}],
                "layout": layout}
    vals, missing = _float_grid(_rows(m, "max", len(ranks)), len(steps))
    nfs, no_nf = _float_grid(_rows(m, "nonfinite", len(ranks)), len(steps))
    with np.errstate(divide="ignore", invalid="ignore"):
        ok = np.isfinite(vals) & ~missing & (vals > 0 if log else True)
        cells = np.where(ok, np.log10(np.where(ok, vals, 1.0)) if log else vals, np.nan)
    z = [[_short(None if x != x else x) for x in row] for row in cells.tolist()]
    bad = np.nonzero((~no_nf & (nfs > 0)) | (~missing & ~np.isfinite(vals)))
    bad_x = [steps[j] for j in bad[1].tolist()]
    bad_y = [ranks[i] for i in bad[0].tolist()]
    traces = [{"type": "heatmap", "x": steps, "y": ranks, "z": z, "colorscale": "Viridis", "name": title,
               "colorbar": {"thickness": 10, "len": 0.9, "ticklabeloverflow": "allow"}, "hoverongaps": False,
               "hovertemplate": "step %{x}<br>rank %{y}<br>%{z:.4g}<extra></extra>"},
              {"type": "scatter", "mode": "markers", "name": "NaN / Inf", "x": bad_x, "y": bad_y,
               "marker": {"symbol": "x", "size": 7, "color": theme.NAN_COLOUR},
               "hovertemplate": "non-finite: rank %{y} at step %{x}<extra></extra>"}]
    if highlight in ranks:
        layout["shapes"].append({"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
                                 "y0": highlight - 0.5, "y1": highlight + 0.5,
                                 "line": {"color": HIGHLIGHT_COLOUR, "width": 1.5}})
    return {"data": traces, "layout": layout}
