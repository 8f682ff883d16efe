"""Per-layer statistics as a layer × step matrix (the run page's heatmaps), downsampled on both axes from
the raw rows or the layer rollups."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from gradwatch.agent.signals import layer_stat

from gradwatch.server.queries.admission import heatmap_cost, heavy_reads
from gradwatch.server.storage.compaction import CompactionRecord
from gradwatch.server.storage.models import ROLLUP_LEVELS, LayerRollup, LayerStat, Run
from gradwatch.server.wire.numbers import measured_mask
from gradwatch.server.storage.rollups import _layer_bits as layer_bits, choose_level, layer_partial_arrays
from gradwatch.server.queries._shared import MAX_MATRIX_CELLS, MAX_MATRIX_READ, RequestTooLarge, _bounds, _compaction, _fetch_blobs
from gradwatch.server.wire.schemas import RunDetailOut


@dataclass
class LayerMatrix:
    """A heatmap: ``cells[row][column]`` float64, NaN where the cell holds a NaN *or* nothing was measured
    (``measured`` tells the two apart). The cells stay numpy arrays: a 1,000,000-cell answer as Python
    floats held the GIL for ~50 ms while it was built, and the API encodes the arrays row block by row
    block (server/api/layer_matrix_json.py); ``values`` gives the lists for callers that want them."""
    run_id: int
    stat: str
    rank: int
    agg: str
    bucket_size: int
    layer_group_size: int
    steps: list[int]                          # first step of each column
    layers: list[str]                         # name of each row (first layer of a group)
    cells: np.ndarray                         # (rows, columns) float64
    measured: np.ndarray                      # (rows, columns) bool: False where nothing was measured

    @property
    def values(self) -> list[list[Optional[float]]]:
        """``values[row][column]``: a float (``nan`` / ``inf`` kept), None where nothing was measured."""
        return [[(x if m else None) for x, m in zip(row_v, row_m)]
                for row_v, row_m in zip(self.cells.tolist(), self.measured.tolist())]


def layer_names_for(run: Run | RunDetailOut, stat: str) -> list[str]:
    """The names that index a statistic's arrays (agent/signals.py says which list; a statistic the table
    does not know is taken to be per parameter)."""
    decl = layer_stat(stat)
    over = decl.over if decl is not None else "params"
    if over == "modules":
        return list(run.module_names or [])
    if over == "bn":
        return list(run.bn_names or [])
    return list(run.param_names or [])


def list_layer_stats(session: Session, *, run_id: int, rank: int = 0) -> list[str]:
    stats = list(session.scalars(
        select(LayerStat.stat).where(LayerStat.run_id == run_id, LayerStat.rank == rank).distinct()
    ).all())
    if _compaction(session, run_id) is not None:    # a statistic whose raw rows are gone lives on in its rollups
        stats += [s for s in session.scalars(select(LayerRollup.stat).where(
            LayerRollup.run_id == run_id, LayerRollup.rank == rank).distinct()) if s not in stats]
    return stats


def get_layer_matrix(session: Session, *, run_id: int, stat: str, start: Optional[int] = None,
                     end: Optional[int] = None, max_steps: int = 500, max_layers: int = 200,
                     rank: int = 0, agg: str = "max", read_budget: int = MAX_MATRIX_READ,
                     admission_wait_s: float = 5.0) -> Optional[LayerMatrix]:
    """A layer × step matrix of one per-layer statistic, downsampled on both axes.

    Columns are step buckets (at most ``max_steps``; from the next rollup level
    up, so fewer, when that keeps ``COARSER_LEVEL_KEEPS`` of them), rows are
    groups of consecutive layers (at most ``max_layers``). ``agg`` is ``max`` (default:
    spikes survive), ``min``, ``mean`` or ``last``; a cell with a NaN among
    its values is NaN, so NaN markers survive too. None if the run is unknown.

    Raises ``RequestTooLarge`` when the answer would have more than ``MAX_MATRIX_CELLS`` cells, or when
    even the coarsest rollup level would read more than ``read_budget`` layer values; below that, a
    request that would read more gets wider buckets (the next rollup level) instead. Raises
    ``HeavyReadBusy`` when the process's heavy-read budget stays taken for ``admission_wait_s``.
    """
    if agg not in ("max", "min", "mean", "last"):
        raise ValueError("agg must be max, min, mean or last")
    run = session.get(Run, run_id)
    if run is None:
        return None
    names = layer_names_for(run, stat)
    base = [LayerStat.run_id == run_id, LayerStat.stat == stat, LayerStat.rank == rank]
    lo, hi = _bounds(session, LayerStat.step, base)
    rec = CompactionRecord.of(run.config)
    if rec is not None:
        lo, hi = rec.bounds(rank, lo, hi)
    empty = LayerMatrix(run_id=run_id, stat=stat, rank=rank, agg=agg, bucket_size=1, layer_group_size=1,
                        steps=[], layers=names[:max_layers], cells=np.empty((0, 0)), measured=np.empty((0, 0), bool))
    if lo is None:
        return empty
    start = lo if start is None else max(start, lo)
    end = hi if end is None else min(end, hi)
    if end < start:
        return empty
    max_steps, max_layers = max(1, int(max_steps)), max(1, int(max_layers))
    width = max(1, len(names))
    if max_steps * min(max_layers, width) > MAX_MATRIX_CELLS:
        raise RequestTooLarge(f"max_steps={max_steps} × {min(max_layers, width)} layer rows is more than "
                              f"{MAX_MATRIX_CELLS:,} cells: ask for fewer steps or layers")
    bucket = max(1, math.ceil((end - start + 1) / max_steps))
    level = _coarsest_keeping_columns(choose_level(bucket), bucket, end - start + 1)
    if rec is not None and rec.layer_level_for(rank, start) > level:   # raw rows (or fine rollups) compacted
        level = rec.layer_level_for(rank, start)
        bucket = max(bucket, level)
    while True:
        # what the answer reads: partials of this level (or raw rows) × layers; too many, and the buckets
        # widen to the next level (a coarser heatmap of the same range) rather than the memory growing
        if level:
            bucket = math.ceil(bucket / level) * level
            read = session.scalar(select(func.count()).select_from(LayerRollup).where(
                LayerRollup.run_id == run_id, LayerRollup.stat == stat, LayerRollup.rank == rank,
                LayerRollup.level == level, LayerRollup.bucket >= start // level, LayerRollup.bucket <= end // level))
        else:
            read = session.scalar(select(func.count()).select_from(LayerStat).where(
                *base, LayerStat.step >= start, LayerStat.step <= end))
        if read * width <= read_budget:
            break
        coarser = [lv for lv in ROLLUP_LEVELS if lv > level]
        if not coarser:
            raise RequestTooLarge(f"this heatmap would read {read * width:,} layer values (more than "
                                  f"{read_budget:,}): ask for a shorter step range")
        level = coarser[0]
        bucket = max(bucket, level)
    # the memory this read holds is admitted against the process's budget for heavy reads first: a
    # queue, then HeavyReadBusy (429/503 with Retry-After) when the budget stays taken (server/queries/admission.py)
    cells = min(max_steps, math.ceil((end - start + 1) / bucket)) * min(max_layers, width)
    gate = heavy_reads()
    cost = heatmap_cost(read * width, cells, from_partials=bool(level))
    with gate.admit(cost, wait_s=admission_wait_s, release=session.rollback):
        try:
            return _read_matrix(session, run_id=run_id, stat=stat, rank=rank, agg=agg, names=names, base=base,
                                start=start, end=end, level=level, bucket=bucket, max_layers=max_layers, empty=empty)
        finally:
            # only after the largest reads: a dropped cache costs the next read of the same pages ~40 ms
            # (bench/query.py's whole-run heatmaps), and a small read does not fill it
            if cost >= gate.budget // 4:
                _drop_page_cache(session)


def _drop_page_cache(session: Session) -> None:
    """SQLite: the connection's page cache given back (``PRAGMA shrink_memory``). Each pooled connection
    keeps up to ``cache_size`` (64 MB, server/storage/db.py) of the pages it read: four heatmaps of a 53,000-step
    × 150-layer run, each read through another connection, left the process 40 MB larger each, pages
    that ``malloc_trim`` cannot give back while SQLite holds them. What the next read needs again comes
    back from the OS's file cache."""
    if session.get_bind().dialect.name == "sqlite":
        session.execute(text("PRAGMA shrink_memory"))


