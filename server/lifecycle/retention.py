"""Retention: compact old runs to the rollups their charts read, in small transactions, in the background.

A run's raw rows (``steps``, ``layer_stats``) older than its project's policy
(``server/lifecycle/retention_config.py``) are deleted; its rollups stay — every step rollup level and
the per-layer levels from the policy's ``layer_level`` up (the finer per-layer partials go too) — and
the query layer reads them wherever raw rows are gone (``runs.config["_retention"]``, written *before*
the first row is deleted, so a reader never takes a half-deleted range for the truth). Alerts,
incidents, events, checkpoints, batch ids, custom scalars (they have no rollups) and the run's metadata
are kept. In a sharded run the ranks' own per-layer rows of combined steps may go earlier
(``rank_layer_steps``).

Every delete is one transaction of at most ``batch_rows`` rows, behind the process's ingest write gate
(``server/ingest/write_gate.py``) and followed by a pause, so ingest waits for one small delete at most
(docs/performance.md, "Storage: bytes per step, before and after retention": ingest p99 side by side with
and without the job).

Example (what the server's background job does on each pass)::

    from gradwatch.server.lifecycle.retention import compact_run
    from gradwatch.server.lifecycle.retention_config import RetentionPolicy
    done = compact_run(database, run_id=1, policy=RetentionPolicy(raw_steps=10_000))
    print(done.rows, done.bytes_freed)
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Optional

import numpy as np
from sqlalchemy import func, select, text

from gradwatch.server.operations.metrics import RetentionCounters
from gradwatch.server.storage.models import ROLLUP_LEVELS, Project, RankLayout, Run, Step
from gradwatch.server.wire.numbers import NULL_F32_BITS, measured_mask
from gradwatch.server.storage.rollups import layer_partial_arrays, step_partial_columns
from gradwatch.server.lifecycle.retention_config import (JobSettings, RetentionConfigError, RetentionPolicy,
                                                         load_retention)
from gradwatch.server.storage.compaction import RECORD_KEY, CompactionRecord

log = logging.getLogger("gradwatch.server.retention")

COMBINED_RANK = -1    # server/storage/ranks.py: the combined row of a sharded run
# bytes a deleted row is reckoned to have freed besides its blob (key columns, row header, index entry),
# from the storage figures of docs/architecture.md ("Why this layout"): a steps row is ~83 B on SQLite,
# ~190 B on PostgreSQL with its index; a blob row's overhead ~40 / ~60 B
ROW_BYTES = {"sqlite": {"steps": 83, "blob": 40}, "postgresql": {"steps": 190, "blob": 60}}


@dataclass
class RunCompaction:
    run_id: int
    raw_before: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    bytes_freed: int = 0

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


def _align(step: int, level: int) -> int:
    return (step // level) * level


def _ranks(session, table: str, run_id: int) -> list[int]:
    """The ranks a run has rows of in ``table``, by index seeks (a DISTINCT would scan the run's rows)."""
    out, cur = [], None
    q_first = text(f"SELECT min(rank) FROM {table} WHERE run_id = :run")
    q_next = text(f"SELECT min(rank) FROM {table} WHERE run_id = :run AND rank > :after")
    while True:
        cur = session.scalar(q_first, {"run": run_id}) if cur is None else \
            session.scalar(q_next, {"run": run_id, "after": cur})
        if cur is None:
            return out
        out.append(int(cur))


def _stats(session, table: str, run_id: int) -> list[str]:
    out, cur = [], None
    while True:
        q = text(f"SELECT min(stat) FROM {table} WHERE run_id = :run" + ("" if cur is None else " AND stat > :after"))
        cur = session.scalar(q, {"run": run_id, "after": cur})
        if cur is None:
            return out
        out.append(cur)


def policy_cutoff(session, run: Run, policy: RetentionPolicy, *, now: float, rank: int,
                  floor: int = 0) -> Optional[int]:
    """The first step whose raw rows the policy keeps (rows of earlier steps may go), or None: keep all.
    ``floor``: raw rows below it are gone already (the search for the first young step starts there)."""
    if policy.raw_days is None and policy.raw_steps is None:
        return None
    keep = []
    if policy.raw_steps is not None:
        last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run.id, Step.rank == rank))
        if last is None:
            return None
        keep.append(int(last) + 1 - policy.raw_steps)
    if policy.raw_days is not None:
        # the first step young enough to keep, by the step's own time (the agent's clock): read in step
        # order from the floor, stopping at the first young row, so it reads only the rows about to go
        # (a min() with the time condition would read every row of the rank)
        young = session.scalar(select(Step.step).where(
            Step.run_id == run.id, Step.rank == rank, Step.step >= floor,
            Step.time >= now - policy.raw_days * 86400.0).order_by(Step.step).limit(1))
        if young is None:
            last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run.id, Step.rank == rank))
            if last is None:
                return None
            young = int(last) + 1
        keep.append(int(young))
    return min(keep)      # raw is kept where either keeps it


