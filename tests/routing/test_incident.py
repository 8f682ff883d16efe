"""A multi-rank NaN incident through real ingest: one notification per receiver per group.

4 ranks; the loss goes NaN on rank 2 at step 40, then on every rank (the all-reduce spreads the NaN
gradients) for 12 steps while the scaler halves the loss scale below 1 and skips every step; when
the loss comes back it spikes. Without routing that is a notification for each of A1, A2, A5, B3,
C3, F1 on every rank to every endpoint; with it, each receiver gets one notification for the
incident (family A: the one A1, which lists the four ranks and is led by rank 2, the one that went first) and the rest is stored, suppressed by A1.
"""
from __future__ import annotations

import math

from gradwatch.dashboard.alert_cards import alert_card
from tests.conftest import WebhookReceiver, wait_until
from tests.routing.conftest import alerts_of, batch, ingest, routing_file, settle, step

RANKS = 4
NAN_RANK = 2
NAN_AT = 40
NAN_STEPS = 12


def _rank_steps(rank: int, lo: int, hi: int) -> list[dict]:
    out = []
    for i in range(lo, hi):
        nan = (i == NAN_AT and rank == NAN_RANK) or NAN_AT < i < NAN_AT + NAN_STEPS
        halvings = max(0, min(i, NAN_AT + NAN_STEPS) - NAN_AT + (1 if rank == NAN_RANK else 0))
        scale = 65536.0 / 2 ** (halvings * 1.5) if i >= NAN_AT else 65536.0
        if nan:
            out.append(step(i, loss="NaN", grad_norm="NaN", scale=scale, overflow=True))
        elif NAN_AT + NAN_STEPS <= i < NAN_AT + NAN_STEPS + 6:
            out.append(step(i, loss=40.0 + i, grad_norm=500.0, scale=scale))     # the loss comes back spiking
        else:
            out.append(step(i, scale=scale))
    return out


def send_incident(srv, project: str, run: str) -> int:
    # rank 2 first, up to its NaN; then the others up to there; then every rank through the rest
    run_id = ingest(srv, batch(project, run, _rank_steps(NAN_RANK, 0, NAN_AT + 1), rank=NAN_RANK,
                               world_size=RANKS))["run_id"]
    for r in range(RANKS):
        if r != NAN_RANK:
            ingest(srv, batch(project, run, _rank_steps(r, 0, NAN_AT + 1), rank=r, world_size=RANKS))
    for r in range(RANKS):
        ingest(srv, batch(project, run, _rank_steps(r, NAN_AT + 1, 120), rank=r, world_size=RANKS))
    return run_id


ROUTING = """
receiver = "everyone"
group_by = ["project", "run", "family"]
group_wait = 2
group_interval = 60
repeat_interval = 0

[[receivers]]
name = "everyone"
webhooks = "all"
email = ["ml-team@example.org"]
"""


def test_nan_incident_one_notification_per_receiver_per_group(server_factory, db_url, tmp_path, smtp_server):
    generic, slack = WebhookReceiver().start(), WebhookReceiver().start()
    try:
        srv = server_factory(db_url, extra_args=["--webhook", generic.url],
                             env={"GRADWATCH_ROUTING": routing_file(tmp_path, ROUTING), **smtp_server.env})
        status, _ = srv.post("/api/v1/webhooks", {"project": "llm", "url": slack.url + "/slack", "format": "slack"})
        assert status == 201
        run_id = send_incident(srv, "llm", "pretrain-64")

        alerts = alerts_of(srv, run_id)
        by_rule = {}
        for a in alerts:
            by_rule.setdefault(a["rule"], []).append(a)
        # one A1 for the incident, listing the ranks, led by the rank that went first
        (a1,) = by_rule["A1"]
        assert a1["rank"] == NAN_RANK and a1["first_step"] == NAN_AT, a1
        assert a1["evidence"]["ranks"] == list(range(RANKS)) and a1["evidence"]["first_rank"] == NAN_RANK, a1
        assert f"rank {NAN_RANK} first, at step {NAN_AT}" in a1["message"], a1
        a1_ids = {a["id"] for a in by_rule["A1"]}
        # what the NaN caused is stored and says so, and is not notified
        caused = [a for a in alerts if a["rule"] in ("A2", "A5", "B3", "C3", "F1")]
        assert {a["rule"] for a in caused} >= {"A5", "B3"}, sorted({a["rule"] for a in alerts})
        for a in caused:
            assert a["suppressed_by"] in a1_ids, a
            assert a["suppressed_by_rule"].startswith("A1 loss_nonfinite rank "), a
        # the dashboard's card (alerts page and run page) says so, from the same record
        card = str(alert_card(caused[0], ack_type="alerts-ack"))
        assert "not sent: part of the incident of A1 loss_nonfinite rank" in card, card
        notified_families = {a["rule"][0] for a in alerts
                             if a["suppressed_by"] is None and a["silenced_by"] is None and not a["muted"]}

        def complete():
            return (len(generic.received) >= len(notified_families) and len(slack.received) >= len(notified_families)
                    and len(smtp_server.received()) >= len(notified_families))

        wait_until(complete, timeout=15, what="one notification per group at every receiver")
        settle(3.0)      # nothing more may come: the group's changes wait for group_interval (60 s)
        bodies = generic.bodies()
        assert len(bodies) == len(notified_families), [b["group"]["labels"] for b in bodies]
        assert len(slack.received) == len(notified_families)
        mails = smtp_server.received()
        assert len(mails) == len(notified_families)

        incident = next(b for b in bodies if b["group"]["labels"]["family"] == "A")
        assert incident["rule"] == "A1" and incident["rank"] == NAN_RANK and incident["step"] == NAN_AT
        assert incident["group"]["ranks"] == list(range(RANKS))
        assert {x["rule"] for x in incident["group"]["alerts"]} <= {"A1", "A3"}
        assert [x["ranks"] for x in incident["group"]["alerts"] if x["rule"] == "A1"] == [list(range(RANKS))]
        assert incident["group"]["first"] == {"rank": NAN_RANK, "step": NAN_AT, "rule": "A1"}
        assert incident["group"]["held_back"] >= 1
        slack_text = next(r.json() for r in slack.received if "A1" in r.json()["text"])
        assert "ranks 0, 1, 2, 3" in str(slack_text["blocks"])
        mail = next(m for m in mails if "A1 loss_nonfinite" in m["Subject"])
        assert mail["X-Envelope-To"] == "ml-team@example.org" and mail["From"] == "gradwatch@test.example"
        text = mail.get_payload(decode=True).decode()
        assert "ranks 0, 1, 2, 3" in text and f"/runs/{run_id}" in text
        assert f"First: rank {NAN_RANK} at step {NAN_AT} (A1)" in text
        assert not math.isnan(incident["created_at"])
    finally:
        generic.stop()
        slack.stop()
