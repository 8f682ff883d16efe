"""Multi-resolution partial aggregates ("rollups") for step signals and layer stats.

Written by ingest for the steps a batch actually inserted, read by queries
when a chart bucket spans at least one rollup level. Every partial covers one
``(level, bucket = step // level)`` from one batch; partials are merged at
read time with the same reductions, so out-of-order batches from several
replicas simply add partials (no shared row is ever updated).

Step partial (``StepRollup.data``): float64[6, W], one column per step signal id
    (agent/signals.py; W = the widest id + 1 when it was written, so a partial written
    before a signal was declared is narrower and holds nothing of it)
    rows: min, max (NaN skipped, ±inf kept; NaN if nothing non-NaN),
          count (measured, NaN included), nonfinite (NaN and ±inf),
          last_step (-1: none), last_value (NaN kept)
Layer partial (``LayerRollup.data``), in one of two forms told apart by the
sign of its first float64:
    full:    float64 last_step (>= 0), then float32[6, W]
             rows: min, max, sum (NaN skipped), count (non-NaN measured), nan count,
                   last value (NULL_F32_BITS pattern when not measured)
    compact: float64 -1 - step, then the step's raw float32[W] exactly as stored in
             ``layer_stats``: a bucket that holds one step of its batch. Its full form
             follows from the raw values alone and is six times the size; a statistic
             sampled every 100 steps makes almost only such partials (docs/architecture.md).
Steps are >= 0 (schema), so a full partial's last_step never looks compact.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

from gradwatch.server.storage.models import ROLLUP_LEVELS
from gradwatch.server.wire.numbers import NULL_F32_BITS, measured_mask

def _group_starts(buckets: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.flatnonzero(np.diff(buckets)) + 1))


def _coarsen(steps: np.ndarray, arrays: dict, levels: Sequence[int]):
    """Yield ``(level, buckets, reduced, changed)`` for each level, coarsest last.

    ``arrays`` maps a name to ``(ufunc, identity, array)`` with one row per step (``identity``: the
    value that leaves the reduction unchanged). Each level is reduced from the one before it rather
    than from the raw rows (a 178-step batch makes ~12 level-16 rows; the coarser levels then cost
    next to nothing), which needs every level to divide the next. ``changed`` is False when every
    row was alone in its bucket and passed through as it was.
    """
    keys, prev, cur = steps, 1, arrays
    for level in levels:
        if level % prev:
            raise ValueError(f"rollup levels must each divide the next: {tuple(levels)}")
        f = level // prev
        buckets = keys // f                     # floor(floor(s / a) / b) == floor(s / (a * b))
        changed = bool(len(buckets) > 1 and (buckets[1:] == buckets[:-1]).any())
        if changed:
            with np.errstate(invalid="ignore"):     # +inf and -inf in one bucket's sum: NaN, as stored
                cur, buckets = _reduce_groups(keys, buckets, f, cur)
        keys, prev = buckets, level
        yield level, keys, cur, changed


def _reduce_groups(keys: np.ndarray, buckets: np.ndarray, f: int, cur: dict):
    """Reduce rows by ``buckets = keys // f`` (keys sorted, unique). Steps of a batch are (nearly)
    consecutive, so the rows are laid out densely as (bucket, f, …) and reduced along one axis,
    which numpy does several times faster than ``ufunc.reduceat`` along the rows; a sparse spread
    of keys falls back to ``reduceat``."""
    first = int(buckets[0]) * f
    span = int(keys[-1]) - first + 1
    groups = -(-span // f)
    if groups * f > 4 * len(keys) + 2 * f:
        starts = np.concatenate(([0], np.flatnonzero(np.diff(buckets)) + 1))
        return ({name: (op, ident, op.reduceat(a, starts, axis=0)) for name, (op, ident, a) in cur.items()},
                buckets[starts])
    pos = keys - first
    occupied = np.zeros(groups, dtype=bool)
    occupied[pos // f] = True
    out = {}
    for name, (op, ident, a) in cur.items():
        dense = np.full((groups * f, *a.shape[1:]), ident, dtype=a.dtype)
        dense[pos] = a
        out[name] = (op, ident, op.reduce(dense.reshape(groups, f, *a.shape[1:]), axis=1)[occupied])
    return out, np.flatnonzero(occupied) + int(buckets[0])


def step_partials(steps: np.ndarray, values: np.ndarray, measured: np.ndarray, *,
                  levels: Sequence[int] = ROLLUP_LEVELS) -> list[tuple[int, int, bytes]]:
    """(level, bucket, blob) for sorted ``steps`` (n,), ``values`` (n, W) float64 by signal id with
    NaN for both NaN and null, ``measured`` (n, W) bool (True for NaN too)."""
    n = len(steps)
    if n == 0:
        return []
    nonfinite = (~np.isfinite(values) & measured).astype(np.float64)
    rows = {"min": (np.minimum, np.inf, np.where(np.isnan(values), np.inf, values)),
            "max": (np.maximum, -np.inf, np.where(np.isnan(values), -np.inf, values)),
            "count": (np.add, 0.0, measured.astype(np.float64)),
            "nonfinite": (np.add, 0.0, nonfinite),
            "finite": (np.add, 0, (measured & ~np.isnan(values)).astype(np.int64)),
            "last": (np.maximum, -1, np.where(measured, np.arange(n)[:, None], -1))}
    cols = np.arange(values.shape[1])[None, :]
    out = []
    raw = b""
    for level, buckets, r, changed in _coarsen(steps, rows, levels):
        if changed or not raw:
            empty = r["finite"][2] == 0         # nothing but NaN: min and max are NaN
            last_idx = r["last"][2]
            has = last_idx >= 0
            safe = np.where(has, last_idx, 0)
            last_step = np.where(has, steps[safe].astype(np.float64), -1.0)
            last_val = np.where(has, values[safe, cols], np.nan)
            block = np.stack([np.where(empty, np.nan, r["min"][2]), np.where(empty, np.nan, r["max"][2]),
                              r["count"][2], r["nonfinite"][2], last_step, last_val], axis=1).astype("<f8")
            raw, size = block.tobytes(), block[0].nbytes   # (g, 6, W)
        for g, b in enumerate(buckets.tolist()):
            out.append((level, b, raw[g * size:(g + 1) * size]))
    return out


def layer_partials(steps: np.ndarray, blobs: Sequence[bytes], *,
                   levels: Sequence[int] = ROLLUP_LEVELS) -> list[tuple[int, int, bytes]]:
    """(level, bucket, blob) for one stat: sorted ``steps`` and their float32 blobs."""
    return [(lv, b, blob) for _, lv, b, blob in layer_partials_by_stat({"": (steps, blobs)}, levels=levels)]


def layer_partials_by_stat(by_stat: dict[str, tuple[Sequence[int], Sequence[bytes]]], *,
                           levels: Sequence[int] = ROLLUP_LEVELS) -> list[tuple[str, int, int, bytes]]:
    """(stat, level, bucket, blob) for several stats, each with sorted steps and float32 blobs.

    Stats sampled at the same steps (the agent sends eight of them together every K steps) are
    reduced side by side as one wide matrix: a 1- or 2-step partial costs its ~50 numpy calls, not
    its numbers, so eight separate ones would cost eight times as much.
    """
    groups: dict[tuple, list[str]] = {}
    for stat, (steps, blobs) in by_stat.items():
        if len(steps):
            groups.setdefault(tuple(int(x) for x in steps), []).append(stat)
    out = []
    for steps_key, stats in groups.items():
        steps = np.array(steps_key, dtype=np.int64)
        mats = [_layer_bits(by_stat[stat][1]) for stat in stats]
        bits = mats[0] if len(mats) == 1 else np.hstack(mats)
        raws: dict[str, tuple[bytes, int]] = {}
        compact: dict[tuple[str, int], bytes] = {}   # (stat, row) -> compact partial, the same at every level
        for level, buckets, changed, body, last_step, alone in _layer_blocks(steps, bits, levels):
            off = 0
            for stat, m in zip(stats, mats):
                w = m.shape[1]
                blobs = by_stat[stat][1]
                if (changed or stat not in raws) and body is not None:
                    record = np.dtype([("last_step", "<f8"), ("rows", "<f4", (6, w))])
                    rec = np.empty(len(buckets), dtype=record)
                    rec["last_step"] = last_step
                    rec["rows"] = body[:, :, off:off + w]
                    raws[stat] = (rec.tobytes(), record.itemsize)
                for g, (b, row) in enumerate(zip(buckets.tolist(), alone.tolist())):
                    if row >= 0:
                        blob = compact.get((stat, row))
                        if blob is None:
                            blob = compact[(stat, row)] = compact_partial(steps_key[row], blobs[row])
                    else:
                        raw, size = raws[stat]
                        blob = raw[g * size:(g + 1) * size]
                    out.append((stat, level, b, blob))
                off += w
    return out


def compact_partial(step: int, raw: bytes) -> bytes:
    """The compact layer partial of a bucket holding one step (see the module docstring).

    >>> compact_partial(7, b"\\x00\\x00\\x80\\x3f")[:8] == np.array([-8.0], "<f8").tobytes()
    True
    """
    return np.array([-1.0 - step], dtype="<f8").tobytes() + raw


def _layer_bits(blobs: Sequence[bytes], width: Optional[int] = None) -> np.ndarray:
    """(steps, width) uint32 bit patterns, ``width`` by default the longest array's; a shorter array is
    padded with "not measured"."""
    sizes = {len(b) for b in blobs}
    if width is None:
        width = max(sizes) // 4
    if sizes == {4 * width}:   # the usual case: every step reports every layer
        return np.frombuffer(b"".join(blobs), dtype="<u4").reshape(len(blobs), width)
    bits = np.full((len(blobs), width), NULL_F32_BITS, dtype="<u4")
    for i, b in enumerate(blobs):
        a = np.frombuffer(b, dtype="<u4")
        bits[i, : len(a)] = a
    return bits


def _layer_blocks(steps: np.ndarray, bits: np.ndarray, levels: Sequence[int]):
    """Yield ``(level, buckets, changed, rows (g, 6, W) float32, last_step (g,) float64, alone (g,))``
    per level; ``alone`` is the row of the bucket's only step, or -1 where it holds several."""
    n = len(steps)
    measured = measured_mask(bits)
    vals = bits.view("<f4")
    nan = np.isnan(vals)
    ok = measured & ~nan
    rows = {"min": (np.minimum, np.inf, np.where(ok, vals, np.float32(np.inf))),
            "max": (np.maximum, -np.inf, np.where(ok, vals, np.float32(-np.inf))),
            # summed in float64 (stored as float32): a long bucket's mean keeps its precision
            "sum": (np.add, 0.0, np.where(ok, vals, np.float32(0)).astype(np.float64)),
            "count": (np.add, 0, ok.astype(np.int32)), "nan": (np.add, 0, (nan & measured).astype(np.int32)),
            "last": (np.maximum, -1, np.where(measured, np.arange(n, dtype=np.int32)[:, None], np.int32(-1))),
            "last_step": (np.maximum, -np.inf, steps.astype(np.float64)),
            "steps": (np.add, 0, np.ones(n, dtype=np.int32)),
            "row": (np.maximum, -1, np.arange(n, dtype=np.int32))}
    cols = np.arange(bits.shape[1])[None, :]
    body = None
    for level, buckets, r, changed in _coarsen(steps, rows, levels):
        alone = np.where(r["steps"][2] == 1, r["row"][2], -1)
        if changed:
            body = None
        if body is None and (alone < 0).any():   # only buckets of several steps need the full form
            count = r["count"][2]
            empty = count == 0                  # nothing measured but NaN: min and max are NaN
            body = np.empty((len(buckets), 6, bits.shape[1]), dtype="<f4")
            body[:, 0] = np.where(empty, np.float32(np.nan), r["min"][2])
            body[:, 1] = np.where(empty, np.float32(np.nan), r["max"][2])
            body[:, 2] = r["sum"][2]
            body[:, 3] = count
            body[:, 4] = r["nan"][2]
            last_idx = r["last"][2]
            has = last_idx >= 0
            body[:, 5] = np.where(has, bits[np.where(has, last_idx, 0), cols], NULL_F32_BITS).view("<f4")
        yield level, buckets, changed, body, r["last_step"][2], alone


