"""Where a rewind's notification goes (docs/webhooks.md, "Rewinds"): to the receivers of the routes that take
the alert it acted on, webhooks and email, and nowhere while a silence covers that alert. A real server on
each database with a routing file, real HTTP receivers and a real SMTP server (aiosmtpd)."""
from __future__ import annotations

import uuid

import pytest

from tests.conftest import wait_until
from tests.routing.conftest import SmtpCapture, alerts_of, ingest, nan_run, routing_file, settle, step

ROUTES = """
receiver = "rest"
group_by = ["alert"]
group_wait = 0
group_interval = 0
repeat_interval = 0

[[receivers]]
name = "rest"
webhooks = ["{base}/rest"]

[[receivers]]
name = "oncall"
webhooks = ["{base}/oncall"]
email = ["oncall@example.org"]

[[routes]]
matchers = ['rule="A1"']
receiver = "oncall"
"""


@pytest.fixture
def smtp_server():
    s = SmtpCapture().start()
    yield s
    s.stop()


def _rewind(alert_id: int, step_no: int, number: int) -> dict:
    return {"step": step_no, "kind": "rewind", "data": {
        "from_step": step_no, "to_step": 10, "batches_skipped": step_no - 10, "lr_factor": 0.5, "cool_steps": 50,
        "trigger": {"rule": "A1", "alert_id": alert_id, "step": 20}, "snapshot_age_steps": step_no - 10,
        "rewind_number": number, "max_rewinds": 3, "action": "rewind"}}


def test_a_rewind_goes_where_its_alert_went_and_a_silence_holds_it(server_factory, db_url, tmp_path,
                                                                     webhook_receiver, smtp_server):
    base = webhook_receiver.url
    srv = server_factory(db_url, extra_args=[f"--webhook={base}/rest", f"--webhook={base}/oncall"],
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, ROUTES.format(base=base)),
                              **smtp_server.env})
    nan_run(srv, "nlp", "r1", nan_from=20, nan_to=20, n=30)
    run_id = srv.get("/api/v1/runs?project=nlp")[1]["runs"][0]["id"]
    a1 = next(a for a in alerts_of(srv, run_id) if a["rule"] == "A1")
    webhook_receiver.wait_for(lambda r: r.path.endswith("/oncall") and r.json().get("event") == "alert")

    ingest(srv, {"batch_id": uuid.uuid4().hex, "project": "nlp", "run": "r1", "steps": [step(30)],
                 "events": [_rewind(a1["id"], 30, 1)]})
    told = webhook_receiver.wait_for(lambda r: r.json().get("event") == "rewind")
    assert told.path.endswith("/oncall"), told.path
    assert told.json()["message"] == "rewound to step 10, skipped 20 batches, LR ×0.5 for 50 steps " \
                                     "(A1 loss_nonfinite at step 20; rewind 1 of 3)"
    mail = wait_until(lambda: next((m for m in smtp_server.received() if "REWIND" in m["Subject"]), None),
                      timeout=15, what="the rewind's email")
    assert mail["X-Envelope-To"] == "oncall@example.org"
    assert mail["Subject"] == "[gradwatch] REWIND A1 loss_nonfinite: nlp/r1 step 30"
    assert "Rewound to step 10, skipped 20 batches" in mail.get_payload(decode=True).decode()

    # someone silences A1: the next rewind is recorded and said on the alert, but not sent
    status, _ = srv.post("/api/v1/silences", {"project": "nlp", "matchers": ["rule=A1"], "duration_s": 3600})
    assert status == 201
    ingest(srv, {"batch_id": uuid.uuid4().hex, "project": "nlp", "run": "r1", "steps": [step(31)],
                 "events": [_rewind(a1["id"], 31, 2)]})
    acted = next(a for a in alerts_of(srv, run_id) if a["id"] == a1["id"])["actions"][0]
    assert acted.startswith("Acted on at step 31 by the Rewind policy: rewound to step 10, skipped 21 batches")
    assert len(srv.get(f"/api/v1/runs/{run_id}/rewinds")[1]["rewinds"]) == 2
    settle(1.5)
    rewinds_told = [r for r in webhook_receiver.received if r.json().get("event") == "rewind"]
    assert len(rewinds_told) == 1, [r.json()["message"] for r in rewinds_told]
    assert not [r for r in webhook_receiver.received if r.path.endswith("/rest") and r.json().get("event") == "rewind"]
    assert len([m for m in smtp_server.received() if "REWIND" in m["Subject"]]) == 1
