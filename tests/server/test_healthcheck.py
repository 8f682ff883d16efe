"""``python -m gradwatch.server.healthcheck`` against real servers: healthy, behind auth, dashboard broken, silent.

The image's HEALTHCHECK and the compose replicas run this module; here it is
run as they run it (a separate process) against a real ``gradwatch serve``.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.conftest import REPO_ROOT, create_token


def healthcheck(url: str, *args: str, token: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRADWATCH_HEALTHCHECK_TOKEN"}
    if token:
        env["GRADWATCH_HEALTHCHECK_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "gradwatch.server.healthcheck", "--url", url, *args],
                          env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)


def assert_unhealthy(done: subprocess.CompletedProcess, why: str) -> None:
    assert done.returncode == 1, done.stdout
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("gradwatch unhealthy: ") and why in done.stderr, done.stderr


def test_healthy_server_api_page_and_layout(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    done = healthcheck(srv.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gradwatch healthy: api ok (sqlite), dashboard page ok, layout ok\n"
    assert healthcheck(srv.url + "/").returncode == 0


def test_behind_auth_with_and_without_a_token(server_factory, sqlite_url):
    srv = server_factory(sqlite_url, env={"GRADWATCH_AUTH": "on"})
    # without a login: the page through the open /favicon.ico, the layout must be refused by auth
    done = healthcheck(srv.url)
    assert done.returncode == 0, done.stderr
    assert "dashboard page ok (auth on: at /favicon.ico)" in done.stdout
    assert "layout behind login (set GRADWATCH_HEALTHCHECK_TOKEN" in done.stdout

    token = create_token(sqlite_url, "healthcheck")
    done = healthcheck(srv.url, token=token)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gradwatch healthy: api ok (sqlite), dashboard page ok, layout ok\n"

    assert_unhealthy(healthcheck(srv.url, token="gw_not-a-token"), "GRADWATCH_HEALTHCHECK_TOKEN was refused")


def test_dashboard_that_failed_to_load_fails_the_check(server_factory, sqlite_url, tmp_path):
    """The API keeps serving when the dashboard cannot load (server/app.py); the health check says so."""
    broken = tmp_path / "broken-dash"
    (broken / "dash").mkdir(parents=True)
    (broken / "dash" / "__init__.py").write_text("raise ImportError('dash broken by the test')\n")
    pythonpath = os.pathsep.join(filter(None, [str(broken), os.environ.get("PYTHONPATH")]))
    srv = server_factory(sqlite_url, env={"PYTHONPATH": pythonpath})
    assert srv.get("/api/health")[0] == 200
    assert_unhealthy(healthcheck(srv.url), "dashboard page: HTTP 503")


def test_no_server_and_a_silent_one_fail_within_the_budget():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        # bound, not listening: refused
        assert_unhealthy(healthcheck(f"http://127.0.0.1:{port}"), "api: no answer")
        # listening but never answering: the budget ends it. What shows that is the reason, a read that
        # timed out, not how long it took (a loaded machine starts the process slowly); healthcheck()'s
        # subprocess timeout (30 s) is the hang bound
        sock.listen(8)
        done = healthcheck(f"http://127.0.0.1:{port}", "--timeout", "1")
        assert_unhealthy(done, "api: no answer")
        assert "timed out" in done.stderr, done.stderr


def test_the_budget_runs_out_on_its_clock():
    """The checks share one budget (``--timeout``); driven by an injected clock, not by waiting."""
    import pytest

    from gradwatch.server.operations.healthcheck import Unhealthy, _Budget
    now = [10.0]
    budget = _Budget(1.0, clock=lambda: now[0])
    assert budget.left("api") == 1.0
    now[0] += 0.75
    assert budget.left("dashboard page") == 0.25
    now[0] += 0.25
    with pytest.raises(Unhealthy, match=r"layout: out of time \(--timeout\)"):
        budget.left("layout")