def choose_level(bucket_size: int) -> int:
    """The coarsest rollup level not larger than ``bucket_size`` (0: read raw rows)."""
    best = 0
    for level in ROLLUP_LEVELS:
        if level <= bucket_size:
            best = level
    return best


def _merge_groups(data: np.ndarray, keys: np.ndarray, starts: np.ndarray):
    """One signal's (r, 6) partial rows merged per group (rows of equal ``keys``, contiguous, starting at
    ``starts``): ``(min, max, count, nonfinite, last, has_last)``, min / max NaN when nothing non-NaN, last
    that of the partial with the greatest last_step (NaN, ``has_last`` False, when none measured it)."""
    mn = np.fmin.reduceat(data[:, 0], starts)
    mx = np.fmax.reduceat(data[:, 1], starts)
    cnt = np.add.reduceat(data[:, 2], starts)
    nf = np.add.reduceat(data[:, 3], starts)
    ls = data[:, 4]
    order = np.lexsort((ls, keys))
    pick = order[np.concatenate((starts[1:], [len(data)])) - 1]
    has_last = ls[pick] >= 0
    return mn, mx, cnt, nf, np.where(has_last, data[pick, 5], np.nan), has_last


def merge_step_partials(rows: Iterable[tuple[int, bytes]], *, signal_index: int, level: int, start0: int,
                        bucket_size: int) -> list[tuple[int, float, float, float, int, int]]:
    """rows (bucket, blob) ordered by bucket -> per output bucket:
    (first_step, min, max, last, count, nonfinite); min/max NaN when nothing non-NaN."""
    rows = list(rows)
    if not rows:
        return []
    buckets = np.fromiter((b for b, _ in rows), dtype=np.int64, count=len(rows))
    data = step_partial_column([blob for _, blob in rows], signal_index)
    cols = (buckets * level - start0) // bucket_size
    starts = _group_starts(cols)
    mn, mx, cnt, nf, last, has_last = _merge_groups(data, cols, starts)
    out = []
    for i, c in enumerate(cols[starts].tolist()):
        out.append((start0 + c * bucket_size, float(mn[i]), float(mx[i]),
                    float(last[i]) if has_last[i] else None, int(cnt[i]), int(nf[i])))
    return out


