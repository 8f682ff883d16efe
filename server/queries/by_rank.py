"""A run's ranks side by side: which ranks sent which steps, the ranks' layout (hosts, devices) and rank ×
step matrices of step signals (the run page's per-rank overlays and heatmaps)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import step_signal

from gradwatch.server.storage.compaction import CompactionRecord
from gradwatch.server.storage.models import ROLLUP_LEVELS, RankLayout, Run, Step, StepRollup
from gradwatch.server.storage.ranks import RANK_META_KEYS
from gradwatch.server.storage.rollups import choose_level, merge_rank_step_partials
from gradwatch.server.queries._shared import MAX_MATRIX_CELLS, RequestTooLarge, UnknownSignal, _bounds, _fetch_blob_rows
from gradwatch.server.queries.series import _series_points, _signal_source


@dataclass
class RankInfo:
    rank: int               # -1: the combined row of a sharded run (server/storage/ranks.py)
    steps: int              # steps stored for this rank in the range asked for
    first_step: Optional[int]
    last_step: Optional[int]
    sharded: bool           # it sent a shard layout (meta.param_shards)


@dataclass
class RankCoverage:
    run_id: int
    world_size: int
    combined: bool                          # a sharded run: its global grad norm lives in rank -1's rows
    ranks: list[RankInfo]
    incomplete: list[dict[str, Any]]        # sharded runs: {"step", "ranks": [the ranks that sent it]}, no combined row


def rank_coverage(session: Session, *, run_id: int, start: Optional[int] = None, end: Optional[int] = None,
                  limit: int = 1000) -> Optional[RankCoverage]:
    """Which ranks sent which steps; for a sharded run, the steps still missing a rank (incomplete: they
    have no combined values yet, rather than values computed from part of the ranks)."""
    run = session.get(Run, run_id)
    if run is None:
        return None
    where = [Step.run_id == run_id]
    if start is not None:
        where.append(Step.step >= start)
    if end is not None:
        where.append(Step.step <= end)
    sharded = set(session.scalars(select(RankLayout.rank).where(RankLayout.run_id == run_id)))
    ranks = [RankInfo(rank=r, steps=n, first_step=lo, last_step=hi, sharded=r in sharded)
             for r, n, lo, hi in session.execute(
                 select(Step.rank, func.count(), func.min(Step.step), func.max(Step.step))
                 .where(*where).group_by(Step.rank).order_by(Step.rank))]
    incomplete: list[dict[str, Any]] = []
    combined = bool(sharded)
    if combined:
        by_step: dict[int, list[int]] = {}
        for s, r in session.execute(select(Step.step, Step.rank).where(*where).order_by(Step.step, Step.rank)):
            by_step.setdefault(s, []).append(r)
        for s, rs in by_step.items():
            if -1 not in rs:
                incomplete.append({"step": s, "ranks": rs})
                if len(incomplete) >= limit:
                    break
    return RankCoverage(run_id=run_id, world_size=run.world_size or 1, combined=combined, ranks=ranks,
                        incomplete=incomplete)


MAX_RANK_READ = 200_000   # rollup partials (or raw rows) one rank × step read may touch, over ranks and a level


def rank_meta(session: Session, *, run_id: int) -> Optional[dict[str, Any]]:
    """What the dashboard needs to lay out a run's ranks, without counting steps: ``{"world_size",
    "combined" (a sharded run: global grad norm and per-layer norms in rank -1), "ranks": [{"rank",
    "host", "local_rank", "device"}]}`` from the meta each rank's agent sent (``runs.config["_ranks"]``)."""
    run = session.get(Run, run_id)
    if run is None:
        return None
    combined = session.scalar(select(RankLayout.rank).where(RankLayout.run_id == run_id).limit(1)) is not None
    sent = dict((run.config or {}).get("_ranks") or {})
    world = max([run.world_size or 1] + [int(k) + 1 for k in sent if str(k).lstrip("-").isdigit()])
    ranks = [{"rank": r, **{k: (sent.get(str(r)) or {}).get(k) for k in RANK_META_KEYS}} for r in range(world)]
    return {"run_id": run_id, "world_size": world, "combined": combined, "ranks": ranks}


@dataclass
class RankMatrix:
    run_id: int
    signal: str
    bucket_size: int
    steps: list[int]                          # first step of each column
    ranks: list[int]                          # rank of each row
    min: list[list[Optional[float]]]          # [row][column], as a series bucket's min / max / last;
    max: list[list[Optional[float]]]          # None where the rank measured nothing in the bucket
    last: list[list[Optional[float]]]
    nonfinite: list[list[int]]


def _cells(values: np.ndarray, present: np.ndarray) -> list[list[Optional[float]]]:
    """A (rows, columns) array as lists of Python floats, ``None`` where not ``present``."""
    return np.where(present, values, None).tolist()


