"""GRADWATCH_AUTH=on: project tokens for ingest and reads, hashed storage, dashboard login; binding notice."""
from __future__ import annotations

import hashlib
import http.client
import os
import subprocess
import sys
from urllib.parse import urlencode, urlsplit

from sqlalchemy import create_engine, text

from tests.conftest import REPO_ROOT
from gw_payloads import batch, step


def create_token(db_url: str, project: str, data_dir) -> str:
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir))
    out = subprocess.run([sys.executable, "-m", "server", "token", "create", "--project", project, "--db", db_url],
                         check=True, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    token = out.stdout.strip()
    assert token.startswith("gw_") and len(token) > 30
    return token


def raw_request(srv, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def test_tokens_scope_ingest_and_reads_and_dashboard_needs_login(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    tok_a = create_token(db_url, "alpha", tmp_path)
    tok_b = create_token(db_url, "beta", tmp_path)
    auth_a = {"Authorization": f"Bearer {tok_a}"}
    auth_b = {"Authorization": f"Bearer {tok_b}"}

    assert srv.get("/api/health")[0] == 200
    status, body = srv.post("/api/v1/ingest", batch([step(0)], project="alpha", run="r1"))
    assert status == 401, body
    status, body = srv.post("/api/v1/ingest", batch([step(0)], project="alpha"), headers={"Authorization": "Bearer nope"})
    assert status == 401
    status, body = srv.post("/api/v1/ingest", batch([step(0)], project="beta", run="x"), headers=auth_a)
    assert status == 403 and "project" in body["detail"]
    status, a = srv.post("/api/v1/ingest", batch([step(0), step(1)], project="alpha", run="r1"), headers=auth_a)
    assert status == 200, a
    status, b = srv.post("/api/v1/ingest", batch([step(0)], project="beta", run="r2"), headers=auth_b)
    assert status == 200, b

    assert srv.get("/api/v1/runs")[0] == 401
    assert [r["name"] for r in srv.get("/api/v1/runs", headers=auth_a)[1]["runs"]] == ["r1"]
    assert [r["name"] for r in srv.get("/api/v1/runs", headers=auth_b)[1]["runs"]] == ["r2"]
    assert srv.get(f"/api/v1/runs/{a['run_id']}/series?signal=loss", headers=auth_a)[0] == 200
    assert srv.get(f"/api/v1/runs/{a['run_id']}/series?signal=loss", headers=auth_b)[0] == 404
    assert srv.get(f"/api/v1/runs/{b['run_id']}", headers=auth_a)[0] == 404
    assert srv.get("/api/v1/alerts")[0] == 401

    # only hashes are stored
    engine = create_engine(db_url)
    with engine.connect() as conn:
        hashes = {h for (h,) in conn.execute(text("SELECT token_hash FROM api_tokens"))}
    engine.dispose()
    assert hashes == {hashlib.sha256(t.encode()).hexdigest() for t in (tok_a, tok_b)}

    # dashboard: redirected to /login, a bad token is refused, a good one sets a session cookie
    status, headers, _ = raw_request(srv, "GET", "/runs/1")
    assert status == 303 and headers["location"].startswith("/login")
    status, _, page = raw_request(srv, "GET", "/login?next=/runs/1")
    assert status == 200 and b'name="token"' in page
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, _, _ = raw_request(srv, "POST", "/login", urlencode({"token": "wrong", "next": "/"}), form)
    assert status == 401
    status, headers, _ = raw_request(srv, "POST", "/login", urlencode({"token": tok_a, "next": "/compare"}), form)
    assert status == 303 and urlsplit(headers["location"]).path == "/compare"
    cookie = headers["set-cookie"].split(";")[0]
    assert "httponly" in headers["set-cookie"].lower()
    status, _, _ = raw_request(srv, "GET", "/", headers={"Cookie": cookie})
    assert status == 200
    # the cookie also reads the API, scoped to its project; a forged one does not
    status, _, data = raw_request(srv, "GET", "/api/v1/runs", headers={"Cookie": cookie})
    assert status == 200 and b'"r1"' in data and b'"r2"' not in data
    forged = cookie[:-4] + "0000"
    assert raw_request(srv, "GET", "/api/v1/runs", headers={"Cookie": forged})[0] == 401
    status, headers, _ = raw_request(srv, "GET", "/logout", headers={"Cookie": cookie})
    assert status == 303
    assert 'gw_session=""' in headers["set-cookie"] or "max-age=0" in headers["set-cookie"].lower()


def test_without_auth_binds_loopback_and_says_so(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    log = srv.log()
    assert "auth is off" in log and "127.0.0.1" in log
    status, body = srv.post("/api/v1/ingest", batch([step(0)]))
    assert status == 200
