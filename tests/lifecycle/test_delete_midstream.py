"""A run deleted while its real training loop is still sending stays deleted.

A tiny real model trains with the real agent attached, sending to a real server; half-way the run is deleted
with ``force=true``. The loop goes on (as a job nobody stopped does): every later batch is refused (410), no
run of that name comes back, and none of the old run's rows are left in any table.
"""
from __future__ import annotations

import threading
import time

import torch
import torch.nn as nn

from gradwatch import agent
from tests.conftest import http_json, wait_until
from tests.lifecycle.lifecycle_data import assert_no_orphans, ids_of, rows_of_run


def _loop(server_url: str, stop: threading.Event, steps_done: list, monitor_box: list) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="mid", run="streaming", server=server_url,
                           flush_interval=0.1)
    monitor_box.append(monitor)
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    step = 0
    try:
        while not stop.is_set() and step < 5000:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            step += 1
            steps_done.append(step)
            time.sleep(0.005)
    finally:
        monitor.close()


def test_a_run_deleted_mid_stream_stays_deleted(server_factory, db_url):
    srv = server_factory(db_url)
    stop, steps_done, box = threading.Event(), [], []
    t = threading.Thread(target=_loop, args=(srv.url, stop, steps_done, box), daemon=True)
    t.start()
    try:
        def stored_steps():
            runs = [r for r in srv.get("/api/v1/runs?project=mid")[1]["runs"] if r["name"] == "streaming"]
            return runs and runs[0]["last_step"] is not None and runs[0]["last_step"] >= 50 and runs[0]
        run = wait_until(stored_steps, timeout=60, what="the loop's first steps stored")
        run_id = run["id"]
        assert http_json("DELETE", f"{srv.url}/api/v1/runs/{run_id}", timeout=60)[0] == 409   # still sending
        alerts = ids_of(db_url, "SELECT id FROM alerts WHERE run_id = :r", r=run_id)
        groups = ids_of(db_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=run_id)
        status, out = http_json("DELETE", f"{srv.url}/api/v1/runs/{run_id}?force=true", timeout=60)
        assert status == 200, out
        at_delete = len(steps_done)
        # the loop goes on sending for a while: at least a few more flushes
        wait_until(lambda: len(steps_done) >= at_delete + 100, timeout=60, what="the loop going on")
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(timeout=60)
    assert not t.is_alive()
    # everything the agent sent after the delete was refused: no run of that name, no row of the old one
    assert [r for r in srv.get("/api/v1/runs?project=mid")[1]["runs"] if r["name"] == "streaming"] == []
    assert srv.get(f"/api/v1/runs/{run_id}")[0] == 404
    assert_no_orphans(db_url, run_id, alerts, groups)
    assert ids_of(db_url, "SELECT COUNT(*) FROM runs") == [0]
    assert rows_of_run(db_url, run_id)["steps"] == 0
    # the agent was told: the refused batches' steps are counted as dropped (a 410 is not retried)
    assert box[0].dropped_steps > 0
