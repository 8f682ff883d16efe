"""Webhook targets are not a way into the server's network (hostile-input report, SSRF): a project token
holder cannot point a webhook at loopback, private or link-local addresses, at this server, or at a URL
with credentials, unless the operator allows it; their delivery log shows no reply bodies; the
operator's server-wide endpoints are trusted and are not shown to them. Real servers, both databases."""
from __future__ import annotations

import http.server
import threading

import pytest

from tests.conftest import create_token, wait_until

INTERNAL = ["http://127.0.0.1:{port}/x", "http://localhost:{port}/x", "http://0.0.0.0:{port}/x",
            "http://2130706433:{port}/x", "http://[::1]:{port}/x", "http://169.254.169.254/latest/meta-data",
            "http://10.0.0.7/hook", "http://192.168.1.1/hook"]


class _Talker:
    """A loopback endpoint that answers 500 with a body (what an internal service might say)."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b"internal service secret: db password hunter2"
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def talker():
    t = _Talker()
    yield t
    t.stop()


def _add(srv, headers, url, project="alpha"):
    return srv.post("/api/v1/webhooks", {"project": project, "url": url}, headers=headers)


def test_project_tokens_cannot_target_internal_addresses(server_factory, db_url, tmp_path, webhook_receiver):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on", "GRADWATCH_WEBHOOK_URLS": webhook_receiver.url})
    auth = {"Authorization": f"Bearer {create_token(db_url, 'alpha')}"}
    for url in [u.format(port=srv.port) for u in INTERNAL] + ["http://user:pw@example.com/hook"]:
        st, err = _add(srv, auth, url)
        assert st == 422, (url, err)
        assert "internal" in err["detail"] or "credentials" in err["detail"] or "resolve" in err["detail"], err
    # the operator's server-wide endpoint (loopback here) is trusted, delivers, and is not listed to the project
    st, listed = srv.get("/api/v1/webhooks", headers=auth)
    assert st == 200 and listed["endpoints"] == [], listed
    st, everything = srv.get("/api/v1/webhooks")
    assert st in (401, 403)            # no token, no list


def test_an_operator_allow_list_admits_an_internal_target_and_the_log_shows_no_reply_body(
        server_factory, db_url, tmp_path, talker):
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on", "GRADWATCH_WEBHOOK_ALLOW": "127.0.0.1"})
    auth = {"Authorization": f"Bearer {create_token(db_url, 'alpha')}"}
    st, ep = _add(srv, auth, f"http://127.0.0.1:{talker.port}/hook")
    assert st == 201, ep
    st, _ = _add(srv, auth, f"http://localhost:{talker.port}/hook")     # allowed by address, after resolving
    assert st == 201
    st, d = srv.post(f"/api/v1/webhooks/{ep['id']}/test", headers=auth)
    assert st == 202, d

    def logged():
        st, log = srv.get(f"/api/v1/webhooks/deliveries?endpoint_id={ep['id']}", headers=auth)
        rows = [r for r in log["deliveries"] if r["attempts"]]
        return rows[0] if rows else None
    row = wait_until(logged, timeout=20, what="a delivery attempt")
    assert row["last_status_code"] == 500 and row["last_error"] == "HTTP 500", row
    assert "hunter2" not in str(row)


def test_an_auth_off_server_on_loopback_keeps_loopback_targets(server_factory, db_url, webhook_receiver):
    srv = server_factory(db_url)
    st, ep = _add(srv, {}, webhook_receiver.url)
    assert st == 201, ep
