"""``gradwatch token create|list|delete`` against a server with ``GRADWATCH_AUTH=on``."""
from __future__ import annotations

from tests.cli.cli_helpers import batch, gradwatch
from tests.conftest import http_json, wait_until


def test_token_create_list_delete_and_the_server_accepting_it(server_factory, sqlite_url, tmp_path):
    # (PostgreSQL: the compose topology test creates its token with this command too)
    db_url = sqlite_url
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    body = batch("r1", [{"step": 0, "time": 1.0, "loss": 1.0}], project="vision")
    status, _ = http_json("POST", srv.url + "/api/v1/ingest", body)
    assert status == 401, "auth on: a batch without a token is refused"

    created = gradwatch("token", "create", "--project", "vision", "--name", "ci", "--db", db_url, data_dir=tmp_path)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token and "\n" not in token, "stdout is the token alone, ready for $(...)"
    assert "shown once" in created.stderr

    auth = {"Authorization": f"Bearer {token}"}
    status, out = http_json("POST", srv.url + "/api/v1/ingest", body, headers=auth)
    assert status == 200 and out["accepted"] == 1, out
    other = batch("r1", [{"step": 0, "time": 1.0, "loss": 1.0}], project="nlp")
    status, _ = http_json("POST", srv.url + "/api/v1/ingest", other, headers=auth)
    assert status in (401, 403), "a token writes its own project only"

    listed = gradwatch("token", "list", "--db", db_url, data_dir=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert [r[1:3] for r in rows] == [["vision", "ci"]]
    assert rows[0][3].startswith("created 20") and rows[0][3].endswith(" UTC")
    assert token not in listed.stdout, "the secret is never shown again"
    # the use is recorded off the request path: it shows up shortly after
    assert wait_until(lambda: "last used never" not in gradwatch("token", "list", "--db", db_url,
                                                                   data_dir=tmp_path).stdout, timeout=15)
    assert gradwatch("token", "list", "--db", db_url, data_dir=tmp_path).stdout.split("\t")[4].startswith("last used 20")

    token_id = rows[0][0]
    assert gradwatch("token", "delete", token_id, "--db", db_url, data_dir=tmp_path).returncode == 0
    assert gradwatch("token", "list", "--db", db_url, data_dir=tmp_path).stdout.strip() == ""
    # the running server drops a revoked token once its short lookup cache expires (5 s)
    assert wait_until(lambda: http_json("POST", srv.url + "/api/v1/ingest", body, headers=auth)[0] == 401,
                      timeout=20, interval=0.5)
    missing = gradwatch("token", "delete", token_id, "--db", db_url, data_dir=tmp_path)
    assert missing.returncode == 1 and f"no token {token_id}" in missing.stderr


def test_token_create_needs_a_project(tmp_path):
    proc = gradwatch("token", "create", data_dir=tmp_path)
    assert proc.returncode == 2
    assert "--project" in proc.stderr
