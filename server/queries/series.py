"""One signal over steps: a run's step signals and custom scalars, downsampled into buckets (min, max, last,
counts), read from the rollups for buckets of a rollup level and more; several runs on one step axis."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from sqlalchemy import Integer, case, cast, func, or_, select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import EXTRA_BASE, STEP_SIGNAL_NAMES, is_step_signal, step_signal

from gradwatch.server.storage.models import CustomScalar, Step, StepRollup
from gradwatch.server.wire.numbers import column_value, extra_value
from gradwatch.server.storage.rollups import choose_level, merge_step_partials
from gradwatch.server.wire.schemas import SeriesOut, SeriesPointOut
from gradwatch.server.queries._shared import MAX_SERIES_POINTS, RequestTooLarge, UnknownSignal, _bounds, _compaction, _fetch_blobs

_INF = math.inf


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


def raw_steps_from(session: Session, *, run_id: int) -> int:
    """The first step whose raw rows a retention policy left (0: every step's), for readers that want
    steps, not buckets (``gradwatch export``)."""
    rec = _compaction(session, run_id)
    return rec.raw_before if rec is not None else 0


def _raw_values(session, table, col, nanflag, where):
    """(step, value) rows in step order; value None when not measured."""
    if isinstance(col, _ExtraSlot):
        # the step's extra blob holds the signal at its slot; a shorter blob, or none, did not measure it
        for step, blob in session.execute(select(table.step, table.extra).where(*where).order_by(table.step)):
            yield step, extra_value(blob, col.slot)
        return
    for step, v, nan in session.execute(select(table.step, col, nanflag).where(*where).order_by(table.step)):
        yield step, column_value(v, bool(nan))


def _raw_points(session, table, col, nanflag, where) -> list[SeriesPointOut]:
    out = []
    for step, val in _raw_values(session, table, col, nanflag, where):
        measured = val is not None
        nf = int(measured and not math.isfinite(val))
        out.append(SeriesPointOut(step=step, min=val, max=val, last=val, count=int(measured), nonfinite=nf))
    return out


def get_series(session: Session, *, run_id: int, signal: str, start: Optional[int] = None,
               end: Optional[int] = None, max_points: int = 2000, since: Optional[int] = None,
               rank: int = 0) -> SeriesOut:
    """A signal over ``[start, end]`` in at most ``max_points`` buckets.

    Each bucket keeps min, max (spikes survive), the last value, the count of
    measured steps and of non-finite ones (NaN markers survive). With
    ``since``: raw steps after that step, for live tails (bucketed only if
    there are more than ``max_points`` of them). Raises ``UnknownSignal``.

    Buckets of at least 16 steps are read from the rollups
    (server/storage/rollups.py): the bucket size is then a multiple of the rollup
    level and bucket boundaries are aligned to it.
    """
    _signal_source(signal)  # validate before touching the database
    if since is not None:
        start = max(since + 1, start or 0)
    bucket, points = _series_points(session, run_id=run_id, signal=signal, rank=rank, start=start, end=end,
                                    max_points=max_points)
    return SeriesOut(run_id=run_id, signal=signal, rank=rank, bucket_size=bucket, points=points)


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
            points.append(SeriesPointOut(step=first, min=mn, max=mx, last=last, count=cnt, nonfinite=nf))
        return bucket, points
    if isinstance(col, _ExtraSlot):
        return bucket, _bucket_in_python(_raw_values(session, table, col, nanflag, where), start, bucket)
    return bucket, _bucketed_points(session, table, col, nanflag, where, base, start, bucket)


def _bucket_in_python(values, start: int, bucket: int) -> list[SeriesPointOut]:
    """What ``_bucketed_points`` computes in SQL, from raw (step, value) rows: for buckets smaller than
    the first rollup level, so at most 16 × max_points rows, each read once."""
    out: list[SeriesPointOut] = []
    cur = None
    for step, v in values:
        b = start + (step - start) // bucket * bucket
        if cur is None or cur.step != b:
            cur = SeriesPointOut(step=b, min=None, max=None, last=None, count=0, nonfinite=0)
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


def _bucketed_points(session, table, col, nanflag, where, base, start: int, bucket: int) -> list[SeriesPointOut]:
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
        out.append(SeriesPointOut(step=start + int(bi) * bucket, min=None if mn is None else float(mn),
                               max=None if mx is None else float(mx), last=column_value(lv, bool(ln)),
                               count=cnt, nonfinite=int(nf or 0)))
    return out


def get_series_multi(session: Session, *, run_ids: Sequence[int], signals: Sequence[str],
                     start: Optional[int] = None, end: Optional[int] = None, max_points: int = 2000,
                     rank: int = 0) -> list[SeriesOut]:
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
                out.append(SeriesOut(run_id=run_id, signal=signal, rank=rank, bucket_size=1, points=[]))
                continue
            bucket, points = _series_points(session, run_id=run_id, signal=signal, rank=rank, start=lo_all,
                                            end=hi_all, max_points=max_points, bounds=(lo_all, hi_all),
                                            rollup_rows=rollup_rows)
            out.append(SeriesOut(run_id=run_id, signal=signal, rank=rank, bucket_size=bucket, points=points))
    return out


def list_signals(session: Session, *, run_id: int) -> list[str]:
    """Step signals plus the run's ``custom:<key>`` signals."""
    keys = session.scalars(select(CustomScalar.key).where(CustomScalar.run_id == run_id).distinct()).all()
    return [*STEP_SIGNAL_NAMES, *(f"custom:{k}" for k in sorted(keys))]


