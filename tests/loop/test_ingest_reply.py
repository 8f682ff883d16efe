"""The ingest reply's alerts (``alerts_after`` → ``alerts``, ``alerts_cursor``) on a real server, both databases.

Hand-written batches, as any client would post them: what the reply says equals what
``GET /api/v1/alerts`` says the server stored.
"""
from __future__ import annotations

import time
import uuid


def post(server, steps: list[dict], **extra) -> dict:
    body = {"batch_id": extra.pop("batch_id", uuid.uuid4().hex), "project": "reply", "run": "r", "steps": steps,
            **extra}
    status, reply = server.post("/api/v1/ingest", body)
    assert status == 200, reply
    return reply


def steps(first: int, n: int, nan_at: tuple[int, ...] = ()) -> list[dict]:
    return [{"step": s, "time": time.time(), "loss": "NaN" if s in nan_at else 1.0 / (1 + s)}
            for s in range(first, first + n)]


def test_the_reply_carries_the_runs_new_alerts(live_server):
    # a client that does not ask gets what it always got
    old = post(live_server, steps(0, 5, nan_at=(3,)))
    assert old["alerts"] is None and old["alerts_cursor"] is None
    status, stored = live_server.get(f"/api/v1/alerts?run={old['run_id']}&rule=A1")
    (a1,) = stored["alerts"]
    assert a1["first_step"] == 3 and a1["status"] == "firing"

    # a process's first batch (alerts_after 0): the run's earlier A1 is history, not news
    first = post(live_server, steps(5, 3), alerts_after=0)
    assert first["alerts"] == [] and first["alerts_cursor"] > 0
    cursor = first["alerts_cursor"]

    # a NaN in a later batch extends the A1 episode: the reply carries it as the server now stores it
    nan = post(live_server, steps(8, 3, nan_at=(9,)), alerts_after=cursor)
    assert [a["rule"] for a in nan["alerts"]] == ["A1"]
    heard = nan["alerts"][0]
    status, body = live_server.get(f"/api/v1/alerts?run={nan['run_id']}")
    assert status == 200
    (stored,) = [a for a in body["alerts"] if a["id"] == heard["id"]]
    for key in ("id", "rule", "name", "severity", "status", "first_step", "last_step", "message", "updated_at"):
        assert heard[key] == stored[key], key
    assert heard["last_step"] == 9 and heard["updated_at"] >= cursor
    assert nan["alerts_cursor"] >= heard["updated_at"]

    # the look-back repeats a recent alert (the agent drops what it has seen), newest first
    again = post(live_server, steps(11, 2), alerts_after=nan["alerts_cursor"])
    assert [a["id"] for a in again["alerts"]] == [heard["id"]]

    # a retried batch is a duplicate and still answers with the news
    retry_id = uuid.uuid4().hex
    post(live_server, steps(13, 2), alerts_after=cursor, batch_id=retry_id)
    dup = post(live_server, steps(13, 2), alerts_after=cursor, batch_id=retry_id)
    assert dup["duplicate"] is True and [a["id"] for a in dup["alerts"]] == [heard["id"]]


def test_a_bad_cursor_is_refused(live_server):
    status, reply = live_server.post("/api/v1/ingest", {"batch_id": "b1", "project": "reply", "run": "bad",
                                                        "steps": [], "alerts_after": -1})
    assert status == 422 and "alerts_after" in reply["detail"]
