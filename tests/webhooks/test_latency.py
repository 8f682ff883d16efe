"""Latency, measured (printed, not asserted): NaN step → webhook received, and step → visible in the API.

A real training loop with the real agent at its default settings (flush every 0.5 s; a
non-finite step is shipped at once), a real server, a real receiver. A poller thread reads
``/series?since=`` every 10 ms and notes when each step first shows up.
"""
from __future__ import annotations

import math
import statistics
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from tests.conftest import wait_until

RUNS = 6
STEPS = 40
NAN_STEP = 34         # training goes on after it (the scaler skips the step), as a real job would
STEP_SECONDS = 0.01


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]


def test_latency_nan_to_webhook_and_step_to_api(server_factory, db_url, webhook_receiver, request):
    srv = server_factory(db_url, extra_args=["--webhook", webhook_receiver.url])
    nan_latency, visible_latency, in_server = [], [], []
    for i in range(RUNS):
        torch.manual_seed(i)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu")
        name = f"latency-{i}"
        ended: dict[int, float] = {}
        seen: dict[int, float] = {}
        stop = threading.Event()

        def poll():
            run_id, last = None, -1
            while not stop.is_set():
                if run_id is None:
                    _, body = srv.get("/api/v1/runs?project=latency")
                    run_id = next((r["id"] for r in body["runs"] if r["name"] == name), None)
                else:
                    _, s = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&since={last}")
                    now = time.time()
                    for b in s["steps"]:
                        seen.setdefault(b["step"], now)
                        last = max(last, b["step"])
                time.sleep(0.01)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        x = torch.randn(32, 8)
        y = x.sum(dim=1, keepdim=True)
        monitor = agent.attach(model, scaler, optimizer=opt, project="latency", run=name, server=srv.url)
        try:
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                loss = F.mse_loss(model(x), y)
                if step == NAN_STEP:
                    loss = loss * math.nan
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                ended[step] = time.time()
                time.sleep(STEP_SECONDS)
            hit = webhook_receiver.wait_for(lambda r: r.json()["run"] == name and r.json()["rule"] == "A1")
            nan_latency.append(hit.time - ended[NAN_STEP])
            # the server's own part: alert row written (inside the ingest transaction) → delivery recorded
            d = wait_until(lambda: (srv.get("/api/v1/webhooks/deliveries?limit=1")[1]["deliveries"] or [{}])[0]
                           .get("delivered_at") and srv.get("/api/v1/webhooks/deliveries?limit=1")[1]["deliveries"][0],
                           what="delivery recorded")
            in_server.append(d["delivered_at"] - d["created_at"])
            # the agent closes a step's record when the next one starts: the last step is sent at close()
            wait_until(lambda: len(seen) >= STEPS - 1, timeout=10, what="the steps visible")
        finally:
            stop.set()
            poller.join(timeout=5)
            monitor.close()
        visible_latency += [seen[s] - ended[s] for s in range(STEPS - 1)]
    backend = request.node.callspec.params["db_url"]
    lines = [
        f"- {backend}: NaN step → webhook received: median {statistics.median(nan_latency) * 1000:.0f} ms, "
        f"p95 {p95(nan_latency) * 1000:.0f} ms, max {max(nan_latency) * 1000:.0f} ms ({RUNS} runs); in the server "
        f"(outbox row → receiver answered) median {statistics.median(in_server) * 1000:.0f} ms",
        f"- {backend}: step → visible in the API: median {statistics.median(visible_latency) * 1000:.0f} ms, "
        f"p95 {p95(visible_latency) * 1000:.0f} ms, max {max(visible_latency) * 1000:.0f} ms "
        f"({len(visible_latency)} steps)",
    ]
    _update_doc(backend, lines)
    print(f"\n[latency:{backend}] NaN step -> webhook received: median {statistics.median(nan_latency) * 1000:.0f} ms, "
          f"p95 {p95(nan_latency) * 1000:.0f} ms, max {max(nan_latency) * 1000:.0f} ms ({RUNS} runs)")
    print(f"[latency:{backend}] of which in the server (outbox row -> receiver answered): "
          f"median {statistics.median(in_server) * 1000:.0f} ms, max {max(in_server) * 1000:.0f} ms")
    print(f"[latency:{backend}] step -> visible in the API: median {statistics.median(visible_latency) * 1000:.0f} ms, "
          f"p95 {p95(visible_latency) * 1000:.0f} ms, max {max(visible_latency) * 1000:.0f} ms "
          f"({len(visible_latency)} steps; agent flush_interval 0.5 s, 10 ms API polling)")
    assert len(nan_latency) == RUNS and len(visible_latency) == RUNS * (STEPS - 1)


def _update_doc(backend: str, lines: list[str]) -> None:
    """Keep docs/rules.md's latency block current: this backend's lines replaced, the others kept."""
    import re

    from tests.conftest import REPO_ROOT

    doc = REPO_ROOT / "docs" / "rules.md"
    if not doc.exists():
        return
    text = doc.read_text()
    m = re.search(r"<!-- latency:start -->\n(.*?)<!-- latency:end -->", text, flags=re.S)
    if not m:
        return
    kept = [ln for ln in m.group(1).splitlines() if ln.startswith("- ") and not ln.startswith((f"- {backend}:", f"- {backend} ("))]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = "\n".join(sorted(kept + [ln.replace(": NaN", f" ({stamp}): NaN", 1) if "NaN step" in ln else ln
                                     for ln in lines])) + "\n"
    doc.write_text(text[:m.start(1)] + body + text[m.end(1):])
