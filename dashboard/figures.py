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
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from dashboard import theme

_STR_FLOATS = {"NaN": math.nan, "nan": math.nan, "Infinity": math.inf, "inf": math.inf,
               "-Infinity": -math.inf, "-inf": -math.inf}

NAN_RUG_Y = 0.96      # where NaN / Inf markers sit on the hidden 0..1 axis
MAX_ALERT_MARKS = 60  # vertical alert lines per chart; older ones are dropped


def to_float(value: Any) -> Optional[float]:
    """A read-path number as a float: ``None`` stays ``None``; strings and bools are decoded."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return _STR_FLOATS[value]
        except KeyError:
            try:
                return float(value)
            except ValueError:
                return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def finite(value: Any) -> Optional[float]:
    """``to_float`` with non-finite values turned into ``None`` (a gap in a line)."""
    f = to_float(value)
    return f if f is not None and math.isfinite(f) else None


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


GIB = 1.0 / (1 << 30)

PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss", (Line("loss", "loss", theme.PALETTE[0]),), smoothed=True),
    Panel("grad_norm", "Grad norm (pre-clip, unscaled)",
          (Line("grad_norm", "grad norm", theme.PALETTE[1]),
           Line("clip_max_norm", "clip max_norm", theme.MUTED, dash="dash")),
          log_y=True, flags=(Flag("clipped", "clipped step", "grad_norm", symbol="circle-open"),)),
    Panel("loss_scale", "Loss scale (log)", (Line("loss_scale", "loss scale", theme.PALETTE[2]),), log_y=True,
          flags=(Flag("overflow", "overflow (skipped step)", "loss_scale"),)),
    Panel("lr", "Learning rate", (Line("lr", "lr", theme.PALETTE[3]),), include_zero=True),
    Panel("ema_divergence", "EMA divergence ‖θ_ema − θ‖ / ‖θ‖",
          (Line("ema_divergence", "EMA divergence", theme.PALETTE[4]),), log_y=True),
    Panel("throughput", "Throughput",
          (Line("samples_per_s", "samples/s", theme.PALETTE[5]), Line("tokens_per_s", "tokens/s", theme.PALETTE[6])),
          include_zero=True),
    Panel("step_time", "Step time (s)", (Line("step_time", "step time", theme.PALETTE[7]),), include_zero=True),
    Panel("memory", "Device memory, peak (GiB)", (Line("mem_peak", "peak allocated", theme.PALETTE[8], scale=GIB),),
          include_zero=True),
)
PANELS_BY_KEY = {p.key: p for p in PANELS}


def panel_signals(panels: Iterable[Panel]) -> tuple[str, ...]:
    """The signals some panels draw, each once, in panel order."""
    return tuple(dict.fromkeys(s for p in panels for s in p.signals))


SERIES_SIGNALS: tuple[str, ...] = panel_signals(PANELS)

# Per-layer heatmaps on the run page: (stat, title, names kind).
HEATMAPS: tuple[tuple[str, str], ...] = (
    ("grad_norm", "Per-parameter grad norm (log10)"),
    ("weight_norm", "Per-parameter weight norm (log10)"),
    ("act_std", "Per-module activation std (log10)"),
)


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


def alerts_signature(alerts: Sequence[dict]) -> list:
    """What, in a run's alerts, changes what the page shows (cheap to compare in a Store)."""
    return [[a.get("id"), a.get("status"), bool(a.get("acknowledged")), a.get("last_step")] for a in alerts]


# --------------------------------------------------------------------------- run-page charts

@dataclass
class PanelState:
    """What live appends need to continue a panel: smoothing state and trace indices."""
    smooth: dict = field(default_factory=lambda: {"ema": 0.0, "n": 0})


def _x_axis(x_range: Optional[Sequence[float]]) -> dict:
    if x_range:
        return {"range": list(x_range), "autorange": False}
    return {"autorange": True}


def series_figure(panel: Panel, series: dict, *, alerts: Sequence[dict] = (), smoothing: float = 0.0,
                  x_range: Optional[Sequence[float]] = None) -> tuple[dict, dict]:
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
    layout["shapes"] = alert_shapes(alerts)
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

def _log10(v: Any) -> Optional[float]:
    f = finite(v)
    return math.log10(f) if f is not None and f > 0 else None


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
    layout["margin"]["l"] = 10
    layout["shapes"] = alert_shapes(alerts)
    steps = list((matrix or {}).get("steps") or [])
    names = list((matrix or {}).get("names") or [])
    rows = (matrix or {}).get("values") or []
    if not steps or not names or not rows:
        layout["annotations"] = [{"text": "no per-layer data for this run", "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5, "showarrow": False, "font": {"color": theme.MUTED}}]
        return {"data": [{"type": "heatmap", "x": [], "y": [], "z": [], "showscale": False, "name": title}],
                "layout": layout}
    z, bad_x, bad_y = [], [], []
    for name, row in zip(names, rows):
        z.append([_log10(v) for v in row])
        for step, v in zip(steps, row):
            if is_nonfinite(v):
                bad_x.append(step)
                bad_y.append(name)
    traces = [{"type": "heatmap", "x": steps, "y": names, "z": z, "colorscale": "Viridis", "name": title,
               "colorbar": {"thickness": 10, "len": 0.9, "title": {"text": "log10", "side": "right"}},
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


# --------------------------------------------------------------------------- compare page

COMPARE_PANELS: tuple[tuple[str, str, bool], ...] = (
    ("loss", "Loss", False),
    ("grad_norm", "Grad norm (pre-clip)", True),
    ("loss_scale", "Loss scale (log)", True),
    ("lr", "Learning rate", False),
    ("ema_divergence", "EMA divergence", True),
    ("samples_per_s", "Throughput (samples/s)", False),
)

ZERO_BASED = {"lr", "samples_per_s", "tokens_per_s", "step_time", "mem_peak"}


def compare_figure(signal: str, title: str, runs: Sequence[tuple[str, dict]], *, log_y: bool = False) -> dict:
    """One signal of several runs overlaid: ``runs`` is ``[(label, {"bucket_size", "steps"})]``."""
    traces = []
    nan_x, nan_text, nan_colour = [], [], []
    for i, (label, s) in enumerate(runs):
        colour = theme.PALETTE[i % len(theme.PALETTE)]
        xs, ys = bucket_points((s or {}).get("steps", []), (s or {}).get("bucket_size", 1) or 1)
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
