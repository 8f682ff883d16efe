"""Issue 43, case 2: heavy reads are admitted against one memory budget per server. With the budget at
its smallest (GRADWATCH_HEAVY_READ_BUDGET_MB=16, below what one heatmap of this run declares), 12
heatmaps asked at once run one after another: each answer is either the heatmap, identical for all, or
a 429/503 with ``Retry-After`` and a message saying why; a reader that waits as told gets the same
heatmap; the server keeps answering ``/api/health`` and ingest throughout. (RSS figures under 20
worst-case reads come from bench/abuse.py --case heatmap, not from a test.) Real server, both databases."""
from __future__ import annotations

import base64
import threading
import time
import uuid

import numpy as np

from tests.conftest import http_json

LAYERS, STEPS = 150, 3000


def _fill(srv) -> int:
    rnd = np.random.default_rng(0)
    names = [f"layer{i}.weight" for i in range(LAYERS)]
    for first in range(0, STEPS, 1000):
        steps = []
        for i in range(first, first + 1000):
            vals = rnd.uniform(0.01, 1.0, LAYERS).astype("<f4")
            steps.append({"step": i, "time": float(i), "loss": 1.0,
                          "layers": {"grad_norm": "f32:" + base64.b64encode(vals.tobytes()).decode()}})
        body = {"batch_id": uuid.uuid4().hex, "project": "heat", "run": "wide", "steps": steps}
        if first == 0:
            body["meta"] = {"param_names": names}
        st, out = srv.post("/api/v1/ingest", body, timeout=120)
        assert st == 200, out
    _, runs = srv.get("/api/v1/runs?project=heat")
    return runs["runs"][0]["id"]


def test_parallel_heatmaps_queue_for_the_budget_and_are_refused_with_retry_after(server_factory, db_url):
    srv = server_factory(db_url, env={"GRADWATCH_HEAVY_READ_BUDGET_MB": "16"})
    run_id = _fill(srv)
    path = f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps={STEPS}&max_layers={LAYERS}"
    st, reference = srv.get(path, timeout=120)
    assert st == 200 and len(reference["layers"]) == LAYERS and len(reference["steps"]) == STEPS, st

    answers: list = []
    lock = threading.Lock()

    def reader():
        for _ in range(200):
            st, body = srv.get(path, timeout=120)        # 120 s: catches a hang only
            with lock:
                answers.append((st, body))
            if st == 200:
                return
            assert st in (429, 503), (st, body)
            time.sleep(0.2)

    threads = [threading.Thread(target=reader) for _ in range(12)]
    for t in threads:
        t.start()
    healthy = []
    while any(t.is_alive() for t in threads):
        healthy.append(srv.get("/api/health", timeout=60)[0])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert healthy and set(healthy) == {200}
    ok = [body for st, body in answers if st == 200]
    assert len(ok) == 12 and all(body == reference for body in ok), "every reader got the same heatmap"
    for st, body in answers:
        if st != 200:
            assert "read budget" in body["detail"] and "try again" in body["detail"], body
    st, out = srv.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": "heat", "run": "other",
                                          "steps": [{"step": 0, "time": 1.0, "loss": 1.0}]})
    assert st == 200, out


def test_a_refusal_carries_retry_after(server_factory, db_url):
    """The header itself, read raw (http_json returns the body only)."""
    import http.client

    srv = server_factory(db_url, env={"GRADWATCH_HEAVY_READ_BUDGET_MB": "16"})
    run_id = _fill(srv)
    path = f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps={STEPS}&max_layers={LAYERS}"
    seen: list = []

    def reader():
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        seen.append((resp.status, resp.getheader("Retry-After")))
        conn.close()

    for _ in range(5):          # bursts until one is refused: 40 readers on a budget that admits one at a time
        threads = [threading.Thread(target=reader) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(st != 200 for st, _ in seen):
            break
    refused = [(st, ra) for st, ra in seen if st != 200]
    assert refused, "40 readers at once on a one-at-a-time budget: the queue (32) overflows"
    assert all(st in (429, 503) and ra is not None and int(ra) >= 1 for st, ra in refused), refused
    assert http_json("GET", f"{srv.url}/api/health")[0] == 200
