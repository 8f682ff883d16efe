"""A run's estimated bytes against what the database file really grew by.

Ground truth: a fresh SQLite file with the schema only, VACUUMed, against the same file after a real server
stored one 150-layer run, VACUUMed again: the run's bytes are the difference (pages on disk, indexes
included). The estimate (server/lifecycle/sizes.py: row counts x each table's bytes per row from dbstat)
must be close to it, and a run twice as long about twice as big.
"""
from __future__ import annotations

import os
import sqlite3

import pytest

from gradwatch.server.storage.db import open_database
from gradwatch.server.lifecycle import sizes
from tests.conftest import http_json
from tests.server.gw_payloads import batch, step

LAYERS = 150


def _send(srv, run: str, steps: int) -> int:
    run_id = None
    for lo in range(0, steps, 250):
        rows = []
        for i in range(lo, min(lo + 250, steps)):
            layers = {"grad_norm": [0.001 * ((i * 7 + k) % 997) for k in range(LAYERS)]}
            if i % 100 == 0:
                layers["weight_norm"] = [1.0 + 0.01 * k for k in range(LAYERS)]
            rows.append(step(i, layers=layers))
        b = batch(rows, project="p", run=run, status="finished" if lo + 250 >= steps else None)
        b["meta"]["param_names"] = [f"p{k}.weight" for k in range(LAYERS)]
        status, body = http_json("POST", srv.url + "/api/v1/ingest", b, timeout=60)
        assert status == 200, body
        run_id = body["run_id"]
    return run_id


def _vacuumed_size(path: str) -> int:
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        c.execute("VACUUM")
    return os.path.getsize(path)


def test_run_bytes_match_what_the_file_grew_by(server_factory, sqlite_url):
    path = sqlite_url.split("///", 1)[1]
    srv = server_factory(sqlite_url)
    srv.stop()
    empty = _vacuumed_size(path)
    srv.start()
    short = _send(srv, "short", 1500)
    long = _send(srv, "long", 3000)
    srv.stop()
    grown = _vacuumed_size(path) - empty

    database = open_database(sqlite_url)
    try:
        with database.sessionmaker() as session:
            est = sizes.run_bytes(session, [short, long])
            total = sizes.database_size(session)
    finally:
        database.dispose()
    print(f"estimated {est[short]:,} + {est[long]:,} = {est[short] + est[long]:,} B; the file grew by {grown:,} B")
    # both runs together against the bytes the file grew by
    assert est[short] + est[long] == pytest.approx(grown, rel=0.10), (est, grown)
    assert est[long] / est[short] == pytest.approx(2.0, rel=0.10)
    assert total.bytes == os.path.getsize(path) and total.free_bytes == 0     # just VACUUMed: no free page


@pytest.mark.postgres
def test_database_size_on_postgresql_is_pg_database_size(server_factory, pg_url):
    import psycopg

    srv = server_factory(pg_url)
    _send(srv, "r", 300)
    status, storage = srv.get("/api/v1/storage")
    assert status == 200 and storage["dialect"] == "postgresql" and storage["free_bytes"] is None
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as c:
        truth = c.execute("SELECT pg_database_size(current_database())").fetchone()[0]
    # the same figure, read a moment apart (the server's own writes may add a page or two meanwhile)
    assert storage["bytes"] == pytest.approx(truth, rel=0.02)
    runs = srv.get("/api/v1/runs")[1]["runs"]
    assert runs[0]["bytes"] > 300 * LAYERS * 4       # at least the run's raw float32 layer values
