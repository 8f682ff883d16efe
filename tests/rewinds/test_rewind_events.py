"""Rewind events end to end (issue 44, "Visible"): a real server on each database, batches sent through
``POST /api/v1/ingest`` as the agent sends them (a ``rewind`` event beside the steps, as a ``checkpoint``
event is sent), a real webhook receiver.

The event is stored and listed (``/rewinds``, ``/events``), the trigger alert says it was acted on (read
back through the ingest reply the training loop reads, and through ``/alerts``), the incident's timeline
lists it, one notification goes out per rewind (not per report), and malformed data is a 422 that names
the field.
"""
from __future__ import annotations

import time
import uuid

import pytest

from tests.alert_texts.truth import api_getter, check_run
from tests.conftest import wait_until

PROJECT = "heal"


def _steps(start: int, stop: int, *, nan_at: int = -1) -> list[dict]:
    return [{"step": i, "time": time.time(), "loss": "NaN" if i == nan_at else 2.0 - i * 1e-3,
             "grad_norm": 0.5, "loss_scale": 65536.0, "lr": 1e-3} for i in range(start, stop)]


def _batch(run: str, steps: list[dict], events=(), **extra) -> dict:
    return {"batch_id": uuid.uuid4().hex, "project": PROJECT, "run": run, "steps": steps, "events": list(events),
            **extra}


def _rewind(step: int, **data) -> dict:
    return {"step": step, "kind": "rewind", "data": data}


def _ingest(srv, body: dict) -> dict:
    status, out = srv.post("/api/v1/ingest", body)
    assert status == 200, out
    return out


def _a_run_with_a_nan(srv, run: str) -> tuple[int, dict, float]:
    """Steps 0-409 with a NaN loss at 405: (run id, its A1 alert, the loop's alerts cursor)."""
    out = _ingest(srv, _batch(run, _steps(0, 410, nan_at=405), alerts_after=0))
    alerts = srv.get(f"/api/v1/alerts?run={out['run_id']}&rule=A1")[1]["alerts"]
    assert len(alerts) == 1 and alerts[0]["first_step"] == 405, alerts
    return out["run_id"], alerts[0], out["alerts_cursor"]


REWIND_TEXT = "rewound to step 300, skipped 112 batches, LR ×0.5 for 200 steps (A1 loss_nonfinite at step 405; " \
              "rewind 1 of 3)"


