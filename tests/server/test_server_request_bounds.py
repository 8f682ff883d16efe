"""Requests built to exhaust the server's memory are refused before the work, on both databases
(issue: hostile input). Each case is the attack as it was reported, scaled to what a test can send;
without the bounds each was answered by growing the server's memory (or with a 500)."""
from __future__ import annotations

import gzip
import json
import time

import numpy as np
import pytest
from gw_payloads import batch, post_raw, step

from gradwatch.server import queries
from gradwatch.server.storage.db import open_database, upgrade
from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _ingest(srv, steps, run="r", **over):
    st, body = srv.post("/api/v1/ingest", batch(steps, run=run, **over))
    assert st == 200, body
    return body["run_id"]


def test_series_and_heatmap_reads_are_bounded_before_any_work(live_server):
    srv = live_server
    run_id = _ingest(srv, [step(i) for i in range(50)])
    # the reported attack: one run repeated 50 times x 20 signals x 100,000 points
    q = "&".join([f"runs={run_id}"] * 50 + ["signals=loss"] * 20) + "&max_points=100000"
    t = time.monotonic()
    st, err = srv.get(f"/api/v1/series?{q}")
    assert st == 422 and "named once" in err["detail"], err
    # distinct runs and signals, still too many points
    others = [_ingest(srv, [step(i) for i in range(3)], run=f"o{k}") for k in range(4)]
    signals = ["loss", "grad_norm", "lr", "loss_scale", "step_time"]
    q = "&".join([f"runs={r}" for r in [run_id, *others]] + [f"signals={s}" for s in signals])
    st, err = srv.get(f"/api/v1/series?{q}&max_points=100000")
    assert st == 422 and "200,000 points" in err["detail"], err
    st, ok = srv.get(f"/api/v1/series?{q}&max_points=2000")        # what the dashboard asks: answered
    assert st == 200 and len(ok["series"]) == 25
    # the heatmap attack: max_steps=10000 x max_layers=10000 on a run of 6 layers is 60,000 cells: fine;
    # a wide model's is refused
    st, m = srv.get(f"/api/v1/runs/{run_id}/layers?max_steps=10000&max_layers=10000")
    assert st == 200, m
    wide = _ingest(srv, [step(i, layers={"grad_norm": [0.5] * 2000}) for i in range(2)], run="wide",
                   meta={"param_names": [f"p{k}" for k in range(2000)]})
    st, err = srv.get(f"/api/v1/runs/{wide}/layers?max_steps=10000&max_layers=10000")
    assert st == 422 and "1,000,000 cells" in err["detail"], err
    assert time.monotonic() - t < 60     # refused, not computed (a bound that catches a hang, not a timing)


def test_a_heatmap_that_would_read_too_much_gets_coarser_buckets_or_is_refused(db_url, tmp_path):
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    try:
        layers = 40
        with database.write_sessionmaker() as s:
            for lo in range(0, 4096, 512):
                body = batch([step(i, layers={"grad_norm": [float(i % 7 + k) for k in range(layers)]})
                              for i in range(lo, lo + 512)], run="h", meta={"param_names": [f"p{k}" for k in range(layers)]})
                ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=settings, now=time.time(),
                             evaluate_rules=False)
            s.commit()
        with database.sessionmaker() as s:
            run_id = queries.list_runs(s)[0].id
            full = queries.get_layer_matrix(s, run_id=run_id, stat="grad_norm", max_steps=4096)
            assert full.bucket_size == 1 and len(full.steps) == 4096          # raw rows: 4096 x 40 values
            # a budget below the raw read: buckets widen to the first rollup level (256 partials x 40)
            coarse = queries.get_layer_matrix(s, run_id=run_id, stat="grad_norm", max_steps=4096, read_budget=4096 * 39)
            assert coarse.bucket_size == 16 and len(coarse.steps) == 256
            assert coarse.values[3][0] == max(full.values[3][:16])            # the same cells, merged
            with pytest.raises(queries.RequestTooLarge, match="shorter step range"):
                queries.get_layer_matrix(s, run_id=run_id, stat="grad_norm", max_steps=4096, read_budget=10)
    finally:
        database.dispose()


