"""Checkpoints recorded by a real training loop, stored, listed, and named in a critical alert's rollback advice.

Real parts only: a tiny model trained with a GradScaler (checklist order: scale, unscale, clip,
step, update), real checkpoint files written with ``torch.save``, a real server on SQLite and on
PostgreSQL, the alert read back through the API and the webhook a real receiver got.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from gradwatch import agent
from tests.conftest import wait_until

PROJECT = "ckpt"


def _loop(server_url: str, run: str, tmp_path, *, steps: int, nan_at: int, checkpoint_every: int = 0):
    """Train ``steps`` steps; the loss is NaN at step ``nan_at``; a checkpoint every ``checkpoint_every``
    steps (saved after the step, so its step is the number of steps taken: ``monitor.step``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project=PROJECT, run=run, server=server_url)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    saved = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if step == nan_at:
            loss = loss * math.nan
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        done = step + 1
        if checkpoint_every and done % checkpoint_every == 0:
            path = tmp_path / f"step-{done}.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scaler": scaler.state_dict(), "step": done}, path)
            assert monitor.step == done
            assert monitor.checkpoint(path) is True
            saved[done] = str(path)
    return monitor, saved


def _run_id(srv, run: str) -> int:
    def find():
        _, body = srv.get(f"/api/v1/runs?project={PROJECT}")
        return next((r["id"] for r in body["runs"] if r["name"] == run), None)
    return wait_until(find, timeout=15, what=f"run {run} listed")


def _a1(srv, run_id: int, what: str = "the A1 alert"):
    def find():
        _, body = srv.get(f"/api/v1/alerts?run={run_id}&rule=A1")
        return (body.get("alerts") or [None])[0]
    return wait_until(find, timeout=15, what=what)


def test_a_nan_run_rolls_back_to_the_last_checkpoint_before_it(server_factory, db_url, webhook_receiver, tmp_path):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    monitor, saved = _loop(srv.url, "nan-350", tmp_path, steps=360, nan_at=350, checkpoint_every=100)
    try:
        assert monitor.flush(10)
        assert sorted(saved) == [100, 200, 300]
        run_id = _run_id(srv, "nan-350")

        # stored as events and listed in step order with the paths the loop wrote
        status, body = srv.get(f"/api/v1/runs/{run_id}/checkpoints")
        assert status == 200, body
        assert [(c["step"], c["path"], c["rank"]) for c in body["checkpoints"]] == \
            [(s, saved[s], 0) for s in (100, 200, 300)]
        assert all(c["source"] is None and c["saved_at"] > 0 for c in body["checkpoints"])
        _, events = srv.get(f"/api/v1/runs/{run_id}/events?kind=checkpoint")
        assert [e["step"] for e in events["events"]] == [100, 200, 300]

        alert = _a1(srv, run_id)
        assert alert["first_step"] == 350 and alert["severity"] == "critical"
        rollback = alert["evidence"]["rollback"]
        # the last checkpoint at or before step 350; PaLM: restart before the spike, skip 200-500 batches
        assert rollback["checkpoint"] == saved[300] and rollback["step"] == 300
        assert rollback["anomaly_step"] == 350
        assert rollback["skip_batches"] == [300, 499]
        assert alert["actions"][1].startswith(f"Roll back to {saved[300]} (step 300) and skip batches 300–499")
        # the checkpoint named is one the loop can load
        state = torch.load(rollback["checkpoint"], weights_only=True)
        assert state["step"] == 300

        # the notification carries the advice: it was written before routing, in the same transaction
        hit = webhook_receiver.wait_for(lambda r: r.json().get("rule") == "A1" and r.json().get("run") == "nan-350",
                                        timeout=15)
        payload = hit.json()
        assert payload["evidence"]["rollback"]["checkpoint"] == saved[300]
        assert payload["actions"] == alert["actions"]
    finally:
        monitor.close()


def test_a_checkpoint_recorded_after_the_alert_updates_its_advice(live_server, tmp_path):
    srv = live_server
    monitor, saved = _loop(srv.url, "late-ckpt", tmp_path, steps=60, nan_at=50)
    try:
        assert monitor.flush(10) and saved == {}
        run_id = _run_id(srv, "late-ckpt")
        alert = _a1(srv, run_id)
        none = alert["evidence"]["rollback"]
        assert none["checkpoint"] is None and none["skip_batches"] is None and none["anomaly_step"] == 50
        assert alert["actions"][1].startswith("No checkpoint recorded at or before step 50")

        # e.g. an asynchronous upload that finished later: recorded with its own step, after the alert.
        # One made after the NaN is never named (its weights may be damaged).
        assert monitor.checkpoint(tmp_path / "after.pt", step=55)
        assert monitor.checkpoint(tmp_path / "upload-40.pt", step=40)
        assert monitor.flush(10)

        def updated():
            a = _a1(srv, run_id)
            return a if a["evidence"]["rollback"]["checkpoint"] else None
        alert = wait_until(updated, timeout=15, what="the advice naming the late checkpoint")
        rollback = alert["evidence"]["rollback"]
        assert rollback["checkpoint"] == str(tmp_path / "upload-40.pt") and rollback["step"] == 40
        assert rollback["skip_batches"] == [40, 239]
        # the advice replaced the old one: no "No checkpoint" action left behind
        assert alert["actions"][1].startswith(f"Roll back to {tmp_path / 'upload-40.pt'} (step 40)")
        # the rule's own first action (the fix for the cause) stays first
        assert alert["actions"][0].startswith("Grad norm was normal before the NaN")
        assert not any(a.startswith("No checkpoint recorded") for a in alert["actions"])
    finally:
        monitor.close()


def test_warnings_get_no_rollback_advice_and_bad_arguments_are_not_recorded(live_server, tmp_path, caplog):
    srv = live_server
    monitor, saved = _loop(srv.url, "healthy", tmp_path, steps=30, nan_at=-1, checkpoint_every=10)
    try:
        # misuse never raises into the loop: logged once, nothing recorded
        assert monitor.checkpoint(tmp_path / "x.pt", step=-1) is False
        assert monitor.checkpoint("", step=3) is False
        assert "checkpoint not recorded" in caplog.text
        assert monitor.flush(10)
        run_id = _run_id(srv, "healthy")
        _, body = srv.get(f"/api/v1/runs/{run_id}/checkpoints")
        assert [c["step"] for c in body["checkpoints"]] == [10, 20, 30]
        _, alerts = srv.get(f"/api/v1/alerts?run={run_id}")
        assert all("rollback" not in a["evidence"] for a in alerts["alerts"])
        status, _ = srv.get("/api/v1/runs/999999/checkpoints")
        assert status == 404
    finally:
        monitor.close()
