"""Rank-aware alerts from real ``torchrun`` jobs (gloo, CPU, the agent attached) against a real server:
a poisoned rank (one A1 naming the rank that went first), a slowed rank (F3 naming rank and host), and
a silent rank (F4) driven through real HTTP ingest of per-rank batches."""
from __future__ import annotations

import socket
import statistics
import time
import uuid

import pytest

from tests.conftest import WebhookReceiver, http_json, wait_until
from tests.distributed.test_distributed import run_id, series, torchrun


def _alerts(srv, rid: int, rule: str = "") -> list[dict]:
    _, body = http_json("GET", f"{srv.url}/api/v1/alerts?run={rid}" + (f"&rule={rule}" if rule else ""))
    return body["alerts"]


@pytest.mark.slow
def test_a_poisoned_ddp_rank_is_one_critical_alert_naming_it(server_factory, db_url, tmp_path):
    """Rank 1's loss is NaN from step 10; the all-reduce makes every rank's grads (then weights, then
    losses) NaN from there. One A1, critical, led by rank 1 at step 10 and listing both ranks; what it
    causes (rank 0's grad explosion A2 at the same step, F1 on rank 1) is stored, suppressed by the A1,
    and not notified. Inhibition is decided when a group notifies: rank 0's batch may arrive before rank
    1's, so the routing waits half a second (group_wait) for the incident's alerts to come in; the
    notification names rank 1."""
    receiver = WebhookReceiver().start()
    try:
        routing = tmp_path / "routing.toml"
        routing.write_text('group_by = ["project", "run", "family"]\ngroup_wait = 0.5\ngroup_interval = 0.5\n'
                           'repeat_interval = 0\n')
        srv = server_factory(db_url, extra_args=["--webhook", receiver.url], env={"GRADWATCH_ROUTING": str(routing)})
        name = f"ddp-nan-{uuid.uuid4().hex[:6]}"
        torchrun("ddp", tmp_path / "run", nproc=2, server=srv, run=name,
                 extra=["--steps", "20", "--nan-rank", "1", "--nan-at", "10"])
        rid = run_id(srv, name)
        (a1,) = _alerts(srv, rid, "A1")
        assert (a1["rank"], a1["first_step"], a1["severity"]) == (1, 10, "critical"), a1
        assert a1["evidence"]["ranks"] == [0, 1] and a1["evidence"]["rank_first_steps"] == {"0": 11, "1": 10}
        assert "rank 1 first, at step 10" in a1["message"]
        critical = [a for a in _alerts(srv, rid) if a["severity"] == "critical"]
        assert all(a["rule"] == "A1" or a["suppressed_by"] == a1["id"] for a in critical), critical
        # if rank 0's batch came more than group_wait before rank 1's, notified once more when rank 1's
        # made it the lead
        wait_until(lambda: [b for b in receiver.bodies() if b["rule"] == "A1" and b["rank"] == 1],
                   timeout=10, what="the A1 notification naming rank 1")
        time.sleep(0.5)
        a1_bodies = [b for b in receiver.bodies() if b["rule"] == "A1"]
        # how soon after the alert (group_wait plus the worker's wake) is measured, not asserted here
        # (docs/performance.md, "Step → visible and NaN → webhook latency")
        assert a1_bodies[-1]["rank"] == 1 and a1_bodies[-1]["step"] == 10
        assert {b["rule"] for b in receiver.bodies()} == {"A1"}, receiver.bodies()
        assert a1_bodies[-1]["group"]["first"] == {"rank": 1, "step": 10, "rule": "A1"}
    finally:
        receiver.stop()


