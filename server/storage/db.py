"""Engines, sessions, SQLite pragmas, and the Alembic upgrade / schema check.

Nothing is created at import time: ``make_engine(settings)`` is called by
``create_app`` and the CLI.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from sqlalchemy import create_engine, event, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


try:  # JSON columns (rule states, alert evidence) are read and written on every batch: orjson is 5-10x faster
    import orjson

    def json_dumps(obj) -> str:
        # Every writer already stores strict JSON (PostgreSQL's json type rejects NaN, so values go
        # through numbers.encode_json / rules.stats.enc first); orjson would turn a stray NaN into null.
        return orjson.dumps(obj).decode()

    def json_loads(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:   # rows written by older versions may hold bare NaN tokens
            return json.loads(text)
except ImportError:  # pragma: no cover - orjson is in the server extra
    json_dumps, json_loads = json.dumps, json.loads


def make_engine(url: str, *, pool_size: int = 10) -> Engine:
    """An engine with the settings each database needs.

    SQLite: WAL (readers never block the writer), ``synchronous=NORMAL`` (WAL
    stays crash-safe; only the last commits may be lost on power loss),
    foreign keys on, and a busy timeout so concurrent writers queue instead
    of failing. Transactions are begun by us (``BEGIN`` / ``BEGIN IMMEDIATE``)
    so a write transaction takes the write lock up front rather than failing
    to upgrade a read lock half way.
    """
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               json_serializer=json_dumps, json_deserializer=json_loads)

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA cache_size=-65536")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("sqlite_immediate") else "BEGIN")

        return engine
    return create_engine(url, pool_size=pool_size, max_overflow=20, pool_pre_ping=True,
                         json_serializer=json_dumps, json_deserializer=json_loads)


class Ping:
    """``SELECT 1`` on a connection of its own, in autocommit: what ``/api/health`` asks the database.

    Through a pooled session the same question took four round trips on PostgreSQL (the pool's pre-ping,
    ``BEGIN``, ``SELECT 1``, ``ROLLBACK``), each waiting for the database's backend to be scheduled. On
    two busy cores (20 heatmap readers, two CPU hogs) 3–6 of ~450 polls took 100–170 ms, where the same
    polls without the database stayed under 70 ms (docs/deployment.md, "Hostile input"). Here it is one.

    A dead connection (the database restarted, a failover) is dropped and the question asked once more
    on a new one; an error then is the answer. While one ping waits on the database, another caller
    does not queue behind it: it asks through a pooled connection of its own, as before.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._conn = None        # a pooled DBAPI connection, kept; None until the first ping or after an error

    def __call__(self) -> None:
        if not self._lock.acquire(blocking=False):
            with self._engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            return
        try:
            for attempt in (0, 1):
                try:
                    if self._conn is None:
                        self._conn = self._engine.raw_connection()
                        if self._engine.dialect.name == "postgresql":
                            self._conn.driver_connection.autocommit = True   # no BEGIN, no idle transaction
                    cur = self._conn.cursor()     # SQLite: the connect hook set isolation_level None
                    try:
                        cur.execute("SELECT 1")
                        cur.fetchall()
                    finally:
                        cur.close()
                    return
                except (self._engine.dialect.loaded_dbapi.Error, DBAPIError):   # the driver's, or the pool's wrapped
                    self._drop(invalidate=True)
                    if attempt:
                        raise
        finally:
            self._lock.release()

    def _drop(self, *, invalidate: bool = False) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.invalidate() if invalidate else conn.close()
        except Exception:  # noqa: BLE001 - a connection already dead cannot be closed cleanly
            pass

    def close(self) -> None:
        with self._lock:
            self._drop()


@dataclass(frozen=True)
class Database:
    """The engine plus two session factories: reads, and writes (SQLite: BEGIN IMMEDIATE); ``ping``
    asks the database whether it answers (``/api/health``)."""

    engine: Engine
    sessionmaker: sessionmaker
    write_sessionmaker: sessionmaker
    ping: Ping = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ping", Ping(self.engine))    # frozen: set once, from the engine

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def dispose(self) -> None:
        self.ping.close()
        self.engine.dispose()


def dialect_insert(session, table):
    """An INSERT into ``table`` in the session's dialect, so that ``.on_conflict_do_nothing()`` (an upsert
    that two replicas or two ranks may run at once) reads the same on PostgreSQL and SQLite."""
    return (pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert)(table)


def open_database(url: str) -> Database:
    engine = make_engine(url)
    write_engine = engine.execution_options(sqlite_immediate=True) if engine.dialect.name == "sqlite" else engine
    return Database(
        engine=engine,
        sessionmaker=sessionmaker(engine, expire_on_commit=False),
        write_sessionmaker=sessionmaker(write_engine, expire_on_commit=False),
    )


# --------------------------------------------------------------------------- Alembic

def alembic_config(url: str):
    """A programmatic Alembic config: no alembic.ini needed in the cwd."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    engine = make_engine(url)
    try:
        cfg = alembic_config(url)
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # replicas started together on an empty database would all create the schema:
                # the first takes the lock and migrates, the others then find it at head
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


def head_revisions(url: str) -> set[str]:
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(alembic_config(url)).get_heads())


def current_revisions(engine: Engine) -> set[str]:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


_MIGRATION_LOCK = 0x67726164   # "grad": the advisory-lock key gradwatch's migrations hold on PostgreSQL


def schema_state(engine: Engine, url: str) -> str:
    """``current`` (at head), ``empty`` (no gradwatch schema and none of its tables: safe to create),
    ``out_of_date`` (an older revision) or ``foreign`` (gradwatch's tables without a revision, or a
    revision this server does not know)."""
    from sqlalchemy import inspect

    from gradwatch.server.storage.models import Base

    current, heads = current_revisions(engine), head_revisions(url)
    if current == heads:
        return "current"
    if current:
        from alembic.script import ScriptDirectory

        known = {r.revision for r in ScriptDirectory.from_config(alembic_config(url)).walk_revisions()}
        return "out_of_date" if current <= known else "foreign"
    ours = set(inspect(engine).get_table_names()) & set(Base.metadata.tables)
    return "foreign" if ours else "empty"


def prepare_schema(url: str, *, upgrade_old: bool) -> None:
    """Create the schema in a database that has none; upgrade an older one only if ``upgrade_old``.

    A database without gradwatch's schema -- a new SQLite file, an empty PostgreSQL database -- is
    given the schema: there is nothing to lose. An explicit database at an older revision is its
    operator's to upgrade (when replicas move to a new schema), so callers pass ``upgrade_old`` for
    the embedded SQLite default (the user's own file) and for ``--migrate`` only; otherwise they
    refuse to start with :func:`schema_problem`'s message.
    """
    engine = make_engine(url)
    try:
        state = schema_state(engine, url)
    finally:
        engine.dispose()
    if state == "empty" or (state == "out_of_date" and upgrade_old):
        upgrade(url)


def schema_problem(engine: Engine, url: str) -> Optional[str]:
    """None when the database is at the head revision, else what is wrong."""
    current, heads = current_revisions(engine), head_revisions(url)
    if current == heads:
        return None
    if not current:
        return "the database has no gradwatch schema"
    return f"the database schema is at {', '.join(sorted(current))}, this server needs {', '.join(sorted(heads))}"

