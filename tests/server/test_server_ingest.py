"""Ingest against a real server on SQLite and PostgreSQL: NaN encoding, validation, idempotency, gzip, limits."""
from __future__ import annotations

import gzip
import json

import base64

import numpy as np
import pytest

from gradwatch.server.wire.numbers import NULL_F32_BITS

from gw_payloads import batch, post_json_text, post_raw, step

NONFINITE_TEXT = json.dumps({
    "batch_id": "nonfinite-1", "project": "default", "run": "nf",
    "meta": {"param_names": ["a", "b", "c", "d"]},
    "steps": [
        {"step": 0, "time": 1.0, "loss": 1.5, "grad_norm": "NaN", "custom": {"acc": "Infinity"},
         "layers": {"grad_norm": [1.0, "NaN", None, "-Infinity"]}},
        {"step": 1, "time": 2.0, "loss": "NaN", "grad_norm": "Infinity", "custom": {"acc": None}},
        {"step": 2, "time": 3.0, "loss": "-Infinity", "grad_norm": None, "custom": {"acc": "NaN"}},
        {"step": 3, "time": 4.0, "loss": None, "grad_norm": 0.5, "custom": {"acc": 0.25}},
    ],
}).replace('"__NAN__"', "NaN")


def test_nan_inf_and_null_stay_distinct_end_to_end(live_server):
    # step 4 uses the bare tokens Python's json writes
    text = NONFINITE_TEXT[:-2] + ', {"step": 4, "time": 5.0, "loss": NaN, "grad_norm": -Infinity}]}'
    status, body = post_json_text(live_server.url + "/api/v1/ingest", text)
    assert status == 200, body
    assert body["accepted"] == 5 and body["duplicate"] is False
    run_id = body["run_id"]

    def raw(signal):
        st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal={signal}")
        assert st == 200, s
        assert s["bucket_size"] == 1
        return {p["step"]: (p["last"], p["count"], p["nonfinite"]) for p in s["steps"]}

    assert raw("loss") == {0: (1.5, 1, 0), 1: ("NaN", 1, 1), 2: ("-Infinity", 1, 1), 3: (None, 0, 0),
                           4: ("NaN", 1, 1)}
    assert raw("grad_norm") == {0: ("NaN", 1, 1), 1: ("Infinity", 1, 1), 2: (None, 0, 0), 3: (0.5, 1, 0),
                                4: ("-Infinity", 1, 1)}
    assert raw("custom:acc") == {0: ("Infinity", 1, 1), 1: (None, 0, 0), 2: ("NaN", 1, 1), 3: (0.25, 1, 0)}

    # one bucket over everything: min/max skip NaN but keep ±inf; NaN is counted
    st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=1")
    assert st == 200 and s["bucket_size"] == 5
    (p,) = s["steps"]
    assert (p["min"], p["max"], p["last"], p["count"], p["nonfinite"]) == ("-Infinity", 1.5, "NaN", 4, 3)
    st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal=grad_norm&max_points=2")
    assert [(q["step"], q["min"], q["max"], q["last"], q["count"], q["nonfinite"]) for q in s["steps"]] == [
        (0, "Infinity", "Infinity", "Infinity", 2, 2),   # steps 0-2: NaN, +inf, null
        (3, "-Infinity", 0.5, "-Infinity", 2, 1),        # steps 3-4
    ]

    st, m = live_server.get(f"/api/v1/runs/{run_id}/layers?stat=grad_norm")
    assert st == 200, m
    assert m["layers"] == ["a", "b", "c", "d"] and m["steps"] == [0]
    assert m["values"] == [[1.0], ["NaN"], [None], ["-Infinity"]]

    st, runs = live_server.get("/api/v1/runs")
    (r,) = runs["runs"]
    assert r["last_step"] == 4 and r["last_loss"] == "NaN"


BAD_INPUTS = [
    (lambda b: b["steps"][2].update(loss="lots"), "steps[2].loss"),
    (lambda b: b["steps"][1].update(step=-1), "steps[1].step"),
    (lambda b: b["steps"][0].update(clipped="yes"), "steps[0].clipped"),
    (lambda b: b["steps"][2]["layers"].update(grad_norm=[1.0, "oops"]), "steps[2].layers.grad_norm"),
    (lambda b: b["steps"][1].pop("time"), "steps[1].time"),
    (lambda b: b.pop("batch_id"), "batch_id"),
    (lambda b: b.update(rank="zero"), "rank"),
    (lambda b: b.update(status="exploded"), "status"),
    (lambda b: b["steps"][0]["custom"].update(acc=[1]), "steps[0].custom.acc"),
    (lambda b: b["meta"].update(param_names="p0"), "meta.param_names"),
    (lambda b: b["steps"][1]["layers"].update(grad_norm="f32:not base64!"), "steps[1].layers.grad_norm"),
    (lambda b: b["steps"][0]["layers"].update(grad_norm="f32:AAAA"), "steps[0].layers.grad_norm"),  # 3 bytes
    (lambda b: b["steps"][2]["layers"].update(act_std="AAAAAA=="), "steps[2].layers.act_std"),   # no prefix
    (lambda b: b["steps"][2]["layers"].update(act_std={"a": 1}), "steps[2].layers.act_std"),
]


