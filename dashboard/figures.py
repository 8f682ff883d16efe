"""Pure figure builders: query results in, Plotly figure dicts (or appends) out.

No Dash, no database: every function here takes plain data and returns plain
data, so the page callbacks stay thin and the builders are testable alone.

Series arrive as the read API's buckets ``{"step", "min", "max", "last",
"count", "nonfinite"}`` (docs/wire-format.md); values may be floats, ``None``
or the strings ``"NaN"`` / ``"Infinity"`` / ``"-Infinity"`` depending on the
layer they came through, and :func:`to_float` accepts all of them.
A downsampled bucket is drawn as two points, its max then its min, so a spike
inside a bucket of 500 steps is still drawn at its full height; buckets that
hold a non-finite value put a marker on the chart's NaN rug.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Optional, Sequence

import numpy as np

from gradwatch.agent import signals as table
from gradwatch.agent.nonfinite import decode_float_or_none
from gradwatch.dashboard import theme

NAN_RUG_Y = 0.96      # where NaN / Inf markers sit on the hidden 0..1 axis
MAX_ALERT_MARKS = 60  # vertical alert lines per chart; older ones are dropped
MAX_CHECKPOINT_MARKS = 60  # vertical checkpoint lines per chart; the latest are kept (a rollback names a late one)


def to_float(value: Any) -> Optional[float]:
    """A read-path number as a float: ``None`` stays ``None``; strings and bools are decoded."""
    if isinstance(value, bool):
        return float(value)
    return decode_float_or_none(value)


def finite(value: Any) -> Optional[float]:
    """``to_float`` with non-finite values turned into ``None`` (a gap in a line)."""
    f = to_float(value)
    return f if f is not None and math.isfinite(f) else None


def plot_text(text: Any) -> str:
    """A name from the training script as Plotly text: Plotly renders a subset of HTML in tick labels,
    legends and hovers (``<a href>`` becomes a link), so ``&``, ``<`` and ``>`` are sent as entities and
    shown as the characters they are."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def is_nonfinite(value: Any) -> bool:
    f = to_float(value)
    return f is not None and not math.isfinite(f)


# --------------------------------------------------------------------------- panel specs

@dataclass(frozen=True)
class Line:
    """One signal drawn as a line."""
    signal: str
    name: str
    colour: str
    dash: Optional[str] = None
    scale: float = 1.0  # e.g. bytes -> GiB


@dataclass(frozen=True)
class Flag:
    """Steps where a boolean signal is true, drawn as markers on ``host`` (the line's signal)."""
    signal: str
    name: str
    host: str
    symbol: str = "triangle-down"
    colour: str = theme.FLAG_COLOUR


@dataclass(frozen=True)
class Panel:
    """A run-page chart: its lines, optional smoothed copy of the first line, flags and NaN rug."""
    key: str
    title: str
    lines: tuple[Line, ...]
    log_y: bool = False
    smoothed: bool = False
    flags: tuple[Flag, ...] = ()
    y_title: str = ""
    include_zero: bool = False  # absolute quantities: a constant LR reads as a level, not as noise

    @property
    def signals(self) -> tuple[str, ...]:
        out = [ln.signal for ln in self.lines] + [f.signal for f in self.flags]
        return tuple(dict.fromkeys(out))

    def trace_names(self) -> list[str]:
        """Trace order is fixed: lines, smoothed line, flags, NaN rug (live appends address them by index)."""
        names = [ln.name for ln in self.lines]
        if self.smoothed:
            names.append(f"{self.lines[0].name} (smoothed)")
        names += [f.name for f in self.flags]
        names.append("NaN / Inf")
        return names


def _panel(p: table.Panel) -> Panel:
    """A run-page panel from the signal table: its signals drawn as lines (one palette colour each, in
    id order across the page), dashed reference lines and flags on the panel's first line."""
    decl = table.panel_signals(p.key)
    host = next(s.name for s in decl if s.draw == "line")
    lines, flags = [], []
    for s in decl:
        if s.draw == "flag":
            flags.append(Flag(s.name, s.label, host, symbol=s.marker))
        elif s.draw == "dash":
            lines.append(Line(s.name, s.label, theme.MUTED, dash="dash", scale=s.scale))
        else:
            lines.append(Line(s.name, s.label, theme.PALETTE[_LINE_COLOURS[s.name] % len(theme.PALETTE)],
                              scale=s.scale))
    return Panel(p.key, p.title, tuple(lines), log_y=p.log_y, smoothed=p.smoothed, flags=tuple(flags),
                 include_zero=p.include_zero)


