"""The run page's step charts: a panel's figure from its series, and the live appends to it."""
from __future__ import annotations

from typing import Optional, Sequence

from gradwatch.dashboard import theme
from gradwatch.dashboard.figures.marks import _x_axis, step_marks
from gradwatch.dashboard.figures.panels import Panel
from gradwatch.dashboard.figures.points import (NAN_RUG_Y, _host_lookup, bucket_points, flag_steps, nonfinite_steps,
                                                smooth)


def series_figure(panel: Panel, series: dict, *, alerts: Sequence[dict] = (), smoothing: float = 0.0,
                  x_range: Optional[Sequence[float]] = None,
                  checkpoints: Sequence[dict] = (), rewinds: Sequence[dict] = ()) -> tuple[dict, dict]:
    """A run-page chart from ``{signal: {"bucket_size", "steps"}}``; returns (figure, live state).

    The live state carries the smoothing EMA so that :func:`series_append`
    can continue the smoothed line from where this figure stopped.
    """
    traces = []
    smooth_state = {"ema": 0.0, "n": 0}
    has_data = False
    for i, line in enumerate(panel.lines):
        s = series.get(line.signal) or {}
        xs, ys = bucket_points(s.get("steps", []), s.get("bucket_size", 1) or 1, line.scale)
        has_data = has_data or any(y is not None for y in ys)
        traces.append({"type": "scatter", "mode": "lines", "name": line.name, "x": xs, "y": ys,
                       "line": {"color": line.colour, "width": 1.3, **({"dash": line.dash} if line.dash else {})},
                       "connectgaps": False})
        if i == 0 and panel.smoothed:
            first = traces[0]
            ys_s, smooth_state = smooth(ys, smoothing)
            traces.append({"type": "scatter", "mode": "lines", "name": first["name"] + " (smoothed)",
                           "x": list(xs) if smoothing > 0 else [], "y": ys_s if smoothing > 0 else [],
                           "line": {"color": "#ffffff", "width": 1.8}, "opacity": 0.85,
                           "visible": True if smoothing > 0 else "legendonly", "hoverinfo": "skip"})
    for flag in panel.flags:
        buckets = (series.get(flag.signal) or {}).get("steps", [])
        host = series.get(flag.host) or {}
        scale = next((ln.scale for ln in panel.lines if ln.signal == flag.host), 1.0)
        look = _host_lookup(host.get("steps", []), scale)
        fx = [s for s in flag_steps(buckets) if s in look]
        traces.append({"type": "scatter", "mode": "markers", "name": flag.name, "x": fx, "y": [look[s] for s in fx],
                       "marker": {"symbol": flag.symbol, "size": 8, "color": flag.colour,
                                  "line": {"width": 1.5, "color": flag.colour}}})
    nan_x = sorted({s for ln in panel.lines if ln.signal != "clip_max_norm"
                    for s in nonfinite_steps((series.get(ln.signal) or {}).get("steps", []))})
    traces.append({"type": "scatter", "mode": "markers", "name": "NaN / Inf", "x": nan_x,
                   "y": [NAN_RUG_Y] * len(nan_x), "yaxis": "y2",
                   "marker": {"symbol": "x", "size": 10, "color": theme.NAN_COLOUR, "line": {"width": 1}},
                   "hovertemplate": "non-finite at step %{x}<extra></extra>"})
    layout = theme.base_layout(panel.title, log_y=panel.log_y, y_title=panel.y_title)
    if panel.include_zero:
        layout["yaxis"]["rangemode"] = "tozero"
    layout["xaxis"].update(_x_axis(x_range))
    layout["shapes"] = step_marks(alerts, checkpoints, rewinds)
    if not has_data:
        layout["annotations"] = [{"text": "no data for this run", "xref": "paper", "yref": "paper", "x": 0.5,
                                  "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
    return {"data": traces, "layout": layout}, {"smooth": smooth_state}


def series_append(panel: Panel, new: dict, *, smoothing: float = 0.0, state: Optional[dict] = None
                  ) -> tuple[dict[int, tuple[list, list]], dict]:
    """New raw steps for a panel as ``{trace index: (xs, ys)}`` to extend, plus the new live state.

    ``new`` is ``{signal: {"steps": [...]}}`` as returned by a ``since=`` query.
    """
    state = dict(state or {})
    out: dict[int, tuple[list, list]] = {}
    idx = 0
    for i, line in enumerate(panel.lines):
        xs, ys = bucket_points((new.get(line.signal) or {}).get("steps", []), 1, line.scale)
        if xs:
            out[idx] = (xs, ys)
        idx += 1
        if i == 0 and panel.smoothed:
            if xs and smoothing > 0:
                ys_s, state["smooth"] = smooth(ys, smoothing, state.get("smooth"))
                out[idx] = (xs, ys_s)
            idx += 1
    for flag in panel.flags:
        scale = next((ln.scale for ln in panel.lines if ln.signal == flag.host), 1.0)
        look = _host_lookup((new.get(flag.host) or {}).get("steps", []), scale)
        fx = [s for s in flag_steps((new.get(flag.signal) or {}).get("steps", [])) if s in look]
        if fx:
            out[idx] = (fx, [look[s] for s in fx])
        idx += 1
    nan_x = sorted({s for ln in panel.lines if ln.signal != "clip_max_norm"
                    for s in nonfinite_steps((new.get(ln.signal) or {}).get("steps", []))})
    if nan_x:
        out[idx] = (nan_x, [NAN_RUG_Y] * len(nan_x))
    return out, state


def last_step(series: dict) -> Optional[int]:
    """The last step present in any signal of a series result (the live cursor)."""
    steps = [s["steps"][-1]["step"] for s in series.values() if s and s.get("steps")]
    return max(steps) if steps else None
