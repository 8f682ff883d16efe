"""Routing fixtures: a real SMTP server (aiosmtpd), routing files, and realistic multi-rank incidents.

Everything goes through the real HTTP ingest of a real server process, on both databases; what the
real HTTP receivers and the real SMTP server got is what the tests count.
"""
from __future__ import annotations

import email
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from tests.conftest import free_port, wait_until


class SmtpCapture:
    """A real SMTP server on 127.0.0.1 (aiosmtpd) that keeps every message it accepts."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.port = free_port()
        self.messages: list[email.message.Message] = []
        self._lock = threading.Lock()
        capture = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):  # noqa: N802 - aiosmtpd API
                msg = email.message_from_bytes(envelope.content)
                msg["X-Envelope-To"] = ",".join(envelope.rcpt_tos)
                with capture._lock:
                    capture.messages.append(msg)
                return "250 OK"

        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)

    def start(self) -> "SmtpCapture":
        self._controller.start()
        return self

    def stop(self) -> None:
        self._controller.stop()

    @property
    def env(self) -> dict[str, str]:
        """The server's SMTP settings for this capture (plain SMTP on loopback: no STARTTLS)."""
        return {"GRADWATCH_SMTP_HOST": "127.0.0.1", "GRADWATCH_SMTP_PORT": str(self.port),
                "GRADWATCH_SMTP_STARTTLS": "off", "GRADWATCH_SMTP_FROM": "gradwatch@test.example"}

    def received(self) -> list[email.message.Message]:
        with self._lock:
            return list(self.messages)


@pytest.fixture
def smtp_server() -> Iterator[SmtpCapture]:
    s = SmtpCapture().start()
    yield s
    s.stop()


@pytest.fixture
def dash_server(tmp_path):
    """A real server with its dashboard on a fresh SQLite file (as tests/dashboard's)."""
    from tests.dashboard.conftest import _start_server

    data_dir = tmp_path / "dashboard-server"
    data_dir.mkdir()
    srv = _start_server(data_dir)
    try:
        yield srv
    finally:
        srv.stop()


def routing_file(tmp_path: Path, text: str, name: str = "routing.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def ingest(srv, body: dict) -> dict:
    status, out = srv.post("/api/v1/ingest", body)
    assert status == 200, out
    return out


def step(i: int, *, loss: Any = None, grad_norm: Any = 0.5, scale: float = 65536.0, overflow: bool = False,
         step_time: float = 0.1) -> dict:
    return {"step": i, "time": time.time(), "loss": 2.0 - i * 0.001 + 0.01 * math.sin(i) if loss is None else loss,
            "grad_norm": grad_norm, "loss_scale": scale, "overflow": overflow, "lr": 1e-3, "step_time": step_time}


def batch(project: str, run: str, steps: list[dict], *, rank: int = 0, world_size: int = 1) -> dict:
    return {"batch_id": uuid.uuid4().hex, "project": project, "run": run, "rank": rank, "world_size": world_size,
            "steps": steps}


def nan_run(srv, project: str, run: str, *, nan_from: int, nan_to: int, n: int, rank: int = 0,
            world_size: int = 1) -> None:
    """One rank's run whose loss is NaN on steps [nan_from, nan_to] and healthy otherwise."""
    steps = [step(i, loss="NaN" if nan_from <= i <= nan_to else None,
                  grad_norm="NaN" if nan_from <= i <= nan_to else 0.5, overflow=nan_from <= i <= nan_to)
             for i in range(n)]
    ingest(srv, batch(project, run, steps, rank=rank, world_size=world_size))


def alerts_of(srv, run_id: int, headers: Optional[dict] = None) -> list[dict]:
    status, out = srv.get(f"/api/v1/alerts?run={run_id}", headers=headers)
    assert status == 200, out
    return out["alerts"]


def settle(seconds: float) -> None:
    """Let timers that should not fire have their chance to (the test then checks nothing more came)."""
    time.sleep(seconds)


__all__ = ["SmtpCapture", "routing_file", "ingest", "step", "batch", "nan_run", "alerts_of", "settle",
           "wait_until"]
