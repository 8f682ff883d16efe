"""``gradwatch runs list|delete`` and ``gradwatch projects delete`` as a user types them, against a real server
(``--server``) and straight on the database (``--db``)."""
from __future__ import annotations

import json

from tests.cli.cli_helpers import gradwatch
from tests.conftest import http_json
from tests.lifecycle.lifecycle_data import assert_no_orphans, fill_run, ids_of, rows_of_run
from tests.server.gw_payloads import batch, step


def _finish(srv, project, run):
    status, body = http_json("POST", srv.url + "/api/v1/ingest",
                             batch([step(10_000)], project=project, run=run, status="finished"))
    assert status == 200, body


def test_runs_list_and_delete_through_the_server(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    a = fill_run(srv, project="sweeps", run="lr-1", steps=20)
    b = fill_run(srv, project="sweeps", run="lr-2", steps=60)
    keep = fill_run(srv, project="sweeps", run="baseline", steps=20)
    _finish(srv, "sweeps", "lr-1")
    server = ["--server", srv.url]

    done = gradwatch("runs", "list", "--project", "sweeps", "--json", *server, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = {r["id"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(listed) == {a, b, keep} and all(r["bytes"] > 0 for r in listed.values())
    done = gradwatch("runs", "list", "--name", "lr-*", *server, data_dir=tmp_path)
    assert done.returncode == 0 and "lr-1" in done.stdout and "baseline" not in done.stdout, done.stdout
    assert "2 run(s)" in done.stdout
    # by age: every run sent data just now, so none is older than an hour, and all are older than 0 s
    done = gradwatch("runs", "list", "--project", "sweeps", "--older-than", "1h", *server, data_dir=tmp_path)
    assert done.returncode == 0 and "0 run(s)" in done.stdout, done.stdout
    done = gradwatch("runs", "delete", "--project", "sweeps", "--older-than", "0s", "--status", "finished",
                     "--dry-run", *server, data_dir=tmp_path)
    assert done.returncode == 0 and "would delete 1 run(s)" in done.stdout and "lr-1" in done.stdout, done.stdout
    done = gradwatch("runs", "list", "--older-than", "30 days", *server, data_dir=tmp_path)
    assert done.returncode != 0 and "30d" in done.stderr

    # a dry run prints what would go and its size, and deletes nothing
    done = gradwatch("runs", "delete", "--project", "sweeps", "--name", "lr-*", "--dry-run", *server, data_dir=tmp_path)
    assert done.returncode != 0 and "still sending" in done.stderr and "--force" in done.stderr   # lr-2 is live
    done = gradwatch("runs", "delete", "--project", "sweeps", "--name", "lr-*", "--dry-run", "--force", *server,
                     data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "would delete 2 run(s)" in done.stdout and "lr-1" in done.stdout and "lr-2" in done.stdout
    assert rows_of_run(sqlite_url, a)["steps"] > 0
    # not a terminal and no --yes: nothing happens
    done = gradwatch("runs", "delete", str(a), *server, data_dir=tmp_path)
    assert done.returncode != 0 and "--yes" in done.stderr
    assert rows_of_run(sqlite_url, a)["steps"] > 0

    alerts = {r: ids_of(sqlite_url, "SELECT id FROM alerts WHERE run_id = :r", r=r) for r in (a, b)}
    groups = {r: ids_of(sqlite_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=r) for r in (a, b)}
    done = gradwatch("runs", "delete", "--project", "sweeps", "--name", "lr-*", "--force", "--yes", *server,
                     data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "deleted 2 run(s)" in done.stdout
    for r in (a, b):
        assert_no_orphans(sqlite_url, r, alerts[r], groups[r])
    assert rows_of_run(sqlite_url, keep)["steps"] > 0
    done = gradwatch("runs", "delete", "--yes", *server, data_dir=tmp_path)
    assert done.returncode != 0 and "say which runs" in done.stderr


def test_projects_delete_on_the_database_directly(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    run_id = fill_run(srv, project="scratch", run="r", steps=20)
    other = fill_run(srv, project="keep", run="r", steps=20)
    _finish(srv, "scratch", "r")
    srv.stop()
    db = ["--db", sqlite_url]
    done = gradwatch("projects", "delete", "scratch", "--dry-run", *db, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "would delete project 'scratch' and 1 run(s)" in done.stdout
    alerts = ids_of(sqlite_url, "SELECT id FROM alerts WHERE run_id = :r", r=run_id)
    groups = ids_of(sqlite_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=run_id)
    done = gradwatch("projects", "delete", "scratch", "--yes", *db, data_dir=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "deleted project 'scratch' and 1 run(s)" in done.stdout
    assert_no_orphans(sqlite_url, run_id, alerts, groups)
    assert ids_of(sqlite_url, "SELECT name FROM projects") == ["keep"]
    assert rows_of_run(sqlite_url, other)["steps"] > 0
    done = gradwatch("projects", "delete", "scratch", "--yes", *db, data_dir=tmp_path)
    assert done.returncode != 0 and "no project" in done.stderr