def merge_rank_step_partials(rows: Sequence[tuple[int, int, bytes]], *, ranks: Sequence[int],
                             signal_indexes: Sequence[int], level: int, start0: int, bucket_size: int):
    """:func:`merge_step_partials` for many ranks and signals in one go. ``rows``: (rank, bucket, blob),
    ordered by rank, then bucket. Returns ``(first_steps, per_signal)``: the output columns (each bucket
    some rank has a partial in, ascending) and, per signal index, six arrays of shape (len(ranks),
    columns): ``min, max, last, count, nonfinite, has_last``; NaN / 0 / False where a rank has no partial
    in the column. Each cell is merged as :func:`merge_step_partials` merges a bucket (for a 64-rank run's
    whole-run matrix, 256 per-rank merges and their Python tuples were ~2/3 of the rank section's read)."""
    ranks = list(ranks)
    if not rows:
        empty = (len(ranks), 0)
        return [], {i: (*(np.zeros(empty) for _ in range(5)), np.zeros(empty, dtype=bool)) for i in signal_indexes}
    where = {r: i for i, r in enumerate(ranks)}
    row_of = np.fromiter((where[r] for r, _, _ in rows), dtype=np.int64, count=len(rows))
    buckets = np.fromiter((b for _, b, _ in rows), dtype=np.int64, count=len(rows))
    cols = (buckets * level - start0) // bucket_size
    keys = row_of * (int(cols.max()) + 1) + cols            # (rank, column)
    blobs = [blob for _, _, blob in rows]
    order = np.argsort(keys, kind="stable")                 # ranks asked for in another order than read
    if (np.diff(order) != 1).any():
        keys, row_of, cols = keys[order], row_of[order], cols[order]
        blobs = [blobs[i] for i in order.tolist()]
    starts = _group_starts(keys)
    firsts, col_index = np.unique(cols[starts], return_inverse=True)
    g_row = row_of[starts]
    shape = (len(ranks), len(firsts))
    out = {}
    for sid, data in zip(signal_indexes, step_partial_columns(blobs, signal_indexes)):
        mn, mx, cnt, nf, last, has_last = _merge_groups(data, keys, starts)
        grids = [np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan), np.zeros(shape),
                 np.zeros(shape), np.zeros(shape, dtype=bool)]
        for grid, vals in zip(grids, (mn, mx, last, cnt, nf, has_last)):
            grid[g_row, col_index] = vals
        out[sid] = tuple(grids)
    return (start0 + firsts * bucket_size).tolist(), out


