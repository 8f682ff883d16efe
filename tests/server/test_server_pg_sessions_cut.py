"""A PostgreSQL restart or failover cuts every session the server holds in its pool; the server must
carry on with new ones: the next batches are stored (nothing lost, nothing doubled), reads answer, and
the webhook worker still delivers the alerts those batches raise."""
from __future__ import annotations

import psycopg
import pytest
from gw_payloads import batch, step

STEPS = 100


def _cut_sessions(admin_url: str, db_url: str) -> int:
    """Terminate every backend connected to the server's database, as a restart would; how many."""
    name = db_url.rsplit("/", 1)[1]
    admin = psycopg.connect(admin_url, autocommit=True)
    try:
        return admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                             "WHERE datname = %s AND pid <> pg_backend_pid()", (name,)).fetchone()[0]
    finally:
        admin.close()


def _send(srv, lo: int, hi: int) -> None:
    for first in range(lo, hi, STEPS):
        status, body = srv.post("/api/v1/ingest", batch([step(i) for i in range(first, first + STEPS)], run="cut"))
        assert status == 200, body


@pytest.mark.postgres
def test_batches_reads_and_webhooks_carry_on_after_the_database_cuts_every_session(server_factory, pg_url,
                                                                                  pg_admin_url, webhook_receiver):
    srv = server_factory(pg_url, extra_args=["--webhook", webhook_receiver.url])
    _send(srv, 0, 500)
    status, runs = srv.get("/api/v1/runs")
    assert status == 200, runs
    run_id = runs["runs"][0]["id"]

    def read(upto: int) -> None:
        status, series = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=10000")
        assert status == 200, series
        assert [p["step"] for p in series["steps"]] == list(range(0, upto))   # every step, once
        status, matrix = srv.get(f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps=20")
        assert status == 200, matrix

    # twice, a write first and then a read first: the pool's replacement connections must be
    # replaceable too, and neither kind of request may be the one that finds the dead sessions
    for cut in range(2):
        assert _cut_sessions(pg_admin_url, pg_url) >= 1          # the pool held at least one idle session
        lo = 500 + cut * 500
        if cut:
            read(lo)
        _send(srv, lo, lo + 500)
        read(lo + 500)
    assert _cut_sessions(pg_admin_url, pg_url) >= 1
    nan = [step(i, loss="NaN" if i == 1520 else 1.0) for i in range(1500, 1530)]
    status, body = srv.post("/api/v1/ingest", batch(nan, run="cut"))
    assert status == 200, body
    webhook_receiver.wait_for(lambda r: r.json()["rule"] == "A1")
    status, health = srv.get("/api/health")
    assert status == 200, health
