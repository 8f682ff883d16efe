"""Multi-resolution partial aggregates ("rollups") for step signals and layer stats.

Written by ingest for the steps a batch actually inserted, read by queries
when a chart bucket spans at least one rollup level. Every partial covers one
``(level, bucket = step // level)`` from one batch; partials are merged at
read time with the same reductions, so out-of-order batches from several
replicas simply add partials (no shared row is ever updated).

Step partial (``StepRollup.data``): float64[6, S], S = len(STEP_SIGNALS)
    rows: min, max (NaN skipped, ±inf kept; NaN if nothing non-NaN),
          count (measured, NaN included), nonfinite (NaN and ±inf),
          last_step (-1: none), last_value (NaN kept)
Layer partial (``LayerRollup.data``): float64 last_step, then float32[6, W]
    rows: min, max, sum (NaN skipped), count (non-NaN measured), nan count,
          last value (NULL_F32_BITS pattern when not measured)
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .models import ROLLUP_LEVELS, STEP_SIGNALS
from .numbers import NULL_F32_BITS

S = len(STEP_SIGNALS)
STEP_ROWS = ("min", "max", "count", "nonfinite", "last_step", "last_value")
LAYER_ROWS = ("min", "max", "sum", "count", "nan", "last")


def _group_starts(buckets: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.flatnonzero(np.diff(buckets)) + 1))


def step_partials(steps: np.ndarray, values: np.ndarray, measured: np.ndarray, *,
                  levels: Sequence[int] = ROLLUP_LEVELS) -> list[tuple[int, int, bytes]]:
    """(level, bucket, blob) for sorted ``steps`` (n,), ``values`` (n, S) float64 with
    NaN for both NaN and null, ``measured`` (n, S) bool (True for NaN too)."""
    n = len(steps)
    if n == 0:
        return []
    isnan = np.isnan(values) & measured
    nonfinite = (isnan | np.isinf(values)).astype(np.float64)
    idx = np.where(measured, np.arange(n)[:, None], -1)
    out = []
    for level in levels:
        buckets = steps // level
        starts = _group_starts(buckets)
        mn = np.fmin.reduceat(values, starts, axis=0)
        mx = np.fmax.reduceat(values, starts, axis=0)
        cnt = np.add.reduceat(measured.astype(np.float64), starts, axis=0)
        nf = np.add.reduceat(nonfinite, starts, axis=0)
        last_idx = np.maximum.reduceat(idx, starts, axis=0)
        has = last_idx >= 0
        safe = np.where(has, last_idx, 0)
        last_step = np.where(has, steps[safe].astype(np.float64), -1.0)
        last_val = np.where(has, values[safe, np.arange(S)[None, :]], np.nan)
        block = np.stack([mn, mx, cnt, nf, last_step, last_val], axis=1)  # (g, 6, S)
        for g, b in enumerate(buckets[starts].tolist()):
            out.append((level, int(b), block[g].astype("<f8").tobytes()))
    return out


def layer_partials(steps: np.ndarray, blobs: Sequence[bytes], *,
                   levels: Sequence[int] = ROLLUP_LEVELS) -> list[tuple[int, int, bytes]]:
    """(level, bucket, blob) for one stat: sorted ``steps`` and their float32 blobs."""
    n = len(steps)
    if n == 0:
        return []
    width = max(len(b) // 4 for b in blobs)
    if n == 1 and len(blobs[0]) == 4 * width:
        # one step (statistics sampled every K steps): its partial is the same at every level
        bits = np.frombuffer(blobs[0], dtype="<u4")
        measured = bits != NULL_F32_BITS
        vals = bits.view("<f4")
        isnan = np.isnan(vals) & measured
        ok = measured & ~isnan
        clean = np.where(ok, vals, np.float32(np.nan))
        body = np.stack([clean, clean, np.where(ok, vals, np.float32(0)), ok, isnan, vals]).astype("<f4")
        blob = np.array([steps[0]], dtype="<f8").tobytes() + body.tobytes()
        s0 = int(steps[0])
        return [(level, s0 // level, blob) for level in levels]
    bits = np.full((n, width), NULL_F32_BITS, dtype="<u4")
    for i, b in enumerate(blobs):
        a = np.frombuffer(b, dtype="<u4")
        bits[i, : len(a)] = a
    measured = bits != NULL_F32_BITS
    vals = bits.view("<f4")
    isnan = np.isnan(vals) & measured
    clean = np.where(measured & ~isnan, vals, np.float32(np.nan))
    zeroed = np.where(np.isnan(clean), np.float32(0), clean)
    counted = (measured & ~isnan).astype(np.float32)
    nan_f = isnan.astype(np.float32)
    idx = np.where(measured, np.arange(n)[:, None], -1)
    record = np.dtype([("last_step", "<f8"), ("rows", "<f4", (6, width))])
    out = []
    for level in levels:
        buckets = steps // level
        starts = _group_starts(buckets)
        groups = len(starts)
        rec = np.empty(groups, dtype=record)
        rows = rec["rows"]
        rows[:, 0] = np.fmin.reduceat(clean, starts, axis=0)
        rows[:, 1] = np.fmax.reduceat(clean, starts, axis=0)
        rows[:, 2] = np.add.reduceat(zeroed, starts, axis=0)
        rows[:, 3] = np.add.reduceat(counted, starts, axis=0)
        rows[:, 4] = np.add.reduceat(nan_f, starts, axis=0)
        last_idx = np.maximum.reduceat(idx, starts, axis=0)
        has = last_idx >= 0
        rows[:, 5] = np.where(has, bits[np.where(has, last_idx, 0), np.arange(width)[None, :]],
                              NULL_F32_BITS).view("<f4")
        rec["last_step"] = steps[np.maximum.reduceat(np.arange(n), starts)]
        raw, size = rec.tobytes(), record.itemsize
        for g, b in enumerate(buckets[starts].tolist()):
            out.append((level, int(b), raw[g * size:(g + 1) * size]))
    return out


def choose_level(bucket_size: int) -> int:
    """The coarsest rollup level not larger than ``bucket_size`` (0: read raw rows)."""
    best = 0
    for level in ROLLUP_LEVELS:
        if level <= bucket_size:
            best = level
    return best


def merge_step_partials(rows: Iterable[tuple[int, bytes]], *, signal_index: int, level: int, start0: int,
                        bucket_size: int) -> list[tuple[int, float, float, float, int, int]]:
    """rows (bucket, blob) ordered by bucket -> per output bucket:
    (first_step, min, max, last, count, nonfinite); min/max NaN when nothing non-NaN."""
    rows = list(rows)
    if not rows:
        return []
    buckets = np.fromiter((b for b, _ in rows), dtype=np.int64, count=len(rows))
    data = np.frombuffer(b"".join(blob for _, blob in rows), dtype="<f8").reshape(len(rows), 6, S)[:, :, signal_index]
    cols = (buckets * level - start0) // bucket_size
    starts = _group_starts(cols)
    mn = np.fmin.reduceat(data[:, 0], starts)
    mx = np.fmax.reduceat(data[:, 1], starts)
    cnt = np.add.reduceat(data[:, 2], starts)
    nf = np.add.reduceat(data[:, 3], starts)
    # last: the partial with the greatest last_step within each output bucket
    ls = data[:, 4]
    order = np.lexsort((ls, cols))
    ends = np.concatenate((starts[1:], [len(rows)])) - 1
    pick = order[ends]
    last_step = ls[pick]
    last = np.where(last_step >= 0, data[pick, 5], np.nan)
    has_last = last_step >= 0
    out = []
    for i, c in enumerate(cols[starts].tolist()):
        out.append((start0 + c * bucket_size, float(mn[i]), float(mx[i]),
                    float(last[i]) if has_last[i] else None, int(cnt[i]), int(nf[i])))
    return out


def layer_partial_arrays(rows: Sequence[tuple[int, bytes]], width: int):
    """rows (bucket, blob) -> buckets (r,), last_step (r,), arrays (r, 6, width) float32 (NULL-padded)."""
    r = len(rows)
    buckets = np.fromiter((b for b, _ in rows), dtype=np.int64, count=r)
    sizes = {len(blob) for _, blob in rows}
    if len(sizes) == 1 and (w := (sizes.pop() - 8) // 24) == width:
        # one layout for every partial (the common case): decode them all at once
        rec = np.frombuffer(b"".join(blob for _, blob in rows), dtype=np.dtype([("ls", "<f8"), ("v", "<f4", (6, w))]))
        return buckets, rec["ls"].astype(np.float64), np.ascontiguousarray(rec["v"])
    last_step = np.empty(r, dtype=np.float64)
    arr = np.zeros((r, 6, width), dtype="<f4")
    arr[:, 0:2, :] = np.nan
    arr[:, 5, :] = np.array([NULL_F32_BITS], dtype="<u4").view("<f4")[0]
    for i, (_, blob) in enumerate(rows):
        last_step[i] = np.frombuffer(blob[:8], dtype="<f8")[0]
        body = np.frombuffer(blob[8:], dtype="<f4")
        w = len(body) // 6
        arr[i, :, :w] = body.reshape(6, w)
    return buckets, last_step, arr