def step_partial_columns(blobs: Sequence[bytes], signal_indexes: Sequence[int]) -> list[np.ndarray]:
    """:func:`step_partial_column` for several signals, the blobs decoded once."""
    sizes = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs))
    outs = [np.tile(_NOTHING, (len(blobs), 1)) for _ in signal_indexes]
    for size in np.unique(sizes).tolist():
        width = size // 48
        rows = np.flatnonzero(sizes == size)
        wanted = [(k, i) for k, i in enumerate(signal_indexes) if i < width]
        if not wanted:
            continue
        group = blobs if len(rows) == len(blobs) else [blobs[i] for i in rows.tolist()]
        decoded = np.frombuffer(b"".join(group), dtype="<f8").reshape(len(rows), 6, width)
        for k, i in wanted:
            outs[k][rows] = decoded[:, :, i]
    return outs


_NOTHING = np.array([np.nan, np.nan, 0.0, 0.0, -1.0, np.nan])   # a partial that holds nothing of a signal


def step_partial_column(blobs: Sequence[bytes], signal_index: int) -> np.ndarray:
    """(r, 6) rows of one signal out of step partials, whatever width each was written with (a batch
    that measured no signal without a column writes narrower partials; so did servers before a signal
    was declared): each width is decoded in one go."""
    return step_partial_columns(blobs, [signal_index])[0]


