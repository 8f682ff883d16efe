"""Retention (server/lifecycle/retention.py) on SQLite and the real PostgreSQL, through real servers.

A run's raw rows go and its charts still draw from the rollups it keeps, with the same values at the
rollup level: each chart is read before and after through the query functions the dashboard calls
(server/queries/, via dashboard/gateway/), and the loss series against the values the test sent.
Alerts, events and metadata survive; a run still receiving keeps its recent raw steps and goes on; in a
sharded run the ranks' own per-layer rows of combined steps go. The job runs inside ``gradwatch serve``.
"""
from __future__ import annotations

import json
import math
import random
import time

import pytest
from sqlalchemy import func, select

from gradwatch.server import queries
from gradwatch.server.storage.db import open_database
from gradwatch.server.lifecycle.retention_config import (LEVELS, RetentionConfigError, RetentionPolicy,
                                                         load_retention, parse_retention_toml, policy_from_env)
from gradwatch.server.storage.models import ROLLUP_LEVELS, Alert, LayerRollup, LayerStat, Run, RunEvent, Step
from tests.conftest import http_json, wait_until
from tests.lifecycle.lifecycle_data import fill_run
from tests.server.gw_payloads import N_PARAMS, batch, expected_bucket, step, wire

STEPS = 700            # 35 batches of 20 steps: several partials per rollup bucket, merged by retention


def _post(srv, body):
    status, out = http_json("POST", srv.url + "/api/v1/ingest", body)
    assert status == 200, out
    return out


def _send(srv, *, project: str, run: str, lo: int, hi: int, sent: dict) -> None:
    rnd = random.Random(lo)
    for a in range(lo, hi, 20):
        rows = []
        for i in range(a, min(a + 20, hi)):
            loss = 3.0 - i * 0.002 + rnd.uniform(-0.1, 0.1)
            if i in (130, 131, 402):
                loss = math.nan                      # NaN markers (and an A1 alert) must survive
            if i == 517:
                loss = math.inf
            layers = {"grad_norm": [rnd.uniform(0.1, 2.0) for _ in range(N_PARAMS)]}
            if i == 250:
                layers["grad_norm"][3] = math.nan
            if i % 100 == 0:
                layers["weight_norm"] = [rnd.uniform(1, 5) for _ in range(N_PARAMS)]
            s = step(i, loss=loss, layers={k: [wire(v) for v in vs] for k, vs in layers.items()})
            rows.append(s)
            sent[i] = loss
        _post(srv, batch(rows, project=project, run=run, events=[{"step": a, "kind": "test_event", "data": {}}]))


def _charts(db_url: str, run_id: int, *, start: int, end: int) -> dict:
    """What the run page draws, read as dashboard/gateway/ reads it, at rollup levels the policy keeps."""
    database = open_database(db_url)
    try:
        with database.sessionmaker() as s:
            run = queries.get_run(s, run_id=run_id, now=0).__dict__
            run["config"] = {k: v for k, v in run["config"].items() if k != "_retention"}   # what it lost: new
            out = {"run": run,
                   "stats": sorted(queries.list_layer_stats(s, run_id=run_id))}
            for sig in ("loss", "grad_norm", "lr", "loss_scale"):
                # 700 steps in 22 points: 32-step buckets, read from level 16
                ser = queries.get_series(s, run_id=run_id, signal=sig, start=start, end=end, max_points=22)
                out[sig] = (ser.bucket_size, [p.__dict__ for p in ser.points])
            for stat in ("grad_norm", "weight_norm"):
                for agg in ("max", "min", "mean", "last"):
                    m = queries.get_layer_matrix(s, run_id=run_id, stat=stat, start=start, end=end, max_steps=2,
                                                 agg=agg)
                    out[(stat, agg)] = (m.bucket_size, m.steps, m.values)
            rm = queries.get_rank_matrix(s, run_id=run_id, signals=["loss"], start=start, end=end, max_steps=22)
            out["rank_matrix"] = [(r.bucket_size, r.steps, r.min, r.max, r.last, r.nonfinite) for r in rm]
            out["alerts"] = sorted((a.rule, a.first_step, a.last_step) for a in queries.list_alerts(s, run_id=run_id))
            out["events"] = len(queries.list_events(s, run_id=run_id))
            return out
    finally:
        database.dispose()


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN (JSON writes both as NaN)."""
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _close(a, b, rel: float = 1e-6) -> bool:
    """``_same`` but floats within ``rel``: a merged partial stores a bucket's per-layer sum as one float32
    (server/storage/rollups.py), where the partials it replaces each stored theirs (the mean moves by ~1e-8)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel)
    return _same(a, b)


