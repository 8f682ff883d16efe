"""Deleting runs and projects: every row they own, in bounded batches, with a tombstone.

A delete has two phases.

1. **Mark** (one short transaction, :func:`mark_runs`): the run's row is locked (it waits for a batch of
   the run being written to commit), ``runs.deleted_at`` is set and a tombstone (``deleted_runs``) records
   the run's project and run names and the agent sessions that wrote it. From this commit on, every read
   treats the run as gone (404) and ingest refuses its batches with 410 Gone.
2. **Purge** (:func:`purge_run`): the run's rows are removed table by table, a bounded number of rows per
   transaction, each transaction taken through the ingest write gate (server/ingest/write_gate.py) so that a
   batch of another run waits for one small delete, never for the whole run. The chunk size adapts so
   that a transaction takes about :data:`CHUNK_SECONDS`. The ``runs`` row goes last and the tombstone's
   ``purged_at`` is set. A server stopped half-way finishes the purge at its next start
   (:func:`purge_pending`): the marked run stays hidden meanwhile.

Which tables hold a run's rows is read from the SQLAlchemy metadata (server/storage/models.py), not listed here,
so a table added later is covered without touching this module:

- every table with a ``run_id`` column (``steps``, ``layer_stats``, rollups, ``alerts``, ``rule_states``,
  ``ingest_batches``, ``notification_groups`` of the run, ...), except the tombstones themselves;
- every table with a foreign key to one of those (``notification_group_alerts`` → alerts,
  ``webhook_deliveries`` → alerts): ``ON DELETE SET NULL`` keys are set to NULL (another run's alert
  suppressed by one of this run's alerts keeps its row), the others' rows are deleted;
- ``webhook_deliveries.group_id`` (a plain column, no foreign key: migration 0009): the outbox entries of
  the run's notification groups.

Late batches: a batch naming a tombstoned run is refused (410) when it comes from one of the deleted
run's sessions, or carries no session (an old agent; it cannot be told apart). A batch of a new session —
a new process started after the delete — starts a new run of that name. See docs/deployment.md,
"Deleting runs".
"""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional

from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from gradwatch.server.storage.models import DeletedRun, Project, Run
from gradwatch.server.lifecycle import sizes
from gradwatch.server.lifecycle.owned import Owned, owned_tables, owned_where, project_tables

log = logging.getLogger("gradwatch.lifecycle")

# Target seconds per purge transaction: the longest a batch of another run waits behind a delete.
CHUNK_SECONDS = 0.01
# After each transaction the purge sleeps this many times as long as it took: the delete takes at most
# half of a core and of the database's time, the rest is ingest's (on PostgreSQL without the pause,
# ingest p99 was 230 ms while a 1M-step run was deleted; docs/performance.md, "Deleting a 1M-step run")
PAUSE_FRACTION = 1.0
PROGRESS_LOG_SECONDS = 5.0      # a long delete logs its progress this often (logger gradwatch.lifecycle)
FIRST_CHUNK_ROWS = 2000
MAX_CHUNK_ROWS = 200_000
MIN_CHUNK_ROWS = 100
# the key of runs.config that lists the agent sessions that wrote the run (server/ingest/resume.py)
_SESSIONS_KEY = "_step_shift"


class RunStillSending(Exception):
    """A run selected for deletion is still receiving batches (status running, seen within the stall time)."""

    def __init__(self, runs: list["RunRef"]):
        self.runs = runs
        names = ", ".join(f"{r.project}/{r.name} (id {r.id})" for r in runs[:10])
        more = f" and {len(runs) - 10} more" if len(runs) > 10 else ""
        super().__init__(f"still sending: {names}{more}; stop the job first or delete with force=true "
                         f"(its later batches are then refused)")


class RunDeleted(Exception):
    """Ingest: the batch names a deleted run (or one being deleted). The API answers 410 Gone."""


@dataclass(frozen=True)
class RunRef:
    id: int
    project: str
    name: str
    status: str            # derived: running | stalled | finished | crashed
    last_seen: float
    started_at: float


@dataclass
class PurgeResult:
    run_id: int
    rows: dict[str, int] = field(default_factory=dict)   # table -> rows removed (or keys set NULL)
    transactions: int = 0
    seconds: float = 0.0

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())


# ----------------------------------------------------------------------------- selecting runs

def _derived_status(run: Run, now: float, stall_seconds: float) -> str:
    if run.status == "running" and now - run.last_seen > stall_seconds:
        return "stalled"
    return run.status


