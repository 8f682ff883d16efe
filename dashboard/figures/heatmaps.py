"""Per-layer heatmaps (layer × step) and the update-ratio chart."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from gradwatch.dashboard import theme
from gradwatch.dashboard.figures.marks import _x_axis, alert_shapes, rewind_shapes
from gradwatch.dashboard.figures.points import finite, plot_text, to_float


HEATMAP_MAX_LABEL_PX = 320     # a longer layer name widens the margin by automargin (one more draw)
ROW_PX = 12                    # the height a labelled row needs (9 px labels): every drawn row is labelled


def _float_grid(rows: Sequence[Sequence[Any]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """A matrix's cells as a (rows, width) float64 array, and the mask of the missing ones (``None``, or past
    a short row's end; NaN in the array). The wire encodings ("NaN", "Infinity"), ints and bools decode as
    :func:`to_float` does them; a row of plain floats and ``None`` (the in-process read) is taken as it is."""
    def floats(row):
        row = list(row)[:width] + [None] * (width - len(row))
        if all(v is None or type(v) is float or type(v) is int for v in row):
            return row
        return [to_float(v) for v in row]

    cells = [floats(row) for row in rows]
    if not cells:
        return np.zeros((0, width)), np.zeros((0, width), dtype=bool)
    missing = np.array([[v is None for v in row] for row in cells], dtype=bool)
    vals = np.array(cells, dtype=np.float64)      # None -> NaN
    return vals, missing


def _log10_cells(rows: Sequence[Sequence[Any]], width: int) -> tuple[list[list[Optional[float]]], tuple]:
    """A matrix's cells as heatmap colours: log10 of the finite positive ones, None for the rest; and the
    (row, column) indices of the non-finite ones, row by row. In numpy: a run page draws five 48 × 300
    heatmaps, and per cell the Python path cost ~80 ms of the heatmaps' request."""
    vals, missing = _float_grid(rows, width)
    finite_ = np.isfinite(vals) & ~missing
    positive = finite_ & (vals > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(positive, np.log10(np.where(positive, vals, 1.0)), np.nan)
    z = [[None if x != x else x for x in row] for row in logs.tolist()]
    return z, np.nonzero(~finite_ & ~missing)


def _with_data(matrix: Optional[dict]) -> dict:
    """The matrix without the rows that hold no value at all (a layer never sampled in this range: an
    empty band with a label nobody can read a number from; issue 42)."""
    steps = list((matrix or {}).get("steps") or [])
    names = list((matrix or {}).get("names") or [])
    rows = list((matrix or {}).get("values") or [])
    if not steps or not rows:
        return dict(matrix or {}, names=names, values=rows)
    _, missing = _float_grid(rows, len(steps))
    keep = [i for i in range(min(len(names), len(rows))) if not missing[i].all()]
    return dict(matrix, names=[names[i] for i in keep], values=[rows[i] for i in keep])


def _cell_span(steps: Sequence[float], step: float) -> tuple[float, float]:
    """The x extent of the heatmap column that holds ``step``: half-way to its neighbours (a lone column: ±0.5)."""
    j = min(range(len(steps)), key=lambda k: abs(steps[k] - step))
    left = steps[j] - steps[j - 1] if j > 0 else None
    right = steps[j + 1] - steps[j] if j + 1 < len(steps) else None
    left = left if left is not None else (right if right is not None else 1.0)
    right = right if right is not None else left
    return steps[j] - left / 2, steps[j] + right / 2


def heatmap_figure(title: str, matrix: Optional[dict], *, alerts: Sequence[dict] = (),
                   x_range: Optional[Sequence[float]] = None, highlight: Optional[str] = None,
                   highlight_step: Optional[float] = None, rewinds: Sequence[dict] = ()) -> dict:
    """Layer × step heatmap of log10(value); non-finite cells get a red ✕ on top.

    ``matrix`` is ``{"steps": [...], "names": [...], "values": [[one per step] per layer]}``. Rows without
    any value are left out, and every row drawn is labelled (the figure grows with its rows).
    ``highlight`` (a layer name, e.g. the NaN origin) is marked on the y axis; with ``highlight_step`` the
    mark is the cell at that step, else the whole row.
    """
    matrix = _with_data(matrix)
    layout = theme.base_layout(title, height=theme.HEATMAP_HEIGHT)
    layout["hovermode"] = "closest"
    layout["xaxis"].update(_x_axis(x_range))
    n_rows = len((matrix or {}).get("names") or [])
    layout["height"] = max(theme.HEATMAP_HEIGHT, 110 + ROW_PX * n_rows)
    # every row labelled: a category axis left to itself labels every other row once they crowd
    layout["yaxis"].update({"automargin": True, "tickfont": {"size": 9}, "type": "category", "tickmode": "linear",
                            "dtick": 1})
    # Margins that already hold the layer names and the colorbar: when automargin has to widen them,
    # plotly draws the heatmap twice (~45 ms a heatmap instead of ~25). 5.8 px a character of the 9 px
    # labels: automargin made 121 px of a 19-character name in the benchmark run; the colorbar took 102.
    longest = max((len(str(n)) for n in (matrix or {}).get("names") or []), default=0)
    layout["margin"]["l"] = min(HEATMAP_MAX_LABEL_PX, 16 + math.ceil(5.8 * longest)) if longest else 10
    layout["margin"]["r"] = 104
    layout["shapes"] = alert_shapes(alerts) + rewind_shapes(rewinds)
    steps = list((matrix or {}).get("steps") or [])
    names = list((matrix or {}).get("names") or [])
    rows = (matrix or {}).get("values") or []
    if not steps or not names or not rows:
        layout["annotations"] = [{"text": "no per-layer data for this run", "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
        return {"data": [{"type": "heatmap", "x": [], "y": [], "z": [], "showscale": False, "name": title}],
                "layout": layout}
    if highlight in names:
        highlight = plot_text(highlight)
    names = [plot_text(n) for n in names]
    z, bad = _log10_cells(rows, len(steps))
    bad_x = [steps[j] for j in bad[1].tolist()]
    bad_y = [names[i] for i in bad[0].tolist()]
    traces = [{"type": "heatmap", "x": steps, "y": names, "z": z, "colorscale": "Viridis", "name": title,
               "colorbar": {"thickness": 10, "len": 0.9, "title": {"text": "log10", "side": "right"},
                            "ticklabeloverflow": "allow"},
               "hovertemplate": "step %{x}<br>%{y}<br>log10 = %{z:.3g}<extra></extra>", "hoverongaps": False},
              {"type": "scatter", "mode": "markers", "name": "NaN / Inf", "x": bad_x, "y": bad_y,
               "marker": {"symbol": "x", "size": 7, "color": theme.NAN_COLOUR},
               "hovertemplate": "non-finite: %{y} at step %{x}<extra></extra>"}]
    if highlight and highlight in names:
        i = names.index(highlight)
        if highlight_step is not None:
            # the cell of the step where it started, not the whole step axis (issue 42)
            x0, x1 = _cell_span(steps, float(highlight_step))
            layout["shapes"].append({"type": "rect", "xref": "x", "yref": "y", "x0": x0, "x1": x1, "y0": i - 0.5,
                                     "y1": i + 0.5, "line": {"color": theme.NAN_COLOUR, "width": 2},
                                     "name": "nan-origin"})
            layout["annotations"] = [{"text": f"NaN origin, step {highlight_step:g}", "xref": "x", "yref": "y",
                                      "x": x1, "y": highlight, "xanchor": "left", "showarrow": False,
                                      "bgcolor": theme.BG, "font": {"color": theme.NAN_COLOUR, "size": 10}}]
        else:
            layout["shapes"].append({"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1,
                                     "y0": i - 0.5, "y1": i + 0.5, "line": {"color": theme.NAN_COLOUR, "width": 1.5}})
            layout["annotations"] = [{"text": "NaN origin", "xref": "paper", "yref": "y", "x": 0.005,
                                      "y": highlight, "xanchor": "left", "showarrow": False, "bgcolor": theme.BG,
                                      "font": {"color": theme.NAN_COLOUR, "size": 10}}]
    layout["showlegend"] = False
    return {"data": traces, "layout": layout}


def update_ratio_figure(matrix: Optional[dict], *, alerts: Sequence[dict] = (),
                        x_range: Optional[Sequence[float]] = None, rewinds: Sequence[dict] = ()) -> dict:
    """Median and max over parameters of ‖Δθ‖/‖θ‖ per sampled step (healthy ≈ 1e-3)."""
    steps = list((matrix or {}).get("steps") or [])
    rows = (matrix or {}).get("values") or []
    med, top = [], []
    for j in range(len(steps)):
        vals = sorted(v for v in (finite(row[j]) for row in rows if j < len(row)) if v is not None)
        med.append(vals[len(vals) // 2] if vals else None)
        top.append(vals[-1] if vals else None)
    layout = theme.base_layout("Update ratio ‖Δθ‖/‖θ‖ (over parameters)", log_y=True)
    layout["xaxis"].update(_x_axis(x_range))
    layout["shapes"] = alert_shapes(alerts) + rewind_shapes(rewinds) + [
        {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": 1e-3, "y1": 1e-3,
         "line": {"color": theme.MUTED, "width": 1, "dash": "dash"}}]
    if not steps:
        layout["annotations"] = [{"text": "no update-ratio samples for this run", "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
    return {"data": [
        {"type": "scatter", "mode": "lines+markers", "name": "median", "x": steps, "y": med,
         "line": {"color": theme.PALETTE[0], "width": 1.3}, "marker": {"size": 3}},
        {"type": "scatter", "mode": "lines", "name": "max", "x": steps, "y": top,
         "line": {"color": theme.PALETTE[3], "width": 1, "dash": "dot"}},
    ], "layout": layout}
