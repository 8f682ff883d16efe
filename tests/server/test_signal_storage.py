"""Step signals declared after the first 14 (agent/signals.py) are stored by id in ``steps.extra`` and in
the rollups' id columns: they round-trip through a real server like the column signals, and rows written
before a signal existed (older rollup partials, one column narrower; steps without ``extra``) stay readable,
on both databases."""
from __future__ import annotations

import math
import random

import numpy as np
from alembic import command
from gw_payloads import batch, expected_bucket, step, wire
from sqlalchemy import create_engine, text

from gradwatch.agent.signals import COLUMN_SIGNALS, EXTRA_SIGNALS, ROLLUP_WIDTH, step_signal
from gradwatch.server import queries
from gradwatch.server.storage.db import alembic_config, open_database, upgrade
from gradwatch.server.storage.models import StepRollup
from gradwatch.server.storage.rollups import step_partials

N = 2000
SIGNAL = EXTRA_SIGNALS[0].name     # the first signal without a column of its own


def value_at(i):
    if i == 777:
        return 5.0            # a spike
    if i in (900, 901):
        return math.nan
    if i == 1200:
        return -math.inf
    if i % 10 or 1500 <= i < 1600:
        return None           # sampled every 10 steps, and a gap
    return 0.01 * (i % 17)


def _points(srv, run_id, query):
    st, s = srv.get(f"/api/v1/runs/{run_id}/series?signal={SIGNAL}&{query}")
    assert st == 200, s
    return s["bucket_size"], [(p["step"], p["min"], p["max"], p["last"], p["count"], p["nonfinite"])
                              for p in s["steps"]]


def test_a_signal_without_a_column_round_trips_raw_bucketed_and_rolled_up(live_server):
    assert not step_signal(SIGNAL).column
    srv = live_server
    batches = []
    for lo in range(0, N, 200):
        steps = [step(i, **({} if value_at(i) is None else {SIGNAL: wire(value_at(i))})) for i in range(lo, lo + 200)]
        batches.append(batch(steps, run="extra"))
    random.Random(3).shuffle(batches)
    for b in batches:
        st, body = srv.post("/api/v1/ingest", b)
        assert st == 200, body
        run_id = body["run_id"]
    for query, level in (("start=700&end=799&max_points=200", None),    # raw
                         ("start=0&end=999&max_points=200", None),      # buckets of 5: below the first rollup level
                         ("max_points=100", 16), ("max_points=3", 256)):  # rollups
        bs, got = _points(srv, run_id, query)
        params = dict(kv.split("=") for kv in query.split("&"))
        lo, hi = int(params.get("start", 0)), int(params.get("end", N - 1))
        if level:
            assert bs % level == 0
        exp = [(first, *expected_bucket([(i, value_at(i)) for i in range(first, min(first + bs, hi + 1))]))
               for first in range(lo, hi + 1, bs)]
        assert got == exp, query
    # the column signals beside it are untouched, and the live tail carries the new signal
    st, s = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=100")
    assert sum(p["count"] for p in s["steps"]) == N
    bs, tail = _points(srv, run_id, "since=1979")
    assert [p[0] for p in tail] == list(range(1980, N)) and tail[0][3] == wire(value_at(1980))


def test_rows_written_before_a_signal_existed_stay_readable(db_url):
    """Migrate to 0004 (before ``steps.extra``), write a run's rows as that schema had them, upgrade to the
    head, add rollup partials one column narrower than today's (as written before the newest signal was
    declared) beside today's, then read every signal through the query layer."""
    cfg = alembic_config(db_url)
    command.upgrade(cfg, "0004")
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', 0)"))
        conn.execute(text("INSERT INTO runs (id, project_id, name, status, started_at, last_seen, last_step, "
                          "last_loss_nan, world_size, param_names, module_names, bn_names, config) VALUES "
                          "(1, 1, 'old', 'finished', 0, 0, 63, false, 1, '[]', '[]', '[]', '{}')"))
        for i in range(32):
            conn.execute(text("INSERT INTO steps (run_id, rank, step, time, loss, nan_mask) "
                              "VALUES (1, 0, :i, 0, :loss, 0)"), {"i": i, "loss": float(i)})
    engine.dispose()
    upgrade(db_url)
    database = open_database(db_url)
    try:
        with database.write_sessionmaker() as s:
            # steps 0..31: partials as an older server wrote them (no column for the extra signal);
            # steps 32..63: today's width, with the extra signal measured
            for lo, width in ((0, ROLLUP_WIDTH - 1), (32, ROLLUP_WIDTH)):
                steps = np.arange(lo, lo + 32)
                vals = np.full((32, width), np.nan)
                vals[:, 0] = steps
                if width == ROLLUP_WIDTH:
                    vals[:, step_signal(SIGNAL).id] = 0.5
                for level, b, blob in step_partials(steps, vals, ~np.isnan(vals)):
                    s.add(StepRollup(run_id=1, rank=0, level=level, bucket=b, data=blob))
            s.execute(text("INSERT INTO steps (run_id, rank, step, time, loss, nan_mask, extra) "
                           "VALUES (1, 0, :i, 0, :loss, 0, :extra)"),
                      [{"i": i, "loss": float(i), "extra": np.array([0.5], "<f8").tobytes()} for i in range(32, 64)])
            s.commit()
        with database.sessionmaker() as s:
            loss = queries.get_series(s, run_id=1, signal="loss", max_points=2)      # buckets of 32: rollups
            assert loss.bucket_size == 32
            assert [(p.min, p.max, p.count) for p in loss.points] == [(0.0, 31.0, 32), (32.0, 63.0, 32)]
            new = queries.get_series(s, run_id=1, signal=SIGNAL, max_points=2)
            assert [(p.step, p.count, p.last) for p in new.points] == [(0, 0, None), (32, 32, 0.5)]
            raw = queries.get_series(s, run_id=1, signal=SIGNAL, max_points=100)    # raw rows, both kinds
            assert [p.count for p in raw.points] == [0] * 32 + [1] * 32
            for sig in COLUMN_SIGNALS[1:]:          # never sent: not measured, from either width
                assert all(p.count == 0 for p in queries.get_series(s, run_id=1, signal=sig.name, max_points=2).points)
    finally:
        database.dispose()
