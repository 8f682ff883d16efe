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


def median_of_others(values, counted):
    """For every cell of ``values`` (steps x ranks), the median of the other ranks' values at that
    step: the counted cells of its row, the cell itself left out; NaN where none is left.

    The cross-rank rules compare each rank with the others' median at every step they judge. Taken
    one rank at a time (``np.nanmedian`` over the other columns) that is N medians of N - 1 values a
    step, O(N^2 log N): ~15 ms a step at 256 ranks. One sort a row does it for every rank: leaving out
    the value at sorted position p, the remaining k-th value is sorted[k] below p and sorted[k + 1]
    from p on."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    counted = np.asarray(counted, dtype=bool) & ~np.isnan(values)
    out = np.full(values.shape, np.nan)
    for i in range(values.shape[0]):
        cols = np.flatnonzero(counted[i])
        n = len(cols)
        if n == 0:
            continue
        order = np.argsort(values[i, cols], kind="stable")
        v = values[i, cols][order]
        out[i] = np.median(v)                     # the cells not counted: every counted value is "other"
        if n == 1:
            out[i, cols] = np.nan                 # the one counted cell has no other
            continue
        p = np.empty(n, dtype=np.int64)
        p[order] = np.arange(n)                   # each counted cell's place in the sorted row
        rest = n - 1

        def kth(k):                               # the k-th smallest of the others, for every counted cell
            return np.where(k < p, v[k], v[np.minimum(k + 1, n - 1)])

        if rest % 2:
            out[i, cols] = kth(rest // 2)
        else:
            out[i, cols] = 0.5 * (kth(rest // 2 - 1) + kth(rest // 2))
    return out
