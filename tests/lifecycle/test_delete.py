"""Deleting runs and projects through a real server, on SQLite and the real PostgreSQL.

After each delete (one run, a filtered set, a project) every table with a ``run_id`` (read from the
SQLAlchemy metadata) and every table keyed by the run's alerts or notification groups is counted for the
run's rows: none may be left but its tombstone. The other runs' rows are counted before and after: the
delete takes nothing of theirs.
"""
from __future__ import annotations

import os
import sqlite3
import time


from tests.conftest import create_token, http_json, wait_until
from tests.lifecycle.lifecycle_data import assert_no_orphans, fill_run, ids_of, rows_of_run
from tests.server.gw_payloads import batch, step


def _delete(srv, path, token=None):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return http_json("DELETE", srv.url + path, headers=headers, timeout=120)


def _owned_ids(db_url, run_id):
    alerts = ids_of(db_url, "SELECT id FROM alerts WHERE run_id = :r", r=run_id)
    groups = ids_of(db_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=run_id)
    return alerts, groups


def _finish(srv, project, run):
    """A last batch that says the run finished (a finished run is deleted without force)."""
    status, body = http_json("POST", srv.url + "/api/v1/ingest",
                             batch([step(10_000)], project=project, run=run, status="finished"))
    assert status == 200, body


def test_delete_run_bulk_and_project_leave_no_orphan_rows(server_factory, db_url, webhook_receiver):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    doomed = fill_run(srv, project="p1", run="doomed")
    kept = fill_run(srv, project="p1", run="kept")
    _finish(srv, "p1", "doomed")
    _finish(srv, "p1", "kept")
    # the runs really own rows in (nearly) every table: the check below is not vacuous
    before = rows_of_run(db_url, doomed)
    for t in ("steps", "layer_stats", "step_rollups", "layer_rollups", "custom_scalars", "run_events",
              "ingest_batches", "alerts", "rule_states", "rank_layouts", "step_ranks"):
        assert before[t] > 0, f"the test run has no rows in {t}: {before}"
    wait_until(lambda: ids_of(db_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=doomed),
               timeout=20, what="a notification group of the run")
    alerts, groups = _owned_ids(db_url, doomed)
    kept_before = rows_of_run(db_url, kept, *_owned_ids(db_url, kept))

    # --- one run: dry run first (nothing goes), then the delete
    status, dry = _delete(srv, f"/api/v1/runs/{doomed}?dry_run=true")
    assert status == 200, dry
    assert dry["dry_run"] and [r["id"] for r in dry["runs"]] == [doomed] and dry["bytes"] > 0
    assert rows_of_run(db_url, doomed)["steps"] == before["steps"]
    status, out = _delete(srv, f"/api/v1/runs/{doomed}")
    assert status == 200, out
    assert not out["dry_run"] and [r["id"] for r in out["runs"]] == [doomed] and out["rows"] > 0
    assert_no_orphans(db_url, doomed, alerts, groups)
    assert rows_of_run(db_url, kept, *_owned_ids(db_url, kept)) == kept_before
    assert srv.get(f"/api/v1/runs/{doomed}")[0] == 404
    assert srv.get(f"/api/v1/runs/{doomed}/series?signal=loss")[0] == 404
    assert doomed not in [r["id"] for r in srv.get("/api/v1/runs")[1]["runs"]]
    assert _delete(srv, f"/api/v1/runs/{doomed}")[0] == 404

    # --- a filtered set: name pattern in a project; the run outside the pattern stays
    a = fill_run(srv, project="p2", run="sweep-a", steps=20)
    b = fill_run(srv, project="p2", run="sweep-b", steps=20)
    other = fill_run(srv, project="p2", run="baseline", steps=20)
    for name in ("sweep-a", "sweep-b", "baseline"):
        _finish(srv, "p2", name)
    owned = {r: _owned_ids(db_url, r) for r in (a, b)}
    status, out = _delete(srv, "/api/v1/runs?project=p2&name=sweep-*&status=finished")
    assert status == 200, out
    assert sorted(r["id"] for r in out["runs"]) == sorted([a, b])
    for r in (a, b):
        assert_no_orphans(db_url, r, *owned[r])
    assert rows_of_run(db_url, other)["steps"] > 0
    # no filter at all is refused rather than taken as "everything"
    assert _delete(srv, "/api/v1/runs")[0] == 422

    # --- a project: its runs, then its own rows (webhook endpoints, silences, ...) and itself
    silence = {"matchers": ["run=baseline"], "ends_at": time.time() + 3600, "comment": "t", "project": "p2"}
    http_json("POST", srv.url + "/api/v1/silences", silence)
    owned_other = _owned_ids(db_url, other)
    status, out = _delete(srv, "/api/v1/projects/p2")
    assert status == 200, out
    assert [r["id"] for r in out["runs"]] == [other]
    assert_no_orphans(db_url, other, *owned_other)
    assert ids_of(db_url, "SELECT id FROM projects WHERE name = 'p2'") == []
    for t in ("api_tokens", "silences", "rule_overrides", "webhook_endpoints", "notification_groups"):
        assert ids_of(db_url, f"SELECT COUNT(*) FROM {t} WHERE project_id NOT IN (SELECT id FROM projects)") == [0], t
    assert _delete(srv, "/api/v1/projects/p2")[0] == 404
    # the other project is whole
    assert rows_of_run(db_url, kept, *_owned_ids(db_url, kept)) == kept_before