@pytest.mark.slow
def test_a_slowed_rank_is_a_straggler_naming_rank_and_host(server_factory, db_url, tmp_path):
    """Rank 1 sleeps 200 ms more per step (its data loader, say). With ranks that do not wait for each
    other every step (``local``: a process group, no per-step collective) its step time is several times
    the other's: one F3 on rank 1, naming this host. A healthy run of the same job: no F3.

    Why 200 ms: F3 needs 20 slow steps in a row, and a step of the fast rank that a loaded machine
    delays past 1.2x the slow one's breaks the streak. With 30 ms (as before), a fresh-clone run beside
    two CPU hogs and two other test suites (load 5-12 on 2 cores) saw no F3 at all; 200 ms is beyond
    the scheduling delays such a machine adds to a 20 ms step.

    Under DDP the same sleep shows on every rank: the all-reduce makes the fast rank wait for the slow
    one, so the ends of the steps, and the step times between them, are the same on both ranks. Each
    rank's ``data_time`` (previous step's end -> first forward) stays its own: F3 names rank 1 through
    it (docs/rules.md, F3), and a healthy DDP run of the same job raises none.

    What the timing causes is asserted, not its size (docs/testing.md, "No wall-clock thresholds"): the
    rank named, the rank that is late to its forward, the fast rank's step covering that lateness. How
    many milliseconds a loaded machine measures is printed."""
    srv = server_factory(db_url)
    host = socket.gethostname()
    slow = f"slow-{uuid.uuid4().hex[:6]}"
    torchrun("local", tmp_path / "slow", nproc=2, server=srv, run=slow,
             extra=["--steps", "50", "--base-s", "0.02", "--slow-rank", "1", "--slow-s", "0.2"])
    rid = run_id(srv, slow)
    (f3,) = _alerts(srv, rid, "F3")
    assert f3["rank"] == 1 and f3["evidence"]["host"] == host and f3["evidence"]["steps"] == 20, f3
    assert f"Rank 1 on host {host} is a straggler" in f3["message"], f3["message"]
    # what the sleep causes: rank 1's step time above the other rank's (by how much is the machine's)
    assert f3["evidence"]["step_time"] > f3["evidence"]["others_median"], f3

    healthy = f"healthy-{uuid.uuid4().hex[:6]}"
    torchrun("local", tmp_path / "healthy", nproc=2, server=srv, run=healthy, extra=["--steps", "40", "--base-s", "0.02"])
    assert _alerts(srv, run_id(srv, healthy), "F3") == []

    ddp = f"ddp-slow-{uuid.uuid4().hex[:6]}"
    torchrun("ddp", tmp_path / "ddp", nproc=2, server=srv, run=ddp,
             extra=["--steps", "50", "--slow-rank", "1", "--slow-s", "0.2"])
    rid = run_id(srv, ddp)
    t0, t1 = series(srv, rid, "step_time", 0), series(srv, rid, "step_time", 1)
    d0, d1 = series(srv, rid, "data_time", 0), series(srv, rid, "data_time", 1)
    steps = [s for s in t0 if s >= 5 and all(v.get(s) is not None for v in (t0, t1, d0, d1))]
    assert len(steps) >= 30, steps
    lateness = [d1[s] - d0[s] for s in steps]          # how much later rank 1 reaches its forward
    # rank 1 is the one that waits before its forward: later than rank 0 at most steps (the median's sign)
    assert statistics.median(lateness) > 0, lateness
    # and rank 0 waited for it at the all-reduce: its step time covers rank 1's lateness (without the
    # collective, as in the local run, rank 0's step would be shorter than rank 1's sleep)
    assert sum(t0[s] for s in steps) > sum(lateness), ([t0[s] for s in steps], lateness)
    print(f"\n[straggler:ddp] rank 1 later to its forward by median {1000 * statistics.median(lateness):.1f} ms "
          f"(sleeps 200 ms); step time rank 0 / rank 1: "
          f"{sum(t0[s] for s in steps) / sum(t1[s] for s in steps):.2f}")
    (f3,) = _alerts(srv, rid, "F3")
    assert f3["rank"] == 1 and f3["evidence"]["host"] == host, f3
    assert "reaches its forward" in f3["message"] and f"Rank 1 on host {host}" in f3["message"], f3["message"]
    # the data-time verdict, on rank 1's own lateness (its size is the machine's, printed)
    assert f3["evidence"]["data_time"] > f3["evidence"]["others_data_median"], f3
    print(f"[straggler:ddp] F3 evidence: excess {1000 * f3['evidence']['excess_s']:.1f} ms, "
          f"{f3['evidence']['ratio']:.2f}x the step time")

    ddp_healthy = f"ddp-healthy-{uuid.uuid4().hex[:6]}"
    torchrun("ddp", tmp_path / "ddp-healthy", nproc=2, server=srv, run=ddp_healthy, extra=["--steps", "40"])
    assert _alerts(srv, run_id(srv, ddp_healthy), "F3") == []


def _batch(name: str, rank: int, steps: range, *, world: int = 2) -> dict:
    return {"batch_id": uuid.uuid4().hex, "project": "default", "run": name, "rank": rank, "world_size": world,
            "meta": {"param_names": ["w"], "host": f"node-{rank}", "pid": 1000 + rank},
            "steps": [{"step": s, "time": 1_700_000_000.0 + 0.1 * s, "loss": 1.0, "grad_norm": 0.5,
                       "step_time": 0.1} for s in steps]}


def test_a_silent_rank_raises_f4_and_resolves_when_it_catches_up(server_factory, db_url, tmp_path):
    """Driven through real HTTP ingest of per-rank batches, not torchrun: under torchrun the other ranks
    would block at the next collective as soon as one rank stops, so "the others go on" cannot be staged
    there without the job hanging. Two ranks send steps 0-49; rank 1 then sends nothing while rank 0
    sends up to step 399: the server's timer scan (the webhook worker, every few seconds: nothing of
    rank 1 arrives to be evaluated) raises one F4 naming rank 1 and its host, notified; rank 1 sending
    again up to where rank 0 is resolves it."""
    receiver = WebhookReceiver().start()
    try:
        rules = tmp_path / "rules.toml"
        rules.write_text('[rules.F4]\nsteps_behind = 100\ntimeout_s = 1.0\n')
        srv = server_factory(db_url, extra_args=["--webhook", receiver.url],
                             env={"GRADWATCH_RULES": str(rules)})
        name = f"silent-{uuid.uuid4().hex[:6]}"
        for rank in range(2):
            assert http_json("POST", f"{srv.url}/api/v1/ingest", _batch(name, rank, range(0, 50)))[0] == 200
        assert http_json("POST", f"{srv.url}/api/v1/ingest", _batch(name, 0, range(50, 400)))[0] == 200
        rid = run_id(srv, name)
        (f4,) = wait_until(lambda: _alerts(srv, rid, "F4"), timeout=15, what="F4 from the timer scan")
        assert (f4["rank"], f4["severity"], f4["status"]) == (1, "critical", "firing"), f4
        assert f4["evidence"]["host"] == "node-1" and f4["evidence"]["ranks"] == [1]
        hit = receiver.wait_for(lambda r: r.json()["rule"] == "F4", timeout=10)
        assert hit.json()["rank"] == 1 and "node-1" in hit.json()["message"]
        assert http_json("POST", f"{srv.url}/api/v1/ingest", _batch(name, 1, range(50, 400)))[0] == 200
        assert [a["status"] for a in _alerts(srv, rid, "F4")] == ["resolved"]
        time.sleep(3.0)                           # a scan or two later: not raised again
        assert len(_alerts(srv, rid, "F4")) == 1
    finally:
        receiver.stop()