class _Writer:
    """Short write transactions behind the ingest gate, each followed by a pause."""

    def __init__(self, database, gate: ContextManager, pause_s: float, sleep: Callable[[float], None]):
        self.database, self.gate, self.pause_s, self.sleep = database, gate, pause_s, sleep

    def run(self, fn):
        with self.gate:
            with self.database.write_sessionmaker() as session:
                out = fn(session)
                session.commit()
        if self.pause_s:
            self.sleep(self.pause_s)
        return out


def _delete_windows(writer: _Writer, dialect: str, *, table: str, keys: dict[str, Any], col: str, lo: int,
                    hi: int, batch_rows: int, blob: Optional[str], extra_where: str = "",
                    counters: Optional[RetentionCounters], job: RunCompaction, label: str) -> None:
    """Delete rows of ``table`` matching ``keys`` with ``lo <= col < hi``, ``batch_rows`` at a time (the
    window's end found by an index seek), counting rows and estimated bytes."""
    where = " AND ".join(f"{k} = :{k}" for k in keys)
    seek = text(f"SELECT {col} FROM {table} WHERE {where} AND {col} >= :lo AND {col} < :hi "
                f"ORDER BY {col} LIMIT 1 OFFSET :n")
    size = f"coalesce(sum(length({blob})), 0)" if blob else "0"
    measure = text(f"SELECT count(*), {size} FROM {table} WHERE {where} AND {col} >= :lo AND {col} < :hi{extra_where}")
    delete = text(f"DELETE FROM {table} WHERE {where} AND {col} >= :lo AND {col} < :hi{extra_where}")
    overhead = ROW_BYTES.get(dialect, ROW_BYTES["sqlite"])["blob" if blob else "steps"]
    start = lo
    while start < hi:
        def one(session, start=start):
            end = session.scalar(seek, {**keys, "lo": start, "hi": hi, "n": batch_rows})
            end = hi if end is None else int(end)
            params = {**keys, "lo": start, "hi": end}
            n, nbytes = session.execute(measure, params).one()
            if n:
                session.execute(delete, params)
            return end, int(n), int(nbytes) + int(n) * overhead
        start, n, nbytes = writer.run(one)
        if n:
            job.rows[label] = job.rows.get(label, 0) + n
            job.bytes_freed += nbytes
            if counters is not None:
                counters.add(label, n, nbytes)


# ----------------------------------------------------------------------------------- merging partials

