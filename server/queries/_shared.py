"""What every read of the query layer shares: its errors and cost bounds, the blob readers (binary on
PostgreSQL), min / max by index seeks, and the record retention leaves on a compacted run."""
from __future__ import annotations

from typing import Optional

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.compaction import CompactionRecord
from gradwatch.server.storage.models import Run


class UnknownSignal(ValueError):
    """The signal names neither a step field nor ``custom:<key>``."""


class RequestTooLarge(ValueError):
    """A read would cost more than its bound (points, cells or rows read); the message says what to narrow."""


# Bounds on what one read may cost, checked before the work (docs/api.md, "Limits"): a request that
# asks for more is refused with a message, never answered by growing the server's memory.
MAX_SERIES_POINTS = 200_000          # buckets over all series of one request (runs × signals × max_points)
MAX_MATRIX_CELLS = 1_000_000         # cells of one heatmap answer (step columns × layer rows)
MAX_MATRIX_READ = 8_000_000          # layer values one heatmap may read (partials or raw rows × layers)


def _compaction(session: Session, run_id: int) -> Optional[CompactionRecord]:
    """What retention took from a run's raw rows (server/lifecycle/retention.py), or None: all are there.
    Where raw rows are gone, series and heatmaps read the rollups retention kept."""
    return CompactionRecord.of(session.scalar(select(Run.config).where(Run.id == run_id)))


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
        return [(k, bytes(b)) for k, b in _in_parts(cur)]


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
        return [(a, k, bytes(b)) for a, k, b in _in_parts(cur)]


# rows psycopg turns into Python objects in one call, which holds the GIL throughout: fetchall() of a
# 53,000-row heatmap read held it long enough that /api/health, polled beside 20 such reads, waited over
# 100 ms (docs/deployment.md, "Hostile input"); 2,048 rows are a few milliseconds
FETCH_ROWS = 2048


def _in_parts(cur):
    while True:
        part = cur.fetchmany(FETCH_ROWS)
        if not part:
            return
        yield from part


def _bounds(session: Session, col, where) -> tuple[Optional[int], Optional[int]]:
    """min and max of an indexed column as two scalar subqueries: SQLite answers a lone
    min() or max() with one index seek, but min() and max() together with a full scan."""
    lo = select(func.min(col)).where(*where).scalar_subquery()
    hi = select(func.max(col)).where(*where).scalar_subquery()
    return tuple(session.execute(select(lo, hi)).one())

