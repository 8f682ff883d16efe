"""A rolling window of finite values with a robust baseline, screened a whole batch at a time.

The definition (the same for every batch cut): values arrive one by one; once the window holds
``min_len`` values each arrival is *judged* against the window's median (and MAD), which is
recomputed when first needed and then whenever ``refresh`` values were pushed since the last
computation (one sort per few values, not per value); a value the rule flags is left out of the
window (a spike does not raise its own baseline), any other is pushed, the oldest dropped beyond
``size``. The cached statistics and the push count live in the state with the values, so a batch of
one value and a batch of 500 reach the same verdicts.

``screen`` evaluates that over a batch with numpy: it assumes no flag, computes the medians at
the refresh points, and where a value turns out flagged, fixes that one assumption and computes
again from there (a batch holds few flags, so this is one pass or two).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gradwatch.server.rules.rule import mads, medians, pack_f8, unpack_f8, window_slices


@dataclass
class Screened:
    med: np.ndarray        # per arrival, the median it faced (NaN: not judged)
    mad: np.ndarray        # per arrival, the MAD it faced (NaN: not judged, or not asked for)
    judged: np.ndarray
    flagged: np.ndarray
    pushed: np.ndarray


class RobustWindow:
    """``state[key]``: the values (packed); ``state[key + "_stats"]``: [median, MAD] as last computed
    (or absent); ``state[key + "_since"]``: values pushed since."""

    def __init__(self, state: dict, key: str, size: int, *, refresh: int, min_len: int, want_mad: bool = False):
        self.state, self.key, self.size, self.refresh, self.min_len = state, key, size, refresh, min_len
        self.want_mad = want_mad
        self.values = unpack_f8(state.get(key))[-size:] if size > 0 else np.empty(0)
        stats = state.get(key + "_stats")
        self.stats: Optional[tuple[float, float]] = (
            tuple(math.nan if v is None else float(v) for v in stats[:2]) if stats else None)  # type: ignore[assignment]
        self.since = int(state.get(key + "_since", 0))

    def __len__(self) -> int:
        return len(self.values)

    def save(self) -> None:
        self.state[self.key] = pack_f8(self.values)
        self.state[self.key + "_since"] = self.since
        if self.stats is not None:
            self.state[self.key + "_stats"] = [None if math.isnan(v) else v for v in self.stats]   # JSON: no NaN
        else:
            self.state.pop(self.key + "_stats", None)

    def _stats_at(self, arr: np.ndarray, hi: np.ndarray, mad_for=None) -> tuple[np.ndarray, np.ndarray]:
        """Median and MAD of the windows ending at ``hi`` (the MAD only where the mask ``mad_for`` says)."""
        lo = np.maximum(hi - self.size, 0)
        med = np.full(len(hi), np.nan)
        mad = np.full(len(hi), np.nan)
        ok = hi > lo
        if ok.any():
            rows = np.flatnonzero(ok)
            for which, w in window_slices(arr, lo[rows], hi[rows]):
                r = rows[which]
                med[r] = m = medians(w)
                if self.want_mad:
                    if mad_for is None:
                        mad[r] = mads(w, m)
                    else:
                        need = mad_for[r]
                        if need.any():
                            mad[r[need]] = mads(w[need], m[need])
        return med, mad

    def screen(self, xs: np.ndarray, pushable: np.ndarray,
               flags: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
               monotone: bool = False) -> Screened:
        """Judge the arrivals ``xs`` in order and push them (``pushable``: a finite value; the others are
        judged only). ``flags(x, median, mad)`` -> which judged arrivals the rule flags.

        ``monotone``: ``flags`` holds more readily for a larger value and for a smaller median or MAD
        (a spike test). Every median a window of these values has is at least their lowest value, so
        when the highest arrival is not flagged against the lowest value as median, MAD 0, nothing is:
        the medians are then not computed (the usual healthy batch)."""
        m, n0, size, refresh = len(xs), len(self.values), self.size, self.refresh
        carried = self.stats
        assume = np.zeros(m, dtype=bool)
        start = 0
        skip = False
        if monotone and m and pushable.all():
            lowest = min(float(xs.min()), float(self.values.min())) if n0 else float(xs.min())
            with np.errstate(invalid="ignore", over="ignore"):
                skip = lowest > 0 and not flags(np.array([xs.max()]), np.array([lowest]), np.zeros(1))[0]
        while True:
            push = pushable & ~assume
            P = np.zeros(m + 1, dtype=np.int64)
            np.cumsum(push, out=P[1:])
            lens = np.minimum(n0 + P[:m], size)
            judged = lens >= self.min_len
            pts: list[int] = []
            js = np.flatnonzero(judged)
            if len(js):
                j = int(js[0])
                if carried is not None:
                    j = max(j, int(np.searchsorted(P[:m], refresh - self.since, "left")))
                if push[j:].all():            # every later arrival is pushed: every refresh-th one recomputes
                    pts = list(range(j, m, max(1, refresh)))
                else:
                    while j < m:
                        pts.append(j)
                        j = max(j + 1, int(np.searchsorted(P[:m], P[j] + refresh, "left")))
            pts_a = np.asarray(pts, dtype=np.int64)
            arr = np.concatenate((self.values, xs[push]))
            if skip:
                pmed, pmad = self._stats_at(arr, n0 + P[pts_a[-1:]]) if pts else (np.empty(0), np.empty(0))
                med = np.full(m, np.nan)
                mad = np.full(m, np.nan)
                flagged = np.zeros(m, dtype=bool)
                break
            which = np.searchsorted(pts_a, np.arange(m), "right") - 1
            c_med, c_mad = carried if carried is not None else (math.nan, math.nan)
            if monotone and self.want_mad and pts:
                # the MAD only raises the bar: where nothing is flagged against MAD 0 it is not needed
                # (but for the last refresh, whose statistics the state keeps)
                hi = n0 + P[pts_a]
                pmed, pmad = self._stats_at(arr, hi, mad_for=np.zeros(len(pts), dtype=bool))
                med0 = np.where(which >= 0, pmed[np.maximum(which, 0)], c_med)
                with np.errstate(invalid="ignore", over="ignore"):
                    maybe = judged & flags(xs, med0, np.zeros(m))
                need = np.zeros(len(pts), dtype=bool)
                need[which[maybe & (which >= 0)]] = True
                need[-1] = True
                rows = np.flatnonzero(need & (hi > np.maximum(hi - self.size, 0)))
                lo = np.maximum(hi - self.size, 0)
                for which_rows, w in window_slices(arr, lo[rows], hi[rows]):
                    r = rows[which_rows]
                    pmad[r] = mads(w, pmed[r])
            else:
                pmed, pmad = self._stats_at(arr, n0 + P[pts_a])
            med = np.where(which >= 0, pmed[np.maximum(which, 0)] if pts else c_med, c_med)
            mad = np.where(which >= 0, pmad[np.maximum(which, 0)] if pts else c_mad, c_mad)
            med[~judged] = np.nan
            mad[~judged] = np.nan
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                flagged = judged & flags(xs, med, mad)
            wrong = np.flatnonzero(pushable[start:] & (flagged[start:] != assume[start:]))
            if not len(wrong):
                break
            k = start + int(wrong[0])
            assume[k] = flagged[k]
            assume[k + 1:] = False
            start = k + 1
        self.values = arr[-size:] if size > 0 else arr[:0]
        if pts:
            self.stats = (float(pmed[-1]), float(pmad[-1]))
            self.since = int(P[m] - P[pts[-1]])
        else:
            self.since += int(P[m])
        return Screened(med, mad, judged, flagged, push)
