"""Alerts reach the training loop: a real tiny loop goes NaN against a real server (both databases).

The A1 alert the server raises comes back in an ingest reply; ``on_alert`` runs in the training thread
at a step boundary, ``monitor.alerts()`` lists it, and what the agent heard equals what the server stored.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from gradwatch import agent
from gradwatch.agent.loop_alerts import LoopAlert, StopOn
from tests.conftest import wait_until
from tests.integrations.conftest import run_of
from tests.loop.loops import regression_model, scaler_loop

NAN_STEP = 30


def _server_alerts(server, run_id: int) -> list[dict]:
    status, body = server.get(f"/api/v1/alerts?run={run_id}")
    assert status == 200, body
    return body["alerts"]


def test_on_alert_runs_in_the_training_thread_with_the_nan_alert(live_server, caplog):
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    calls: list[tuple[LoopAlert, int, int]] = []      # (alert, thread id, step the loop was on)
    current = {"step": -1}
    training_thread = threading.get_ident()

    clock = {}

    def on_alert(alert: LoopAlert) -> None:
        calls.append((alert, threading.get_ident(), current["step"]))
        clock.setdefault(alert.rule, time.monotonic())

    def broken(alert: LoopAlert) -> None:
        raise RuntimeError("a user's callback bug")

    stop = StopOn("critical")
    monitor = agent.attach(model, scaler, optimizer=opt, project="loop", run="nan-run", server=live_server.url,
                           flush_interval=0.1, on_alert=broken)
    monitor.add_alert_callback(on_alert)
    monitor.add_alert_callback(stop)

    def until(step: int) -> bool:
        current["step"] = step + 1     # the callback runs inside the next step's scaler.update()
        if step == NAN_STEP:
            clock["nan"] = time.monotonic()
        return bool(stop)

    with caplog.at_level(logging.WARNING, logger="gradwatch.agent"):
        taken = scaler_loop(model, opt, scaler, steps=2000, nan_at={NAN_STEP}, until=until, pause=0.005)
    monitor.close()

    assert stop.triggered is not None, "no critical alert reached the loop in 2000 steps (~10 s)"
    assert taken < 2000
    a1 = [a for a, _, _ in calls if a.rule == "A1"]
    assert a1, f"on_alert saw {[str(a) for a, _, _ in calls]}"
    alert = a1[0]
    assert alert.name == "loss_nonfinite" and alert.severity == "critical" and alert.firing
    assert alert.step == NAN_STEP
    assert all(tid == training_thread for _, tid, _ in calls), "on_alert must run in the training thread"
    assert all(step > NAN_STEP for a, _, step in calls if a.rule == "A1"), "heard only after the NaN step"
    assert stop.triggered.rule == "A1"
    # reported, not asserted (no timing assertions in tests): the NaN step's end to on_alert
    print(f"\nA1 heard {clock['A1'] - clock['nan']:.3f} s after the NaN step ended, "
          f"{[s for a, _, s in calls if a.rule == 'A1'][0] - NAN_STEP} steps later")
    # the broken callback raised on every alert: logged once; training went on, the other callbacks were called
    assert taken > NAN_STEP + 1
    raised = [r for r in caplog.records if "on_alert callback" in r.getMessage()]
    assert len(raised) == 1 and "a user's callback bug" in raised[0].getMessage()

    # what the loop heard is what the server stored
    run = run_of(live_server, "loop", "nan-run")
    stored = {a["id"]: a for a in _server_alerts(live_server, run["id"])}
    assert alert.id in stored
    assert (stored[alert.id]["rule"], stored[alert.id]["first_step"], stored[alert.id]["severity"]) == \
        ("A1", NAN_STEP, "critical")
    assert alert.run_id == run["id"]

    listed = monitor.alerts()
    assert [a.id for a in listed if a.rule == "A1"] == [alert.id]
    assert [a.updated_at for a in listed] == sorted((a.updated_at for a in listed), reverse=True), "newest first"


def test_a_resumed_process_does_not_hear_the_runs_old_alerts(live_server):
    def attach(model, opt, scaler, **kw):
        return agent.attach(model, scaler, optimizer=opt, project="loop", run="resumed", server=live_server.url,
                            flush_interval=0.1, **kw)

    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    first = attach(model, opt, scaler)
    scaler_loop(model, opt, scaler, steps=NAN_STEP + 3, nan_at={NAN_STEP})
    rng = torch.get_rng_state()      # the checkpoint holds the RNG state too (a full restore: no G6)
    wait_until(lambda: first.flush(5.0) and any(a.rule == "A1" for a in first.alerts()), timeout=20,
               what="the first process hears its A1")
    first.close()
    run = run_of(live_server, "loop", "resumed")
    assert any(a["rule"] == "A1" and a["status"] == "firing" for a in _server_alerts(live_server, run["id"]))

    # a new process of the same run, resumed from a checkpoint: the old A1 is history on the dashboard,
    # not news for it
    model2 = regression_model(seed=1)
    model2.load_state_dict(model.state_dict())
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(opt.state_dict())
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(scaler.state_dict())
    heard: list[LoopAlert] = []
    torch.set_rng_state(rng)
    second = attach(model2, opt2, scaler2, on_alert=heard.append)
    second.step = NAN_STEP + 3
    scaler_loop(model2, opt2, scaler2, steps=4, first=NAN_STEP + 3)   # clean steps, fewer than A1's clear_steps
    assert second.flush(10.0)
    scaler_loop(model2, opt2, scaler2, steps=2, first=NAN_STEP + 7)   # the replies' news is handed over at a step boundary
    assert second.flush(10.0)
    second.close()
    assert second.alerts() == [] and heard == []


def test_loop_alerts_off_asks_for_nothing(live_server):
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    monitor = agent.attach(model, scaler, optimizer=opt, project="loop", run="quiet", server=live_server.url,
                           flush_interval=0.1, loop_alerts=False)
    scaler_loop(model, opt, scaler, steps=NAN_STEP + 5, nan_at={NAN_STEP})
    monitor.close()
    run = run_of(live_server, "loop", "quiet")
    assert any(a["rule"] == "A1" for a in _server_alerts(live_server, run["id"]))
    assert monitor.alerts() == []