def layer_partial_width(blob: bytes) -> int:
    """The number of layers a layer partial holds, in either form."""
    return int(_partial_widths(np.array([len(blob)]), np.frombuffer(blob[:8], dtype="<f8") < 0)[0])


def _partial_widths(sizes: np.ndarray, compact: np.ndarray) -> np.ndarray:
    return (sizes - 8) // np.where(compact, 4, 24)


def layer_partial_arrays(rows: Sequence[tuple[int, bytes]], width: int):
    """rows (bucket, blob) -> buckets (r,), last_step (r,), arrays (r, 6, W) float32 (NULL-padded),
    in the rows' order, whichever form each partial has; W is ``width`` or the widest partial's."""
    r = len(rows)
    buckets = np.fromiter((b for b, _ in rows), dtype=np.int64, count=r)
    blobs = [blob for _, blob in rows]
    heads = np.frombuffer(b"".join(blob[:8] for blob in blobs), dtype="<f8")
    compact = heads < 0
    if r:
        width = max(width, int(_partial_widths(np.fromiter(map(len, blobs), np.int64, r), compact).max()))
    if compact.all():      # one form (the usual case): decoded in one go
        last_step, arr = _decode_compact(heads, blobs, width)
    elif not compact.any():
        last_step, arr = _decode_full(blobs, width)
    else:
        last_step = np.empty(r, dtype=np.float64)
        arr = np.empty((r, 6, width), dtype="<f4")
        c, f = np.flatnonzero(compact), np.flatnonzero(~compact)
        last_step[c], arr[c] = _decode_compact(heads[c], [blobs[i] for i in c.tolist()], width)
        last_step[f], arr[f] = _decode_full([blobs[i] for i in f.tolist()], width)
    return buckets, last_step, arr


def _decode_compact(heads: np.ndarray, blobs: Sequence[bytes], width: int):
    return raw_layer_partials(-1.0 - heads, [blob[8:] for blob in blobs], width)


def _decode_full(blobs: Sequence[bytes], width: int):
    r = len(blobs)
    sizes = {len(blob) for blob in blobs}
    if len(sizes) == 1 and (w := (sizes.pop() - 8) // 24) == width:
        # one layout for every partial (the common case): decode them all at once
        rec = np.frombuffer(b"".join(blobs), dtype=np.dtype([("ls", "<f8"), ("v", "<f4", (6, w))]))
        return rec["ls"].astype(np.float64), np.ascontiguousarray(rec["v"])
    last_step = np.empty(r, dtype=np.float64)
    arr = np.zeros((r, 6, width), dtype="<f4")
    arr[:, 0:2, :] = np.nan
    arr[:, 5, :] = np.array([NULL_F32_BITS], dtype="<u4").view("<f4")[0]
    for i, blob in enumerate(blobs):
        last_step[i] = np.frombuffer(blob[:8], dtype="<f8")[0]
        body = np.frombuffer(blob[8:], dtype="<f4")
        w = len(body) // 6
        arr[i, :, :w] = body.reshape(6, w)
    return last_step, arr


def raw_layer_partials(steps, blobs: Sequence[bytes], width: int):
    """Raw per-step arrays (as stored in ``layer_stats``) as one-step partials:
    last_step (r,) float64, arrays (r, 6, width) float32 (NULL-padded)."""
    r = len(blobs)
    bits = _layer_bits(blobs, width)
    vals = bits.view("<f4")
    measured = measured_mask(bits)
    isnan = np.isnan(vals) & measured
    ok = measured & ~isnan
    arr = np.empty((r, 6, width), dtype="<f4")
    clean = np.where(ok, vals, np.float32(np.nan))
    arr[:, 0] = clean
    arr[:, 1] = clean
    arr[:, 2] = np.where(ok, vals, np.float32(0))
    arr[:, 3] = ok
    arr[:, 4] = isnan
    arr[:, 5].view("<u4")[:] = bits
    return np.asarray(steps, dtype=np.float64), arr