def test_a_run_still_sending_is_refused_unless_forced_and_its_late_batches_are_refused(server_factory, db_url):
    srv = server_factory(db_url)
    run_id = fill_run(srv, project="p", run="live", steps=20)      # status running, seen just now
    status, body = _delete(srv, f"/api/v1/runs/{run_id}")
    assert status == 409 and "still sending" in body["detail"], body
    assert srv.get(f"/api/v1/runs/{run_id}")[0] == 200
    alerts, groups = _owned_ids(db_url, run_id)
    status, body = _delete(srv, f"/api/v1/runs/{run_id}?force=true")
    assert status == 200, body
    assert_no_orphans(db_url, run_id, alerts, groups)
    # a late batch of the deleted run's session (fill_run's rank 0 session): 410, nothing written
    sessions = ids_of(db_url, "SELECT sessions FROM deleted_runs WHERE run_id = :r", r=run_id)
    late_session = (sessions[0] if isinstance(sessions[0], list) else __import__("json").loads(sessions[0]))[0]
    late = batch([step(500)], project="p", run="live", session=late_session, step_origin="given")
    status, body = http_json("POST", srv.url + "/api/v1/ingest", late)
    assert status == 410 and "deleted" in body["detail"], body
    # ... and one without a session (an older agent): it cannot be told apart, so refused too
    status, body = http_json("POST", srv.url + "/api/v1/ingest", batch([step(501)], project="p", run="live"))
    assert status == 410, body
    assert not [r for r in srv.get("/api/v1/runs?project=p")[1]["runs"] if r["name"] == "live"]
    # a new process (a new session) may start a new run of that name
    fresh = batch([step(0)], project="p", run="live", session="new-process-1", step_origin="given")
    status, body = http_json("POST", srv.url + "/api/v1/ingest", fresh)
    assert status == 200 and body["run_id"] != run_id, body
    _, series = srv.get(f"/api/v1/runs/{body['run_id']}/series?signal=loss&max_points=1000")
    assert [p["step"] for p in series["steps"]] == [0]


def test_another_projects_token_cannot_delete(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    mine = create_token(db_url, "mine")
    theirs = create_token(db_url, "theirs")
    run_id = fill_run(srv, project="mine", run="r", steps=20, token=mine)
    stored = rows_of_run(db_url, run_id)["steps"]
    assert stored > 0
    status, out = _delete(srv, f"/api/v1/runs/{run_id}?force=true", token=theirs)
    assert status == 404, out
    assert _delete(srv, "/api/v1/projects/mine?force=true", token=theirs)[0] == 404
    status, out = _delete(srv, "/api/v1/runs?project=mine&force=true", token=theirs)
    assert status == 200 and out["runs"] == [], out
    status, out = _delete(srv, "/api/v1/runs?name=*&force=true", token=theirs)     # scoped to its own project
    assert status == 200 and out["runs"] == [], out
    assert rows_of_run(db_url, run_id)["steps"] == stored
    status, out = _delete(srv, f"/api/v1/runs/{run_id}?force=true", token=mine)
    assert status == 200 and [r["id"] for r in out["runs"]] == [run_id], out
    assert rows_of_run(db_url, run_id)["steps"] == 0


def test_run_list_and_detail_carry_bytes_and_storage_the_database_size(server_factory, db_url):
    srv = server_factory(db_url)
    small = fill_run(srv, project="p", run="small", steps=20)
    big = fill_run(srv, project="p", run="big", steps=200)
    runs = {r["id"]: r for r in srv.get("/api/v1/runs")[1]["runs"]}
    assert runs[small]["bytes"] > 0 and runs[big]["bytes"] > runs[small]["bytes"]
    assert srv.get(f"/api/v1/runs/{big}")[1]["bytes"] == runs[big]["bytes"]
    if not db_url.startswith("sqlite"):
        status, storage = srv.get("/api/v1/storage")
        assert status == 200 and storage["dialect"] == "postgresql"
        assert storage["bytes"] > runs[big]["bytes"]
        return
    # the file holds every page once the write-ahead log is checkpointed into it
    path = db_url.split("///", 1)[1]
    with sqlite3.connect(path) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    status, storage = srv.get("/api/v1/storage")
    assert status == 200 and storage["dialect"] == "sqlite"
    assert storage["bytes"] == os.path.getsize(path)
    assert runs[big]["bytes"] < storage["bytes"]


def test_a_delete_cut_short_is_finished_at_the_next_start(server_factory, db_url):
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.lifecycle.delete import mark_runs, select_runs

    srv = server_factory(db_url)
    run_id = fill_run(srv, project="p", run="cut", steps=40)
    alerts, groups = _owned_ids(db_url, run_id)
    srv.stop()
    # the server stopped right after the mark committed: the rows are all still there
    database = open_database(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with database.write_sessionmaker() as session:
        refs = select_runs(session, run_ids=[run_id], stall_seconds=300)
        mark_runs(session, runs=refs, force=True, stall_seconds=300)
        session.commit()
    database.dispose()
    assert rows_of_run(db_url, run_id)["steps"] > 0
    srv.start()
    assert srv.get(f"/api/v1/runs/{run_id}")[0] == 404       # hidden from the start
    wait_until(lambda: rows_of_run(db_url, run_id)["runs"] == 0, timeout=60, what="the purge finished at start")
    assert_no_orphans(db_url, run_id, alerts, groups)