def _count(db_url: str, *where) -> int:
    database = open_database(db_url)
    try:
        with database.sessionmaker() as s:
            return s.scalar(select(func.count()).where(*where))
    finally:
        database.dispose()


def _metric(srv, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
               or line.startswith(name + " "))


def test_retention_compacts_old_runs_and_keeps_what_the_charts_draw(server_factory, db_url, tmp_path):
    srv = server_factory(db_url)
    sent_old: dict[int, float] = {}
    sent_live: dict[int, float] = {}
    _send(srv, project="archive", run="old", lo=0, hi=STEPS, sent=sent_old)
    _send(srv, project="team", run="live", lo=0, hi=STEPS, sent=sent_live)
    database = open_database(db_url)
    with database.sessionmaker() as s:
        runs = dict(s.execute(select(Run.name, Run.id)).all())
    database.dispose()
    old, live = runs["old"], runs["live"]
    before_old = _charts(db_url, old, start=0, end=STEPS - 1)
    before_live = _charts(db_url, live, start=0, end=STEPS - 1)
    assert before_old["alerts"], "the NaN losses raised an alert"
    srv.stop()

    policy = tmp_path / "retention.toml"
    policy.write_text("[projects.archive.retention]\nraw_days = 0\nlayer_level = 256\n"
                      "[projects.team.retention]\nraw_steps = 300\n")
    srv = server_factory(db_url, env={"GRADWATCH_RETENTION": str(policy), "GRADWATCH_RETENTION_INTERVAL": "0.5",
                                      "GRADWATCH_RETENTION_BATCH_ROWS": "50"})
    wait_until(lambda: _metric(srv, "gradwatch_retention_passes_total") >= 1, timeout=60, what="a retention pass")
    assert _metric(srv, "gradwatch_retention_rows_compacted_total") > 0
    assert _metric(srv, "gradwatch_retention_bytes_freed_estimate_total") > 0
    assert _metric(srv, "gradwatch_retention_runs_processed_total") == 2
    assert "retention: run" in srv.log()

    # the old run: every raw row of a whole 16-step bucket gone, so are its per-layer partials below 256
    assert _count(db_url, Step.run_id == old, Step.step < 688) == 0
    assert _count(db_url, LayerStat.run_id == old, LayerStat.step < 688) == 0
    assert _count(db_url, LayerRollup.run_id == old, LayerRollup.level == 16, LayerRollup.bucket < 688 // 16) == 0
    # at most one partial per kept bucket left (merged)
    database = open_database(db_url)
    with database.sessionmaker() as s:
        dup = s.execute(select(LayerRollup.stat, LayerRollup.level, LayerRollup.bucket, func.count())
                        .where(LayerRollup.run_id == old, LayerRollup.bucket * LayerRollup.level + LayerRollup.level
                               <= 688).group_by(LayerRollup.stat, LayerRollup.level, LayerRollup.bucket)
                        .having(func.count() > 1)).all()
        compact = [r for r in dup if r[0] == "weight_norm"]   # one-step partials kept apart where smaller
        assert not [r for r in dup if r not in compact], dup
    database.dispose()

    after_old = _charts(db_url, old, start=0, end=STEPS - 1)
    for key, value in before_old.items():
        assert (_close if "mean" in key else _same)(after_old[key], value), key
    assert _count(db_url, Alert.run_id == old) == len(before_old["alerts"])
    assert _count(db_url, RunEvent.run_id == old) == before_old["events"]
    # the loss, against what was sent (32-step buckets)
    bucket, points = after_old["loss"]
    assert bucket == 32
    for p in points:
        want = expected_bucket([(i, sent_old[i]) for i in range(p["step"], min(p["step"] + 32, STEPS))])
        assert (wire(p["min"]), wire(p["max"]), wire(p["last"]), p["count"], p["nonfinite"]) == want
    # the whole-run views a user opens still draw every point, from the rollups
    database = open_database(db_url)
    with database.sessionmaker() as s:
        whole = queries.get_series(s, run_id=old, signal="loss", max_points=2000)
        assert whole.bucket_size == 16 and whole.points[0].step == 0 and whole.points[-1].step == 688
        assert sum(p.count for p in whole.points) == STEPS and sum(p.nonfinite for p in whole.points) == 4
        heat = queries.get_layer_matrix(s, run_id=old, stat="grad_norm", max_steps=500)
        assert heat.bucket_size == 256 and heat.steps == [0, 256, 512]
        assert math.isnan(heat.values[3][0])            # the NaN layer at step 250
        run = s.get(Run, old)
        assert run.param_names == [f"p{k}.weight" for k in range(N_PARAMS)] and run.config["max_norm"] == 1.0
    database.dispose()

    # export writes steps, not buckets: the old run's raw tail only, from the database and from the server
    from gradwatch.server.commands.export import DatabaseSource, HttpSource, collect
    for source in (DatabaseSource(db_url), HttpSource(srv.url)):
        try:
            table = collect(source, source.find_run(str(old), None))
        finally:
            source.close()
        col = table.columns.index("loss")
        assert [r[0] for r in table.rows] == list(range(688, STEPS))
        assert [r[col] for r in table.rows] == pytest.approx([sent_old[i] for i in range(688, STEPS)])

    # steps re-sent under a new batch id after they were compacted are stored already (in the rollups):
    # skipped and counted as such, not rolled up a second time
    out = _post(srv, batch([step(i, loss=sent_old[i]) for i in range(0, 20)], project="archive", run="old"))
    assert out["already_stored"] == 20
    again = _charts(db_url, old, start=0, end=STEPS - 1)
    for key, value in after_old.items():
        # the charts (not the run's last_seen, its events — the skip is one — or alerts: the rules read
        # every step a batch carries, stored or not, as for any re-sent step)
        if key not in ("events", "run", "alerts"):
            assert _same(again[key], value), key
    assert (again["run"]["last_step"], again["run"]["last_loss"]) == (STEPS - 1, after_old["run"]["last_loss"])

    # the live run: only steps before its last 300 (on a 16-step edge) compacted; it goes on receiving
    assert _count(db_url, Step.run_id == live, Step.step < 400) == 0
    assert _count(db_url, Step.run_id == live, Step.step >= 400) == 300
    after_live = _charts(db_url, live, start=0, end=STEPS - 1)
    for key in ("loss", "grad_norm", "lr", "alerts", "events", "stats", "rank_matrix"):
        assert _same(after_live[key], before_live[key]), key
    _send(srv, project="team", run="live", lo=STEPS, hi=STEPS + 100, sent=sent_live)
    database = open_database(db_url)
    with database.sessionmaker() as s:
        tail = queries.get_series(s, run_id=live, signal="loss", since=STEPS - 1)
        assert [p.step for p in tail.points] == list(range(STEPS, STEPS + 100))
        zoom = queries.get_series(s, run_id=live, signal="loss", start=600, end=650)     # raw still there
        assert zoom.bucket_size == 1 and len(zoom.points) == 51
        old_part = queries.get_series(s, run_id=live, signal="loss", start=100, end=150)  # compacted: rollups
        assert old_part.bucket_size == 16 and sum(p.count for p in old_part.points) == 64
    database.dispose()


def test_sharded_ranks_layer_rows_go_once_combined(server_factory, db_url, tmp_path):
    srv = server_factory(db_url)
    run_id = fill_run(srv, project="fsdp", run="r", steps=60)
    database = open_database(db_url)
    with database.sessionmaker() as s:
        combined = set(s.scalars(select(Step.step).where(Step.run_id == run_id, Step.rank == -1)))
        stats = {r: sorted(queries.list_layer_stats(s, run_id=run_id, rank=r)) for r in (0, 1, -1)}
        before = {(r, st): queries.get_layer_matrix(s, run_id=run_id, stat=st, rank=r, start=0, end=47,
                                                    max_steps=3).values for r in (0, 1, -1) for st in stats[r]}
        rank_rows = s.scalar(select(func.count()).where(LayerStat.run_id == run_id, LayerStat.rank >= 0))
    database.dispose()
    assert combined == set(range(60)) and rank_rows > 0 and stats[0]
    srv.stop()
    srv = server_factory(db_url, env={"GRADWATCH_RETENTION_RANK_LAYER_STEPS": "10",
                                      "GRADWATCH_RETENTION_INTERVAL": "0.5"})
    wait_until(lambda: _metric(srv, "gradwatch_retention_passes_total") >= 1, timeout=60, what="a retention pass")
    # below step 48 (60 - 10, on a 16-step edge) the ranks' own layer rows are gone; the combined row's stay
    assert _count(db_url, LayerStat.run_id == run_id, LayerStat.rank >= 0, LayerStat.step < 48) == 0
    assert _count(db_url, LayerStat.run_id == run_id, LayerStat.rank >= 0, LayerStat.step >= 48) > 0
    assert _count(db_url, LayerStat.run_id == run_id, LayerStat.rank == -1) == 60 * len(stats[-1])
    assert _count(db_url, Step.run_id == run_id) == 3 * 60          # steps rows kept: no raw policy
    database = open_database(db_url)
    with database.sessionmaker() as s:
        for (r, st), values in before.items():
            assert queries.get_layer_matrix(s, run_id=run_id, stat=st, rank=r, start=0, end=47,
                                            max_steps=3).values == values, (r, st)   # no NaN sent
    database.dispose()


def test_policy_file_and_environment(tmp_path):
    assert LEVELS == ROLLUP_LEVELS
    c = parse_retention_toml('[retention]\nraw_days = 30\n[projects.p.retention]\nraw_steps = 5\n'
                             '[projects.keep.retention]\nraw_days = "forever"\n')
    assert c.policy_for("x") == RetentionPolicy(raw_days=30.0)
    assert c.policy_for("p") == RetentionPolicy(raw_days=30.0, raw_steps=5)
    assert not c.policy_for("keep").active
    for bad, says in (("[retention]\nraw_dayz = 1", "unknown setting"), ("[retention]\nlayer_level = 100", "one of"),
                      ("[retention]\nraw_steps = -1", "whole number"), ("[other]\n", "top-level"),
                      ("[retention]\nraw_days = true", "number of days")):
        with pytest.raises(RetentionConfigError, match=says):
            parse_retention_toml(bad)
    assert policy_from_env({"GRADWATCH_RETENTION_RAW_STEPS": "100", "GRADWATCH_RETENTION_LAYER_LEVEL": "256"}) == \
        RetentionPolicy(raw_steps=100, layer_level=256)
    f = tmp_path / "r.toml"
    f.write_text("[retention]\nraw_steps = 7\n")
    env = {"GRADWATCH_RETENTION": str(f), "GRADWATCH_RETENTION_RAW_DAYS": "2"}
    assert load_retention(env).policy_for("a") == RetentionPolicy(raw_steps=7, raw_days=2.0)
    time.sleep(0.01)
    f.write_text("[retention]\nraw_steps = 9\n")
    import os
    os.utime(f, (time.time() + 5, time.time() + 5))
    assert load_retention(env).policy_for("a").raw_steps == 9      # re-read when it changes


def test_a_bad_retention_file_stops_the_server_saying_where(server_factory, sqlite_url, tmp_path):
    bad = tmp_path / "retention.toml"
    bad.write_text("[projects.p.retention]\nraw_dayz = 3\n")
    with pytest.raises(AssertionError, match=r"projects\.p\.retention.*unknown setting 'raw_dayz'"):
        server_factory(sqlite_url, env={"GRADWATCH_RETENTION": str(bad)})