def test_compact_f32_layer_arrays_keep_nan_inf_and_null(live_server):
    """The ``"f32:" + base64`` form stores the same as the list form, NaN / ±Inf / "not measured" included."""
    nan = float("nan")
    values = np.array([0.5, nan, np.inf, -np.inf, 1e-30, 0.0], dtype="<f4")
    as_bytes = bytearray(values.tobytes())
    as_bytes[16:20] = np.array([NULL_F32_BITS], dtype="<u4").tobytes()   # index 4: "not measured"
    compact = "f32:" + base64.b64encode(bytes(as_bytes)).decode()
    listed = [0.5, "NaN", "Infinity", "-Infinity", None, 0.0]
    b = batch([step(0, layers={"grad_norm": compact}), step(1, layers={"grad_norm": listed})], run="f32")
    status, body = live_server.post("/api/v1/ingest", b)
    assert status == 200, body
    st, m = live_server.get(f"/api/v1/runs/{body['run_id']}/layers?stat=grad_norm")
    assert st == 200, m
    assert m["steps"] == [0, 1]
    assert [row[0] for row in m["values"]] == [row[1] for row in m["values"]] == listed


def test_bad_input_names_the_field_and_writes_nothing(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    for i, (mutate, field) in enumerate(BAD_INPUTS):
        b = batch([step(i) for i in range(3)], run="bad")
        mutate(b)
        status, body = srv.post("/api/v1/ingest", b)
        assert status == 422, (i, body)
        assert field in body["detail"], (field, body["detail"])
    assert srv.get("/api/v1/runs")[1] == {"runs": []}


def test_bad_input_on_both_databases(live_server):
    b = batch([step(0), step(1), step(2, overflow_count=-3)], run="bad")
    status, body = live_server.post("/api/v1/ingest", b)
    assert status == 422 and "steps[2].overflow_count" in body["detail"]
    for text, code in [("{not json", 400), ("[1, 2]", 422), ('{"batch_id": "x"}', 422)]:
        status, body = post_json_text(live_server.url + "/api/v1/ingest", text)
        assert status == code, (text, body)
        assert body["detail"]
    assert live_server.get("/api/v1/runs")[1] == {"runs": []}
    # a valid batch afterwards is written whole
    status, body = live_server.post("/api/v1/ingest", batch([step(i) for i in range(3)], run="bad"))
    assert status == 200 and body["accepted"] == 3


def test_retried_batch_is_idempotent(live_server):
    b = batch([step(i) for i in range(10)], run="retry", batch_id="fixed-batch-id",
              events=[{"step": 3, "kind": "nan_origin", "data": {"module": "blocks.3.mlp"}}])
    first = live_server.post("/api/v1/ingest", b)
    second = live_server.post("/api/v1/ingest", b)
    assert first[0] == second[0] == 200
    assert first[1]["duplicate"] is False and second[1]["duplicate"] is True
    assert first[1]["run_id"] == second[1]["run_id"]
    run_id = first[1]["run_id"]
    st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal=loss")
    assert len(s["steps"]) == 10
    st, ev = live_server.get(f"/api/v1/runs/{run_id}/events")
    assert [e["kind"] for e in ev["events"]] == ["nan_origin"]
    # a new batch id carrying steps already stored neither fails nor doubles them
    status, body = live_server.post("/api/v1/ingest", batch([step(i) for i in range(5, 15)], run="retry"))
    assert status == 200
    st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal=loss")
    assert [p["step"] for p in s["steps"]] == list(range(15))


def test_batch_ids_are_scoped_to_their_run(live_server):
    """Another project's (or run's) batch that reuses a batch id is a different batch: it is stored, and
    the reply names its own run (batch ids were global: such a batch was answered duplicate and dropped)."""
    ids = {}
    for project, run in (("alpha", "r"), ("beta", "r"), ("alpha", "other")):
        st, body = live_server.post("/api/v1/ingest", batch([step(i) for i in range(4)], project=project, run=run,
                                                            batch_id="shared-id"))
        assert st == 200 and body["duplicate"] is False and body["accepted"] == 4, (project, run, body)
        ids[(project, run)] = body["run_id"]
    assert len(set(ids.values())) == 3
    for run_id in ids.values():
        st, s = live_server.get(f"/api/v1/runs/{run_id}/series?signal=loss")
        assert [p["step"] for p in s["steps"]] == [0, 1, 2, 3]
    # within one run the id still makes a retry a duplicate
    st, body = live_server.post("/api/v1/ingest", batch([step(9)], project="beta", run="r", batch_id="shared-id"))
    assert body["duplicate"] is True and body["run_id"] == ids[("beta", "r")]


def test_gzip_body_and_size_limits(server_factory, db_url):
    srv = server_factory(db_url, env={"GRADWATCH_MAX_BODY_BYTES": "60000", "GRADWATCH_MAX_DECODED_BYTES": "200000"})
    url = srv.url + "/api/v1/ingest"
    small = json.dumps(batch([step(i) for i in range(20)], run="gz"))
    status, body = post_json_text(url, small, gzip_it=True)
    assert status == 200 and body["accepted"] == 20, body
    # over the body limit
    big = json.dumps(batch([step(i) for i in range(400)], run="big"))
    assert len(big) > 60000
    status, body = post_json_text(url, big)
    assert status == 413, body
    # small compressed, but over the decompressed limit (a gzip bomb)
    bomb = json.dumps(batch([step(i, custom={"pad": 1.0, "x" * 150: 0.0}) for i in range(1200)], run="bomb"))
    assert len(bomb) > 200000 and len(gzip.compress(bomb.encode())) < 60000
    status, body = post_json_text(url, bomb, gzip_it=True)
    assert status == 413, body
    status, body = post_raw(url, b"\x1f\x8b not gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert status == 400, body
    status, body = post_raw(url, small.encode(), {"Content-Type": "application/json", "Content-Encoding": "br"})
    assert status == 415, body
    runs = {r["name"] for r in srv.get("/api/v1/runs")[1]["runs"]}
    assert runs == {"gz"}