# each drawn line keeps one colour on every page: its place among the table's line signals
_LINE_COLOURS = {s.name: i for i, s in enumerate(
    s for p in table.PANELS for s in table.panel_signals(p.key) if s.draw == "line")}
PANELS: tuple[Panel, ...] = tuple(_panel(p) for p in table.PANELS)
PANELS_BY_KEY = {p.key: p for p in PANELS}
HEADLINE: tuple[str, ...] = tuple(p.key for p in table.PANELS if p.headline)


def panel_signals(panels: Iterable[Panel]) -> tuple[str, ...]:
    """The signals some panels draw, each once, in panel order."""
    return tuple(dict.fromkeys(s for p in panels for s in p.signals))


SERIES_SIGNALS: tuple[str, ...] = panel_signals(PANELS)

# Per-layer heatmaps on the run page: (stat, title), the table's statistics that declare one.
HEATMAPS: tuple[tuple[str, str], ...] = tuple((s.name, s.heatmap) for s in table.LAYER_STATS if s.heatmap)


# --------------------------------------------------------------------------- series -> points

def bucket_points(buckets: Sequence[dict], bucket_size: int = 1, scale: float = 1.0) -> tuple[list, list]:
    """Line points of one series: raw steps as they are; a bucket as (step, max), (mid, min).

    Steps where the signal was not measured (sampled signals such as the EMA
    divergence) are left out, so the line joins the samples; a NaN / Inf step
    is a ``None``, a visible gap, besides its marker on the NaN rug.
    """
    xs: list = []
    ys: list = []
    for b in buckets:
        step = b["step"]
        count = b.get("count")
        if count == 0:
            continue
        lo, hi, last = finite(b.get("min")), finite(b.get("max")), finite(b.get("last"))
        if bucket_size <= 1 or (count or 1) <= 1 or lo is None or hi is None or lo == hi:
            y = last if last is not None else (hi if hi is not None else lo)
            xs.append(step)
            ys.append(None if y is None else y * scale)
        else:
            xs += [step, step + bucket_size / 2]
            ys += [hi * scale, lo * scale]
    return xs, ys


def nonfinite_steps(buckets: Sequence[dict]) -> list:
    """Steps (bucket starts) that hold a NaN or an Inf."""
    return [b["step"] for b in buckets
            if (b.get("nonfinite") or 0) > 0 or is_nonfinite(b.get("last"))
            or is_nonfinite(b.get("min")) or is_nonfinite(b.get("max"))]


def flag_steps(buckets: Sequence[dict]) -> list:
    """Steps (bucket starts) where a boolean signal was true at least once."""
    out = []
    for b in buckets:
        v = b.get("max")
        if v is None:
            v = b.get("last")
        if v is True or (finite(v) or 0.0) >= 0.5:
            out.append(b["step"])
    return out


def smooth(ys: Iterable[Optional[float]], weight: float, state: Optional[dict] = None) -> tuple[list, dict]:
    """Debiased exponential moving average (TensorBoard's), skipping gaps; resumable via ``state``."""
    state = dict(state or {"ema": 0.0, "n": 0})
    out = []
    for y in ys:
        if y is None or not math.isfinite(y) or weight <= 0:
            out.append(y if weight <= 0 else None)
            continue
        state["ema"] = state["ema"] * weight + (1 - weight) * y
        state["n"] += 1
        out.append(state["ema"] / (1 - weight ** state["n"]))
    return out, state


def _host_lookup(buckets: Sequence[dict], scale: float) -> dict:
    look = {}
    for b in buckets:
        v = finite(b.get("max"))
        if v is None:
            v = finite(b.get("last"))
        if v is not None:
            look[b["step"]] = v * scale
    return look


# --------------------------------------------------------------------------- alerts