def _read_matrix(session: Session, *, run_id, stat, rank, agg, names, base, start, end, level, bucket, max_layers,
                 empty) -> LayerMatrix:
    if level:
        start0 = (start // level) * level
        rows = _fetch_blobs(session, select(LayerRollup.bucket, LayerRollup.data).where(
            LayerRollup.run_id == run_id, LayerRollup.stat == stat, LayerRollup.rank == rank,
            LayerRollup.level == level, LayerRollup.bucket >= start // level, LayerRollup.bucket <= end // level,
        ).order_by(LayerRollup.bucket))
        buckets, last_step, arr = layer_partial_arrays(rows, len(names))   # widened to the widest partial
        cols = (buckets * level - start0) // bucket
    else:
        rows = _fetch_blobs(session, select(LayerStat.step, LayerStat.values).where(
            *base, LayerStat.step >= start, LayerStat.step <= end).order_by(LayerStat.step))
        if len(rows) == 0:
            return empty
        width = max([len(names)] + [len(v) // 4 for _, v in rows])
        steps = np.fromiter((st for st, _ in rows), dtype=np.int64, count=len(rows))
        bits = _bits_of([v for _, v in rows], width)
        del rows
        cols = (steps - start) // bucket
        cells = _raw_cells(bits, steps, cols, agg)
        return _matrix(run_id, stat, rank, agg, names, cols, cells, start, bucket, max_layers)
    if len(rows) == 0:
        return empty
    return _finish_matrix(run_id, stat, rank, agg, names, cols, last_step, arr, start0, bucket, max_layers)


def _bits_of(blobs: list[bytes], width: int) -> np.ndarray:
    """Raw layer arrays -> (steps, width) uint32 bit patterns (``_layer_bits``), copied ~4,096 rows at a
    time where every array has ``width`` values: one ``b"".join`` of a 53,000-step read copies 32 MB
    with the GIL held."""
    if any(len(b) != 4 * width for b in blobs):
        return layer_bits(blobs, width)
    bits = np.empty((len(blobs), width), dtype="<u4")
    for first in range(0, len(blobs), 4096):
        part = blobs[first:first + 4096]
        bits[first:first + len(part)] = np.frombuffer(b"".join(part), dtype="<u4").reshape(len(part), width)
    return bits


# A heatmap read from the next rollup level up when that keeps at least this share of the columns: a
# 1,000,000-step run asked for 300 columns gets 245 of 4,096 steps instead of 279 of 3,584, from a
# sixteenth of the level's partials (~4 MB instead of ~14 MB a statistic with 150 layers).
COARSER_LEVEL_KEEPS = 0.8


def _coarsest_keeping_columns(level: int, bucket: int, span: int) -> int:
    """``level``, or a coarser rollup level whose buckets still give ``COARSER_LEVEL_KEEPS`` of its columns."""
    if not level:
        return level

    def columns(lv: int) -> int:
        return math.ceil(span / (math.ceil(bucket / lv) * lv))

    for coarser in (lv for lv in ROLLUP_LEVELS if lv > level):
        if columns(coarser) < COARSER_LEVEL_KEEPS * columns(level):
            break
        level = coarser
    return level


def _finish_matrix(run_id, stat, rank, agg, names, cols, last_step, arr, start0, bucket, max_layers) -> LayerMatrix:
    """Merge partials (r, 6, W), sorted by column, into cells (rows: layer groups, columns: buckets)."""
    # rows come ordered by step (or bucket), so usually already in (column, last step) order: the sort's
    # copy of ``arr`` (190 MB for a 53,000-step × 150-layer read) only when they are not
    if not _in_order(cols, last_step):
        order = np.lexsort((last_step, cols))
        cols, last_step, arr = cols[order], last_step[order], arr[order]
    r, _, width = arr.shape
    starts = _column_starts(cols)
    cnt = _reduce_columns(np.add, arr[:, 3], starts)
    nan = _reduce_columns(np.add, arr[:, 4], starts)
    if agg == "last":
        # per layer: the latest partial in the column where the layer was measured
        meas = measured_mask(arr[:, 5])
        val, has = _latest_measured(meas, starts, lambda best, col: arr[best, 5, col])
        return _matrix(run_id, stat, rank, agg, names, cols, (val, has, has & np.isnan(val)), start0, bucket,
                       max_layers)
    if agg == "max":
        val = _reduce_columns(np.fmax, arr[:, 1], starts)
    elif agg == "min":
        val = _reduce_columns(np.fmin, arr[:, 0], starts)
    else:
        sm = _reduce_columns(np.add, arr[:, 2].astype(np.float64), starts)
        val = np.where(cnt > 0, sm / np.maximum(cnt, 1), np.nan)
    return _matrix(run_id, stat, rank, agg, names, cols, (val.astype(np.float64), (cnt + nan) > 0, nan > 0),
                   start0, bucket, max_layers)


def _raw_cells(bits: np.ndarray, steps: np.ndarray, cols: np.ndarray, agg: str):
    """Raw per-step arrays ``bits`` (r, W) uint32, rows in step order, straight into per-column cells
    ``(values, measured, nan)``, (columns, W) each: the same numbers ``_finish_matrix`` gets from their
    one-step partials (``raw_layer_partials``), without the (r, 6, W) float32 partials (190 MB for a
    53,000-step × 150-layer read) or their sort."""
    if not _in_order(cols, steps):
        order = np.argsort(steps, kind="stable")
        bits, cols, steps = bits[order], cols[order], steps[order]
    starts = _column_starts(cols)
    measured = measured_mask(bits)
    vals = bits.view("<f4")
    isnan = np.isnan(vals) & measured
    ok = measured & ~isnan
    nan = _reduce_columns(np.add, isnan, starts, dtype=np.int32)
    if agg == "last":
        del ok, isnan
        val, has = _latest_measured(measured, starts, lambda best, col: vals[best, col])
        return val, has, has & np.isnan(val)
    cnt = _reduce_columns(np.add, ok, starts, dtype=np.int32)
    if agg == "mean":
        sm = _reduce_columns(np.add, np.where(ok, vals, np.float32(0)).astype(np.float64), starts)
        val = np.where(cnt > 0, sm / np.maximum(cnt, 1), np.nan)
    else:
        reduce = np.fmax if agg == "max" else np.fmin
        val = _reduce_columns(reduce, np.where(ok, vals, np.float32(np.nan)), starts).astype(np.float64)
    return val, (cnt + nan) > 0, nan > 0


def _in_order(cols: np.ndarray, last_step: np.ndarray) -> bool:
    """Rows already in (column, last step) order (the usual case: read ordered by step or bucket)."""
    return len(cols) < 2 or bool(np.all((cols[1:] > cols[:-1])
                                        | ((cols[1:] == cols[:-1]) & (last_step[1:] >= last_step[:-1]))))


def _column_starts(cols: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.flatnonzero(np.diff(cols)) + 1))


# rows of (r, W) arrays one ``reduceat`` call reduces: numpy holds the GIL through a ``reduceat``, and one
# over a 53,000-step × 150-layer read held it for 100–170 ms, while ``/api/health`` waited
REDUCE_BLOCK_VALUES = 250_000


def _reduce_columns(ufunc, a: np.ndarray, starts: np.ndarray, dtype=None) -> np.ndarray:
    """``ufunc.reduceat(a, starts, axis=0)`` a block of whole columns (about ``REDUCE_BLOCK_VALUES``
    values) at a time: the same result, the GIL let go between blocks."""
    n = len(a)
    rows = max(1, REDUCE_BLOCK_VALUES // max(1, a[0].size if n else 1))
    if n <= rows:
        return ufunc.reduceat(a, starts, axis=0, dtype=dtype)
    out, i = [], 0
    while i < len(starts):
        j = max(i + 1, int(np.searchsorted(starts, starts[i] + rows, side="left")))
        lo, hi = int(starts[i]), (int(starts[j]) if j < len(starts) else n)
        out.append(ufunc.reduceat(a[lo:hi], starts[i:j] - lo, axis=0, dtype=dtype))
        i = j
    return np.concatenate(out)


def _reduce_groups(ufunc, a: np.ndarray, gstarts: np.ndarray) -> np.ndarray:
    """``ufunc.reduceat(a, gstarts, axis=1)`` (layer groups), a block of rows at a time (as above)."""
    rows = max(1, REDUCE_BLOCK_VALUES // max(1, a.shape[1]))
    return np.concatenate([ufunc.reduceat(a[i:i + rows], gstarts, axis=1) for i in range(0, len(a), rows)])


def _latest_measured(meas: np.ndarray, starts: np.ndarray, value_at):
    """Per column and layer: the value of the latest row (rows sorted by last step within a column) where
    the layer was measured, ``value_at(row_index, layer_index)``; NaN and False where none was."""
    r, width = meas.shape
    idx = np.where(meas, np.arange(r, dtype=np.int64 if r >= 2**31 else np.int32)[:, None], -1)
    best = _reduce_columns(np.maximum, idx, starts)
    has = best >= 0
    val = np.where(has, value_at(np.where(has, best, 0), np.arange(width)[None, :]), np.nan).astype(np.float64)
    return np.where(has & np.isnan(val), np.nan, val), has


def _matrix(run_id, stat, rank, agg, names, cols, cells, start0, bucket, max_layers) -> LayerMatrix:
    """Per-column cells ``(values, measured, nan)`` (columns, W) into the answer: consecutive layers
    grouped into at most ``max_layers`` rows, rows × columns."""
    val, measured_cell, nan_cell = cells
    width = val.shape[1]
    group = max(1, math.ceil(width / max_layers))
    gstarts = np.arange(0, width, group)
    if group > 1:
        meas_g = _reduce_groups(np.logical_or, measured_cell, gstarts)
        nan_g = _reduce_groups(np.logical_or, nan_cell, gstarts)
        if agg == "min":
            val_g = _reduce_groups(np.fmin, val, gstarts)
        elif agg == "mean":
            ok = ~np.isnan(val)
            n_g = _reduce_groups(np.add, ok.astype(np.float64), gstarts)
            s_g = _reduce_groups(np.add, np.where(ok, val, 0.0), gstarts)
            val_g = np.where(n_g > 0, s_g / np.maximum(n_g, 1), np.nan)
        else:  # max, and last (the largest of the group's latest values)
            val_g = _reduce_groups(np.fmax, val, gstarts)
    else:
        meas_g, nan_g, val_g = measured_cell, nan_cell, val
    # NaN where the cell holds a NaN or nothing was measured; ``measured`` tells which
    val_g = np.where(nan_g | ~meas_g, np.nan, val_g)
    layers = [names[g] if g < len(names) else f"#{g}" for g in gstarts.tolist()]
    starts = _column_starts(cols)
    steps_out = [int(start0 + c * bucket) for c in cols[starts].tolist()]
    return LayerMatrix(run_id=run_id, stat=stat, rank=rank, agg=agg, bucket_size=bucket, layer_group_size=group,
                       steps=steps_out, layers=layers, cells=np.ascontiguousarray(val_g.T),
                       measured=np.ascontiguousarray(meas_g.T))
