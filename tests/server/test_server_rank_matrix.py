"""Ranks side by side: rank × step matrices of step signals (GET /runs/{id}/rank-matrix,
queries.get_rank_matrix) and where each rank runs (GET /runs/{id}/ranks), on both databases."""
from __future__ import annotations

import math
import time

import pytest

from gw_payloads import batch, step

from gradwatch.server import queries
from gradwatch.server.storage.db import open_database, upgrade
from gradwatch.server.ingest.write import ingest_batch
from gradwatch.server.storage.rollups import choose_level
from gradwatch.server.wire.schemas import IngestBatchIn
from gradwatch.server.operations.settings import Settings


def _rank_body(rank: int, steps: list[dict], world: int = 3, **over) -> dict:
    body = batch(steps, run="ranks", rank=rank, world_size=world, **over)
    body["meta"].update(host=f"node-{rank // 2}", local_rank=rank % 2, device=f"cuda:{rank % 2}", pid=100 + rank)
    return body


def test_rank_matrix_holds_every_ranks_values_and_ranks_say_where_they_run(live_server):
    srv = live_server
    for r in range(3):
        st, out = srv.post("/api/v1/ingest", _rank_body(r, [step(i, loss=1.0 + r + i / 100, step_time=0.1 * (r + 1))
                                                             for i in range(40)]))
        assert st == 200, out
    run_id = out["run_id"]
    st, m = srv.get(f"/api/v1/runs/{run_id}/rank-matrix?signals=loss&signals=step_time")
    assert st == 200, m
    loss, step_time = m["matrices"]
    assert loss["signal"] == "loss" and loss["ranks"] == [0, 1, 2] and loss["steps"] == list(range(40))
    for r in range(3):
        assert loss["last"][r] == [1.0 + r + i / 100 for i in range(40)]
        assert step_time["max"][r] == [0.1 * (r + 1)] * 40
    # a range, downsampled: columns are shared by every rank and keep each bucket's max
    st, m = srv.get(f"/api/v1/runs/{run_id}/rank-matrix?signals=loss&start=10&end=29&max_steps=4&ranks=2&ranks=0")
    assert st == 200, m
    one = m["matrices"][0]
    assert one["ranks"] == [2, 0] and one["bucket_size"] == 5 and one["steps"] == [10, 15, 20, 25]
    assert one["max"][0] == [3.0 + (s + 4) / 100 for s in (10, 15, 20, 25)]

    st, ranks = srv.get(f"/api/v1/runs/{run_id}/ranks")
    assert st == 200, ranks
    assert [(r["rank"], r["host"], r["local_rank"], r["device"], r["pid"]) for r in ranks["ranks"]] == [
        (0, "node-0", 0, "cuda:0", 100), (1, "node-0", 1, "cuda:1", 101), (2, "node-1", 0, "cuda:0", 102)]
    # bounded before any work: 10,000 ranks × 10,000 columns
    q = "&".join(f"ranks={r}" for r in range(200))
    st, err = srv.get(f"/api/v1/runs/{run_id}/rank-matrix?signals=loss&max_steps=10000&{q}")
    assert st == 422 and "1,000,000 cells" in err["detail"], err
    st, err = srv.get(f"/api/v1/runs/{run_id}/rank-matrix?signals=custom:acc")
    assert st == 422, err


def test_a_rank_matrix_that_would_read_too_much_gets_coarser_buckets(db_url, tmp_path):
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    try:
        with database.write_sessionmaker() as s:
            for r in range(4):
                for lo in range(0, 4096, 1024):
                    body = _rank_body(r, [step(i, loss=float(r)) for i in range(lo, lo + 1024)], world=4)
                    ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=settings, now=time.time(),
                                 evaluate_rules=False)
            s.commit()
        with database.sessionmaker() as s:
            run_id = queries.list_runs(s)[0].id
            full = queries.get_rank_matrix(s, run_id=run_id, signals=["loss"], max_steps=4096)[0]
            assert full.bucket_size == 1 and len(full.steps) == 4096 and full.ranks == [0, 1, 2, 3]
            # 4 ranks × 4096 raw rows is over this budget: the columns widen to a rollup level instead
            coarse = queries.get_rank_matrix(s, run_id=run_id, signals=["loss"], max_steps=4096,
                                             read_budget=4 * 4096 - 1)[0]
            assert coarse.bucket_size >= 16 and len(coarse.steps) <= 4096 // 16
            assert [row[0] for row in coarse.max] == [0.0, 1.0, 2.0, 3.0]
            meta = queries.rank_meta(s, run_id=run_id)
            assert meta["world_size"] == 4 and not meta["combined"]
            assert [r["host"] for r in meta["ranks"]] == ["node-0", "node-0", "node-1", "node-1"]
    finally:
        database.dispose()


