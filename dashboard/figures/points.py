"""Numbers and buckets as plot points: read-path values (floats, None, the wire's "NaN" strings) as floats,
a downsampled bucket as two points (its max then its min, so a spike survives), non-finite steps for the
NaN rug, smoothing, table-cell formatting."""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence

from gradwatch.agent.nonfinite import decode_float_or_none

NAN_RUG_Y = 0.96      # where NaN / Inf markers sit on the hidden 0..1 axis


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
