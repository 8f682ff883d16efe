"""End to end: real training loop → agent → real server → SQL → rule → webhook receiver.

Runs on SQLite and on the machine's PostgreSQL, and prints the measured
NaN-step → webhook-received latency (a figure, not an assertion: timings do
not belong in tests). The fuller latency measurement, step → visible in the
API included, is tests/webhooks/test_latency.py.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn

from gradwatch import agent
from tests.conftest import wait_until

RUNS = 2            # NaN episodes per database (one per run)
HEALTHY_STEPS = 30


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


STEP_TIME = 0.05    # a real step takes time; the loop goes on after the NaN, as real loops do


def _train_through_nan(server_url: str, run_name: str, nan_step: int, after: int = 10):
    """Checklist loop (scale → unscale → clip → step → update); NaN loss at ``nan_step``.

    Training goes on for ``after`` steps past the NaN (the scaler skips that
    step), each taking ``STEP_TIME``, like a real job that does not stop.
    Returns (wall time when the NaN step ended, per-step end times, monitor).
    """
    model = _tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="e2e", run=run_name, server=server_url)
    step_end = {}
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    for step in range(nan_step + 1 + after):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if step == nan_step:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        step_end[step] = time.time()
        time.sleep(STEP_TIME)
    return step_end[nan_step], step_end, monitor


def _run_id(srv, run_name: str) -> int:
    def find():
        _, body = srv.get("/api/v1/runs?project=e2e")
        return next((r["id"] for r in body["runs"] if r["name"] == run_name), None)
    return wait_until(find, timeout=10, what=f"run {run_name} listed")


def test_nan_step_reaches_the_webhook_with_diagnosis(server_factory, db_url, webhook_receiver, request):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    nan_latencies = []
    for i in range(RUNS):
        run_name = f"nan-run-{i}"
        t_nan, step_end, monitor = _train_through_nan(srv.url, run_name, nan_step=HEALTHY_STEPS)
        try:
            hit = webhook_receiver.wait_for(
                lambda r: r.json().get("run") == run_name and r.json().get("rule") == "A1", timeout=15)
            nan_latencies.append(hit.time - t_nan)
            body = hit.json()
            # the payload a receiver needs to act, with the checklist's diagnosis
            for key in ("rule", "name", "severity", "project", "run", "step", "message", "diagnosis",
                        "actions", "evidence", "dashboard_url"):
                assert key in body, f"webhook body lacks {key!r}: {body}"
            assert body["name"] == "loss_nonfinite"
            assert body["severity"] == "critical"
            assert body["project"] == "e2e"
            assert body["step"] == HEALTHY_STEPS
            assert body["actions"], "an alert must say what to do"
            # grad norm was normal before the NaN: the diagnosis points at the loss computation
            assert "loss" in body["diagnosis"].lower()
            run_id = _run_id(srv, run_name)
            assert body["dashboard_url"].endswith(f"/runs/{run_id}")
        finally:
            monitor.close()

        # everything the loop did is stored: every step, the NaN step's loss as NaN
        _, series = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=100000")
        steps = [b["step"] for b in series["steps"]]
        assert steps == list(range(HEALTHY_STEPS + 11))
        assert series["steps"][HEALTHY_STEPS]["last"] == "NaN"
        others = series["steps"][:HEALTHY_STEPS] + series["steps"][HEALTHY_STEPS + 1:]
        assert all(isinstance(b["last"], float) and math.isfinite(b["last"]) for b in others)

        _, alerts = srv.get(f"/api/v1/alerts?run={run_id}")
        rules = {a["rule"] for a in alerts["alerts"]}
        assert "A1" in rules
        assert not rules & {"A2", "B3"}, f"a single NaN step must not look like an explosion or collapse: {rules}"

    backend = request.node.callspec.params["db_url"]
    print(f"\n[latency:{backend}] NaN step -> webhook received: "
          + ", ".join(f"{v * 1000:.0f} ms" for v in nan_latencies))


def test_scaler_overflow_storm_and_scale_collapse_alerts(server_factory, sqlite_url, webhook_receiver):
    """A NaN loss for 20 steps: the scaler skips each one and halves its scale below 1."""
    srv = server_factory(sqlite_url, extra_args=["--webhook", webhook_receiver.url])
    model = _tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    with agent.attach(model, scaler, optimizer=opt, project="e2e", run="storm", server=srv.url):
        for step in range(60):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            if 20 <= step < 40:
                loss = loss * math.nan
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    run_id = _run_id(srv, "storm")
    # the NaN is what is notified; the overflow storm and the scale collapse it causes are stored,
    # marked as suppressed by it (the default inhibition, docs/webhooks.md), and not sent
    wait_until(lambda: "A1" in {b["rule"] for b in webhook_receiver.bodies() if b["run"] == "storm"},
               timeout=15, what="A1 webhook")
    _, alerts = srv.get(f"/api/v1/alerts?run={run_id}")
    by_rule = {a["rule"]: a for a in alerts["alerts"]}
    assert by_rule["A5"]["name"] == "overflow_storm"
    assert by_rule["B3"]["name"] == "loss_scale_collapse"
    assert by_rule["A1"]["step"] == 20
    for rule in ("A5", "B3"):
        assert by_rule[rule]["suppressed_by"] == by_rule["A1"]["id"], by_rule[rule]
    time.sleep(1.0)
    assert not {"A5", "B3"} & {b["rule"] for b in webhook_receiver.bodies() if b["run"] == "storm"}
    # 20 skipped steps, counted by the agent from the scaler's own state
    _, oc = srv.get(f"/api/v1/runs/{run_id}/series?signal=overflow_count&max_points=100000")
    assert oc["steps"][-1]["last"] == 20
    _, scale = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss_scale&max_points=100000")
    assert scale["steps"][0]["last"] == 2.0**16
    assert scale["steps"][39]["last"] == 2.0**16 / 2**19   # the scale used at the 20th skipped step