def test_bodies_that_expand_in_memory_are_refused_before_parsing(live_server):
    srv = live_server
    pid = srv.proc.pid
    before = _peak_rss_mb(pid)
    # the reported gzip bomb: a few hundred KB of gzip holding a 60 MB list of numbers in a layer array
    inner = b"0.5," * (15 * 1024 * 1024)
    raw = (b'{"batch_id":"bomb","project":"default","run":"bomb","steps":[{"step":0,"time":1.0,'
           b'"layers":{"grad_norm":[' + inner + b'0.5]}}]}')
    st, err = post_raw(f"{srv.url}/api/v1/ingest", gzip.compress(raw, 9),
                       {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert st == 413 and "JSON values" in err["detail"], err
    # nested lists in an event's data: refused by the same count, and a smaller nest by the event bound
    nest = b"[" + b"[]," * 3_000_000 + b"[]]"
    raw = (b'{"batch_id":"nest","project":"default","run":"bomb","steps":[],'
           b'"events":[{"kind":"x","data":{"a":' + nest + b'}}]}')
    st, err = post_raw(f"{srv.url}/api/v1/ingest", gzip.compress(raw, 9),
                       {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert st == 413, err
    st, err = srv.post("/api/v1/ingest", batch([], run="bomb", events=[{"kind": "x", "data": {"a": [[]] * 40_000}}]))
    assert st == 422 and "event data" in err["detail"], err
    st, runs = srv.get("/api/v1/runs?name=bomb")
    assert runs["runs"] == [] or all(r["last_step"] is None for r in runs["runs"])   # nothing stored
    # JSON nested 100,000 deep: a 400 that says so, not a 500
    deep = b'{"batch_id":"d","project":"p","run":"r","steps":[],"events":[{"kind":"x","data":{"a":' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}}]}"
    st, err = post_raw(f"{srv.url}/api/v1/ingest", deep, {"Content-Type": "application/json"})
    assert st == 400 and "JSON" in err["detail"], err
    assert _peak_rss_mb(pid) - before < 400, (before, _peak_rss_mb(pid))
    st, _ = srv.get("/api/health")
    assert st == 200


def test_small_hostile_bodies_get_a_4xx_and_store_nothing(live_server):
    srv = live_server
    # a NUL in a custom key, a name or a layer name (a 500 on PostgreSQL before)
    for body in (batch([step(0, custom={"a\x00b": 1.0})], run="nul"),
                 batch([step(0)], run="nul\x00"),
                 batch([step(0)], run="nul", meta={"param_names": ["w\x00"]})):
        st, err = srv.post("/api/v1/ingest", body)
        assert st == 422 and "NUL" in err["detail"], err
    # an "f32:" array of 100,001 values is over the 100,000 limit, however its base64 is padded
    import base64
    over = "f32:" + base64.b64encode(np.zeros(100_001, "<f4").tobytes()).decode()
    st, err = srv.post("/api/v1/ingest", batch([step(0, layers={"grad_norm": over})], run="nul"))
    assert st == 422 and "at most 100000" in err["detail"], err
    # gzip with bytes after its end, or cut short
    good = gzip.compress(json.dumps(batch([step(0)], run="nul")).encode())
    for raw in (good + b"trailing garbage", good[:-6]):
        st, err = post_raw(f"{srv.url}/api/v1/ingest", raw, {"Content-Type": "application/json",
                                                             "Content-Encoding": "gzip"})
        assert st == 400 and "gzip" in err["detail"], err
    st, runs = srv.get("/api/v1/runs")
    assert [r["name"] for r in runs["runs"]] == []
    st, _ = post_raw(f"{srv.url}/api/v1/ingest", good, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert st == 200
