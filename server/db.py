"""Engines, sessions, SQLite pragmas, and the Alembic upgrade / schema check.

Nothing is created at import time: ``make_engine(settings)`` is called by
``create_app`` and the CLI.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


try:  # JSON columns (rule states, alert evidence) are read and written on every batch: orjson is 5-10x faster
    import orjson

    def json_dumps(obj) -> str:
        # Every writer already stores strict JSON (PostgreSQL's json type rejects NaN, so values go
        # through numbers.json_safe / rules.stats.enc first); orjson would turn a stray NaN into null.
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


@dataclass(frozen=True)
class Database:
    """The engine plus two session factories: reads, and writes (SQLite: BEGIN IMMEDIATE)."""

    engine: Engine
    sessionmaker: sessionmaker
    write_sessionmaker: sessionmaker

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def dispose(self) -> None:
        self.engine.dispose()


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


def schema_problem(engine: Engine, url: str) -> Optional[str]:
    """None when the database is at the head revision, else what is wrong."""
    current, heads = current_revisions(engine), head_revisions(url)
    if current == heads:
        return None
    if not current:
        return "the database has no gradwatch schema"
    return f"the database schema is at {', '.join(sorted(current))}, this server needs {', '.join(sorted(heads))}"


def session_scope(factory: sessionmaker) -> Session:
    return factory()
