"""``/api/health`` asks the database on a connection of its own (server/storage/db.py, ``Ping``), against
a real server: the connection is kept between polls, it never holds a transaction open (PostgreSQL: no
``idle in transaction`` session; SQLite: a checkpoint of the whole WAL is not blocked), it is replaced
when the database cuts it, and a database that does not answer is a failed health check, not an ok.
bench/abuse.py --case heatmap measures what it buys (docs/deployment.md, "Hostile input")."""
from __future__ import annotations

import sqlite3

import psycopg
import pytest

from tests.server.test_server_pg_sessions_cut import _cut_sessions


def _sessions(admin_url: str, db_url: str) -> list[tuple[int, str]]:
    name = db_url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url, autocommit=True) as admin:
        return admin.execute("SELECT pid, state FROM pg_stat_activity WHERE datname = %s", (name,)).fetchall()


@pytest.mark.postgres
def test_health_keeps_one_autocommit_session_and_replaces_it_when_cut(server_factory, pg_url, pg_admin_url):
    srv = server_factory(pg_url)
    for _ in range(20):
        assert srv.get("/api/health") == (200, {"status": "ok", "database": "postgresql"})
    sessions = _sessions(pg_admin_url, pg_url)
    assert sessions, "the server holds no session at all"
    # every session the server keeps is idle: the health check's own one holds no transaction open
    assert {state for _, state in sessions} == {"idle"}, sessions
    before = {pid for pid, _ in sessions}
    for _ in range(3):
        assert _cut_sessions(pg_admin_url, pg_url) >= 1
        # the first poll after the cut finds its connection dead, drops it and asks again on a new one
        assert srv.get("/api/health") == (200, {"status": "ok", "database": "postgresql"})
    after = {pid for pid, _ in _sessions(pg_admin_url, pg_url)}
    assert after and not after & before, (before, after)


def test_health_leaves_no_read_transaction_open_on_sqlite(server_factory, tmp_path):
    db = tmp_path / "gradwatch.db"
    srv = server_factory(f"sqlite:///{db}")
    for i in range(5):
        status, _ = srv.post("/api/v1/ingest", {"batch_id": f"b{i}", "project": "p", "run": "r",
                                                "steps": [{"step": i, "time": float(i), "loss": 1.0}]})
        assert status == 200
        assert srv.get("/api/health") == (200, {"status": "ok", "database": "sqlite"})
    con = sqlite3.connect(db)
    try:
        # busy = 0 and every frame checkpointed: no reader (the health check's connection included) pins the WAL
        busy, frames, done = con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        con.close()
    assert busy == 0 and frames == done, (busy, frames, done)
    assert srv.get("/api/health") == (200, {"status": "ok", "database": "sqlite"})


@pytest.mark.postgres
def test_health_fails_while_the_database_refuses_and_recovers_after(server_factory, pg_url, pg_admin_url):
    """The answer is the database's: once the kept session is cut and no new one is allowed, the health
    check fails (500) instead of answering ok; it answers ok again as soon as the database does."""
    srv = server_factory(pg_url)
    assert srv.get("/api/health")[0] == 200
    name = pg_url.rsplit("/", 1)[1]
    with psycopg.connect(pg_admin_url, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        try:
            assert _cut_sessions(pg_admin_url, pg_url) >= 1
            for _ in range(3):
                status, body = srv.get("/api/health")
                assert status == 500, (status, body)
        finally:
            admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
    assert srv.get("/api/health") == (200, {"status": "ok", "database": "postgresql"})
