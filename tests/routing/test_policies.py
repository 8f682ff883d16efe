"""Warm-up mute, pending periods, routes with and without continue, repeat interval: real servers,
real receivers, both databases."""
from __future__ import annotations

import time
import uuid

from tests.conftest import WebhookReceiver, http_json, wait_until
from tests.routing.conftest import alerts_of, batch, ingest, nan_run, routing_file, settle, step


def _run_ids(srv, project: str) -> dict[str, int]:
    _, runs = srv.get(f"/api/v1/runs?project={project}")
    return {r["name"]: r["id"] for r in runs["runs"]}


def test_warmup_mute_and_pending_steps(server_factory, db_url, tmp_path, webhook_receiver):
    rules = tmp_path / "rules.toml"
    rules.write_text("[warmup]\nsteps = 50\n\n[rules.A1]\npending_steps = 10\n")
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url, "--rules", str(rules)])
    nan_run(srv, "p", "early", nan_from=20, nan_to=39, n=40)             # inside the warm-up: muted
    nan_run(srv, "p", "short", nan_from=100, nan_to=104, n=160)          # resolved before 10 steps: never
    # fires across two batches: pending after the first (4 steps), notified once it has fired 10
    ingest(srv, batch("p", "long", [step(i, loss="NaN" if i >= 100 else None, grad_norm="NaN" if i >= 100 else 0.5)
                                    for i in range(105)]))
    settle(1.5)
    assert webhook_receiver.bodies() == []
    ids = _run_ids(srv, "p")
    early = next(a for a in alerts_of(srv, ids["early"]) if a["rule"] == "A1")
    assert early["muted"] == "warm-up" and early["status"] == "firing"
    short = next(a for a in alerts_of(srv, ids["short"]) if a["rule"] == "A1")
    assert short["status"] == "resolved" and short["muted"] is None
    ingest(srv, batch("p", "long", [step(i, loss="NaN", grad_norm="NaN") for i in range(105, 115)]))
    # how soon is measured, not asserted (docs/performance.md, "Step → visible and NaN → webhook latency")
    got = webhook_receiver.wait_for(lambda r: r.json()["run"] == "long", timeout=5)
    assert got.json()["rule"] == "A1"
    settle(1.5)
    assert [(b["run"], b["rule"]) for b in webhook_receiver.bodies()] == [("long", "A1")]

    # a bad setting is refused naming the rule and the key
    status, out = http_json("PUT", srv.url + "/api/v1/rules/p/A1", {"pending_steps": -1})
    assert status == 422 and "A1" in out["detail"] and "'pending_steps'" in out["detail"], out
    status, out = http_json("PUT", srv.url + "/api/v1/rules/p/warmup", {"steps": 10, "minutes": 3})
    assert status == 422 and "'minutes'" in out["detail"], out
    status, out = http_json("PUT", srv.url + "/api/v1/rules/p/warmup", {"steps": 10})
    assert status == 200 and out["steps"] == 10 and out["overridden"] == ["steps"], out
    bad = tmp_path / "bad.toml"
    bad.write_text("[warmup]\nsteps = -5\n")
    from gradwatch.server.rules.config import RuleConfigError, load_rules_file
    try:
        load_rules_file(str(bad))
    except RuleConfigError as e:
        assert "warmup" in str(e) and "'steps'" in str(e) and "≥ 0" in str(e)
    else:
        raise AssertionError("a negative warm-up was accepted")


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
name = "audit"
webhooks = ["{base}/audit"]

[[receivers]]
name = "crit"
webhooks = ["{base}/crit"]

[[receivers]]
name = "vision"
webhooks = ["{base}/vision"]

[[routes]]                      # every critical alert is also audited
matchers = ['severity="critical"']
receiver = "audit"
continue = true

[[routes]]                      # first match wins: a critical vision alert stops here
matchers = ['severity="critical"']
receiver = "crit"

