"""Two real server processes sharing one database: batches for one run, any order, any replica, retries."""
from __future__ import annotations

import random
import re
import threading
import urllib.request

from gw_payloads import batch, step

BATCHES, STEPS = 40, 50


def _metric(text: str, name: str, label: str = "") -> float:
    m = re.search(rf"^{re.escape(name + label)} (\S+)$", text, re.M)
    assert m, name + label
    return float(m.group(1))


def test_two_replicas_accept_one_run_in_any_order_nothing_lost_or_doubled(server_factory, db_url):
    a = server_factory(db_url)
    b = server_factory(db_url, migrate=False)
    payloads = [batch([step(i) for i in range(k * STEPS, (k + 1) * STEPS)], run="shared",
                      events=[{"step": k * STEPS, "kind": "marker", "data": {"k": k}}]) for k in range(BATCHES)]
    rnd = random.Random(3)
    jobs = []
    for p in payloads:            # every batch goes to one replica, and is retried on the other
        first, second = (a, b) if rnd.random() < 0.5 else (b, a)
        jobs += [(first, p), (second, p)]
    rnd.shuffle(jobs)
    results, errors = [], []
    lock = threading.Lock()

    def worker(chunk):
        for srv, p in chunk:
            status, body = srv.post("/api/v1/ingest", p)
            with lock:
                (results if status == 200 else errors).append((p["batch_id"], body))

    threads = [threading.Thread(target=worker, args=(jobs[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    by_batch: dict[str, list[bool]] = {}
    for bid, body in results:
        by_batch.setdefault(bid, []).append(body["duplicate"])
    assert len(by_batch) == BATCHES
    assert all(sorted(v) == [False, True] for v in by_batch.values())   # written once, recognised once
    assert len({body["run_id"] for _, body in results}) == 1
    run_id = results[0][1]["run_id"]

    n = BATCHES * STEPS
    for srv in (a, b):
        st, raw = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points={n}")
        assert [p["step"] for p in raw["steps"]] == list(range(n))
        st, coarse = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=20")
        assert coarse["bucket_size"] >= 16 and sum(p["count"] for p in coarse["steps"]) == n
        st, ev = srv.get(f"/api/v1/runs/{run_id}/events")
        assert sorted(e["data"]["k"] for e in ev["events"]) == list(range(BATCHES))
        st, runs = srv.get("/api/v1/runs")
        assert [(r["name"], r["last_step"]) for r in runs["runs"]] == [("shared", n - 1)]

    texts = [urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode() for s in (a, b)]
    accepted = sum(_metric(t, "gradwatch_ingest_batches_total", '{result="accepted"}') for t in texts)
    dups = sum(_metric(t, "gradwatch_ingest_batches_total", '{result="duplicate"}') for t in texts)
    steps_total = sum(_metric(t, "gradwatch_ingest_steps_total") for t in texts)
    assert (accepted, dups, steps_total) == (BATCHES, BATCHES, n)
    assert all(_metric(t, "gradwatch_ingest_batch_seconds_count") > 0 for t in texts)
    assert "gradwatch_alerts_open" in texts[0] and "gradwatch_webhook_delivery_failures_total" in texts[0]
    assert _metric(texts[0], "gradwatch_ingest_rows_written_total") + \
        _metric(texts[1], "gradwatch_ingest_rows_written_total") > n