def test_a_rewind_is_stored_listed_told_and_acted_on(server_factory, db_url, webhook_receiver):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url + "/json"],
                         env={"GRADWATCH_PUBLIC_URL": "https://gw.example.org"})
    status, _ = srv.post("/api/v1/webhooks", {"project": PROJECT, "url": webhook_receiver.url + "/slack",
                                              "format": "slack"})
    assert status == 201
    run_id, a1, cursor = _a_run_with_a_nan(srv, "r1")
    webhook_receiver.wait_for(lambda r: r.path.endswith("/json") and r.json().get("event") == "alert")

    # the agent's Rewind policy acted on A1 at step 412: one event, the step axis goes on from 412
    data = {"from_step": 412, "to_step": 300, "batches_skipped": 112, "lr_factor": 0.5, "cool_steps": 200,
            "trigger": {"rule": "A1", "alert_id": a1["id"], "step": 405, "name": "nan_loss"},
            "snapshot_age_steps": 112, "rewind_number": 1, "max_rewinds": 3, "action": "rewind"}
    reply = _ingest(srv, _batch("r1", _steps(410, 413), [_rewind(412, **data)], alerts_after=cursor))

    # the loop hears it: the reply carries the trigger alert, which now says what was done about it
    told = next(a for a in reply["alerts"] if a["id"] == a1["id"])
    acted = "Acted on at step 412 by the Rewind policy: rewound to step 300, skipped 112 batches, LR ×0.5 for " \
            "200 steps (rewind 1 of 3)."
    assert told["actions"][0] == acted, told["actions"]
    assert told["actions"][1:] == a1["actions"], "the rule's own actions stay, after it"
    assert told["evidence"]["remediation"][0]["to_step"] == 300
    assert told["status"] == a1["status"] and told["severity"] == a1["severity"]
    stored = srv.get(f"/api/v1/alerts?run={run_id}&rule=A1")[1]["alerts"][0]
    assert stored["actions"][0] == acted

    # the same rewind reported again (another rank, or a re-sent batch under a new id) is one rewind
    _ingest(srv, _batch("r1", _steps(413, 415), [_rewind(412, **data)]))
    rewinds = srv.get(f"/api/v1/runs/{run_id}/rewinds")[1]
    assert rewinds["run_id"] == run_id and len(rewinds["rewinds"]) == 1, rewinds
    r = rewinds["rewinds"][0]
    assert (r["step"], r["action"], r["from_step"], r["to_step"], r["batches_skipped"], r["lr_factor"],
            r["cool_steps"], r["snapshot_age_steps"], r["rewind_number"], r["max_rewinds"]) == \
        (412, "rewind", 412, 300, 112, 0.5, 200, 112, 1, 3)
    # the stored alert's name, not the agent's copy of it
    assert r["trigger"] == {"rule": "A1", "name": "loss_nonfinite", "step": 405, "alert_id": a1["id"],
                            "severity": "critical"}
    assert r["text"] == REWIND_TEXT
    events = srv.get(f"/api/v1/runs/{run_id}/events?kind=rewind")[1]["events"]
    assert [e["step"] for e in events] == [412, 412], "both reports are stored as sent"
    assert events[0]["data"]["trigger"]["name"] == "nan_loss"

    # the incident lists it
    incident = srv.get(f"/api/v1/alerts/{a1['id']}/incident")[1]
    assert [x["step"] for x in incident["rewinds"]] == [412]
    line = next(t for t in incident["timeline"] if t["kind"] == "rewind")
    assert line["step"] == 412 and line["to_step"] == 300 and line["alert_id"] == a1["id"]
    assert line["text"] == REWIND_TEXT[0].upper() + REWIND_TEXT[1:]
    kinds = [t["kind"] for t in incident["timeline"]]
    assert kinds.index("alert") < kinds.index("rewind"), "in step order: the NaN at 405, the rewind at 412"

    # one notification per rewind, to each endpoint, in its format
    got = webhook_receiver.wait_for(lambda r: r.path.endswith("/json") and r.json().get("event") == "rewind").json()
    assert got["message"] == REWIND_TEXT and got["alert_id"] == a1["id"] and got["severity"] == "critical"
    assert (got["rule"], got["name"], got["step"], got["run"], got["project"]) == \
        ("A1", "loss_nonfinite", 412, "r1", PROJECT)
    assert got["rewind"]["to_step"] == 300 and got["incident_url"] == f"https://gw.example.org/incidents/{a1['id']}"
    slack = webhook_receiver.wait_for(lambda r: r.path.endswith("/slack") and b"REWIND" in r.body).json()
    assert slack["text"].startswith(":rewind: REWIND A1 loss_nonfinite: heal/r1 step 412")
    assert "Rewound to step 300, skipped 112 batches, LR ×0.5 for 200 steps" in slack["blocks"][0]["text"]["text"]
    time.sleep(1.0)     # a second notification, had the re-sent report made one, would be in by now
    rewind_bodies = [b for b in webhook_receiver.bodies() if b.get("event") == "rewind" or
                     "REWIND" in str(b.get("text", ""))]
    assert len(rewind_bodies) == 2, rewind_bodies   # one JSON, one Slack
    # every alert text of the run is true, the "Acted on" line included (tests/alert_texts/truth.py)
    problems = check_run(api_getter(srv.url), run_id)
    assert not problems, "\n".join(problems)


