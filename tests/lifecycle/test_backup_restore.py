"""``gradwatch backup`` while a real server ingests, ``gradwatch restore`` into a fresh database (a new SQLite
file / a new PostgreSQL database made here and dropped after), a fresh server on it: the charts read the same.
"""
from __future__ import annotations

import uuid

import pytest

from tests.cli.cli_helpers import gradwatch
from tests.conftest import PG_ADMIN_URL, _pg_connect
from tests.lifecycle.lifecycle_data import fill_run

CHART_QUERIES = (
    "/series?signal=loss&max_points=100000",
    "/series?signal=grad_norm&max_points=100000&rank=-1",
    "/series?signal=custom:acc&max_points=100000",
    "/layers?stat=grad_norm&max_steps=500&max_layers=50",
    "/layers?stat=grad_norm&max_steps=500&max_layers=50&rank=1",
    "/events",
)


def _charts(srv, run_id):
    out = {}
    for q in CHART_QUERIES:
        status, body = srv.get(f"/api/v1/runs/{run_id}{q}")
        assert status == 200, (q, body)
        out[q] = body
    status, alerts = srv.get(f"/api/v1/alerts?run={run_id}")
    assert status == 200, alerts
    out["alerts"] = sorted((a["rule"], a["rank"], a["step"]) for a in alerts["alerts"])
    return out


@pytest.fixture
def fresh_target(db_url, tmp_path):
    """An empty database of the same kind as ``db_url`` to restore into (PostgreSQL: created and dropped here)."""
    if db_url.startswith("sqlite"):
        yield f"sqlite:///{tmp_path / 'restored.db'}"
        return
    admin = _pg_connect(PG_ADMIN_URL)
    name = f"gw_restore_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_backup_while_ingesting_restores_the_same_charts_on_a_fresh_server(server_factory, db_url, fresh_target,
                                                                            tmp_path):
    srv = server_factory(db_url)
    run_id = fill_run(srv, project="p", run="kept", steps=120)
    before = _charts(srv, run_id)
    # the loss the charts draw is the loss that was sent (tests/server/gw_payloads.step: 2.0 - i / 1000;
    # NaN at step 60); the loop's own values, not the server's
    loss = {p["step"]: p["last"] for p in before["/series?signal=loss&max_points=100000"]["steps"]}
    assert loss[60] == "NaN" and all(loss[i] == pytest.approx(2.0 - i * 0.001) for i in range(120) if i != 60)
    assert before["alerts"], "the NaN raised an alert"

    out = tmp_path / ("backup.db" if db_url.startswith("sqlite") else "backup.dump")
    done = gradwatch("backup", "--db", db_url, str(out), data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "backed up" in done.stdout and out.stat().st_size > 0
    # a second backup to the same file is refused rather than overwriting it
    again = gradwatch("backup", "--db", db_url, str(out), data_dir=tmp_path)
    assert again.returncode != 0 and "exists" in again.stderr
    # ingest goes on after the backup: the restored copy must not have it
    fill_run(srv, project="p", run="after-backup", steps=20)

    done = gradwatch("restore", str(out), "--db", fresh_target, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    restored = server_factory(fresh_target, migrate=False)
    assert _charts(restored, run_id) == before
    names = sorted(r["name"] for r in restored.get("/api/v1/runs")[1]["runs"])
    assert names == ["kept"]
    # restoring over a database that has data is refused
    done = gradwatch("restore", str(out), "--db", fresh_target, data_dir=tmp_path)
    assert done.returncode != 0 and ("exists" in done.stderr or "not empty" in done.stderr)
