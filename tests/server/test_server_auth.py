"""GRADWATCH_AUTH=on: project tokens for ingest and reads, hashed storage, dashboard login; binding notice."""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
from urllib.parse import urlencode, urlsplit

from sqlalchemy import create_engine, text

from tests.conftest import REPO_ROOT, create_token, create_token_with_cli, wait_until
from gw_payloads import batch, step


def raw_request(srv, method, path, body=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    c.request(method, path, body=body, headers=headers or {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict(r.getheaders()), data


def test_tokens_scope_ingest_and_reads_and_dashboard_needs_login(server_factory, db_url, tmp_path):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    # one token as an operator makes it (the `gradwatch token create` process, on both databases), the
    # other by the same function in this process (as the other tests make theirs): both are accepted
    # and stored alike
    tok_a = create_token_with_cli(db_url, "alpha", tmp_path)
    tok_b = create_token(db_url, "beta")
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


def test_sessions_end_with_their_token_and_cookie_writes_must_come_from_the_dashboard(server_factory, db_url, tmp_path):
    """Hostile-input report: a revoked token's dashboard sessions went on for their 7 days; a form served
    from another port of the same host acknowledged an alert with the victim's cookie; a login form there
    switched the victim's session."""
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    tok = create_token(db_url, "alpha")
    other = create_token(db_url, "mallory")
    auth = {"Authorization": f"Bearer {tok}"}
    st, _, _ = raw_request(srv, "POST", "/api/v1/ingest", json.dumps(batch(
        [step(0, loss="NaN")], project="alpha", run="r")), {**auth, "Content-Type": "application/json"})
    assert st == 200
    st, _, data = raw_request(srv, "GET", "/api/v1/alerts", headers=auth)
    alert_id = json.loads(data)["alerts"][0]["id"]
    own = f"http://127.0.0.1:{srv.port}"
    form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": own}
    st, headers, _ = raw_request(srv, "POST", "/login", urlencode({"token": tok, "next": "/"}), form)
    assert st == 303
    cookie = {"Cookie": headers["set-cookie"].split(";")[0]}

    # login CSRF: another origin's form cannot sign the browser in (to the attacker's project)
    evil = f"http://127.0.0.1:{srv.port + 1}"
    st, _, _ = raw_request(srv, "POST", "/login", urlencode({"token": other, "next": "/"}), {**form, "Origin": evil})
    assert st == 403
    # a cookie write from another origin (same host, other port) is refused; from the dashboard it works
    ack = f"/api/v1/alerts/{alert_id}/ack"
    for hdr in ({"Origin": evil}, {"Origin": "null"}, {"Referer": evil + "/page"}, {}):
        st, _, body = raw_request(srv, "POST", ack, b"{}", {**cookie, "Content-Type": "application/json", **hdr})
        assert st == 403, (hdr, body)
    st, _, data = raw_request(srv, "GET", "/api/v1/alerts", headers=auth)
    assert json.loads(data)["alerts"][0]["acknowledged"] is False
    st, _, _ = raw_request(srv, "POST", ack, b"{}", {**cookie, "Content-Type": "application/json", "Origin": own})
    assert st == 200
    # revoking the token ends the session (after the token cache's few seconds)
    assert raw_request(srv, "GET", "/api/v1/runs", headers=cookie)[0] == 200
    subprocess.run([sys.executable, "-m", "gradwatch.server", "token", "delete", "1", "--db", db_url], check=True,
                   capture_output=True, env=dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path)), cwd=REPO_ROOT,
                   timeout=60)
    wait_until(lambda: raw_request(srv, "GET", "/api/v1/runs", headers=cookie)[0] == 401, timeout=30,
               what="the revoked token's session to end")
    assert raw_request(srv, "GET", "/", headers=cookie)[0] == 303     # the dashboard sends it to /login


def test_another_projects_resources_are_answered_as_missing_without_naming_it(server_factory, db_url, tmp_path,
                                                                              webhook_receiver):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on", "GRADWATCH_WEBHOOK_ALLOW": "127.0.0.1"})
    alpha = {"Authorization": f"Bearer {create_token(db_url, 'alpha-secret-name')}"}
    beta = {"Authorization": f"Bearer {create_token(db_url, 'beta')}"}
    status, body = srv.post("/api/v1/ingest", batch([step(0, loss="NaN")], project="alpha-secret-name", run="r"),
                            headers=alpha)
    assert status == 200, body
    alert_id = srv.get("/api/v1/alerts", headers=alpha)[1]["alerts"][0]["id"]
    st, ep = srv.post("/api/v1/webhooks", {"project": "alpha-secret-name", "url": webhook_receiver.url}, headers=alpha)
    assert st == 201, ep
    for method, path in (("POST", f"/api/v1/alerts/{alert_id}/ack"), ("DELETE", f"/api/v1/webhooks/{ep['id']}"),
                         ("POST", f"/api/v1/webhooks/{ep['id']}/test"),
                         ("GET", f"/api/v1/webhooks/deliveries?endpoint_id={ep['id']}")):
        st, _, data = raw_request(srv, method, path, b"{}" if method != "GET" else None,
                                  {**beta, "Content-Type": "application/json"})
        assert st == 404 and b"alpha" not in data, (method, path, st, data)
    assert srv.get("/api/v1/webhooks", headers=alpha)[1]["endpoints"][0]["id"] == ep["id"]   # still there
