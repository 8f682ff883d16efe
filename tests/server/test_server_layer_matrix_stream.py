"""The per-layer heatmap (``GET /api/v1/runs/{id}/layers``) read from numpy cells and streamed (issue 43):

- raw rows reduced straight into cells give the numbers their one-step partials gave (the path every
  heatmap took before, and still the rollup levels' path), for every ``agg``, layer grouping and NaN /
  ±Inf / "not measured" mix, and ``reduceat`` done a block of columns at a time equals one call;
- the streamed JSON is, byte for byte, the JSON of the whole reply encoded at once (orjson and the
  standard library alike);
- on a real server, both databases: the reply comes chunked, its cells are the stored float32 values,
  and the server answers ``/api/health`` while a heatmap is half sent.
"""
from __future__ import annotations

import base64
import http.client
import json
import math
import uuid

import numpy as np
import orjson
import pytest
from starlette.responses import JSONResponse

from gradwatch.server.api.layer_matrix_json import BLOCK_CELLS, layer_matrix_json
from gradwatch.server.wire.numbers import NULL_F32_BITS, encode_float
from gradwatch.server.queries import LayerMatrix
from gradwatch.server.queries.layers import _bits_of, _finish_matrix, _matrix, _raw_cells, _reduce_columns
from gradwatch.server.storage.rollups import _layer_bits, raw_layer_partials

AGGS = ("max", "min", "mean", "last")


