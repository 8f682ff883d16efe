"""Ranks side by side: rank × step matrices of step signals (GET /runs/{id}/rank-matrix,
queries.get_rank_matrix) and where each rank runs (GET /runs/{id}/ranks), on both databases."""
from __future__ import annotations

import time

from gw_payloads import batch, step

from gradwatch.server import queries
from gradwatch.server.db import open_database, upgrade
from gradwatch.server.ingest import ingest_batch
from gradwatch.server.schemas import IngestBatchIn
from gradwatch.server.settings import Settings


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
