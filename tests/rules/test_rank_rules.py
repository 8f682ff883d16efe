"""Rank-aware rules through the real ingest path, on both databases: F3 straggler, F4 rank_silent (the
timer scan), and one alert per incident across ranks (A1 led by the rank that went first, whatever
order the ranks' batches arrive in)."""
from __future__ import annotations

import itertools
import math
import random
import time

import pytest

from gradwatch.server.rules.engine import scan_timer_rules
from tests.rules.conftest import RulesDB, run_name, step

HOSTS = {0: "node-a", 1: "node-b", 2: "node-c"}


@pytest.fixture
def rdb_any(db_url, tmp_path):
    r = RulesDB(db_url, tmp_path)
    yield r
    r.close()


def _meta(rank: int) -> dict:
    return {"param_names": ["w"], "host": HOSTS[rank], "pid": 100 + rank}


def _timed(n: int, rank: int, *, slow_rank: int = -1, slow_from: int = 10**9, factor: float = 1.3,
           seed: int = 0) -> list[dict]:
    """Steps with step_time ~0.1 s +-4 % noise; ``slow_rank`` takes ``factor`` x as long from ``slow_from``."""
    rng = random.Random(seed * 100 + rank)
    out = []
    for i in range(n):
        t = 0.1 * (1 + rng.uniform(-0.04, 0.04))
        if rank == slow_rank and i >= slow_from:
            t *= factor
        out.append(step(i, loss=1.0, step_time=None if i == 0 else t))
    return out


def _f3(rdb, name):
    return [a for a in rdb.alerts(name) if a.rule == "F3"]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3)))[::2])
def test_f3_names_the_slow_rank_and_its_host_whatever_the_order(rdb_any, order):
    """Rank 1 takes 1.3x the others' step time from step 30: F3 fires on rank 1 at its 20th slow step
    (49), naming node-b, once per incident; the ranks' batches arrive in any order and cut anywhere."""
    name = run_name()
    for k, rank in enumerate(order):
        rdb_any.feed(name, _timed(120, rank, slow_rank=1, slow_from=30), rank=rank, world_size=3,
                     meta=_meta(rank), batch=(7, 50, 33)[k])
    (f3,) = _f3(rdb_any, name)
    assert (f3.rank, f3.first_step, f3.severity, f3.status) == (1, 49, "warning", "firing")
    assert f3.evidence["host"] == "node-b" and f3.evidence["steps"] == 20
    assert 1.2 < f3.evidence["ratio"] < 1.45
    assert "Rank 1 on host node-b is a straggler" in f3.message