def _bits(rng, rows: int, width: int) -> np.ndarray:
    """Stored layer arrays: uniform values with NaN, +Inf, -Inf and "not measured" sprinkled in."""
    vals = rng.uniform(-2.0, 2.0, size=(rows, width)).astype("<f4")
    pick = rng.random((rows, width))
    vals[pick < 0.02] = np.nan
    vals[(pick >= 0.02) & (pick < 0.03)] = np.inf
    vals[(pick >= 0.03) & (pick < 0.04)] = -np.inf
    bits = vals.view("<u4").copy()
    bits[(pick >= 0.04) & (pick < 0.15)] = NULL_F32_BITS
    bits[rng.random(rows) < 0.05, width // 2:] = NULL_F32_BITS        # steps that measured half the layers
    return bits


def _same(a: LayerMatrix, b: LayerMatrix) -> None:
    assert (a.steps, a.layers, a.layer_group_size) == (b.steps, b.layers, b.layer_group_size)
    assert np.array_equal(a.measured, b.measured)
    assert np.array_equal(a.cells, b.cells, equal_nan=True)
    assert json.dumps(a.values) == json.dumps(b.values)       # NaN, inf and None where they were


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("rows,width,bucket,max_layers", [(3000, 100, 7, 100), (3000, 100, 1, 30), (40, 9, 3, 2)])
def test_raw_rows_give_the_cells_their_one_step_partials_gave(agg, rows, width, bucket, max_layers):
    rng = np.random.default_rng(rows + width + bucket)
    bits = _bits(rng, rows, width)
    steps = np.sort(rng.choice(np.arange(10 * rows), size=rows, replace=False)).astype(np.int64)  # gaps
    start = int(steps[0])
    cols = (steps - start) // bucket
    names = [f"layer{i}" for i in range(width)]
    direct = _matrix(1, "grad_norm", 0, agg, names, cols, _raw_cells(bits, steps, cols, agg), start, bucket,
                     max_layers)
    last_step, arr = raw_layer_partials(steps, [row.tobytes() for row in bits], width)
    via_partials = _finish_matrix(1, "grad_norm", 0, agg, names, cols, last_step, arr, start, bucket, max_layers)
    _same(direct, via_partials)
    assert direct.measured.any() and np.isnan(direct.cells[direct.measured]).any()


@pytest.mark.parametrize("ufunc,dtype", [(np.fmax, None), (np.add, np.int32), (np.maximum, None)])
def test_reduceat_a_block_of_columns_at_a_time_equals_one_call(ufunc, dtype):
    rng = np.random.default_rng(5)
    a = rng.uniform(size=(5000, 60)).astype("<f4")
    a[rng.random(a.shape) < 0.05] = np.nan
    if dtype is not None:
        a = a > 0.5
    starts = np.flatnonzero(np.r_[True, rng.random(4999) < 0.3])         # columns of 1 to ~15 rows
    one_call = ufunc.reduceat(a, starts, axis=0, dtype=dtype)
    blocked = _reduce_columns(ufunc, a, starts, dtype=dtype)             # 250,000 values a block: 2 blocks
    assert blocked.shape == one_call.shape and np.array_equal(blocked, one_call, equal_nan=dtype is None)


def test_layer_arrays_copied_a_block_at_a_time_equal_one_join():
    rng = np.random.default_rng(9)
    bits = _bits(rng, 9000, 12)                                      # three blocks of 4,096 rows
    blobs = [row.tobytes() for row in bits]
    assert np.array_equal(_bits_of(blobs, 12), _layer_bits(blobs, 12))
    assert np.array_equal(_bits_of(blobs, 12), bits)
    ragged = blobs[:100] + [blobs[100][:20]] + blobs[101:200]        # a step that sent 5 of the 12 layers
    assert np.array_equal(_bits_of(ragged, 12), _layer_bits(ragged, 12))


def _matrix_of(rng, rows: int, columns: int) -> LayerMatrix:
    cells = rng.standard_normal((rows, columns)) * 10.0 ** rng.integers(-30, 30, size=(rows, columns))
    pick = rng.random((rows, columns))
    cells[pick < 0.03] = np.nan
    cells[(pick >= 0.03) & (pick < 0.05)] = np.inf
    cells[(pick >= 0.05) & (pick < 0.06)] = -np.inf
    measured = pick >= 0.01
    cells[~measured] = np.nan
    return LayerMatrix(run_id=7, stat="grad_norm", rank=0, agg="max", bucket_size=3, layer_group_size=1,
                       steps=list(range(0, 3 * columns, 3)), layers=[f"blocks.{i}.w ü" for i in range(rows)],
                       cells=cells, measured=measured)


def _whole_reply(m: LayerMatrix) -> dict:
    """What the route answered before it streamed: one dict, every cell a Python float or wire string."""
    return {"run_id": m.run_id, "stat": m.stat, "rank": m.rank, "agg": m.agg, "bucket_size": m.bucket_size,
            "layer_group_size": m.layer_group_size, "steps": m.steps, "layers": m.layers,
            "values": [[encode_float(v) for v in row] for row in m.values]}


@pytest.mark.parametrize("rows,columns", [(150, 700), (3, BLOCK_CELLS + 5), (400, 2), (1, 1), (0, 0)])
def test_the_streamed_json_is_the_whole_reply_encoded_at_once(rows, columns):
    m = _matrix_of(np.random.default_rng(rows * 7 + columns), rows, columns)
    whole = _whole_reply(m)
    pieces = list(layer_matrix_json(m))
    assert b"".join(pieces) == orjson.dumps(whole)
    assert b"".join(layer_matrix_json(m, use_orjson=False)) == JSONResponse(whole).body   # without orjson
    if rows * columns > 2 * BLOCK_CELLS:
        assert len(pieces) > 3, "a large heatmap goes out in blocks"
    assert json.loads(b"".join(pieces))["values"] == json.loads(json.dumps(whole["values"]))


LAYERS, STEPS = 150, 3000


def _post_run(srv, values: np.ndarray, *, project: str) -> int:
    """A run whose ``grad_norm`` arrays are ``values`` (steps × layers, float32; NaN / ±Inf kept; the
    NULL_F32_BITS NaN is "not measured"), sent as the agent sends them."""
    names = [f"layer{i}.weight" for i in range(values.shape[1])]
    for first in range(0, len(values), 1000):
        steps = [{"step": i, "time": float(i), "loss": 1.0,
                  "layers": {"grad_norm": "f32:" + base64.b64encode(values[i].astype("<f4").tobytes()).decode()}}
                 for i in range(first, min(first + 1000, len(values)))]
        body = {"batch_id": uuid.uuid4().hex, "project": project, "run": "wide", "steps": steps}
        if first == 0:
            body["meta"] = {"param_names": names}
        st, out = srv.post("/api/v1/ingest", body, timeout=120)
        assert st == 200, out
    _, runs = srv.get(f"/api/v1/runs?project={project}")
    return runs["runs"][0]["id"]


def _wire(x: np.float32, measured: bool):
    if not measured:
        return None
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def test_the_streamed_heatmap_holds_the_stored_values(server_factory, db_url):
    srv = server_factory(db_url)
    rng = np.random.default_rng(11)
    bits = _bits(rng, 400, 40)
    run_id = _post_run(srv, bits.view("<f4"), project="stream")
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("GET", f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps=400&max_layers=40")
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type") == "application/json"
    assert resp.getheader("Transfer-Encoding") == "chunked" and resp.getheader("Content-Length") is None
    assert body["steps"] == list(range(400)) and body["bucket_size"] == 1 and body["layer_group_size"] == 1
    vals, measured = bits.view("<f4"), bits != NULL_F32_BITS
    expected = [[_wire(vals[s, layer], measured[s, layer]) for s in range(400)] for layer in range(40)]
    assert body["values"] == expected          # every cell the float32 that was stored, as a float

    # buckets of 10 steps, agg=max: NaN where a NaN was measured, else the largest value, null where none
    st, coarse = srv.get(f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps=40&max_layers=40&agg=max")
    assert st == 200 and coarse["bucket_size"] == 10
    for layer in (0, 7, 39):
        for col in range(40):
            v, m = vals[col * 10:col * 10 + 10, layer], measured[col * 10:col * 10 + 10, layer]
            want = (None if not m.any() else "NaN" if np.isnan(v[m]).any() else _wire(np.max(v[m]), True))
            assert coarse["values"][layer][col] == want, (layer, col)


def test_the_server_answers_health_while_a_heatmap_is_half_sent(server_factory, db_url):
    srv = server_factory(db_url)
    values = np.random.default_rng(3).uniform(0.01, 1.0, size=(STEPS, LAYERS)).astype("<f4")
    run_id = _post_run(srv, values, project="half")
    path = f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps={STEPS}&max_layers={LAYERS}"
    st, reference = srv.get(path, timeout=120)
    assert st == 200 and len(reference["values"]) == LAYERS

    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)   # 120 s: catches a hang only
    conn.request("GET", path)
    resp = conn.getresponse()
    first = resp.read(64 * 1024)            # a first part of ~9 MB of JSON; the rest waits in the server
    assert first.startswith(b'{"run_id":')
    assert srv.get("/api/health", timeout=60)[0] == 200
    st, out = srv.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": "half", "run": "other",
                                          "steps": [{"step": 0, "time": 1.0, "loss": 1.0}]})
    assert st == 200, out
    rest = resp.read()
    conn.close()
    assert json.loads(first + rest) == reference
