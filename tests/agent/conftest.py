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