def alert_shapes(alerts: Sequence[dict]) -> list[dict]:
    """A dotted vertical line, labelled with the rule id, at the step where each alert started."""
    marks = sorted(alerts, key=lambda a: a.get("first_step") or a.get("step") or 0)[-MAX_ALERT_MARKS:]
    shapes = []
    for a in marks:
        step = a.get("first_step", a.get("step"))
        if step is None:
            continue
        colour = theme.SEVERITY_COLOURS.get(a.get("severity"), theme.MUTED)
        shapes.append({
            "type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": colour, "width": 1, "dash": "dot"}, "layer": "above",
            "label": {"text": str(a.get("rule", "")), "textposition": "end", "yanchor": "top",
                      "font": {"size": 9, "color": colour}},
        })
    return shapes


def checkpoint_shapes(checkpoints: Sequence[dict]) -> list[dict]:
    """A thin solid vertical line, labelled "ckpt <step>" at the chart's foot, at each checkpoint's step
    (``GET /api/v1/runs/{id}/checkpoints``; the step a resume from it continues with). Drawn under the
    traces and apart from the alerts' dotted lines, so a rollback's checkpoint reads off the same axis."""
    marks = sorted((c for c in checkpoints if c.get("step") is not None), key=lambda c: c["step"])
    shapes = []
    for c in marks[-MAX_CHECKPOINT_MARKS:]:
        step = c["step"]
        shapes.append({
            "type": "line", "xref": "x", "yref": "paper", "x0": step, "x1": step, "y0": 0, "y1": 1,
            "line": {"color": theme.CHECKPOINT_COLOUR, "width": 1}, "opacity": 0.55, "layer": "below",
            "name": f"checkpoint {step}",
            "label": {"text": f"ckpt {step:,}", "textposition": "start", "yanchor": "bottom",
                      "font": {"size": 9, "color": theme.CHECKPOINT_COLOUR}},
        })
    return shapes


def checkpoints_signature(checkpoints: Sequence[dict]) -> list:
    return [[c.get("step"), c.get("path")] for c in checkpoints]


def alerts_signature(alerts: Sequence[dict]) -> list:
    """What, in a run's alerts, changes what the page shows (cheap to compare in a Store)."""
    return [[a.get("id"), a.get("status"), bool(a.get("acknowledged")), a.get("last_step"), a.get("suppressed_by"),
             a.get("silenced_by"), a.get("muted")] for a in alerts]


# --------------------------------------------------------------------------- run-page charts

def _x_axis(x_range: Optional[Sequence[float]]) -> dict:
    if x_range:
        return {"range": list(x_range), "autorange": False}
    return {"autorange": True}


def series_figure(panel: Panel, series: dict, *, alerts: Sequence[dict] = (), smoothing: float = 0.0,
                  x_range: Optional[Sequence[float]] = None,
                  checkpoints: Sequence[dict] = ()) -> tuple[dict, dict]:
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
    layout["shapes"] = alert_shapes(alerts) + checkpoint_shapes(checkpoints)
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


# --------------------------------------------------------------------------- per-layer heatmaps

HEATMAP_MAX_LABEL_PX = 320     # a longer layer name widens the margin by automargin (one more draw)


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


def heatmap_figure(title: str, matrix: Optional[dict], *, alerts: Sequence[dict] = (),
                   x_range: Optional[Sequence[float]] = None, highlight: Optional[str] = None) -> dict:
    """Layer × step heatmap of log10(value); non-finite cells get a red ✕ on top.

    ``matrix`` is ``{"steps": [...], "names": [...], "values": [[one per step] per layer]}``.
    ``highlight`` (a layer name, e.g. the NaN origin) is marked on the y axis.
    """
    layout = theme.base_layout(title, height=theme.HEATMAP_HEIGHT)
    layout["hovermode"] = "closest"
    layout["xaxis"].update(_x_axis(x_range))
    layout["yaxis"].update({"automargin": True, "tickfont": {"size": 9}, "type": "category"})
    # Margins that already hold the layer names and the colorbar: when automargin has to widen them,
    # plotly draws the heatmap twice (~45 ms a heatmap instead of ~25). 5.8 px a character of the 9 px
    # labels: automargin made 121 px of a 19-character name in the benchmark run; the colorbar took 102.
    longest = max((len(str(n)) for n in (matrix or {}).get("names") or []), default=0)
    layout["margin"]["l"] = min(HEATMAP_MAX_LABEL_PX, 16 + math.ceil(5.8 * longest)) if longest else 10
    layout["margin"]["r"] = 104
    layout["shapes"] = alert_shapes(alerts)
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
        layout["shapes"].append({"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": i - 0.5,
                                 "y1": i + 0.5, "line": {"color": theme.NAN_COLOUR, "width": 1.5}})
        layout["annotations"] = [{"text": "NaN origin", "xref": "paper", "yref": "y", "x": 0.005, "y": highlight,
                                  "xanchor": "left", "showarrow": False, "bgcolor": theme.BG,
                                  "font": {"color": theme.NAN_COLOUR, "size": 10}}]
    layout["showlegend"] = False
    return {"data": traces, "layout": layout}