def test_cool_and_gave_up_say_what_they_did(server_factory, db_url, webhook_receiver):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    run_id, a1, cursor = _a_run_with_a_nan(srv, "r2")
    # an early warning's milder action, naming no alert the server has (the agent's own trigger)
    cool = {"from_step": 410, "lr_factor": 0.5, "cool_steps": 100, "action": "cool",
            "trigger": {"rule": "H12", "alert_id": 99999, "step": 400, "name": "attention_logit_forecast"}}
    gave_up = {"from_step": 412, "to_step": None, "batches_skipped": 0, "lr_factor": 1.0, "cool_steps": 0,
               "trigger": {"rule": "A1", "alert_id": a1["id"], "step": 405}, "rewind_number": 3,
               "max_rewinds": 3, "action": "gave_up", "then": "stop"}
    _ingest(srv, _batch("r2", _steps(410, 413), [_rewind(410, **cool), _rewind(412, **gave_up)],
                        alerts_after=cursor))
    texts = {r["action"]: r["text"] for r in srv.get(f"/api/v1/runs/{run_id}/rewinds")[1]["rewinds"]}
    assert texts == {"cool": "cooled the LR ×0.5 for 100 steps, no rewind (H12 attention_logit_forecast at step 400)",
                     "gave_up": "gave up at step 412 after 3 of 3 rewinds: the run stops "
                                "(A1 loss_nonfinite at step 405)"}
    bodies = {}
    wait_until(lambda: len([b for b in webhook_receiver.bodies() if b.get("event") == "rewind"]) == 2,
               timeout=15, what="both rewind notifications")
    for b in webhook_receiver.bodies():
        if b.get("event") == "rewind":
            bodies[b["action"]] = b
    assert bodies["gave_up"]["severity"] == "critical" and bodies["gave_up"]["alert_id"] == a1["id"]
    assert bodies["cool"]["severity"] == "warning" and bodies["cool"]["alert_id"] is None
    assert bodies["cool"]["incident_url"] is None
    a1_now = srv.get(f"/api/v1/alerts?run={run_id}&rule=A1")[1]["alerts"][0]
    assert a1_now["actions"][0] == "Acted on at step 412 by the Rewind policy: gave up at step 412 after 3 of 3 " \
                                   "rewinds: the run stops."
    problems = check_run(api_getter(srv.url), run_id)
    assert not problems, "\n".join(problems)


MALFORMED = [
    ({"from_step": 412, "to_step": 300}, "action: Field required"),
    ({"action": "undo", "from_step": 412}, "action: Input should be 'rewind', 'cool' or 'gave_up'"),
    ({"action": "rewind", "from_step": 412}, "to_step: a rewind names the step it went back to"),
    ({"action": "rewind", "from_step": 300, "to_step": 412}, "to_step=412 is after from_step=300"),
    ({"action": "rewind", "from_step": 412, "to_step": "300"}, "to_step: Input should be a valid integer"),
    ({"action": "rewind", "from_step": 412, "to_step": 300, "lr_factor": -1}, "lr_factor: Input should be greater"),
    ({"action": "rewind", "from_step": 412, "to_step": 300, "lr_factor": 1e9}, "lr_factor: Input should be less"),
    ({"action": "rewind", "from_step": -1, "to_step": 0}, "from_step: Input should be greater than or equal to 0"),
    ({"action": "cool", "from_step": 4, "trigger": {"rule": "A1\r\nX"}}, "trigger.rule: must not contain control characters"),
    ({"action": "cool", "from_step": 4, "trigger": {"rule": "A" * 65}}, "trigger.rule: String should have at most"),
    ({"action": "cool", "from_step": 4, "trigger": "A1"}, "trigger: Input should be a valid dictionary"),
    ({"action": "gave_up", "from_step": 4, "then": "explode"}, "then: Input should be 'stop' or 'continue'"),
    ({"action": "cool", "from_step": 4, "pad": "x" * 70_000}, "event data is 70,"),
]


def test_malformed_rewind_data_is_refused_by_name(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    for data, says in MALFORMED:
        status, out = srv.post("/api/v1/ingest", _batch("bad", _steps(0, 5), [_rewind(4, **data)]))
        assert status == 422, (data, out)
        assert "events[0]" in out["detail"] and says in out["detail"], out["detail"]
        if "pad" not in data:
            assert "rewind data: " in out["detail"]
    assert srv.get(f"/api/v1/runs?project={PROJECT}")[1]["runs"] == [], "every batch was refused whole"
    # the same data well formed is stored; another kind's data is not checked against the rewind's shape
    _ingest(srv, _batch("bad", _steps(0, 5), [_rewind(4, action="cool", from_step=4, lr_factor=0.5, cool_steps=10),
                                              {"step": 4, "kind": "custom_note", "data": {"action": "undo"}}]))