def select_runs(session: Session, *, run_ids: Optional[Iterable[int]] = None, project: Optional[str] = None,
                name: Optional[str] = None, status: Optional[str] = None, older_than_s: Optional[float] = None,
                stall_seconds: float, now: Optional[float] = None) -> list[RunRef]:
    """The runs a delete would take, not yet deleted.

    ``name`` is a shell pattern (``exp-*``, ``*-debug``; no wildcard: the exact name); ``status`` the derived
    status (running | stalled | finished | crashed); ``older_than_s``: last seen more than that many seconds
    ago. Filters combine with AND.
    """
    now = time.time() if now is None else now
    q = (select(Run, Project.name).join(Project, Project.id == Run.project_id).where(Run.deleted_at.is_(None)))
    if run_ids is not None:
        q = q.where(Run.id.in_(list(run_ids)))
    if project is not None:
        q = q.where(Project.name == project)
    if name is not None and not any(ch in name for ch in "*?["):
        q = q.where(Run.name == name)
    if older_than_s is not None:
        q = q.where(Run.last_seen < now - older_than_s)
    out = []
    for run, project_name in session.execute(q.order_by(Run.id)).all():
        if name is not None and not fnmatch.fnmatchcase(run.name, name):
            continue
        st = _derived_status(run, now, stall_seconds)
        if status is not None and st != status:
            continue
        out.append(RunRef(run.id, project_name, run.name, st, run.last_seen, run.started_at))
    return out


# ----------------------------------------------------------------------------- phase 1: mark

def mark_runs(session: Session, *, runs: list[RunRef], force: bool, stall_seconds: float,
              now: Optional[float] = None) -> list[RunRef]:
    """Mark ``runs`` deleted and write their tombstones, in the caller's transaction (the caller commits).

    Locks each run's row first (a batch of it being written finishes first), then re-reads its status: a
    run still sending raises :class:`RunStillSending` unless ``force`` (nothing is marked then). Returns the
    runs marked (a run deleted meanwhile by someone else is left out).
    """
    now = time.time() if now is None else now
    locked: list[tuple[Run, RunRef]] = []
    for ref in runs:
        run = session.scalars(select(Run).where(Run.id == ref.id).with_for_update()).one_or_none()
        if run is None or run.deleted_at is not None:
            continue
        locked.append((run, RunRef(ref.id, ref.project, ref.name, _derived_status(run, now, stall_seconds),
                                   run.last_seen, run.started_at)))
    sending = [ref for _, ref in locked if ref.status == "running"]
    if sending and not force:
        raise RunStillSending(sending)
    for run, ref in locked:
        run.deleted_at = now
        sessions = sorted((run.config or {}).get(_SESSIONS_KEY, {}) or {})
        session.add(DeletedRun(run_id=run.id, project=ref.project, run=run.name, sessions=sessions,
                               deleted_at=now))
    return [ref for _, ref in locked]


def refuse_if_deleted(session: Session, *, project: str, run: str, batch_session: Optional[str]) -> None:
    """Ingest, before creating a run that does not exist: raise :class:`RunDeleted` for a late batch of a
    deleted run (its tombstone lists the batch's session, or the batch has none)."""
    for deleted_at, sessions in session.execute(
            select(DeletedRun.deleted_at, DeletedRun.sessions)
            .where(DeletedRun.project == project, DeletedRun.run == run)).all():
        if batch_session is None or batch_session in (sessions or []):
            raise RunDeleted(_deleted_message(project, run, deleted_at))


def next_run_id(session: Session) -> int:
    """SQLite: the id a new run gets, after every run and every deleted run (two index lookups)."""
    from sqlalchemy import func

    live = session.scalar(select(func.max(Run.id))) or 0
    gone = session.scalar(select(func.max(DeletedRun.run_id))) or 0
    return max(live, gone) + 1


def _deleted_message(project: str, run: str, deleted_at: float) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(deleted_at))
    return (f"run {run!r} of project {project!r} was deleted at {when}; this batch belongs to it and is "
            f"refused (a new process may start a new run of that name)")


def run_deleted_error(*, project: str, run: Run) -> RunDeleted:
    """Ingest found the run's row marked deleted (its purge is under way)."""
    return RunDeleted(_deleted_message(project, run.name, run.deleted_at or time.time()))


# ----------------------------------------------------------------------------- phase 2: purge

