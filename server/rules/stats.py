"""Small robust-statistics helpers for the rules (leaf module, standard library only).

Windows hold finite values only; callers leave out non-finite values and the
values they flagged as spikes before pushing.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

MAD_TO_SIGMA = 1.4826   # MAD of a normal distribution × this = its standard deviation


def num(value: Any) -> Optional[float]:
    """A wire value as a float (``"NaN"`` / ``"Infinity"`` strings included); None when absent."""
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


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


def enc(x: Any) -> Any:
    """A value safe for JSON columns and bodies: non-finite floats become the wire strings."""
    if isinstance(x, float):
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x
    if isinstance(x, dict):
        return {k: enc(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [enc(v) for v in x]
    return x


def fmt(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Inf" if x > 0 else "-Inf")
    return f"{x:.4g}"
