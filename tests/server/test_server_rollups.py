"""Downsampled reads (rollups) agree with a brute-force computation over what was sent, on both databases."""
from __future__ import annotations

import math
import random

from gw_payloads import batch, step, wire

N = 3000
LAYERS = 6


def loss_at(i):
    if i == 1234:
        return 1e6            # a spike
    if i in (1500, 1501):
        return math.nan
    if i == 2000:
        return math.inf
    if 2500 <= i < 2511:
        return None           # not measured
    return 2.0 + math.sin(i / 50.0)


def layer_at(i, k):
    if k == 2 and i == 1700:
        return math.nan
    if k == 4 and 100 <= i < 200:
        return None
    return (k + 1) * 0.1 + (i % 13) * 0.01 + (50.0 if (k == 1 and i == 2222) else 0.0)


def _send(srv):
    def enc(v):
        return wire(v)
    batches = []
    for lo in range(0, N, 250):
        steps = [step(i, loss=enc(loss_at(i)), layers={"grad_norm": [enc(layer_at(i, k)) for k in range(LAYERS)]})
                 for i in range(lo, lo + 250)]
        batches.append(batch(steps, run="roll"))
    random.Random(7).shuffle(batches)   # out of order, as from several replicas
    run_id = None
    for b in batches:
        status, body = srv.post("/api/v1/ingest", b)
        assert status == 200, body
        run_id = body["run_id"]
    return run_id


def _expected_bucket(values):
    measured = [(s, v) for s, v in values if v is not None]
    finite_or_inf = [v for _, v in measured if not math.isnan(v)]
    last = max(measured)[1] if measured else None
    return (wire(min(finite_or_inf)) if finite_or_inf else ("NaN" if measured else None),
            wire(max(finite_or_inf)) if finite_or_inf else ("NaN" if measured else None),
            wire(last), len(measured), sum(1 for _, v in measured if not math.isfinite(v)))


def test_downsampled_series_and_heatmap_match_brute_force(live_server):
    srv = live_server
    run_id = _send(srv)
    for max_points in (100, 7, 1):   # levels 16, 256, and 4096 (bucket 3000 -> 256 x 12)
        st, s = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points={max_points}")
        assert st == 200, s
        bs = s["bucket_size"]
        assert bs % 16 == 0 and len(s["steps"]) <= max_points   # read from the rollups
        got = [(p["step"], p["min"], p["max"], p["last"], p["count"], p["nonfinite"]) for p in s["steps"]]
        exp = []
        for first in range(0, N, bs):
            vals = [(i, loss_at(i)) for i in range(first, min(first + bs, N))]
            exp.append((first, *_expected_bucket(vals)))
        assert got == exp, max_points
    # the spike and the NaNs survive a 100-point chart
    st, s = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=100")
    assert max(p["max"] for p in s["steps"] if isinstance(p["max"], float)) == 1e6
    assert sum(p["nonfinite"] for p in s["steps"]) == 3

    for max_steps in (40, 3):
        st, m = srv.get(f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps={max_steps}")
        assert st == 200, m
        bs = m["bucket_size"]
        assert len(m["steps"]) <= max_steps and m["steps"] == list(range(0, N, bs))
        for k in range(LAYERS):
            row = []
            for first in m["steps"]:
                vals = [layer_at(i, k) for i in range(first, min(first + bs, N))]
                vals = [v for v in vals if v is not None]
                row.append(None if not vals else ("NaN" if any(math.isnan(v) for v in vals)
                                                  else max(vals)))
            got = m["values"][k]
            assert [g if not isinstance(g, float) else round(g, 4) for g in got] == \
                   [e if not isinstance(e, float) else round(e, 4) for e in row], (max_steps, k)
    # layers grouped in pairs: max over the pair
    st, m = srv.get(f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps=3&max_layers=3")
    assert m["layer_group_size"] == 2 and m["layers"] == ["p0.weight", "p2.weight", "p4.weight"]
    assert m["values"][0][2] > 50   # the layer-1 spike at step 2222 shows in group 0

    # comparison call: two runs on one axis
    st, body = srv.post("/api/v1/ingest", batch([step(i) for i in range(0, 1000)], run="other"))
    other = body["run_id"]
    st, multi = srv.get(f"/api/v1/series?runs={run_id}&runs={other}&signals=loss&signals=grad_norm&max_points=50")
    assert st == 200, multi
    assert [(x["run_id"], x["signal"]) for x in multi["series"]] == [
        (run_id, "loss"), (run_id, "grad_norm"), (other, "loss"), (other, "grad_norm")]
    assert len({x["bucket_size"] for x in multi["series"]}) == 1
    assert multi["series"][2]["steps"][-1]["step"] < 1000 and multi["series"][0]["steps"][-1]["step"] > 2900

    # live tail
    st, tail = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&since=2990")
    assert [p["step"] for p in tail["steps"]] == list(range(2991, 3000)) and tail["bucket_size"] == 1