[[routes]]
matchers = ['project=~"vision|vision-.*"']
receiver = "vision"
"""


def _nan_then_origin(srv, project: str, run: str) -> None:
    nan_run(srv, project, run, nan_from=20, nan_to=29, n=30)              # A1, critical
    ingest(srv, {"batch_id": uuid.uuid4().hex, "project": project, "run": run, "steps": [],   # A3, warning
                 "events": [{"step": 20, "kind": "nan_origin", "data": {"module": "fc2", "where": "activation"}}]})


def test_routes_first_match_and_continue(server_factory, db_url, tmp_path, webhook_receiver):
    base = webhook_receiver.url
    hooks = [f"--webhook={base}/{name}" for name in ("rest", "audit", "crit", "vision", "unrouted")]
    srv = server_factory(db_url, extra_args=hooks,
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, ROUTES.format(base=base))})
    _nan_then_origin(srv, "nlp", "r1")
    _nan_then_origin(srv, "vision", "r1")
    expected = {("audit", "nlp", "A1"), ("crit", "nlp", "A1"), ("rest", "nlp", "A3"),
                ("audit", "vision", "A1"), ("crit", "vision", "A1"), ("vision", "vision", "A3")}

    def got():
        return {(r.path.rsplit("/", 1)[1], r.json()["project"], r.json()["rule"]) for r in webhook_receiver.received}

    wait_until(lambda: got() >= expected, timeout=10, what=f"routed notifications {expected}")
    settle(1.0)
    assert got() == expected
    assert len(webhook_receiver.received) == len(expected)      # one each: no route sent anything twice


def test_repeat_interval_resends_an_unchanged_firing_group(server_factory, db_url, tmp_path):
    receiver = WebhookReceiver().start()
    try:
        text = ('group_by = ["project", "run", "family"]\ngroup_wait = 0\ngroup_interval = 0.5\n'
                'repeat_interval = 2\n')
        srv = server_factory(db_url, extra_args=["--webhook", receiver.url],
                             env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
        nan_run(srv, "p", "r", nan_from=20, nan_to=39, n=40)               # fires on to the end
        first = receiver.wait_for(lambda r: True, timeout=5)
        second = receiver.wait_for(lambda r: r is not first, timeout=6)
        gap = second.time - first.time
        assert gap >= 1.9, gap          # not before repeat_interval (how late a loaded machine sends it is not a test)
        a, b = first.json(), second.json()
        assert a["alert_id"] == b["alert_id"] and a["group"]["key"] == b["group"]["key"]
        # resolved: no more repeats
        ingest(srv, batch("p", "r", [step(i) for i in range(40, 80)]))
        ids = _run_ids(srv, "p")
        assert all(x["status"] == "resolved" for x in alerts_of(srv, ids["r"]) if x["rule"] == "A1")
        count = len(receiver.received)
        settle(3.0)
        assert len(receiver.received) == count
    finally:
        receiver.stop()


def test_repeat_interval_counts_from_the_delivery(server_factory, db_url, tmp_path):
    """A receiver that takes 1 s to answer: the repeat comes repeat_interval after the first notification
    was delivered (its reply), not after it was written to the outbox: ~3 s between the requests, not 2
    (Alertmanager's notification log is written after the send, too)."""
    receiver = WebhookReceiver().start()
    receiver.reply_delay = 1.0
    try:
        text = ('group_by = ["project", "run", "family"]\ngroup_wait = 0\ngroup_interval = 0.5\n'
                'repeat_interval = 2\n')
        srv = server_factory(db_url, extra_args=["--webhook", receiver.url],
                             env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
        nan_run(srv, "p", "r", nan_from=20, nan_to=39, n=40)               # fires on to the end
        first = receiver.wait_for(lambda r: True, timeout=5)
        second = receiver.wait_for(lambda r: r is not first, timeout=8)
        gap = second.time - first.time
        assert gap >= 2.9, gap          # repeat_interval after the delivery (with the old code: 1.95 s)
        assert second.json()["alert_id"] == first.json()["alert_id"]
    finally:
        receiver.stop()


def test_a_group_waiting_when_the_server_dies_is_notified_after_the_restart(server_factory, db_url, tmp_path,
                                                                            webhook_receiver):
    text = 'group_by = ["project", "run", "family"]\ngroup_wait = 3\ngroup_interval = 60\nrepeat_interval = 0\n'
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url],
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
    nan_run(srv, "p", "r", nan_from=20, nan_to=39, n=40)
    srv.kill()                      # inside group_wait: nothing sent yet, the group is in the database
    assert webhook_receiver.received == []
    srv.start()
    got = webhook_receiver.wait_for(lambda r: True, timeout=10)
    assert got.json()["rule"] == "A1" and got.json()["group"]["labels"]["family"] == "A"
    settle(1.5)
    assert len(webhook_receiver.received) == 1


def test_pending_seconds_and_group_interval_batching(server_factory, db_url, tmp_path, webhook_receiver):
    rules = tmp_path / "rules.toml"
    rules.write_text("[rules.A1]\npending_seconds = 2\n")
    text = 'group_by = ["project", "run", "family"]\ngroup_wait = 0\ngroup_interval = 2\nrepeat_interval = 0\n'
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url, "--rules", str(rules)],
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
    sent_at = time.time()
    nan_run(srv, "p", "held", nan_from=20, nan_to=39, n=40)          # fires on: notified once 2 s have passed
    nan_run(srv, "p", "brief", nan_from=20, nan_to=22, n=60)         # resolved at once: never notified
    first = webhook_receiver.wait_for(lambda r: r.json()["run"] == "held", timeout=8)
    assert first.time - sent_at >= 1.9 and first.json()["rule"] == "A1"
    # a new alert in the same incident: batched into the next notification, group_interval after the first
    ingest(srv, {"batch_id": uuid.uuid4().hex, "project": "p", "run": "held", "steps": [],
                 "events": [{"step": 20, "kind": "nan_origin", "data": {"module": "fc2", "where": "activation"}}]})
    second = webhook_receiver.wait_for(lambda r: r is not first, timeout=8)
    assert second.time - first.time >= 1.9, second.time - first.time
    group = second.json()["group"]
    assert group["key"] == first.json()["group"]["key"] and {a["rule"] for a in group["alerts"]} == {"A1", "A3"}
    settle(2.5)
    assert [b["run"] for b in webhook_receiver.bodies()] == ["held", "held"]


