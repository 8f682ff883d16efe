"""The ingest reply's ``pace`` follows the measured hold of the run's lock (server/ingest/pacing.py), on both
databases: a real server, real batches of one rank of a large run."""
from __future__ import annotations

import re
import urllib.request

from gw_payloads import batch, step
from sqlalchemy import create_engine, text

from gradwatch.agent.pacing import FIRST_HOLD_FACTOR
from gradwatch.server.ingest.pacing import (LEAST_HOLD_S, MAX_PACE_S, RUN_BATCHES_PER_S, RUN_LOCK_SHARE, YOUNG_RUN_S,
                                     rank_pace)


def _lock_hold(srv, figure: str = "paced") -> float:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r'^gradwatch_ingest_lock_hold_seconds\{figure="%s"\} (\S+)$' % figure, text, re.M).group(1))


def test_the_pace_of_a_large_runs_ranks_is_the_one_the_measured_lock_hold_gives(live_server):
    srv = live_server
    initial = _lock_hold(srv, "average")
    assert initial == _lock_hold(srv) == RUN_LOCK_SHARE / RUN_BATCHES_PER_S
    paces, holds = [], []
    for b in range(6):
        # 20 steps with 150-layer stats: a batch of real weight, as a paced rank sends
        steps = [step(b * 20 + i, loss=1.0 + i / 100, layers={"grad_norm": [0.1] * 150}) for i in range(20)]
        st, out = srv.post("/api/v1/ingest", batch(steps, run="big", rank=7, world_size=4096))
        assert st == 200, out
        paces.append(out["pace"])
        holds.append(_lock_hold(srv))      # nothing else writes to this server: the hold the reply used
    assert _lock_hold(srv, "average") != initial, "the ingest transactions' lock hold was never measured"
    assert paces == [rank_pace(4096, 7, hold_s=h) for h in holds]
    assert all(p == MAX_PACE_S for p in paces), paces       # 4096 ranks: the longest pace at any hold
    # rank 0 and a single-process run are never paced
    st, out = srv.post("/api/v1/ingest", batch([step(0)], run="big", rank=0, world_size=4096))
    assert st == 200 and out["pace"] == 0.0, out
    st, out = srv.post("/api/v1/ingest", batch([step(0)], run="solo"))
    assert st == 200 and out["pace"] == 0.0, out
    # a young 64-rank run (its first batch just now): at least the pace of batches FIRST_HOLD_FACTOR times
    # as dear as the least, whatever the measured hold (server/ingest/pacing.py, YOUNG_RUN_S)
    st, out = srv.post("/api/v1/ingest", batch([step(0)], run="mid", rank=5, world_size=64))
    assert st == 200, out
    floor = rank_pace(64, 5, hold_s=FIRST_HOLD_FACTOR * LEAST_HOLD_S)
    assert out["pace"] == max(rank_pace(64, 5, hold_s=_lock_hold(srv)), floor) and floor == 2.0, out
    # the same run once it is older (its start moved back in the database): what the measured hold gives,
    # at least the 128-batches-a-second one
    engine = create_engine(srv.db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE runs SET started_at = started_at - :s WHERE name = 'mid'"),
                         {"s": YOUNG_RUN_S + 1})
    finally:
        engine.dispose()
    st, out = srv.post("/api/v1/ingest", batch([step(1)], run="mid", rank=5, world_size=64))
    assert st == 200, out
    assert out["pace"] == rank_pace(64, 5, hold_s=_lock_hold(srv)) >= 64 / RUN_BATCHES_PER_S