def _value(rank: int, i: int):
    """A rank's loss at step i: mostly finite, some NaN and ±inf (as the wire spells them)."""
    k = (i * 7 + rank * 13) % 211
    if k == 0:
        return "NaN"
    if k == 1:
        return "Infinity" if rank % 2 else "-Infinity"
    return 1.0 + rank + ((i * 37 + rank) % 101) / 100


def _decoded(v):
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(v, v) if isinstance(v, str) else v


def _brute_cells(per_rank: dict[int, dict[int, object]], ranks, start0: int, bucket: int, steps: list[int]):
    """Each (rank, column) cell from the raw values: min / max over the non-NaN ones (NaN if all are NaN),
    the last measured one, how many are non-finite; None / 0 where the rank measured nothing."""
    out = {k: [] for k in ("min", "max", "last", "nonfinite")}
    for r in ranks:
        rows = {k: [] for k in out}
        for s in steps:
            vals = [(i, _decoded(v)) for i, v in sorted(per_rank[r].items()) if s <= i < s + bucket and v is not None]
            if not vals:
                for k in ("min", "max", "last"):
                    rows[k].append(None)
                rows["nonfinite"].append(0)
                continue
            real = [v for _, v in vals if not math.isnan(v)]
            rows["min"].append(min(real) if real else math.nan)
            rows["max"].append(max(real) if real else math.nan)
            rows["last"].append(vals[-1][1])
            rows["nonfinite"].append(sum(1 for _, v in vals if not math.isfinite(v)))
        for k in out:
            out[k].append(rows[k])
    return out


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == pytest.approx(b, rel=1e-6)      # partials store float32 values


def test_a_coarse_rank_matrix_equals_one_computed_from_the_raw_steps(db_url, tmp_path):
    """The rollup path (every rank's partials merged at once) against brute force over the raw values:
    non-finite values, a rank that went silent, a signal one rank did not measure for a while, ranks asked
    for out of order."""
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(database_url=db_url, data_dir=tmp_path)
    n, world = 2000, 4
    # rank 2 stops at 1200; rank 3 sends nothing from 1400 to 1799 (a range inside that gap has no partials)
    loss = {r: {i: _value(r, i) for i in range(1200 if r == 2 else n) if r != 3 or not 1400 <= i < 1800}
            for r in range(world)}
    step_time = {r: {i: (None if r == 1 and 300 <= i < 700 else 0.01 * (r + 1) + (i % 5) / 1000) for i in loss[r]}
                 for r in range(world)}
    try:
        with database.write_sessionmaker() as s:
            for r in range(world):
                for lo in range(0, n, 500):
                    steps = [step(i, loss=loss[r][i], step_time=step_time[r][i]) for i in range(lo, lo + 500)
                             if i in loss[r]]
                    if not steps:
                        continue
                    body = _rank_body(r, steps, world=world)
                    ingest_batch(s, batch=IngestBatchIn.model_validate(body), settings=settings, now=time.time(),
                                 evaluate_rules=False)
            s.commit()
        with database.sessionmaker() as s:
            run_id = queries.list_runs(s)[0].id
            for ranks, kw in ((None, {"max_steps": 60}), ([3, 0, 2, 1], {"max_steps": 25, "start": 130, "end": 1700}),
                              ([1], {"max_steps": 9}), ([3], {"max_steps": 5, "start": 1450, "end": 1750})):
                got = queries.get_rank_matrix(s, run_id=run_id, signals=["loss", "step_time"], ranks=ranks,
                                              read_budget=1000, **kw)
                asked = ranks or list(range(world))
                for m, raw in zip(got, (loss, step_time)):
                    assert m.ranks == asked and m.bucket_size >= 16, (m.bucket_size, kw)
                    b = m.bucket_size
                    lo = kw.get("start", 0)
                    hi = min(kw.get("end", n - 1), max(max(raw[r]) for r in asked))
                    # the rollup level the read used: the coarsest not above the asked bucket (within budget here)
                    level = choose_level(math.ceil((hi - lo + 1) / kw["max_steps"]))
                    assert level >= 16 and b == math.ceil((hi - lo + 1) / kw["max_steps"] / level) * level
                    start0 = (lo // level) * level
                    # the columns: every bucket some asked rank has a step in
                    cols = sorted({start0 + (i - start0) // b * b for r in asked for i in raw[r] if lo // level * level <= i
                                   and i // level <= hi // level})
                    assert m.steps == cols, kw
                    window = {r: {i: v for i, v in raw[r].items() if i // level >= lo // level and i // level <= hi // level}
                              for r in asked}
                    want = _brute_cells(window, asked, start0, b, cols)
                    for key in ("min", "max", "last", "nonfinite"):
                        for row, (g, w) in enumerate(zip(getattr(m, key), want[key])):
                            bad = [(c, x, y) for c, (x, y) in enumerate(zip(g, w)) if not _same(x, y)]
                            assert not bad, (m.signal, key, asked[row], kw, bad[:3])
    finally:
        database.dispose()