def test_f3_quiet_on_a_healthy_run_and_thresholds_are_settings(db_url, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[rules.F3]\nfactor = 1.5\nconsecutive = 10\n')
    strict = RulesDB(db_url, tmp_path, rules_file=str(rules))
    plain = RulesDB(db_url, tmp_path)
    try:
        healthy = run_name()
        for rank in range(3):
            plain.feed(healthy, _timed(200, rank, seed=3), rank=rank, world_size=3, meta=_meta(rank))
        assert not _f3(plain, healthy)
        # 1.3x is below a factor of 1.5: nothing; 1.6x for 10 steps is enough under these settings
        for factor, expect in ((1.3, []), (1.6, [(2, 39)])):
            name = run_name()
            for rank in range(3):
                strict.feed(name, _timed(100, rank, slow_rank=2, slow_from=30, factor=factor), rank=rank,
                            world_size=3, meta=_meta(rank))
            assert [(a.rank, a.first_step) for a in _f3(strict, name)] == expect
    finally:
        strict.close()
        plain.close()


def test_f3_resolves_when_the_rank_keeps_up_again(rdb_any):
    name = run_name()
    for rank in range(2):
        steps = _timed(150, rank, slow_rank=0, slow_from=20)
        for s in steps[60:]:                       # rank 0 back to normal from step 60
            if s["step_time"] is not None and rank == 0:
                s["step_time"] /= 1.3
        rdb_any.feed(name, steps, rank=rank, world_size=2, meta=_meta(rank))
    (f3,) = _f3(rdb_any, name)
    assert (f3.rank, f3.first_step, f3.status) == (0, 39, "resolved")


def _silent_scan(rdb, now):
    with rdb.db.write_sessionmaker() as s, s.begin():
        return [(a.rule, a.rank) for a in scan_timer_rules(s, settings=rdb.settings, now=now)]


def test_f4_a_rank_that_stops_sending_is_named_and_resolves_when_it_catches_up(rdb_any):
    """Two ranks send steps 0-49; then rank 1 sends nothing while rank 0 goes on to step 299: the scan
    (which cannot rely on rank 1's batches: there are none) raises one F4 naming rank 1 and its host;
    rank 1's data coming back resolves it once it is no longer behind."""
    name = run_name()
    now = time.time()
    for rank in range(2):
        rdb_any.feed(name, [step(i, loss=1.0) for i in range(50)], rank=rank, world_size=2, meta=_meta(rank),
                     now=now)
    assert _silent_scan(rdb_any, now) == []
    rdb_any.feed(name, [step(i, loss=1.0) for i in range(50, 300)], rank=0, world_size=2, now=now + 1)
    assert _silent_scan(rdb_any, now + 2) == [("F4", 1)]
    assert _silent_scan(rdb_any, now + 3) == []            # still firing: not raised twice
    (f4,) = [a for a in rdb_any.alerts(name) if a.rule == "F4"]
    assert (f4.rank, f4.severity, f4.status, f4.first_step) == (1, "critical", "firing", 49)
    assert f4.evidence["host"] == "node-b" and f4.evidence["ranks"] == [1]
    assert f4.evidence["silent_ranks"][0]["steps_behind"] == 250
    # rank 0's data does not resolve it; rank 1 back but still far behind does not either
    rdb_any.feed(name, [step(i, loss=1.0) for i in range(300, 320)], rank=0, world_size=2, now=now + 4)
    rdb_any.feed(name, [step(i, loss=1.0) for i in range(50, 60)], rank=1, world_size=2, now=now + 5)
    assert [a.status for a in rdb_any.alerts(name) if a.rule == "F4"] == ["firing"]
    rdb_any.feed(name, [step(i, loss=1.0) for i in range(60, 320)], rank=1, world_size=2, now=now + 6)
    assert [a.status for a in rdb_any.alerts(name) if a.rule == "F4"] == ["resolved"]
    assert _silent_scan(rdb_any, now + 7) == []


def test_f4_by_time_and_not_on_a_whole_run_gone_quiet(db_url, tmp_path):
    """``timeout_s``: a rank whose last step is that many seconds (the agents' clocks) behind the others'
    fires though few steps behind; a run whose every rank stopped together is F2's, not F4's."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[rules.F4]\ntimeout_s = 2.0\nsteps_behind = 1000\n')
    r = RulesDB(db_url, tmp_path, rules_file=str(rules))
    try:
        name = run_name()
        now = time.time()
        slow = [{"step": i, "time": 1_700_000_000.0 + i, "loss": 1.0} for i in range(5)]   # 1 s a step
        r.feed(name, slow, rank=0, world_size=2, meta=_meta(0), now=now)
        r.feed(name, slow[:2], rank=1, world_size=2, meta=_meta(1), now=now)
        assert _silent_scan(r, now + 1) == [("F4", 1)]
        together = run_name()
        for rank in range(2):
            r.feed(together, slow, rank=rank, world_size=2, meta=_meta(rank), now=now)
        # 600 s later: both runs are quiet as a whole, which F2 says (each once); no F4 for them
        assert _silent_scan(r, now + 600) == [("F2", 0), ("F2", 0)]
    finally:
        r.close()


def _nan_steps(rank: int, first_nan: int, n: int = 80) -> list[dict]:
    out = []
    for i in range(n):
        nan = first_nan <= i < 60
        out.append(step(i, loss=math.nan if nan else 1.0 + 0.01 * (i % 3),
                        grad_norm=math.nan if nan else 0.5 + 0.01 * (i % 4)))
    return out


@pytest.mark.parametrize("poisoned_last", [False, True])
def test_a1_on_four_ranks_is_one_alert_led_by_the_rank_that_went_first(db_url, tmp_path, poisoned_last):
    """Rank 2's loss is NaN from step 40, every other rank's from 41 (the all-reduce spread it): one A1,
    listing the four ranks, led by rank 2 at step 40 — also when rank 2's batch arrives last, in which
    case the alert is notified again with the right lead."""
    # a server-wide endpoint, so that what is notified is counted (nothing is delivered in this test)
    rdb_any = RulesDB(db_url, tmp_path, webhook_urls=("http://127.0.0.1:9/hook",))
    name = run_name()
    order = [0, 1, 3, 2] if poisoned_last else [2, 0, 1, 3]
    notified = []
    for rank in order:
        out = rdb_any.feed(name, _nan_steps(rank, 40 if rank == 2 else 41), rank=rank, world_size=4, batch=80)
        notified.append(out[0])
    alerts = rdb_any.alerts(name)
    rdb_any.close()
    (a1,) = [a for a in alerts if a.rule == "A1"]
    assert (a1.rank, a1.first_step, a1.severity, a1.status) == (2, 40, "critical", "resolved")
    assert a1.evidence["ranks"] == [0, 1, 2, 3] and a1.evidence["first_rank"] == 2
    assert a1.evidence["rank_first_steps"] == {"0": 41, "1": 41, "2": 40, "3": 41}
    assert a1.message.endswith("(ranks 0, 1, 2, 3; rank 2 first, at step 40)")
    # the first batch notifies; a late first rank notifies once more (the lead changed)
    assert notified[0] >= 1 and sum(notified[1:3]) == 0
    assert (notified[3] >= 1) == poisoned_last


def test_a_straggler_inhibits_the_rank_divergence_it_explains(rdb_any):
    """The default inhibition F3 -> F1 (same run and rank, within 50 steps): rank 1 is slow from step 10
    (F3 at 29, once all three ranks sent steps 0-49) and its loss 4x the others' from step 60 (F1 at 64):
    the F1 is stored, suppressed by the F3. (Inhibition is decided when an alert is notified: an F1 raised
    before the F3 exists is held back only within a route's group_wait, docs/webhooks.md.)"""
    name = run_name()
    runs = {}
    for rank in range(3):
        runs[rank] = _timed(100, rank, slow_rank=1, slow_from=10)
        if rank == 1:
            for s in runs[rank][60:]:
                s["loss"] = 4.0
    for lo, hi in ((0, 50), (50, 100)):
        for rank in range(3):
            rdb_any.feed(name, runs[rank][lo:hi], rank=rank, world_size=3, meta=_meta(rank) if lo == 0 else None)
    by_rule = {a.rule: a for a in rdb_any.alerts(name)}
    f3, f1 = by_rule["F3"], by_rule["F1"]
    assert (f3.rank, f3.first_step, f1.rank, f1.first_step) == (1, 29, 1, 64)
    assert f1.suppressed_by == f3.id and f3.suppressed_by is None


def test_without_a_warmup_window_no_rank_is_muted_by_a_racing_clock(db_url, tmp_path):
    """Two ranks' first batches of a new run race: the run row is created by rank 0's transaction (its
    ``started_at``), while rank 1's batch read the clock a millisecond earlier, before it waited for the
    run's row lock. With no warm-up window configured nothing is muted, whatever the order of the clock
    readings: rank 1's A1 was muted "warm-up" for good here (a PostgreSQL CI run), so it was never
    notified."""
    rdb = RulesDB(db_url, tmp_path, webhook_urls=("http://127.0.0.1:9/hook",))
    name = run_name()
    t = time.time()
    rdb.feed(name, [step(i) for i in range(5)], rank=0, world_size=2, now=t)
    notified = rdb.feed(name, [step(i, loss=math.nan if i >= 3 else 1.0) for i in range(5)], rank=1,
                        world_size=2, now=t - 0.001)
    (a1,) = [a for a in rdb.alerts(name) if a.rule == "A1"]
    rdb.close()
    assert a1.rank == 1 and a1.muted is None and a1.suppressed_by is None, (a1.muted, a1.suppressed_by)
    assert notified == [1]


@pytest.mark.parametrize("excursion, expect", [(4, []), (5, [(2, 24)])])
def test_f1_counts_each_step_once_whatever_the_number_of_ranks(rdb_any, excursion, expect):
    """Four ranks, one-step batches arriving round-robin (the agents' cadence on a slow loop): rank 2's
    loss is 4x the others' for ``excursion`` steps from step 20. F1 needs 5 consecutive steps: a step is
    judged once, when its last rank arrives, so 4 steps stay quiet and 5 fire at the fifth (24). Judged
    on every batch, each step counted up to three times and 4 steps fired at step 21."""
    name = run_name()
    for i in range(40):
        for rank in (3, 2, 0, 1):
            loss = 4.0 if rank == 2 and 20 <= i < 20 + excursion else 1.0 + 0.01 * rank
            rdb_any.feed(name, [step(i, loss=loss)], rank=rank, world_size=4,
                         meta={"param_names": ["w"]} if i == 0 else None)
    assert [(a.rank, a.first_step) for a in rdb_any.alerts(name) if a.rule == "F1"] == expect
