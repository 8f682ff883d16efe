"""The read path: every SELECT the API and the dashboard use.

Keyword-only functions that take a Session and return plain dataclasses.
Floats are Python floats and may be ``nan`` / ``inf`` / ``-inf``; ``None``
means "not measured". The routes turn them into wire strings
(server/numbers.py); the dashboard uses them as they are.

Example::

    from gradwatch.server import queries
    with sessionmaker() as session:
        runs = queries.list_runs(session, project="default")
        s = queries.get_series(session, run_id=runs[0].id, signal="loss", max_points=500)
        for p in s.points:
            print(p.step, p.min, p.max, p.last, p.nonfinite)
"""
from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
from sqlalchemy import Integer, case, cast, func, or_, select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import EXTRA_BASE, STEP_SIGNAL_NAMES, is_step_signal, layer_stat, step_signal

from .lifecycle.retention_config import CompactionRecord
from .models import (ROLLUP_LEVELS, Alert, CustomScalar, LayerRollup, LayerStat, Project, RankLayout, Run, RunEvent, Step,
                     StepRollup)
from .numbers import NULL_F32_BITS, column_value, extra_value
from .ranks import RANK_META_KEYS
from .rollups import choose_level, layer_partial_arrays, merge_rank_step_partials, merge_step_partials, \
    raw_layer_partials
from .rules.registry import ids_of_family
from .rules.spec import EARLY_WARNING
from .settings import DEFAULT_STALL_SECONDS

_INF = math.inf


class UnknownSignal(ValueError):
    """The signal names neither a step field nor ``custom:<key>``."""


class RequestTooLarge(ValueError):
    """A read would cost more than its bound (points, cells or rows read); the message says what to narrow."""


# Bounds on what one read may cost, checked before the work (docs/api.md, "Limits"): a request that
# asks for more is refused with a message, never answered by growing the server's memory.
MAX_SERIES_POINTS = 200_000          # buckets over all series of one request (runs × signals × max_points)
MAX_MATRIX_CELLS = 1_000_000         # cells of one heatmap answer (step columns × layer rows)
MAX_MATRIX_READ = 8_000_000          # layer values one heatmap may read (partials or raw rows × layers)


@dataclass
class RunSummary:
    id: int
    project: str
    name: str
    status: str             # running | finished | crashed | stalled (derived from last_seen)
    last_step: Optional[int]
    last_loss: Optional[float]
    started_at: float
    last_seen: float
    open_alerts: int
    health: str             # ok | warning | critical (worst firing alert)
    world_size: int = 1


@dataclass
class RunDetail(RunSummary):
    param_names: list[str] = field(default_factory=list)
    module_names: list[str] = field(default_factory=list)
    bn_names: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class SeriesPoint:
    step: int               # first step of the bucket (the step itself when bucket_size == 1)
    min: Optional[float]    # over non-NaN values; NaN when every measured value was NaN
    max: Optional[float]
    last: Optional[float]   # value at the bucket's last measured step (may be NaN / ±inf)
    count: int              # measured steps (NaN included)
    nonfinite: int          # NaN and ±inf among them


@dataclass
class Series:
    run_id: int
    signal: str
    rank: int
    bucket_size: int
    points: list[SeriesPoint]


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


@dataclass
class AlertRecord:
    id: int
    run_id: int
    rule: str
    name: str
    severity: str
    status: str
    step: int
    first_step: int
    last_step: int
    rank: int
    message: str
    diagnosis: str
    actions: list[Any]
    evidence: dict[str, Any]
    acknowledged: bool
    created_at: float
    updated_at: float
    resolved_at: Optional[float] = None
    # why it was not notified (server/routing/): the inhibiting alert, "A1 loss_nonfinite rank 2" for it,
    # the silence, the warm-up mute
    suppressed_by: Optional[int] = None
    suppressed_by_rule: Optional[str] = None
    silenced_by: Optional[int] = None
    muted: Optional[str] = None


@dataclass
class EventRecord:
    id: int
    run_id: int
    rank: int
    step: Optional[int]
    kind: str
    data: dict[str, Any]
    time: float


