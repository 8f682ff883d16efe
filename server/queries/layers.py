"""Per-layer statistics as a layer × step matrix (the run page's heatmaps), downsampled on both axes from
the raw rows or the layer rollups."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import layer_stat

from ..admission import heatmap_cost, heavy_reads
from ..lifecycle.retention_config import CompactionRecord
from ..models import ROLLUP_LEVELS, LayerRollup, LayerStat, Run
from ..numbers import NULL_F32_BITS
from ..rollups import choose_level, layer_partial_arrays, raw_layer_partials
from ._shared import MAX_MATRIX_CELLS, MAX_MATRIX_READ, RequestTooLarge, _bounds, _compaction, _fetch_blobs
from .runs import RunDetail


@dataclass
class LayerMatrix:
    run_id: int
    stat: str
    rank: int
    agg: str
    bucket_size: int
    layer_group_size: int
    steps: list[int]                          # first step of each column
    layers: list[str]                         # name of each row (first layer of a group)
    values: list[list[Optional[float]]]       # values[row][column]; None: nothing measured


def layer_names_for(run: Run | RunDetail, stat: str) -> list[str]:
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
                        steps=[], layers=names[:max_layers], values=[])
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
    # queue, then HeavyReadBusy (429/503 with Retry-After) when the budget stays taken (server/admission.py)
    cells = min(max_steps, math.ceil((end - start + 1) / bucket)) * min(max_layers, width)
    with heavy_reads().admit(heatmap_cost(read * width, cells), wait_s=admission_wait_s, release=session.rollback):
        return _read_matrix(session, run_id=run_id, stat=stat, rank=rank, agg=agg, names=names, base=base,
                            start=start, end=end, level=level, bucket=bucket, max_layers=max_layers, empty=empty)


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
        start0 = start
        rows = _fetch_blobs(session, select(LayerStat.step, LayerStat.values).where(
            *base, LayerStat.step >= start, LayerStat.step <= end).order_by(LayerStat.step))
        width = max([len(names)] + [len(v) // 4 for _, v in rows])
        last_step, arr = raw_layer_partials([st for st, _ in rows], [v for _, v in rows], width)
        cols = (last_step.astype(np.int64) - start0) // bucket
    if len(rows) == 0:
        return empty
    return _finish_matrix(run_id, stat, rank, agg, names, cols, last_step, arr, start0, bucket, max_layers)


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
    in_order = len(cols) < 2 or bool(np.all((cols[1:] > cols[:-1])
                                            | ((cols[1:] == cols[:-1]) & (last_step[1:] >= last_step[:-1]))))
    if not in_order:
        order = np.lexsort((last_step, cols))
        cols, last_step, arr = cols[order], last_step[order], arr[order]
    r, _, width = arr.shape
    starts = np.concatenate(([0], np.flatnonzero(np.diff(cols)) + 1))
    cnt = np.add.reduceat(arr[:, 3], starts, axis=0)
    nan = np.add.reduceat(arr[:, 4], starts, axis=0)
    if agg == "last":
        # per layer: the latest partial in the column where the layer was measured
        meas = arr[:, 5].view("<u4") != NULL_F32_BITS
        idx = np.where(meas, np.arange(r)[:, None], -1)
        best = np.maximum.reduceat(idx, starts, axis=0)  # rows are sorted by last_step within a column
        has = best >= 0
        val = np.where(has, arr[np.where(has, best, 0), 5, np.arange(width)[None, :]], np.nan).astype(np.float64)
        measured_cell = has
        nan_cell = has & np.isnan(val)
        val = np.where(nan_cell, np.nan, val)
    else:
        if agg == "max":
            val = np.fmax.reduceat(arr[:, 1], starts, axis=0)
        elif agg == "min":
            val = np.fmin.reduceat(arr[:, 0], starts, axis=0)
        else:
            sm = np.add.reduceat(arr[:, 2].astype(np.float64), starts, axis=0)
            val = np.where(cnt > 0, sm / np.maximum(cnt, 1), np.nan)
        val = val.astype(np.float64)
        measured_cell = (cnt + nan) > 0
        nan_cell = nan > 0
    # layer groups
    group = max(1, math.ceil(width / max_layers))
    gstarts = np.arange(0, width, group)
    if group > 1:
        meas_g = np.logical_or.reduceat(measured_cell, gstarts, axis=1)
        nan_g = np.logical_or.reduceat(nan_cell, gstarts, axis=1)
        if agg == "min":
            val_g = np.fmin.reduceat(val, gstarts, axis=1)
        elif agg == "mean":
            ok = ~np.isnan(val)
            n_g = np.add.reduceat(ok.astype(np.float64), gstarts, axis=1)
            s_g = np.add.reduceat(np.where(ok, val, 0.0), gstarts, axis=1)
            val_g = np.where(n_g > 0, s_g / np.maximum(n_g, 1), np.nan)
        else:  # max, and last (the largest of the group's latest values)
            val_g = np.fmax.reduceat(val, gstarts, axis=1)
    else:
        meas_g, nan_g, val_g = measured_cell, nan_cell, val
    val_g = np.where(nan_g, np.nan, val_g)
    values = [[(x if m else None) for x, m in zip(row_v, row_m)]
              for row_v, row_m in zip(val_g.T.tolist(), meas_g.T.tolist())]
    layers = [names[g] if g < len(names) else f"#{g}" for g in gstarts.tolist()]
    steps_out = [int(start0 + c * bucket) for c in cols[starts].tolist()]
    return LayerMatrix(run_id=run_id, stat=stat, rank=rank, agg=agg, bucket_size=bucket, layer_group_size=group,
                       steps=steps_out, layers=layers, values=values)


