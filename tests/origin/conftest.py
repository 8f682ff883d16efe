"""A real gradwatch server (SQLite) shared by one module's tests, and readers for what it stored."""
from __future__ import annotations

import pytest

from tests.conftest import LiveServer, wait_until
# The shared server and the run naming of tests/integrations (one place for both).
from tests.integrations.conftest import gw_server, run_name, run_of  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def sqlite_server(gw_server):
    return gw_server


def run_id(server: LiveServer, project: str, name: str) -> int:
    return run_of(server, project, name)["id"]


def events(server: LiveServer, rid: int, kind: str) -> list[dict]:
    status, body = server.get(f"/api/v1/runs/{rid}/events?kind={kind}")
    assert status == 200, body
    return body["events"]


def alerts(server: LiveServer, rid: int, rule: str) -> list[dict]:
    status, body = server.get(f"/api/v1/alerts?run={rid}&rule={rule}")
    assert status == 200, body
    return body["alerts"]


def stored_steps(server: LiveServer, rid: int) -> list[int]:
    status, body = server.get(f"/api/v1/runs/{rid}/series?signal=loss&max_points=100000")
    assert status == 200, body
    return [p["step"] for p in body["steps"]]


def wait_for_alert(server: LiveServer, rid: int, rule: str) -> list[dict]:
    return wait_until(lambda: alerts(server, rid, rule), timeout=15, what=f"{rule} alert")


@pytest.fixture(autouse=True)
def spool_in_tmp(tmp_path, monkeypatch):
    """The agent's spool (used only while a server is unreachable) stays inside the test's tmp dir."""
    monkeypatch.setenv("GRADWATCH_SPOOL_DIR", str(tmp_path / "spool"))