# --------------------------------------------------------------------------- runs

_SEVERITY_ORDER = {"critical": 2, "warning": 1}


def _alert_counts(session: Session, run_ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    if not run_ids:
        return {}
    rows = session.execute(
        select(Alert.run_id, Alert.severity, func.count())
        .where(Alert.status == "firing", Alert.run_id.in_(list(run_ids)))
        .group_by(Alert.run_id, Alert.severity)
    ).all()
    out: dict[int, tuple[int, str]] = {}
    for run_id, severity, n in rows:
        count, health = out.get(run_id, (0, "ok"))
        if _SEVERITY_ORDER.get(severity, 0) > _SEVERITY_ORDER.get(health, 0):
            health = severity
        out[run_id] = (count + n, health)
    return out


def _status(run: Run, now: float, stall_seconds: float) -> str:
    if run.status == "running" and now - run.last_seen > stall_seconds:
        return "stalled"
    return run.status


def _summary(run: Run, project_name: str, counts, now: float, stall_seconds: float, cls=RunSummary, **extra):
    n, health = counts.get(run.id, (0, "ok"))
    return cls(
        id=run.id, project=project_name, name=run.name, status=_status(run, now, stall_seconds),
        last_step=run.last_step, last_loss=math.nan if run.last_loss_nan else run.last_loss,
        started_at=run.started_at, last_seen=run.last_seen, open_alerts=n, health=health,
        world_size=run.world_size, **extra,
    )


def list_runs(session: Session, *, project: Optional[str] = None, status: Optional[str] = None,
              name: Optional[str] = None, stall_seconds: float = DEFAULT_STALL_SECONDS,
              now: Optional[float] = None) -> list[RunSummary]:
    """Runs, most recently seen first. ``name`` matches a substring; ``status`` the derived status."""
    now = _time.time() if now is None else now
    q = select(Run, Project.name).join(Project, Project.id == Run.project_id).where(Run.deleted_at.is_(None))
    if project:
        q = q.where(Project.name == project)
    if name:
        q = q.where(Run.name.contains(name, autoescape=True))
    if status == "stalled":
        q = q.where(Run.status == "running", Run.last_seen < now - stall_seconds)
    elif status == "running":
        q = q.where(Run.status == "running", Run.last_seen >= now - stall_seconds)
    elif status:
        q = q.where(Run.status == status)
    rows = session.execute(q.order_by(Run.last_seen.desc(), Run.id.desc())).all()
    counts = _alert_counts(session, [r.id for r, _ in rows])
    return [_summary(r, p, counts, now, stall_seconds) for r, p in rows]


def get_run(session: Session, *, run_id: int, stall_seconds: float = DEFAULT_STALL_SECONDS,
            now: Optional[float] = None) -> Optional[RunDetail]:
    """One run with its layer names and config, or None."""
    now = _time.time() if now is None else now
    row = session.execute(
        select(Run, Project.name).join(Project, Project.id == Run.project_id)
        .where(Run.id == run_id, Run.deleted_at.is_(None))
    ).first()
    if row is None:
        return None
    run, project_name = row
    counts = _alert_counts(session, [run.id])
    return _summary(run, project_name, counts, now, stall_seconds, cls=RunDetail,
                    param_names=list(run.param_names or []), module_names=list(run.module_names or []),
                    bn_names=list(run.bn_names or []), config=dict(run.config or {}))


def run_project(session: Session, *, run_id: int) -> Optional[str]:
    """The project name of a run (for token checks), or None."""
    return session.scalar(select(Project.name).join(Run, Run.project_id == Project.id)
                          .where(Run.id == run_id, Run.deleted_at.is_(None)))    # being deleted: gone


# --------------------------------------------------------------------------- series

@dataclass(frozen=True)
class _ExtraSlot:
    """Where a step signal without a column of its own lives: its slot in ``steps.extra``."""
    slot: int


def _signal_source(signal: str):
    """(table, value column expr or _ExtraSlot, nan-flag expr, extra where) for a signal."""
    if signal.startswith("custom:"):
        key = signal[len("custom:"):]
        if not key:
            raise UnknownSignal("custom signal needs a key: custom:<key>")
        return CustomScalar, CustomScalar.value, CustomScalar.is_nan.is_(True), [CustomScalar.key == key]
    if not is_step_signal(signal):
        raise UnknownSignal(f"unknown signal {signal!r}: use one of {', '.join(STEP_SIGNAL_NAMES)} or custom:<key>")
    sig = step_signal(signal)
    if not sig.column:
        return Step, _ExtraSlot(sig.id - EXTRA_BASE), None, []
    col = getattr(Step, signal)
    if sig.kind == "bool":
        col = cast(col, Integer)
    return Step, col, Step.nan_mask.op("&")(1 << sig.id) != 0, []


def _step_bounds(session: Session, table, run_id: int, rank: int, extra) -> tuple[Optional[int], Optional[int]]:
    return _bounds(session, table.step, [table.run_id == run_id, table.rank == rank, *extra])


def _compaction(session: Session, run_id: int) -> Optional[CompactionRecord]:
    """What retention took from a run's raw rows (server/lifecycle/retention.py), or None: all are there.
    Where raw rows are gone, series and heatmaps read the rollups retention kept."""
    return CompactionRecord.of(session.scalar(select(Run.config).where(Run.id == run_id)))


def raw_steps_from(session: Session, *, run_id: int) -> int:
    """The first step whose raw rows a retention policy left (0: every step's), for readers that want
    steps, not buckets (``gradwatch export``)."""
    rec = _compaction(session, run_id)
    return rec.raw_before if rec is not None else 0


def _fetch_blobs(session: Session, stmt) -> list[tuple[int, bytes]]:
    """(int, bytes) rows without ORM overhead. On PostgreSQL the result comes in
    binary format: bytea in text format is hex, twice the bytes and a parse."""
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        return [(k, bytes(b)) for k, b in conn.execute(stmt)]
    compiled = stmt.compile(dialect=conn.dialect)
    params = compiled.construct_params()
    sql = compiled.string
    raw = conn.connection.driver_connection
    with raw.cursor(binary=True) as cur:
        cur.execute(sql, params)
        return [(k, bytes(b)) for k, b in cur.fetchall()]


def _fetch_blob_rows(session: Session, stmt) -> list[tuple[int, int, bytes]]:
    """``_fetch_blobs`` for (int, int, bytes) rows."""
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        return [(a, k, bytes(b)) for a, k, b in conn.execute(stmt)]
    # render_postcompile: the IN list of ranks as plain parameters (the raw cursor knows no expanding ones)
    compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    raw = conn.connection.driver_connection
    with raw.cursor(binary=True) as cur:
        cur.execute(compiled.string, compiled.construct_params())
        return [(a, k, bytes(b)) for a, k, b in cur.fetchall()]


def _bounds(session: Session, col, where) -> tuple[Optional[int], Optional[int]]:
    """min and max of an indexed column as two scalar subqueries: SQLite answers a lone
    min() or max() with one index seek, but min() and max() together with a full scan."""
    lo = select(func.min(col)).where(*where).scalar_subquery()
    hi = select(func.max(col)).where(*where).scalar_subquery()
    return tuple(session.execute(select(lo, hi)).one())


def _raw_values(session, table, col, nanflag, where):
    """(step, value) rows in step order; value None when not measured."""
    if isinstance(col, _ExtraSlot):
        # the step's extra blob holds the signal at its slot; a shorter blob, or none, did not measure it
        for step, blob in session.execute(select(table.step, table.extra).where(*where).order_by(table.step)):
            yield step, extra_value(blob, col.slot)
        return
    for step, v, nan in session.execute(select(table.step, col, nanflag).where(*where).order_by(table.step)):
        yield step, column_value(v, bool(nan))


def _raw_points(session, table, col, nanflag, where) -> list[SeriesPoint]:
    out = []
    for step, val in _raw_values(session, table, col, nanflag, where):
        measured = val is not None
        nf = int(measured and not math.isfinite(val))
        out.append(SeriesPoint(step=step, min=val, max=val, last=val, count=int(measured), nonfinite=nf))
    return out


def get_series(session: Session, *, run_id: int, signal: str, start: Optional[int] = None,
               end: Optional[int] = None, max_points: int = 2000, since: Optional[int] = None,
               rank: int = 0) -> Series:
    """A signal over ``[start, end]`` in at most ``max_points`` buckets.

    Each bucket keeps min, max (spikes survive), the last value, the count of
    measured steps and of non-finite ones (NaN markers survive). With
    ``since``: raw steps after that step, for live tails (bucketed only if
    there are more than ``max_points`` of them). Raises ``UnknownSignal``.

    Buckets of at least 16 steps are read from the rollups
    (server/rollups.py): the bucket size is then a multiple of the rollup
    level and bucket boundaries are aligned to it.
    """
    _signal_source(signal)  # validate before touching the database
    if since is not None:
        start = max(since + 1, start or 0)
    bucket, points = _series_points(session, run_id=run_id, signal=signal, rank=rank, start=start, end=end,
                                    max_points=max_points)
    return Series(run_id=run_id, signal=signal, rank=rank, bucket_size=bucket, points=points)


def _series_points(session: Session, *, run_id: int, signal: str, rank: int, start: Optional[int],
                   end: Optional[int], max_points: int, bounds: Optional[tuple[int, int]] = None,
                   rollup_rows: Optional[dict] = None):
    """(bucket size, points). ``rollup_rows``: a dict shared by the signals of one request; each
    rollup partial holds every step signal, so they are read once, not once per signal."""
    max_points = max(1, int(max_points))
    table, col, nanflag, extra = _signal_source(signal)
    base = [table.run_id == run_id, table.rank == rank, *extra]
    lo, hi = bounds if bounds is not None else _step_bounds(session, table, run_id, rank, extra)
    rec = _compaction(session, run_id) if table is Step else None    # custom scalars are kept raw
    if rec is not None and bounds is None:
        lo, hi = rec.bounds(rank, lo, hi)
    if lo is None:
        return 1, []
    start = lo if start is None else max(start, lo)
    end = hi if end is None else min(end, hi)
    if end < start:
        return 1, []
    where = [*base, table.step >= start, table.step <= end]
    bucket = max(1, math.ceil((end - start + 1) / max_points))
    if rec is not None:     # raw rows compacted in the range: its buckets are a kept rollup level at least
        bucket = max(bucket, rec.step_level_for(start))
    if bucket == 1:
        return 1, _raw_points(session, table, col, nanflag, where)
    level = choose_level(bucket) if table is Step else 0
    if level:
        bucket = math.ceil(bucket / level) * level
        start0 = (start // level) * level
        key = (run_id, rank, level, start // level, end // level)
        rows = None if rollup_rows is None else rollup_rows.get(key)
        if rows is None:
            rows = _fetch_blobs(session, select(StepRollup.bucket, StepRollup.data).where(
                StepRollup.run_id == run_id, StepRollup.rank == rank, StepRollup.level == level,
                StepRollup.bucket >= start // level, StepRollup.bucket <= end // level,
            ).order_by(StepRollup.bucket))
            if rollup_rows is not None:
                rollup_rows[key] = rows
        merged = merge_step_partials(rows, signal_index=step_signal(signal).id, level=level, start0=start0,
                                     bucket_size=bucket)
        points = []
        for first, mn, mx, last, cnt, nf in merged:
            if cnt == 0:
                mn = mx = None
            points.append(SeriesPoint(step=first, min=mn, max=mx, last=last, count=cnt, nonfinite=nf))
        return bucket, points
    if isinstance(col, _ExtraSlot):
        return bucket, _bucket_in_python(_raw_values(session, table, col, nanflag, where), start, bucket)
    return bucket, _bucketed_points(session, table, col, nanflag, where, base, start, bucket)


def _bucket_in_python(values, start: int, bucket: int) -> list[SeriesPoint]:
    """What ``_bucketed_points`` computes in SQL, from raw (step, value) rows: for buckets smaller than
    the first rollup level, so at most 16 × max_points rows, each read once."""
    out: list[SeriesPoint] = []
    cur = None
    for step, v in values:
        b = start + (step - start) // bucket * bucket
        if cur is None or cur.step != b:
            cur = SeriesPoint(step=b, min=None, max=None, last=None, count=0, nonfinite=0)
            out.append(cur)
        if v is None:
            continue
        cur.count += 1
        cur.last = v
        if not math.isfinite(v):
            cur.nonfinite += 1
        if not math.isnan(v):
            cur.min = v if cur.min is None else min(cur.min, v)
            cur.max = v if cur.max is None else max(cur.max, v)
    for p in out:
        if p.min is None and p.count:
            p.min = p.max = math.nan  # every measured value in the bucket was NaN
    return out


def _bucketed_points(session, table, col, nanflag, where, base, start: int, bucket: int) -> list[SeriesPoint]:
    b = ((table.step - start) // bucket).label("b")
    measured = or_(col.is_not(None), nanflag)
    agg = (
        select(
            b,
            func.min(col).label("mn"),
            func.max(col).label("mx"),
            func.count(case((measured, 1))).label("cnt"),
            func.sum(case((or_(nanflag, col == _INF, col == -_INF), 1), else_=0)).label("nf"),
            func.max(case((measured, table.step))).label("last_step"),
        )
        .where(*where)
        .group_by(b)
        .subquery()
    )
    last = select(table.step.label("ls"), col.label("lv"), nanflag.label("ln")).where(*base).subquery()
    q = (
        select(agg.c.b, agg.c.mn, agg.c.mx, agg.c.cnt, agg.c.nf, last.c.lv, last.c.ln)
        .select_from(agg.outerjoin(last, last.c.ls == agg.c.last_step))
        .order_by(agg.c.b)
    )
    out = []
    for bi, mn, mx, cnt, nf, lv, ln in session.execute(q):
        cnt = int(cnt or 0)
        if mn is None and cnt:
            mn = mx = math.nan  # every measured value in the bucket was NaN
        out.append(SeriesPoint(step=start + int(bi) * bucket, min=None if mn is None else float(mn),
                               max=None if mx is None else float(mx), last=column_value(lv, bool(ln)),
                               count=cnt, nonfinite=int(nf or 0)))
    return out


def get_series_multi(session: Session, *, run_ids: Sequence[int], signals: Sequence[str],
                     start: Optional[int] = None, end: Optional[int] = None, max_points: int = 2000,
                     rank: int = 0) -> list[Series]:
    """Several runs × signals on one shared step axis (same buckets), for comparison.

    Step signals read each run's rollup partials once for all of them (a
    partial holds every step signal): a dozen signals cost about one."""
    if len(set(run_ids)) != len(run_ids) or len(set(signals)) != len(signals):
        raise RequestTooLarge("each run and each signal may be named once")
    if len(run_ids) * len(signals) * max_points > MAX_SERIES_POINTS:
        raise RequestTooLarge(f"{len(run_ids)} runs × {len(signals)} signals × max_points={max_points} is more than "
                              f"{MAX_SERIES_POINTS:,} points: ask for fewer runs, signals or points")
    sources = {signal: _signal_source(signal) for signal in signals}
    lo_all = hi_all = None
    for signal, (table, _, _, extra) in sources.items():
        for run_id in run_ids:
            lo, hi = _step_bounds(session, table, run_id, rank, extra)
            rec = _compaction(session, run_id) if table is Step else None
            if rec is not None:
                lo, hi = rec.bounds(rank, lo, hi)
            if lo is not None:
                lo_all = lo if lo_all is None else min(lo_all, lo)
                hi_all = hi if hi_all is None else max(hi_all, hi)
    out = []
    if lo_all is not None:
        lo_all = lo_all if start is None else max(start, lo_all)
        hi_all = hi_all if end is None else min(end, hi_all)
    rollup_rows: dict = {}
    for run_id in run_ids:
        for signal in signals:
            if lo_all is None:
                out.append(Series(run_id=run_id, signal=signal, rank=rank, bucket_size=1, points=[]))
                continue
            bucket, points = _series_points(session, run_id=run_id, signal=signal, rank=rank, start=lo_all,
                                            end=hi_all, max_points=max_points, bounds=(lo_all, hi_all),
                                            rollup_rows=rollup_rows)
            out.append(Series(run_id=run_id, signal=signal, rank=rank, bucket_size=bucket, points=points))
    return out


def list_signals(session: Session, *, run_id: int) -> list[str]:
    """Step signals plus the run's ``custom:<key>`` signals."""
    keys = session.scalars(select(CustomScalar.key).where(CustomScalar.run_id == run_id).distinct()).all()
    return [*STEP_SIGNAL_NAMES, *(f"custom:{k}" for k in sorted(keys))]


# --------------------------------------------------------------------------- layer matrix

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
                     rank: int = 0, agg: str = "max", read_budget: int = MAX_MATRIX_READ) -> Optional[LayerMatrix]:
    """A layer × step matrix of one per-layer statistic, downsampled on both axes.

    Columns are step buckets (at most ``max_steps``; from the next rollup level
    up, so fewer, when that keeps ``COARSER_LEVEL_KEEPS`` of them), rows are
    groups of consecutive layers (at most ``max_layers``). ``agg`` is ``max`` (default:
    spikes survive), ``min``, ``mean`` or ``last``; a cell with a NaN among
    its values is NaN, so NaN markers survive too. None if the run is unknown.

    Raises ``RequestTooLarge`` when the answer would have more than ``MAX_MATRIX_CELLS`` cells, or when
    even the coarsest rollup level would read more than ``read_budget`` layer values; below that, a
    request that would read more gets wider buckets (the next rollup level) instead.
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


# --------------------------------------------------------------------------- alerts and events

def alert_record(a: Alert, inhibitors: Optional[dict[int, str]] = None) -> AlertRecord:
    """The one shape of an alert outside the database: the API (``AlertOut``), the dashboard and the CLI.

    ``inhibitors``: alert id → "A1 loss_nonfinite rank 2" for the alerts that suppress others."""
    return AlertRecord(
        id=a.id, run_id=a.run_id, rule=a.rule, name=a.name, severity=a.severity, status=a.status,
        step=a.first_step, first_step=a.first_step, last_step=a.last_step, rank=a.rank, message=a.message,
        diagnosis=a.diagnosis, actions=list(a.actions or []), evidence=dict(a.evidence or {}),
        acknowledged=bool(a.acknowledged), created_at=a.created_at, updated_at=a.updated_at,
        resolved_at=a.resolved_at, suppressed_by=a.suppressed_by,
        suppressed_by_rule=(inhibitors or {}).get(a.suppressed_by) if a.suppressed_by is not None else None,
        silenced_by=a.silenced_by, muted=a.muted,
    )


def _inhibitors(session: Session, alerts: list[Alert]) -> dict[int, str]:
    ids = {a.suppressed_by for a in alerts if a.suppressed_by is not None}
    if not ids:
        return {}
    return {i: f"{rule} {name} rank {rank}" for i, rule, name, rank in session.execute(
        select(Alert.id, Alert.rule, Alert.name, Alert.rank).where(Alert.id.in_(ids)))}


def list_alerts(session: Session, *, run_id: Optional[int] = None, severity: Optional[str] = None,
                rule: Optional[str] = None, status: Optional[str] = None, project: Optional[str] = None,
                limit: int = 1000) -> list[AlertRecord]:
    """Alerts, newest first. ``rule`` matches the id ("A1") or the name ("loss_nonfinite")."""
    q = select(Alert)
    if run_id is not None:
        q = q.where(Alert.run_id == run_id)
    if severity:
        q = q.where(Alert.severity == severity)
    if rule:
        q = q.where(or_(Alert.rule == rule, Alert.name == rule))
    if status:
        q = q.where(Alert.status == status)
    if project:
        q = q.join(Run, Run.id == Alert.run_id).join(Project, Project.id == Run.project_id).where(Project.name == project)
    q = q.order_by(Alert.updated_at.desc(), Alert.id.desc()).limit(limit)
    alerts = list(session.scalars(q))
    inhibitors = _inhibitors(session, alerts)
    return [alert_record(a, inhibitors) for a in alerts]


def get_alert(session: Session, *, alert_id: int) -> Optional[AlertRecord]:
    a = session.get(Alert, alert_id)
    return None if a is None else alert_record(a, _inhibitors(session, [a]))


def list_events(session: Session, *, run_id: int, kind: Optional[str] = None, limit: int = 1000) -> list[EventRecord]:
    """A run's events in step order (events without a step last)."""
    q = select(RunEvent).where(RunEvent.run_id == run_id)
    if kind:
        q = q.where(RunEvent.kind == kind)
    q = q.order_by(RunEvent.step.is_(None), RunEvent.step, RunEvent.id).limit(limit)
    return [EventRecord(id=e.id, run_id=e.run_id, rank=e.rank, step=e.step, kind=e.kind, data=dict(e.data or {}),
                        time=e.time) for e in session.scalars(q)]


@dataclass
class CheckpointRecord:
    step: int                     # optimizer steps taken when it was saved: the step a resume continues with
    path: Optional[str]           # None: saved where gradwatch was not told (Lightning's trainer.save_checkpoint)
    rank: int                     # the lowest rank that recorded it
    saved_at: Optional[float]     # the agent's wall clock when it was recorded
    source: Optional[str]         # "transformers", "lightning", or None (monitor.checkpoint)


def list_checkpoints(session: Session, *, run_id: int, limit: int = 10_000) -> list[CheckpointRecord]:
    """A run's checkpoints (``checkpoint`` events) in step order; the same step and path recorded by
    several ranks (each DDP process runs the framework callback) is listed once."""
    q = (select(RunEvent.step, RunEvent.data, RunEvent.rank)
         .where(RunEvent.run_id == run_id, RunEvent.kind == "checkpoint", RunEvent.step.is_not(None))
         .order_by(RunEvent.step, RunEvent.rank, RunEvent.id).limit(limit))
    out: dict[tuple[int, Optional[str]], CheckpointRecord] = {}
    for step, data, rank in session.execute(q):
        data = data or {}
        key = (int(step), data.get("path"))
        if key not in out:
            out[key] = CheckpointRecord(step=int(step), path=data.get("path"), rank=rank,
                                        saved_at=data.get("saved_at"), source=data.get("source"))
    return list(out.values())


@dataclass
class RankInfo:
    rank: int               # -1: the combined row of a sharded run (server/ranks.py)
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


# --------------------------------------------------------------------------- ranks side by side

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


# --------------------------------------------------------------------------- early warning (the runs list's badge)

def early_warnings(session: Session, *, run_ids: Sequence[int]) -> dict[int, dict[str, list]]:
    """Per run, its firing early-warning alerts (the rules of family ``spec.EARLY_WARNING``, docs/
    early-warning-advice.md: H1-H4 read step signals, H5-H9 the setup), acknowledged or not: ``{"warnings":
    [[rule, name, severity], ...]}`` above info and ``{"advice": [[rule, name], ...]}`` at info, by rule
    id. One grouped query for all the runs; a run with none is absent."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(Alert.run_id, Alert.rule, Alert.name, Alert.severity)
        .where(Alert.status == "firing", Alert.run_id.in_(list(run_ids)),
               Alert.rule.in_(ids_of_family(EARLY_WARNING)))
        .group_by(Alert.run_id, Alert.rule, Alert.name, Alert.severity)
    ).all()
    out: dict[int, dict[str, list]] = {}
    for run_id, rule, name, severity in sorted(rows, key=lambda r: (r[0], r[1], -_SEVERITY_ORDER.get(r[3], 0))):
        mine = out.setdefault(run_id, {"warnings": [], "advice": []})
        if any(rule == w[0] for w in mine["warnings"]) or any(rule == a[0] for a in mine["advice"]):
            continue   # the rule's worst firing severity counts (one per rank could differ)
        if severity == "info":
            mine["advice"].append([rule, name])
        else:
            mine["warnings"].append([rule, name, severity])
    return out
