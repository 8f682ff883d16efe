"""Downsampled reads (rollups) agree with a brute-force computation over what was sent, on both databases."""
from __future__ import annotations

import math
import random

import pytest
from gw_payloads import batch, expected_bucket, step, wire

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
            exp.append((first, *expected_bucket(vals)))
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


SAMPLED_EVERY = 100


def sampled_at(i, k):
    """A statistic the agent samples every 100 steps (at 37, 137, …) plus at 1610, so that one level-16
    bucket holds two samples: its partials are mostly compact one-step ones, a few full ones."""
    if k == 3 and i == 5037:
        return math.nan
    if k == 5 and i in (837, 937):
        return None                       # not measured
    return (k + 1) * 0.25 + (i % 997) * 1e-3 + (9.0 if (k == 0 and i == 12037) else 0.0)


def _sampled_steps():
    return sorted([i for i in range(37, 20_000, SAMPLED_EVERY)] + [1610])


def _expected_cells(samples, value, origin, bs, k, agg):
    cells = {}
    for s in samples:
        v = value(s, k)
        cells.setdefault(origin + (s - origin) // bs * bs, [])
        if v is not None:
            cells[origin + (s - origin) // bs * bs].append((s, v))
    out = []
    for start in sorted(cells):
        vals = cells[start]
        if not vals:
            out.append(None)
        elif agg == "last":
            last = max(vals)[1]
            out.append("NaN" if math.isnan(last) else last)
        elif any(math.isnan(v) for _, v in vals):
            out.append("NaN")
        else:
            xs = [v for _, v in vals]
            out.append({"max": max, "min": min, "mean": lambda a: sum(a) / len(a)}[agg](xs))
    return sorted(cells), out


def test_heatmap_of_a_sampled_statistic_matches_brute_force(live_server):
    """Buckets holding one sample are stored as compact partials (server/storage/rollups.py); a heatmap mixes
    them with full ones and must give what the raw samples give, at every level and aggregation."""
    srv = live_server
    samples = set(_sampled_steps())
    batches = []
    for lo in range(0, 20_000, 2_500):          # the agent's every-step signals every 10 steps, for size
        steps = []
        for i in sorted(set(range(lo, lo + 2_500, 10)) | {s for s in samples if lo <= s < lo + 2_500}):
            layers = {"grad_norm": [0.1] * LAYERS}
            if i in samples:
                width = LAYERS if i != 1610 else 4            # a shorter array: its last layers not measured
                layers["act_std"] = [wire(sampled_at(i, k)) for k in range(width)]
            steps.append(step(i, layers=layers))
        batches.append(batch(steps, run="sampled"))
    random.Random(3).shuffle(batches)
    run_id = None
    for b in batches:
        status, body = srv.post("/api/v1/ingest", b)
        assert status == 200, body
        run_id = body["run_id"]

    def value_at(i, k):
        return None if (i == 1610 and k >= 4) else sampled_at(i, k)     # the short array at 1610

    seen_sizes = set()
    # levels 16, 256, 4096, raw rows (bucket 2); and 6 columns asked: 6 of 3,584 steps from level 256, or
    # 5 of 4,096 from level 4096 -- 83 % of the columns, so the coarser level (COARSER_LEVEL_KEEPS)
    for max_steps in (150, 40, 3, 10_000, 6):
        for agg in ("max", "min", "mean", "last"):
            st, m = srv.get(f"/api/v1/runs/{run_id}/layers?stat=act_std&max_steps={max_steps}&agg={agg}")
            assert st == 200, m
            bs = m["bucket_size"]
            seen_sizes.add(bs)
            origin = m["steps"][0]
            for k in range(LAYERS):
                starts, exp = _expected_cells(sorted(samples), value_at, origin, bs, k, agg)
                assert m["steps"] == starts, (max_steps, agg)
                got = m["values"][k]
                assert len(got) == len(exp)
                for g, e in zip(got, exp):
                    if isinstance(e, float):
                        assert isinstance(g, float) and g == pytest.approx(e, rel=1e-5), (max_steps, agg, k)
                    else:
                        assert g == e, (max_steps, agg, k)
    assert seen_sizes == {144, 512, 8192, 2, 4096}