def _chunk_delete_sql(dialect: str, owned: Owned, limit: int) -> str:
    """One bounded DELETE (or UPDATE … SET NULL) of the run's rows of one table."""
    t = owned.table.name
    where = owned_where(owned, "run_id", "run_id")
    if owned.set_null:
        where = f"{where} AND {t}.{owned.column} IS NOT NULL"
    row_id = "ctid" if dialect == "postgresql" else "rowid"
    picked = f"SELECT {t}.{row_id} FROM {t} WHERE {where} LIMIT {int(limit)}"
    target = f"{row_id} = ANY(ARRAY({picked}))" if dialect == "postgresql" else f"{row_id} IN ({picked})"
    if owned.set_null:
        return f"UPDATE {t} SET {owned.column} = NULL WHERE {target}"
    return f"DELETE FROM {t} WHERE {target}"


def purge_run(factory: sessionmaker, *, run_id: int, gate: Optional[ContextManager] = None,
              chunk_seconds: float = CHUNK_SECONDS, pause_fraction: float = PAUSE_FRACTION,
              progress: Optional[Callable[[str, int], None]] = None) -> PurgeResult:
    """Remove every row of a run marked deleted, a bounded chunk per transaction; the run row last.

    ``gate``: the app's ingest write gate, taken for each transaction (ingest batches queued meanwhile go
    first). After each transaction the purge sleeps ``pause_fraction`` times its duration, outside the
    gate. ``progress(table, rows)`` is called after each chunk.
    """
    started = time.perf_counter()
    result = PurgeResult(run_id=run_id)
    gate = gate if gate is not None else contextlib.nullcontext()
    rows_per_chunk = FIRST_CHUNK_ROWS
    logged = started
    with factory() as session:
        dialect = session.bind.dialect.name
        marked = session.scalar(select(Run.deleted_at).where(Run.id == run_id))
    if marked is None:
        raise ValueError(f"run {run_id} is not marked deleted (mark_runs first)")
    for owned in owned_tables():
        while True:
            sql = text(_chunk_delete_sql(dialect, owned, rows_per_chunk))
            with gate:
                t0 = time.perf_counter()
                with factory() as session:
                    n = session.execute(sql, {"run_id": run_id}).rowcount
                    session.commit()
                took = time.perf_counter() - t0
            result.transactions += 1
            if pause_fraction > 0 and n:
                time.sleep(took * pause_fraction)
            if n:
                result.rows[owned.table.name] = result.rows.get(owned.table.name, 0) + n
                if progress is not None:
                    progress(owned.table.name, n)
                if time.perf_counter() - logged >= PROGRESS_LOG_SECONDS:
                    logged = time.perf_counter()
                    log.info("deleting run %d: %d rows so far, now %s", run_id, result.total_rows, owned.table.name)
            if n < rows_per_chunk:
                break
            # aim the next chunk at chunk_seconds (rows cost differently per table: a layer_stats row of
            # 150 float32s against a 20-column steps row)
            scale = chunk_seconds / max(took, 1e-4)
            rows_per_chunk = int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, rows_per_chunk * min(2.0, max(0.5, scale)))))
    with gate:
        with factory() as session:
            session.execute(text("DELETE FROM runs WHERE id = :run_id AND deleted_at IS NOT NULL"), {"run_id": run_id})
            session.execute(text("UPDATE deleted_runs SET purged_at = :now WHERE run_id = :run_id"),
                            {"run_id": run_id, "now": time.time()})
            session.commit()
    result.transactions += 1
    result.rows["runs"] = 1
    result.seconds = time.perf_counter() - started
    log.info("deleted run %d: %d rows in %d transactions, %.1f s", run_id, result.total_rows,
             result.transactions, result.seconds)
    return result


def purge_pending(factory: sessionmaker, *, gate: Optional[ContextManager] = None) -> list[PurgeResult]:
    """Finish the purges a stopped server left half-done (runs marked deleted whose row is still there)."""
    with factory() as session:
        ids = list(session.scalars(select(Run.id).where(Run.deleted_at.is_not(None)).order_by(Run.id)))
    return [purge_run(factory, run_id=i, gate=gate) for i in ids]


# ----------------------------------------------------------------------------- projects

def delete_project_rows(session: Session, *, project_id: int) -> dict[str, int]:
    """The project's own rows and the project itself, in the caller's transaction (its runs already gone).
    Small tables: one transaction."""
    out: dict[str, int] = {}
    for owned in project_tables():
        t = owned.table.name
        where = owned_where(owned, "project_id", "pid")
        sql = (f"UPDATE {t} SET {owned.column} = NULL WHERE {where}" if owned.set_null
               else f"DELETE FROM {t} WHERE {where}")
        n = session.execute(text(sql), {"pid": project_id}).rowcount
        if n:
            out[t] = out.get(t, 0) + n
    session.execute(text("DELETE FROM projects WHERE id = :pid"), {"pid": project_id})
    out["projects"] = 1
    return out


