"""The read path: every SELECT the API and the dashboard use.

Keyword-only functions that take a Session and return plain dataclasses.
Floats are Python floats and may be ``nan`` / ``inf`` / ``-inf``; ``None``
means "not measured". The routes turn them into wire strings
(server/numbers.py); the dashboard uses them as they are.

Example::

    from server import queries
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
from sqlalchemy import Integer, and_, case, cast, func, literal, or_, select
from sqlalchemy.orm import Session

from .models import STEP_SIGNALS, Alert, CustomScalar, LayerRollup, LayerStat, Project, Run, RunEvent, Step, StepRollup
from .numbers import NULL_F32_BITS
from .rollups import choose_level, layer_partial_arrays, merge_step_partials, raw_layer_partials

DEFAULT_STALL_SECONDS = 300.0
PARAM_STATS = ("grad_norm", "weight_norm", "update_ratio")
MODULE_STATS = ("act_mean", "act_std", "act_absmax", "act_nonfinite")
BN_STATS = ("bn_mean_norm", "bn_var_norm")
_BOOL_SIGNALS = {"clipped", "overflow"}
_NAN_BIT = {name: 1 << i for i, name in enumerate(STEP_SIGNALS)}
_INF = math.inf


class UnknownSignal(ValueError):
    """The signal names neither a step field nor ``custom:<key>``."""


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
    q = select(Run, Project.name).join(Project, Project.id == Run.project_id)
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
        select(Run, Project.name).join(Project, Project.id == Run.project_id).where(Run.id == run_id)
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
    return session.scalar(select(Project.name).join(Run, Run.project_id == Project.id).where(Run.id == run_id))


# --------------------------------------------------------------------------- series

def _signal_source(signal: str):
    """(table, value column expr, nan-flag expr, extra where) for a signal."""
    if signal.startswith("custom:"):
        key = signal[len("custom:"):]
        if not key:
            raise UnknownSignal("custom signal needs a key: custom:<key>")
        return CustomScalar, CustomScalar.value, CustomScalar.is_nan.is_(True), [CustomScalar.key == key]
    if signal not in STEP_SIGNALS:
        raise UnknownSignal(f"unknown signal {signal!r}: use one of {', '.join(STEP_SIGNALS)} or custom:<key>")
    col = getattr(Step, signal)
    if signal in _BOOL_SIGNALS:
        col = cast(col, Integer)
    return Step, col, Step.nan_mask.op("&")(_NAN_BIT[signal]) != 0, []


def _step_bounds(session: Session, table, run_id: int, rank: int, extra) -> tuple[Optional[int], Optional[int]]:
    return _bounds(session, table.step, [table.run_id == run_id, table.rank == rank, *extra])


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


def _bounds(session: Session, col, where) -> tuple[Optional[int], Optional[int]]:
    """min and max of an indexed column as two scalar subqueries: SQLite answers a lone
    min() or max() with one index seek, but min() and max() together with a full scan."""
    lo = select(func.min(col)).where(*where).scalar_subquery()
    hi = select(func.max(col)).where(*where).scalar_subquery()
    return tuple(session.execute(select(lo, hi)).one())


def _value(v, nan: bool) -> Optional[float]:
    if nan:
        return math.nan
    return None if v is None else float(v)


def _raw_points(session, table, col, nanflag, where, limit: Optional[int] = None) -> list[SeriesPoint]:
    q = select(table.step, col, nanflag).where(*where).order_by(table.step)
    if limit:
        q = q.limit(limit)
    out = []
    for step, v, nan in session.execute(q):
        val = _value(v, bool(nan))
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
    if lo is None:
        return 1, []
    start = lo if start is None else max(start, lo)
    end = hi if end is None else min(end, hi)
    if end < start:
        return 1, []
    where = [*base, table.step >= start, table.step <= end]
    bucket = max(1, math.ceil((end - start + 1) / max_points))
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
        merged = merge_step_partials(rows, signal_index=STEP_SIGNALS.index(signal), level=level, start0=start0,
                                     bucket_size=bucket)
        points = []
        for first, mn, mx, last, cnt, nf in merged:
            if cnt == 0:
                mn = mx = None
            points.append(SeriesPoint(step=first, min=mn, max=mx, last=last, count=cnt, nonfinite=nf))
        return bucket, points
    return bucket, _bucketed_points(session, table, col, nanflag, where, base, start, bucket)


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
                               max=None if mx is None else float(mx), last=_value(lv, bool(ln)),
                               count=cnt, nonfinite=int(nf or 0)))
    return out


def get_series_multi(session: Session, *, run_ids: Sequence[int], signals: Sequence[str],
                     start: Optional[int] = None, end: Optional[int] = None, max_points: int = 2000,
                     rank: int = 0) -> list[Series]:
    """Several runs × signals on one shared step axis (same buckets), for comparison.

    Step signals read each run's rollup partials once for all of them (a
    partial holds every step signal): a dozen signals cost about one."""
    sources = {signal: _signal_source(signal) for signal in signals}
    lo_all = hi_all = None
    for signal, (table, _, _, extra) in sources.items():
        for run_id in run_ids:
            lo, hi = _step_bounds(session, table, run_id, rank, extra)
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
    return [*STEP_SIGNALS, *(f"custom:{k}" for k in sorted(keys))]


# --------------------------------------------------------------------------- layer matrix

def layer_names_for(run: Run | RunDetail, stat: str) -> list[str]:
    if stat in MODULE_STATS:
        return list(run.module_names or [])
    if stat in BN_STATS:
        return list(run.bn_names or [])
    return list(run.param_names or [])


def list_layer_stats(session: Session, *, run_id: int, rank: int = 0) -> list[str]:
    return list(session.scalars(
        select(LayerStat.stat).where(LayerStat.run_id == run_id, LayerStat.rank == rank).distinct()
    ).all())


def get_layer_matrix(session: Session, *, run_id: int, stat: str, start: Optional[int] = None,
                     end: Optional[int] = None, max_steps: int = 500, max_layers: int = 200,
                     rank: int = 0, agg: str = "max") -> Optional[LayerMatrix]:
    """A layer × step matrix of one per-layer statistic, downsampled on both axes.

    Columns are step buckets (at most ``max_steps``), rows are groups of
    consecutive layers (at most ``max_layers``). ``agg`` is ``max`` (default:
    spikes survive), ``min``, ``mean`` or ``last``; a cell with a NaN among
    its values is NaN, so NaN markers survive too. None if the run is unknown.
    """
    if agg not in ("max", "min", "mean", "last"):
        raise ValueError("agg must be max, min, mean or last")
    run = session.get(Run, run_id)
    if run is None:
        return None
    names = layer_names_for(run, stat)
    base = [LayerStat.run_id == run_id, LayerStat.stat == stat, LayerStat.rank == rank]
    lo, hi = _bounds(session, LayerStat.step, base)
    empty = LayerMatrix(run_id=run_id, stat=stat, rank=rank, agg=agg, bucket_size=1, layer_group_size=1,
                        steps=[], layers=names[:max_layers], values=[])
    if lo is None:
        return empty
    start = lo if start is None else max(start, lo)
    end = hi if end is None else min(end, hi)
    if end < start:
        return empty
    max_steps, max_layers = max(1, int(max_steps)), max(1, int(max_layers))
    bucket = max(1, math.ceil((end - start + 1) / max_steps))
    level = choose_level(bucket)
    if level:
        bucket = math.ceil(bucket / level) * level
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

def _alert(a: Alert) -> AlertRecord:
    return AlertRecord(
        id=a.id, run_id=a.run_id, rule=a.rule, name=a.name, severity=a.severity, status=a.status,
        step=a.first_step, first_step=a.first_step, last_step=a.last_step, rank=a.rank, message=a.message,
        diagnosis=a.diagnosis, actions=list(a.actions or []), evidence=dict(a.evidence or {}),
        acknowledged=bool(a.acknowledged), created_at=a.created_at, updated_at=a.updated_at,
    )


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
    return [_alert(a) for a in session.scalars(q)]


def get_alert(session: Session, *, alert_id: int) -> Optional[AlertRecord]:
    a = session.get(Alert, alert_id)
    return None if a is None else _alert(a)


def list_events(session: Session, *, run_id: int, kind: Optional[str] = None, limit: int = 1000) -> list[EventRecord]:
    """A run's events in step order (events without a step last)."""
    q = select(RunEvent).where(RunEvent.run_id == run_id)
    if kind:
        q = q.where(RunEvent.kind == kind)
    q = q.order_by(RunEvent.step.is_(None), RunEvent.step, RunEvent.id).limit(limit)
    return [EventRecord(id=e.id, run_id=e.run_id, rank=e.rank, step=e.step, kind=e.kind, data=dict(e.data or {}),
                        time=e.time) for e in session.scalars(q)]
