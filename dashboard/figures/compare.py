"""The compare page: one signal of several runs overlaid."""
from __future__ import annotations

from typing import Sequence

from gradwatch.dashboard import theme
from gradwatch.dashboard.figures.panels import ZERO_BASED
from gradwatch.dashboard.figures.points import NAN_RUG_Y, bucket_points, nonfinite_steps, plot_text


def compare_figure(signal: str, title: str, runs: Sequence[tuple[str, dict]], *, log_y: bool = False) -> dict:
    """One signal of several runs overlaid: ``runs`` is ``[(label, {"bucket_size", "steps"})]``."""
    traces = []
    nan_x, nan_text, nan_colour = [], [], []
    for i, (label, s) in enumerate(runs):
        colour = theme.PALETTE[i % len(theme.PALETTE)]
        xs, ys = bucket_points((s or {}).get("steps", []), (s or {}).get("bucket_size", 1) or 1)
        label = plot_text(label)
        traces.append({"type": "scatter", "mode": "lines", "name": label, "x": xs, "y": ys,
                       "line": {"color": colour, "width": 1.3}})
        for step in nonfinite_steps((s or {}).get("steps", [])):
            nan_x.append(step)
            nan_text.append(label)
            nan_colour.append(colour)
    traces.append({"type": "scatter", "mode": "markers", "name": "NaN / Inf", "x": nan_x,
                   "y": [NAN_RUG_Y] * len(nan_x), "yaxis": "y2", "text": nan_text,
                   "marker": {"symbol": "x", "size": 10, "color": nan_colour or theme.NAN_COLOUR},
                   "hovertemplate": "%{text}: non-finite at step %{x}<extra></extra>"})
    layout = theme.base_layout(title, log_y=log_y)
    if signal in ZERO_BASED:
        layout["yaxis"]["rangemode"] = "tozero"
    return {"data": traces, "layout": layout}
