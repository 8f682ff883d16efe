"""Divergence, defined without gradwatch (issue 41).

A run diverges at the first step of 5 consecutive losses above 1.5x the running minimum (the minimum of
every loss up to and including the step before), or at the first non-finite loss, whichever comes first.

>>> diverged_at([3.0, 2.0, 1.0, 1.0, 1.6, 1.7, 1.8, 1.9, 2.0, 1.0])
4
>>> diverged_at([3.0, 2.0, 1.0, 1.6, 1.7, 1.0, 1.6, 1.7, 1.8, 1.9])
>>> diverged_at([3.0, 2.0, float("nan")])
2
"""
from __future__ import annotations

import math
from typing import Optional

FACTOR, RUN = 1.5, 5


def diverged_at(losses: list[float], factor: float = FACTOR, run: int = RUN) -> Optional[int]:
    best, start, count = math.inf, None, 0
    for i, x in enumerate(losses):
        if not math.isfinite(x):
            return i
        if x > factor * best:
            if count == 0:
                start = i
            count += 1
            if count >= run:
                return start
        else:
            count, start = 0, None
        best = min(best, x)
    return None


def learned(losses: list[float], until: Optional[int] = None, fraction: float = 0.85) -> bool:
    """Whether the loss fell to ``fraction`` x its first value before step ``until`` (the loss must fall first).

    >>> learned([3.0, 2.0, 9.0], until=2), learned([3.0, 2.9, 9.0], until=2)
    (True, False)
    """
    xs = [x for x in losses[:until] if math.isfinite(x)]
    return bool(xs) and min(xs) <= fraction * xs[0]