def get_rank_matrix(session: Session, *, run_id: int, signals: Sequence[str], start: Optional[int] = None,
                    end: Optional[int] = None, max_steps: int = 300, ranks: Optional[Sequence[int]] = None,
                    read_budget: int = MAX_RANK_READ) -> Optional[list[RankMatrix]]:
    """Rank × step matrices of step signals (one per signal, same columns): every rank's series on one
    shared step axis, for the dashboard's per-rank overlay and heatmap. ``ranks``: default every rank of
    the run (0 … world_size − 1). None if the run is unknown.

    Raises ``RequestTooLarge`` above ``MAX_MATRIX_CELLS`` cells (ranks × columns × signals); a request that
    would read more than ``read_budget`` rollup partials gets wider buckets (the next level) instead, so a
    64-rank run's whole-run heatmap reads a few thousand partials per rank, not a million rows."""
    run = session.get(Run, run_id)
    if run is None:
        return None
    ranks = list(range(run.world_size or 1)) if ranks is None else list(dict.fromkeys(int(r) for r in ranks))
    for signal in signals:
        if signal.startswith("custom:"):
            raise UnknownSignal("rank matrices are of step signals")
        _signal_source(signal)
    max_steps = max(1, int(max_steps))
    if len(ranks) * max_steps * max(1, len(signals)) > MAX_MATRIX_CELLS:
        raise RequestTooLarge(f"{len(ranks)} ranks × max_steps={max_steps} × {len(signals)} signals is more than "
                              f"{MAX_MATRIX_CELLS:,} cells: ask for fewer steps, ranks or signals")
    bounds = [_bounds(session, Step.step, [Step.run_id == run_id, Step.rank == r]) for r in ranks]
    rec = CompactionRecord.of(run.config)
    if rec is not None:
        bounds = [rec.bounds(r, *b) for r, b in zip(ranks, bounds)]
    los = [lo for lo, _ in bounds if lo is not None]
    empty = [RankMatrix(run_id=run_id, signal=s, bucket_size=1, steps=[], ranks=ranks, min=[], max=[], last=[],
                        nonfinite=[]) for s in signals]
    if not los:
        return empty
    lo = los[0] if start is None else start
    lo = max(lo, min(los))
    hi = max(h for _, h in bounds if h is not None)
    hi = hi if end is None else min(end, hi)
    if hi < lo:
        return empty
    span = hi - lo + 1
    points = max_steps
    while True:
        # rollup partials (or raw rows) read: about ranks × span / level; too many, and the columns widen
        # to the next rollup level (a coarser heatmap of the same range) rather than the read growing
        level = choose_level(max(1, math.ceil(span / points)))
        if len(ranks) * span / max(level, 1) <= read_budget:
            break
        coarser = [lv for lv in ROLLUP_LEVELS if lv > level]
        if not coarser:
            raise RequestTooLarge(f"{len(ranks)} ranks over {span:,} steps would read too much: "
                                  f"ask for a shorter step range or fewer ranks")
        points = max(1, span // coarser[0])
    out = []
    per_signal: dict[str, list] = {s: [] for s in signals}
    bucket_sizes: dict[str, int] = {}
    bucket = max(1, math.ceil(span / points))
    if rec is not None:
        bucket = max(bucket, rec.step_level_for(lo))
    level = choose_level(bucket)
    if level:
        # every rank's rollup partials in one read (a partial holds every step signal), merged for every
        # rank and signal at once: 64 ranks cost one query, not 64 × the per-series query building
        bucket = math.ceil(bucket / level) * level
        start0 = (lo // level) * level
        rows = _fetch_blob_rows(session, select(StepRollup.rank, StepRollup.bucket, StepRollup.data).where(
                StepRollup.run_id == run_id, StepRollup.rank.in_(ranks), StepRollup.level == level,
                StepRollup.bucket >= lo // level, StepRollup.bucket <= hi // level,
        ).order_by(StepRollup.rank, StepRollup.bucket))
        sids = {s: step_signal(s).id for s in signals}
        cols, merged = merge_rank_step_partials(rows, ranks=ranks, signal_indexes=list(dict.fromkeys(sids.values())),
                                                level=level, start0=start0, bucket_size=bucket)
        for s in signals:
            mn, mx, last, cnt, nf, has_last = merged[sids[s]]
            seen = cnt > 0             # a cell no partial measured the signal in stays empty
            out.append(RankMatrix(run_id=run_id, signal=s, bucket_size=bucket, steps=cols, ranks=ranks,
                                  min=_cells(mn, seen), max=_cells(mx, seen), last=_cells(last, seen & has_last),
                                  nonfinite=np.where(seen, nf, 0).astype(np.int64).tolist()))
        return out
    # short ranges: raw rows, a series read per rank and signal
    for r in ranks:
        for s in signals:
            b, pts = _series_points(session, run_id=run_id, signal=s, rank=r, start=lo, end=hi,
                                    max_points=points, bounds=(lo, hi))
            bucket_sizes[s] = b
            per_signal[s].append(pts)
    for s in signals:
        bucket = bucket_sizes.get(s, 1)
        cols = sorted({p.step for pts in per_signal[s] for p in pts})
        where = {c: i for i, c in enumerate(cols)}
        grid = {k: [[None] * len(cols) for _ in ranks] for k in ("min", "max", "last")}
        nf = [[0] * len(cols) for _ in ranks]
        for row, pts in enumerate(per_signal[s]):
            for p in pts:
                if not p.count:
                    continue
                j = where[p.step]
                grid["min"][row][j], grid["max"][row][j], grid["last"][row][j] = p.min, p.max, p.last
                nf[row][j] = p.nonfinite
        out.append(RankMatrix(run_id=run_id, signal=s, bucket_size=bucket, steps=cols, ranks=ranks, min=grid["min"],
                              max=grid["max"], last=grid["last"], nonfinite=nf))
    return out