def update_ratio_figure(matrix: Optional[dict], *, alerts: Sequence[dict] = (),
                        x_range: Optional[Sequence[float]] = None) -> dict:
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
    layout["shapes"] = alert_shapes(alerts) + [
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


# --------------------------------------------------------------------------- ranks

# what a sharded run's combined row (rank -1) holds, read there by default instead of on rank 0 (whose
# grad norm is "not measured" under FSDP by design: docs/integrations.md, "Distributed training")
COMBINED_SIGNALS: frozenset[str] = frozenset(s.name for s in table.STEP_SIGNALS if s.combined)
COMBINED_STATS: frozenset[str] = frozenset(s.name for s in table.LAYER_STATS if s.combined)
# the all-ranks overlays and rank × step heatmaps: (signal, title, log y), from the table's per_rank titles
RANK_CHARTS: tuple[tuple[str, str, bool], ...] = tuple(
    (s.name, s.per_rank, bool(s.panel and table.panel(s.panel).log_y)) for s in table.STEP_SIGNALS if s.per_rank)
# a sharded run's ranks measure only their pieces (agent/signals.py: grad_norm_local): its per-rank chart of
# a combined signal draws what each rank measured, the combined value being one number for all ranks
SHARDED_PER_RANK: dict[str, str] = {s.name: f"{s.name}_local" for s in table.STEP_SIGNALS
                                    if s.per_rank and s.combined and table.is_step_signal(f"{s.name}_local")}
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
                        x_range: Optional[Sequence[float]] = None) -> dict:
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
    layout["shapes"] = alert_shapes(alerts)
    layout["hovermode"] = "closest"   # "x unified" would list every one of 64 ranks
    if not has_data:
        layout["annotations"] = [{"text": "no data for this run", "xref": "paper", "yref": "paper", "x": 0.5,
                                  "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
    return {"data": traces, "layout": layout}


def rank_heatmap_figure(title: str, matrix: Optional[dict], *, log: bool = False, highlight: Optional[int] = None,
                        x_range: Optional[Sequence[float]] = None) -> dict:
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
        layout["shapes"] = [{"type": "rect", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": highlight - 0.5,
                             "y1": highlight + 0.5, "line": {"color": HIGHLIGHT_COLOUR, "width": 1.5}}]
    return {"data": traces, "layout": layout}


# --------------------------------------------------------------------------- compare page

# The compare page: (signal, title, log y) for each step signal the table gives a compare title, in
# run-page panel order.
COMPARE_PANELS: tuple[tuple[str, str, bool], ...] = tuple(
    (s.name, s.compare, p.log_y) for p in table.PANELS for s in table.panel_signals(p.key) if s.compare)

# signals whose charts start at zero (their panel says include_zero)
ZERO_BASED = frozenset(s.name for s in table.STEP_SIGNALS if s.panel and table.panel(s.panel).include_zero)


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


# --------------------------------------------------------------------------- formatting

def format_number(value: Any, digits: int = 4) -> str:
    """A number for a table cell: non-finite values spelled out, ``—`` for missing."""
    f = to_float(value)
    if f is None:
        return "—"
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "Inf" if f > 0 else "-Inf"
    if f != 0 and (abs(f) >= 1e5 or abs(f) < 1e-3):
        return f"{f:.{digits - 1}e}"
    return f"{f:.{digits}g}"
