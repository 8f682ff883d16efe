"""Silences through the API and the CLI: a silenced alert is stored, marked, not notified; expiring the
silence notifies what still fires. A project token sees and makes its own project's silences only."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import REPO_ROOT, create_token, http_json
from tests.routing.conftest import alerts_of, nan_run, settle


def cli(srv, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(srv.data_dir))
    return subprocess.run([sys.executable, "-m", "gradwatch.server", "silence", *args, "--db", srv.db_url],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)


def test_silences_api_and_cli_expiry_restores_notifications(server_factory, db_url, webhook_receiver):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    status, by_api = srv.post("/api/v1/silences", {"project": "nlp", "matchers": ["run=api-run"], "duration_s": 3600,
                                                   "created_by": "ana", "comment": "known bad shard"})
    assert status == 201, by_api
    assert by_api["state"] == "active" and by_api["matchers"] == ['run="api-run"']
    out = cli(srv, "add", 'rule=~"A[0-9]"', "run=cli-run", "--project", "nlp", "--duration", "1h",
              "--comment", "from the CLI")
    assert out.returncode == 0, out.stderr
    cli_id = int(out.stdout.split()[1].rstrip(":"))
    # a bad matcher is refused, saying what is wrong
    status, bad = srv.post("/api/v1/silences", {"project": "nlp", "matchers": ["rule=~("], "duration_s": 60})
    assert status == 422 and "regular expression" in bad["detail"]
    bad_cli = cli(srv, "add", "colour=red", "--duration", "1h")
    assert bad_cli.returncode == 2 and "unknown label 'colour'" in bad_cli.stderr

    # loss NaN from step 20 to the end: A1 fires and goes on firing
    nan_run(srv, "nlp", "api-run", nan_from=20, nan_to=39, n=40)
    nan_run(srv, "nlp", "cli-run", nan_from=20, nan_to=39, n=40)
    nan_run(srv, "nlp", "loud-run", nan_from=20, nan_to=39, n=40)
    webhook_receiver.wait_for(lambda r: r.json()["run"] == "loud-run")
    settle(1.5)
    assert {b["run"] for b in webhook_receiver.bodies()} == {"loud-run"}
    _, runs = srv.get("/api/v1/runs?project=nlp")
    ids = {r["name"]: r["id"] for r in runs["runs"]}
    a1 = {name: next(a for a in alerts_of(srv, ids[name]) if a["rule"] == "A1") for name in ids}
    assert a1["api-run"]["silenced_by"] == by_api["id"] and a1["cli-run"]["silenced_by"] == cli_id
    assert a1["loud-run"]["silenced_by"] is None

    listed = cli(srv, "list", "--project", "nlp")
    assert listed.returncode == 0 and "api-run" in listed.stdout and "cli-run" in listed.stdout
    _, api_list = srv.get("/api/v1/silences?project=nlp&active=true")
    assert {s["id"] for s in api_list["silences"]} == {by_api["id"], cli_id}

    # expiring restores notifications for what still fires
    status, expired = srv.post(f"/api/v1/silences/{by_api['id']}/expire")
    assert status == 200 and expired["state"] == "expired"
    webhook_receiver.wait_for(lambda r: r.json()["run"] == "api-run", timeout=5)
    out = cli(srv, "expire", str(cli_id))
    assert out.returncode == 0, out.stderr
    webhook_receiver.wait_for(lambda r: r.json()["run"] == "cli-run", timeout=5)
    settle(1.0)
    assert sorted(b["run"] for b in webhook_receiver.bodies()) == ["api-run", "cli-run", "loud-run"]
    assert alerts_of(srv, ids["api-run"])[0]["silenced_by"] is None
    _, active = srv.get("/api/v1/silences?active=true")
    assert active["silences"] == []
    assert cli(srv, "expire", "999").returncode == 1


def test_silences_are_scoped_by_project_token(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url, env={"GRADWATCH_AUTH": "on"})
    nlp = {"Authorization": f"Bearer {create_token(sqlite_url, 'nlp')}"}
    vision = {"Authorization": f"Bearer {create_token(sqlite_url, 'vision')}"}
    status, own = http_json("POST", srv.url + "/api/v1/silences", {"project": "nlp", "matchers": ["run=a"],
                                                                   "duration_s": 600}, headers=nlp)
    assert status == 201, own
    status, _ = http_json("POST", srv.url + "/api/v1/silences", {"project": "vision", "matchers": ["run=a"],
                                                                 "duration_s": 600}, headers=nlp)
    assert status == 403
    # no project: a silence over every project is the operator's
    status, _ = http_json("POST", srv.url + "/api/v1/silences", {"matchers": ["run=a"], "duration_s": 600},
                          headers=nlp)
    assert status == 403
    operator = cli(srv, "add", "severity=info", "--duration", "10m")
    assert operator.returncode == 0, operator.stderr
    status, mine = http_json("GET", srv.url + "/api/v1/silences", headers=nlp)
    assert status == 200 and [s["id"] for s in mine["silences"]] == [own["id"]]
    status, theirs = http_json("GET", srv.url + "/api/v1/silences", headers=vision)
    assert status == 200 and theirs["silences"] == []
    status, _ = http_json("POST", srv.url + f"/api/v1/silences/{own['id']}/expire", headers=vision)
    assert status == 404
    status, done = http_json("POST", srv.url + f"/api/v1/silences/{own['id']}/expire", headers=nlp)
    assert status == 200 and done["ends_at"] <= time.time()