def test_a_rank_that_went_first_but_reported_late_is_notified_again_naming_it(server_factory, db_url, tmp_path,
                                                                              webhook_receiver):
    """A 2-rank run: rank 0's batch (NaN from step 11) arrives and is notified after group_wait; rank 1's
    batch (NaN from step 10: it went first, the all-reduce spread it) arrives after that notification.
    The one A1 now leads with rank 1, and the group is notified once more, group_interval after the
    first notification, naming rank 1 at step 10. The path the torchrun test takes only when its rank 0
    reports a group_wait ahead of rank 1 (tests/distributed/test_rank_alerts.py), taken here every time."""
    text = ('group_by = ["project", "run", "family"]\ngroup_wait = 0.5\ngroup_interval = 0.5\nrepeat_interval = 0\n'
            'rank_wait = 0\n')          # rank 1 later than any rank_wait: the path a rank slower than it takes
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url],
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
    nan_run(srv, "p", "r", nan_from=11, nan_to=19, n=20, rank=0, world_size=2)
    first = webhook_receiver.wait_for(lambda r: True, timeout=5)
    assert (first.json()["rule"], first.json()["rank"], first.json()["step"]) == ("A1", 0, 11)
    nan_run(srv, "p", "r", nan_from=10, nan_to=19, n=20, rank=1, world_size=2)
    second = webhook_receiver.wait_for(lambda r: r is not first, timeout=5)
    body = second.json()
    assert (body["rule"], body["rank"], body["step"], body["alert_id"]) == ("A1", 1, 10, first.json()["alert_id"])
    assert body["group"]["first"] == {"rank": 1, "step": 10, "rule": "A1"}
    assert second.time - first.time >= 0.5 - 0.05, second.time - first.time
    settle(1.5)
    assert [(b["rule"], b["rank"]) for b in webhook_receiver.bodies()] == [("A1", 0), ("A1", 1)]


def test_a_multi_rank_group_waits_for_every_rank_of_the_incident_step(server_factory, db_url, tmp_path,
                                                                      webhook_receiver):
    """rank_wait: rank 0's batch (its grads NaN from step 10 after the all-reduce, its loss from 11) comes
    in; group_wait passes, but rank 1 has not sent step 11 yet, so nothing is sent. Rank 1's batch (its
    loss NaN from step 10: the cause) arrives: one notification, the A1 led by rank 1 at step 10 (without
    the rank wait it would name rank 0 at step 11), rank 0's overflow storm (A5) suppressed by it and never
    notified. A second run whose rank 1 never reports is
    notified once rank_wait has passed: a dead rank does not hold the NaN back."""
    text = ('group_by = ["project", "run", "family"]\ngroup_wait = 0.2\ngroup_interval = 0.5\nrepeat_interval = 0\n'
            'rank_wait = 10\n')
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url],
                         env={"GRADWATCH_ROUTING": routing_file(tmp_path, text)})
    rank0 = [step(i, loss="NaN" if i >= 11 else None, grad_norm="NaN" if i >= 10 else 0.5, overflow=i >= 10)
             for i in range(20)]
    ingest(srv, batch("p", "r", rank0, rank=0, world_size=2))
    settle(1.5)
    assert webhook_receiver.received == []
    nan_run(srv, "p", "r", nan_from=10, nan_to=19, n=20, rank=1, world_size=2)
    first = webhook_receiver.wait_for(lambda r: True, timeout=5)
    body = first.json()
    assert (body["rule"], body["rank"], body["step"]) == ("A1", 1, 10), body
    assert body["group"]["first"] == {"rank": 1, "step": 10, "rule": "A1"}
    assert "A5" not in {a["rule"] for a in body["group"]["alerts"]}
    ids = _run_ids(srv, "p")
    a5 = [a for a in alerts_of(srv, ids["r"]) if a["rule"] == "A5" and a["rank"] == 0]
    assert a5 and a5[0]["suppressed_by"] == body["alert_id"], [(a["rule"], a["rank"], a["suppressed_by"]) for a in alerts_of(srv, ids["r"])]
    settle(1.0)
    assert len(webhook_receiver.received) == 1

    text2 = text.replace("rank_wait = 10", "rank_wait = 1.5")
    srv2 = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url],
                          env={"GRADWATCH_ROUTING": routing_file(tmp_path, text2, name="routing2.toml")})
    sent = time.time()
    ingest(srv2, batch("p", "dead-rank", rank0, rank=0, world_size=2))
    late = webhook_receiver.wait_for(lambda r: r.json()["run"] == "dead-rank", timeout=8)
    assert late.time - sent >= 1.4 and late.json()["rank"] == 0, late.time - sent