def merge_step_blobs(blobs: list[bytes]) -> bytes:
    """One step partial (server/storage/rollups.py) equal, for every reader, to the partials ``blobs`` of one bucket:
    min / max over them, counts added, the last value that of the partial with the latest last_step."""
    width = max(len(b) for b in blobs) // 48
    cols = step_partial_columns(blobs, list(range(width)))          # per signal: (r, 6)
    data = np.stack(cols, axis=2)                                   # (r, 6, W)
    out = np.empty((6, width), dtype="<f8")
    with np.errstate(invalid="ignore"):
        out[0] = np.fmin.reduce(data[:, 0], axis=0)
        out[1] = np.fmax.reduce(data[:, 1], axis=0)
        out[2] = data[:, 2].sum(axis=0)
        out[3] = data[:, 3].sum(axis=0)
    pick = np.argmax(data[:, 4], axis=0)                            # the latest last_step (-1: none)
    out[4] = data[pick, 4, np.arange(width)]
    out[5] = np.where(out[4] >= 0, data[pick, 5, np.arange(width)], np.nan)
    return out.tobytes()


def merge_layer_blobs(blobs: list[bytes]) -> Optional[bytes]:
    """One full layer partial equal to ``blobs`` of one bucket for every reader (``_finish_matrix``), or None
    where they are cheaper as they are (one-step compact partials of a sparsely sampled statistic)."""
    heads = np.frombuffer(b"".join(b[:8] for b in blobs), dtype="<f8")
    width = max((len(b) - 8) // (4 if h < 0 else 24) for b, h in zip(blobs, heads))
    if (heads < 0).all() and sum(len(b) for b in blobs) <= 8 + 24 * width:
        return None
    _, last_step, arr = layer_partial_arrays([(0, b) for b in blobs], width)
    order = np.argsort(last_step, kind="stable")
    last_step, arr = last_step[order], arr[order]
    out = np.empty((6, width), dtype="<f4")
    with np.errstate(invalid="ignore"):        # +inf and -inf in one bucket's sum: NaN, as ingest stores it
        out[0] = np.fmin.reduce(arr[:, 0], axis=0)
        out[1] = np.fmax.reduce(arr[:, 1], axis=0)
        out[2] = arr[:, 2].astype(np.float64).sum(axis=0)
    out[3] = arr[:, 3].sum(axis=0)
    out[4] = arr[:, 4].sum(axis=0)
    measured = measured_mask(arr[:, 5])
    idx = np.where(measured, np.arange(len(blobs))[:, None], -1).max(axis=0)   # latest partial measuring it
    out[5] = np.where(idx >= 0, arr[np.maximum(idx, 0), 5, np.arange(width)],
                      np.array([NULL_F32_BITS], dtype="<u4").view("<f4")[0])
    empty = out[3] == 0                                             # nothing but NaN: min and max NaN
    out[0][empty] = np.nan
    out[1][empty] = np.nan
    return np.array([last_step.max()], dtype="<f8").tobytes() + out.tobytes()


def _merge_windows(writer: _Writer, *, table: str, keys: dict[str, Any], lo: int, hi: int, batch_rows: int,
                   merge: Callable[[list[bytes]], Optional[bytes]], counters: Optional[RetentionCounters],
                   job: RunCompaction) -> None:
    """Merge the partials of each bucket in ``[lo, hi)`` into one, a window of about ``batch_rows`` partials
    per transaction (a bucket is never split across two). Rows written since are left as they are: a
    reader merges them with the merged one."""
    where = " AND ".join(f"{k} = :{k}" for k in keys)
    seek = text(f"SELECT bucket FROM {table} WHERE {where} AND bucket >= :lo AND bucket < :hi "
                f"ORDER BY bucket LIMIT 1 OFFSET :n")
    read = text(f"SELECT id, bucket, data FROM {table} WHERE {where} AND bucket >= :lo AND bucket < :hi "
                f"ORDER BY bucket, id")
    cols = ", ".join(keys)
    insert = text(f"INSERT INTO {table} ({cols}, bucket, data) VALUES ({', '.join(':' + k for k in keys)}, "
                  f":bucket, :data)")
    start = lo
    while start < hi:
        def one(session, start=start):
            end = session.scalar(seek, {**keys, "lo": start, "hi": hi, "n": batch_rows})
            end = hi if end is None else max(int(end), start + 1)
            rows = session.execute(read, {**keys, "lo": start, "hi": end}).all()
            by_bucket: dict[int, list] = {}
            for rid, b, blob in rows:
                by_bucket.setdefault(int(b), []).append((rid, bytes(blob)))
            gone, freed, new = [], 0, []
            for b, parts in by_bucket.items():
                if len(parts) < 2:
                    continue
                merged = merge([blob for _, blob in parts])
                if merged is None:
                    continue
                gone += [rid for rid, _ in parts]
                freed += sum(len(blob) for _, blob in parts) - len(merged)
                new.append({**keys, "bucket": b, "data": merged})
            deleted = 0
            for i in range(0, len(gone), 500):
                deleted += session.execute(
                    text(f"DELETE FROM {table} WHERE id IN ({', '.join(map(str, gone[i:i + 500]))})")).rowcount
            if deleted != len(gone):
                # another replica merged these partials first (its delete committed while ours waited):
                # inserting ours too would count the bucket twice
                session.rollback()
                return end, 0, 0
            if new:
                session.execute(insert, new)
            return end, len(gone) - len(new), freed
        start, n, freed = writer.run(one)
        if n:
            label = table
            job.rows[label] = job.rows.get(label, 0) + n
            job.bytes_freed += freed
            if counters is not None:
                counters.add(label, n, freed)


def _write_record(writer: _Writer, run_id: int, record: CompactionRecord, now: float) -> None:
    def one(session):
        # the run's row lock (PostgreSQL; SQLite has one writer): ingest rewrites runs.config under it
        run = session.scalar(select(Run).where(Run.id == run_id).with_for_update())
        if run is None:
            return
        config = dict(run.config or {})
        config[RECORD_KEY] = record.as_json(at=now)
        run.config = config
    writer.run(one)


def compact_run(database, *, run_id: int, policy: RetentionPolicy, now: Optional[float] = None,
                batch_rows: int = 2000, pause_s: float = 0.0, gate: Optional[ContextManager] = None,
                counters: Optional[RetentionCounters] = None,
                sleep: Callable[[float], None] = time.sleep) -> RunCompaction:
    """Apply ``policy`` to one run: record what goes, then delete it in transactions of ``batch_rows``
    rows. Safe to run again (and on two replicas at once): it carries on where the record says."""
    now = time.time() if now is None else now
    job = RunCompaction(run_id=run_id)
    writer = _Writer(database, gate or contextlib.nullcontext(), pause_s, sleep)
    dialect = database.engine.dialect.name
    with database.sessionmaker() as session:
        run = session.get(Run, run_id)
        if run is None or not policy.active:
            return job
        old = CompactionRecord.of(run.config)
        ranks = _ranks(session, "steps", run_id)
        if not ranks:
            return job
        sharded = session.scalar(select(RankLayout.rank).where(RankLayout.run_id == run_id).limit(1)) is not None
        lead = 0 if 0 in ranks else ranks[0]
        # one boundary for the whole run (every rank), on a step-rollup bucket's edge; finer rollups and
        # merges only touch buckets wholly below it, and a read from below it reads the kept levels
        align = policy.step_level
        cut = policy_cutoff(session, run, policy, now=now, rank=lead, floor=old.raw_before if old else 0)
        raw_before = max(old.raw_before if old else 0, _align(cut, align) if cut is not None and cut > 0 else 0)
        rank_before = old.rank_layers_before if old else 0
        if sharded and policy.rank_layer_steps is not None:
            combined_last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id,
                                                                             Step.rank == COMBINED_RANK))
            if combined_last is not None:
                last = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id, Step.rank == lead))
                c = min(int(combined_last) + 1, int(last) + 1 - policy.rank_layer_steps)
                rank_before = max(rank_before, _align(c, ROLLUP_LEVELS[0]) if c > 0 else 0)
        if raw_before <= 0 and rank_before <= 0:
            return job
        if (old and raw_before <= old.raw_before and rank_before <= old.rank_layers_before
                and not _raw_left(session, run_id, ranks, raw_before)):
            return job
        first = dict(old.first) if old else {}
        last = dict(old.last) if old else {}
        for r in ranks:
            if r not in first:
                lo = session.scalar(select(func.min(Step.step)).where(Step.run_id == run_id, Step.rank == r))
                if lo is not None:
                    first[r] = int(lo)
            hi = session.scalar(select(func.max(Step.step)).where(Step.run_id == run_id, Step.rank == r,
                                                                 Step.step < raw_before))
            if hi is not None:
                last[r] = max(int(hi), last.get(r, -1))
        layer_ranks = ranks        # a rank's per-layer rows are of steps it sent (a seek each, if it has none)
        layer_stats = _stats(session, "layer_stats", run_id)
        rollup_stats = _stats(session, "layer_rollups", run_id)
    record = CompactionRecord(raw_before=raw_before, step_level=policy.step_level, layer_level=policy.layer_level,
                              rank_layers_before=rank_before, first=first, last=last)
    job.raw_before = raw_before
    _write_record(writer, run_id, record, now)   # readers switch to the rollups before a row goes
    common = dict(writer=writer, dialect=dialect, batch_rows=batch_rows, counters=counters, job=job)
    if raw_before > 0:
        for r in ranks:
            _delete_windows(table="steps", keys={"run_id": run_id, "rank": r}, col="step", lo=first.get(r, 0),
                            hi=raw_before, blob=None, label="steps", **common)
        for stat in layer_stats:
            for r in layer_ranks:
                _delete_windows(table="layer_stats", keys={"run_id": run_id, "stat": stat, "rank": r}, col="step",
                                lo=first.get(r, 0), hi=raw_before, blob="\"values\"", label="layer_stats", **common)
        for level in (lv for lv in ROLLUP_LEVELS if lv < policy.layer_level):
            for stat in rollup_stats:
                for r in layer_ranks:
                    _delete_windows(table="layer_rollups", keys={"run_id": run_id, "stat": stat, "rank": r,
                                                                 "level": level}, col="bucket", lo=0,
                                    hi=raw_before // level, blob="data", label="layer_rollups", **common)
        for level in (lv for lv in ROLLUP_LEVELS if lv < policy.step_level):
            for r in ranks:
                _delete_windows(table="step_rollups", keys={"run_id": run_id, "rank": r, "level": level},
                                col="bucket", lo=0, hi=raw_before // level, blob="data", label="step_rollups",
                                **common)
        # the partials left of each kept bucket (one per batch that touched it: an agent's 0.5 s batches
        # leave ~13 per level-256 bucket) merged into one, level by level, up to the bucket holding the
        # boundary (merging is exact whenever it runs: a reader merges a merged partial with later ones)
        old_before = old.raw_before if old else 0
        for level in (lv for lv in ROLLUP_LEVELS if lv >= policy.step_level):
            for r in ranks:
                _merge_windows(writer, table="step_rollups", keys={"run_id": run_id, "rank": r, "level": level},
                               lo=old_before // level, hi=-(-raw_before // level), batch_rows=batch_rows,
                               merge=merge_step_blobs, counters=counters, job=job)
        for level in (lv for lv in ROLLUP_LEVELS if lv >= policy.layer_level):
            for stat in rollup_stats:
                for r in layer_ranks:
                    _merge_windows(writer, table="layer_rollups",
                                   keys={"run_id": run_id, "stat": stat, "rank": r, "level": level},
                                   lo=old_before // level, hi=-(-raw_before // level), batch_rows=batch_rows,
                                   merge=merge_layer_blobs, counters=counters, job=job)
    if rank_before > raw_before:
        # the ranks' own per-layer rows of steps whose combined row exists (server/storage/ranks.py)
        combined = (f" AND step IN (SELECT step FROM steps WHERE run_id = :run_id AND rank = {COMBINED_RANK}"
                    " AND step >= :lo AND step < :hi)")
        for stat in layer_stats:
            for r in (r for r in layer_ranks if r >= 0):
                _delete_windows(table="layer_stats", keys={"run_id": run_id, "stat": stat, "rank": r}, col="step",
                                lo=raw_before, hi=rank_before, blob="\"values\"", extra_where=combined,
                                label="layer_stats", **common)
    if job.total_rows:
        log.info("retention: run %d compacted below step %d (ranks' layers below %d): %s rows, ~%.1f MB freed",
                 run_id, raw_before, rank_before, job.rows, job.bytes_freed / 1e6)
    return job



def _raw_left(session, run_id: int, ranks: list[int], raw_before: int) -> bool:
    """Whether raw steps below the boundary remain (a pass cut short, or a resumed run re-sent them)."""
    return any(session.scalar(select(Step.step).where(Step.run_id == run_id, Step.rank == r,
                                                      Step.step < raw_before).limit(1)) is not None for r in ranks)


def retention_pass(database, config_loader: Callable[[], Any], *, job: JobSettings,
                   gate: Optional[ContextManager] = None, counters: Optional[RetentionCounters] = None,
                   stop: Optional[threading.Event] = None, now: Optional[float] = None) -> list[RunCompaction]:
    """One pass over every run of every project whose policy is active."""
    config = config_loader()
    with database.sessionmaker() as session:
        rows = session.execute(select(Run.id, Project.name).join(Project, Project.id == Run.project_id)
                               .where(Run.deleted_at.is_(None)).order_by(Run.id)).all()
    done = []
    for run_id, project in rows:
        if stop is not None and stop.is_set():
            break
        policy = config.policy_for(project)
        if not policy.active:
            continue
        if counters is not None:
            counters.count(runs_checked=1)
        out = compact_run(database, run_id=run_id, policy=policy, now=now, batch_rows=job.batch_rows,
                          pause_s=job.pause_s, gate=gate, counters=counters,
                          sleep=(stop.wait if stop is not None else time.sleep))
        if out.total_rows:
            done.append(out)
            if counters is not None:
                counters.count(runs=1)
    if counters is not None:
        counters.count(passes=1)
    return done


def retention_configured(env) -> bool:
    """Whether any ``GRADWATCH_RETENTION*`` variable is set: without one the server starts no job."""
    return any(k.startswith("GRADWATCH_RETENTION") and v.strip() for k, v in env.items())


class RetentionJob:
    """The server's background thread: a pass every ``interval_s`` (the first soon after start)."""

    def __init__(self, database, env, *, gate: Optional[ContextManager] = None,
                 counters: Optional[RetentionCounters] = None, first_delay_s: float = 5.0):
        self.database, self.env, self.gate = database, env, gate
        self.counters = counters or RetentionCounters()
        self.job = JobSettings.from_env(env)
        self.first_delay_s = first_delay_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        load_retention(self.env)     # a bad retention file stops the server here, saying where
        self._thread = threading.Thread(target=self._loop, name="gradwatch-retention", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        if self._stop.wait(self.first_delay_s):
            return
        while not self._stop.is_set():
            try:
                t0 = time.monotonic()
                done = retention_pass(self.database, lambda: load_retention(self.env), job=self.job, gate=self.gate,
                                      counters=self.counters, stop=self._stop)
                if done:
                    log.info("retention pass: %d runs compacted, %d rows, ~%.1f MB freed in %.1f s", len(done),
                             sum(d.total_rows for d in done), sum(d.bytes_freed for d in done) / 1e6,
                             time.monotonic() - t0)
            except RetentionConfigError as e:
                self.counters.count(errors=1)
                log.error("retention: %s (nothing compacted this pass)", e)
            except Exception:  # noqa: BLE001 - a failed pass is logged and retried next interval
                self.counters.count(errors=1)
                log.exception("retention pass failed")
            self._stop.wait(self.job.interval_s)