# ----------------------------------------------------------------------------- the whole delete

@dataclass
class DeleteReport:
    runs: list[RunRef]
    bytes: dict[int, int]                  # estimated bytes per run, taken before the delete
    rows: int = 0                          # rows removed (0 on a dry run)
    seconds: float = 0.0
    dry_run: bool = False
    project_rows: dict[str, int] = field(default_factory=dict)


def delete_runs(database, *, runs: list[RunRef], force: bool, stall_seconds: float, dry_run: bool = False,
                gate: Optional[ContextManager] = None) -> DeleteReport:
    """Mark ``runs`` deleted (one transaction) and purge each; ``dry_run``: only say what would go.

    Raises :class:`RunStillSending` (nothing deleted) for a run still sending without ``force``.
    ``database``: server/storage/db.py ``Database``.
    """
    started = time.perf_counter()
    gate = gate if gate is not None else contextlib.nullcontext()
    with database.sessionmaker() as session:
        estimate = sizes.run_bytes(session, [r.id for r in runs])
    if dry_run:
        sending = [r for r in runs if r.status == "running"]
        if sending and not force:
            raise RunStillSending(sending)
        return DeleteReport(runs=runs, bytes=estimate, dry_run=True)
    with gate:
        with database.write_sessionmaker() as session:
            marked = mark_runs(session, runs=runs, force=force, stall_seconds=stall_seconds)
            session.commit()
    report = DeleteReport(runs=marked, bytes={r.id: estimate.get(r.id, 0) for r in marked})
    for ref in marked:
        report.rows += purge_run(database.write_sessionmaker, run_id=ref.id, gate=gate).total_rows
    with database.sessionmaker() as session:
        sizes.forget(session, [r.id for r in marked])
    report.seconds = time.perf_counter() - started
    return report


def delete_project(database, *, project: str, force: bool, stall_seconds: float, dry_run: bool = False,
                   gate: Optional[ContextManager] = None) -> Optional[DeleteReport]:
    """Delete every run of ``project``, then its tokens, silences, rule overrides, webhook endpoints and
    notification groups, then the project. None when there is no such project.

    A run that a batch starts meanwhile is deleted too (up to three rounds; then :class:`RunStillSending`).
    """
    gate = gate if gate is not None else contextlib.nullcontext()
    with database.sessionmaker() as session:
        project_id = session.scalar(select(Project.id).where(Project.name == project))
        if project_id is None:
            return None
        runs = select_runs(session, project=project, stall_seconds=stall_seconds)
    report = delete_runs(database, runs=runs, force=force, stall_seconds=stall_seconds, dry_run=dry_run, gate=gate)
    if dry_run:
        return report
    for _ in range(3):
        # runs marked by an earlier delete that a stopped server left half-purged, and runs started meanwhile
        with database.sessionmaker() as session:
            left = list(session.scalars(select(Run.id).where(Run.project_id == project_id, Run.deleted_at.is_not(None))))
            late = select_runs(session, project=project, stall_seconds=stall_seconds)
        for rid in left:
            report.rows += purge_run(database.write_sessionmaker, run_id=rid, gate=gate).total_rows
        if late:
            more = delete_runs(database, runs=late, force=True, stall_seconds=stall_seconds, gate=gate)
            report.runs += more.runs
            report.bytes.update(more.bytes)
            report.rows += more.rows
            continue
        with gate:
            with database.write_sessionmaker() as session:
                # the project's row locked: a batch creating a run of it waits, then finds no project
                session.execute(select(Project.id).where(Project.id == project_id).with_for_update())
                if session.scalar(select(Run.id).where(Run.project_id == project_id).limit(1)) is not None:
                    session.rollback()
                    continue
                report.project_rows = delete_project_rows(session, project_id=project_id)
                session.commit()
        report.rows += sum(report.project_rows.values())
        return report
    raise RunStillSending(select_runs_by_project(database, project, stall_seconds))


def select_runs_by_project(database, project: str, stall_seconds: float) -> list[RunRef]:
    with database.sessionmaker() as session:
        return select_runs(session, project=project, stall_seconds=stall_seconds)
