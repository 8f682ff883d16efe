"""Small robust-statistics helpers for the rules (leaf module: the standard library and the wire codec).

Windows hold finite values only; callers leave out non-finite values and the
values they flagged as spikes before pushing.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from gradwatch.agent.nonfinite import decode_float_or_none, encode_json

MAD_TO_SIGMA = 1.4826   # MAD of a normal distribution × this = its standard deviation


def num(value: Any) -> Optional[float]:
    """A wire value as a float (``"NaN"`` / ``"Infinity"`` strings included, through the one decoder of
    agent/nonfinite.py; a bool reads as 0 / 1); None when absent or not a number."""
    if value is None or isinstance(value, (bool, int, float)):
        return None if value is None else float(value)
    return decode_float_or_none(value)


def finite(x: Optional[float]) -> bool:
    return x is not None and math.isfinite(x)


def median(values: Iterable[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return math.nan
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def median_mad(values: list[float]) -> tuple[float, float]:
    """(median, MAD scaled to a standard deviation)."""
    m = median(values)
    return m, MAD_TO_SIGMA * median(abs(v - m) for v in values)


# A value safe for JSON columns and bodies (rule states, evidence): the one encoder, agent/nonfinite.py.
enc = encode_json


def fmt(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Inf" if x > 0 else "-Inf")
    return f"{x:.4g}"
