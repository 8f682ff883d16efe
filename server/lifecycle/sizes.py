"""How many bytes a run takes, and the whole database.

**Per run (an estimate).** For every table holding a run's rows (the tables a delete empties,
``owned.owned_tables``): the run's row count in that table times the table's average bytes per row,
indexes included, summed. The average comes from the database's own accounting of the whole table:

- SQLite: the ``dbstat`` virtual table (pages of the table and of each of its indexes) over the table's
  row count; without ``dbstat`` (a SQLite built without it), the mean stored size of the columns over a
  sample of 1,000 rows plus 8 bytes of row header.
- PostgreSQL: ``pg_total_relation_size`` (heap, TOAST, indexes) over ``pg_class.reltuples`` (the planner's
  row count, kept by autovacuum/ANALYZE); a table never analysed: ``pg_column_size`` of a 1,000-row
  sample plus 28 bytes of tuple header and line pointer.

So a run's bytes are its share of each table, not bytes on disk that only it holds: free pages, page
slack and an index's upper levels are shared out by rows. The per-table averages are taken at most every
:data:`TABLE_STATS_SECONDS`; a run's row counts (indexed range counts: ~0.1 s for a 575,000-step,
150-layer run on SQLite) are kept until the run is seen again (a finished run is counted once per
process).

**The database.** SQLite: ``page_count × page_size`` (the file; ``freelist_count`` pages of it are free:
a delete frees pages that new data reuses, the file shrinks only with ``VACUUM``). PostgreSQL:
``pg_database_size``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Optional

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Run
from gradwatch.server.lifecycle.owned import owned_tables, owned_where

TABLE_STATS_SECONDS = 600.0
# a running run's counts are taken again after this long (its rows keep growing)
RUNNING_RECOUNT_SECONDS = 60.0

_lock = threading.Lock()
_table_stats: dict[str, tuple[float, dict[str, float]]] = {}          # engine url -> (taken at, bytes/row)
_run_counts: dict[tuple[str, int], tuple[float, float, int]] = {}     # (url, run) -> (last_seen, taken at, bytes)


@dataclass(frozen=True)
class DatabaseSize:
    dialect: str
    bytes: int
    free_bytes: Optional[int]       # SQLite: pages on the freelist (reused before the file grows)


def _key(session: Session) -> str:
    return str(session.bind.engine.url)


def database_size(session: Session) -> DatabaseSize:
    dialect = session.bind.dialect.name
    if dialect == "postgresql":
        n = session.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        return DatabaseSize(dialect, int(n), None)
    page_size = session.execute(text("PRAGMA page_size")).scalar_one()
    pages = session.execute(text("PRAGMA page_count")).scalar_one()
    free = session.execute(text("PRAGMA freelist_count")).scalar_one()
    return DatabaseSize(dialect, int(pages) * int(page_size), int(free) * int(page_size))


def _row_bytes_sqlite(session: Session, tables: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    owner = dict(session.execute(text("SELECT name, tbl_name FROM sqlite_schema WHERE type IN ('table', 'index')")).all())
    try:
        pages = session.execute(text("SELECT name, SUM(pgsize) FROM dbstat WHERE aggregate = 1 GROUP BY name")).all()
    except Exception:          # no dbstat in this SQLite build
        pages = None
    if pages is not None:
        per_table: dict[str, int] = {}
        for name, size in pages:
            t = owner.get(name)
            if t in tables:
                per_table[t] = per_table.get(t, 0) + int(size or 0)
        for t in tables:
            # a scan of the table's smallest index: ~0.05 s per million rows, once per TABLE_STATS_SECONDS
            count = session.execute(text(f"SELECT COUNT(*) FROM {t}")).scalar() or 0
            if count:
                out[t] = per_table.get(t, 0) / count
    for t in tables:
        if t not in out:
            cols = [r[1] for r in session.execute(text(f"PRAGMA table_info({t})")).all()]
            width = " + ".join(f"COALESCE(LENGTH(CAST(\"{c}\" AS BLOB)), 1)" for c in cols) or "0"
            avg = session.execute(text(f"SELECT AVG({width}) FROM (SELECT * FROM {t} LIMIT 1000)")).scalar()
            out[t] = float(avg or 0) + 8.0
    return out


def _row_bytes_postgresql(session: Session, tables: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for t in tables:
        total, tuples = session.execute(text(
            "SELECT pg_total_relation_size(c.oid), c.reltuples FROM pg_class c "
            "WHERE c.oid = to_regclass(:t)"), {"t": t}).one()
        if tuples and tuples > 0:
            out[t] = float(total) / float(tuples)
        else:
            avg = session.execute(text(f"SELECT AVG(pg_column_size(s.*)) FROM (SELECT * FROM {t} LIMIT 1000) s")).scalar()
            out[t] = float(avg or 0) + 28.0
    return out


def table_row_bytes(session: Session, *, max_age: float = TABLE_STATS_SECONDS) -> dict[str, float]:
    """Average bytes per row (indexes included) of each table holding runs' rows; cached ``max_age`` s."""
    key, now = _key(session), time.monotonic()
    with _lock:
        hit = _table_stats.get(key)
    if hit is not None and now - hit[0] < max_age:
        return hit[1]
    tables = sorted({o.table.name for o in owned_tables() if not o.set_null})
    stats = (_row_bytes_postgresql if session.bind.dialect.name == "postgresql" else _row_bytes_sqlite)(session, tables)
    with _lock:
        _table_stats[key] = (now, stats)
    return stats


def _count_rows(session: Session, run_id: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in owned_tables():
        if o.set_null:
            continue
        t = o.table.name
        sql = f"SELECT COUNT(*) FROM {t} WHERE {owned_where(o, 'run_id', 'r')}"
        n = session.execute(text(sql), {"r": run_id}).scalar() or 0
        counts[t] = counts.get(t, 0) + int(n)
    return counts


def run_bytes(session: Session, run_ids: Iterable[int]) -> dict[int, int]:
    """Estimated bytes of each run (see the module docstring); runs unknown are left out."""
    ids = list(run_ids)
    if not ids:
        return {}
    key, now = _key(session), time.monotonic()
    seen = dict(session.execute(select(Run.id, Run.last_seen).where(Run.id.in_(ids))).all())
    out: dict[int, int] = {}
    todo = []
    with _lock:
        for rid, last_seen in seen.items():
            hit = _run_counts.get((key, rid))
            if hit is not None and (hit[0] == last_seen or now - hit[1] < RUNNING_RECOUNT_SECONDS):
                out[rid] = hit[2]
            else:
                todo.append(rid)
    if todo:
        per_row = table_row_bytes(session)
        for rid in todo:
            rows = _count_rows(session, rid)
            b = int(sum(n * per_row.get(t, 0.0) for t, n in rows.items()) + 1024)   # + the runs row, ~1 KiB
            out[rid] = b
            with _lock:
                _run_counts[(key, rid)] = (seen[rid], now, b)
    return out


def forget(session: Session, run_ids: Iterable[int]) -> None:
    """Drop cached sizes of deleted runs (a later run reusing the id starts afresh)."""
    key = _key(session)
    with _lock:
        for rid in run_ids:
            _run_counts.pop((key, rid), None)
