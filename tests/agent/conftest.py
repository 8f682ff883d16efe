"""Fixtures for the agent tests (helpers live in agent_helpers.py)."""
from __future__ import annotations

import pytest

from agent_helpers import RecordingTransport


@pytest.fixture
def recorder() -> RecordingTransport:
    return RecordingTransport()


@pytest.fixture
def agent_settings(tmp_path):
    """Keyword arguments that keep a test's spool inside its tmp dir."""
    return {"spool_dir": str(tmp_path / "spool"), "project": "tests", "run": "r1", "flush_interval": 0.1}




@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One real server (SQLite) for the agent tests that neither stop it nor need its port.

    Each test uses its own run names, so sharing it only saves start-up time.
    """
    from tests.conftest import start_sqlite_server

    srv = start_sqlite_server(tmp_path_factory.mktemp("agent-shared-server"))
    yield srv
    srv.stop()
