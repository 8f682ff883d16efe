"""Distributed runs, end to end: real ``torchrun`` jobs (gloo, CPU) against a real server.

Each rank of ``worker.py`` records PyTorch's own numbers (the loss, what clipping returned, the full
parameters' grad norms, weight norms and update ratios, the activation statistics) in its own JSON
file; every stored number is read back through the API and compared with them. Nothing is mocked.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import REPO_ROOT, http_json, start_sqlite_server

WORKER = Path(__file__).with_name("worker.py")
REL = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("dist-server"))
    yield srv
    srv.stop()


def torchrun(mode: str, out: Path, *, nproc: int = 2, server=None, run: str = "", extra=(), timeout: int = 300,
             worker: Path = WORKER):
    """Run ``worker.py`` (or ``worker``) under torchrun; returns every rank's record (rank order)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), mode, str(out), "--run-name", run or "none", *extra]
    if server is not None:
        cmd += ["--server", server.url]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(out / "torchrun.log", "wb") as log:   # ranks interleave here; each writes its own JSON
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, timeout=timeout)
    assert proc.returncode == 0, (out / "torchrun.log").read_text(errors="replace")[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_id(server, name: str) -> int:
    _, body = http_json("GET", f"{server.url}/api/v1/runs?name={quote(name)}")
    (run,) = body["runs"]
    return run["id"]


def series(server, rid: int, signal: str, rank: int) -> dict[int, float]:
    _, body = http_json("GET", f"{server.url}/api/v1/runs/{rid}/series?signal={signal}&rank={rank}&max_points=1000")
    return {p["step"]: p["last"] for p in body["steps"]}


def layers(server, rid: int, stat: str, rank: int) -> dict[int, list]:
    _, body = http_json("GET", f"{server.url}/api/v1/runs/{rid}/layers?stat={stat}&rank={rank}"
                               f"&max_steps=500&max_layers=200")
    assert body["layer_group_size"] == 1 and body["bucket_size"] == 1
    return {step: [row[c] for row in body["values"]] for c, step in enumerate(body["steps"])}


def rel(a, b) -> float:
    a, b = float(a), float(b)
    return abs(a - b) / max(abs(b), 1e-12)


def compare(server, name: str, records: list[dict]) -> dict[str, float]:
    """Every stored number against PyTorch's; returns the worst relative difference of each kind."""
    rid = run_id(server, name)
    mode = records[0]["mode"]
    worst: dict[str, float] = {}

    def note(key, stored, ref):
        assert stored is not None, f"{key}: nothing stored where PyTorch has {ref}"
        worst[key] = max(worst.get(key, 0.0), rel(stored, ref))

    n_steps = len(records[0]["steps"])
    for rec in records:          # per rank: its own loss and its own modules' activations
        r = rec["rank"]
        loss = series(server, rid, "loss", r)
        assert sorted(loss) == list(range(n_steps))
        for st in rec["steps"]:
            note("loss", loss[st["step"]], st["loss"])
        _, run = http_json("GET", f"{server.url}/api/v1/runs/{rid}")
        modules = run["module_names"]
        for k, stat in enumerate(("act_mean", "act_std", "act_absmax")):
            stored = layers(server, rid, stat, r)
            for st in rec["steps"]:
                for mod, ref in st["acts"].items():
                    value = stored[st["step"]][modules.index(mod)]
                    # a mean near 0 is compared on the scale of its module's spread
                    scale = max(abs(ref[k]), ref[1], 1e-6)
                    assert value is not None
                    worst[stat] = max(worst.get(stat, 0.0), abs(float(value) - ref[k]) / scale)
    # global and per-parameter numbers: a rank's own under DDP (its grads are the all-reduced ones),
    # the combined row (-1) when the parameters are sharded
    ranks = [rec["rank"] for rec in records] if mode == "ddp" else [-1]
    for r in ranks:
        g = series(server, rid, "grad_norm", r)
        per = {stat: layers(server, rid, stat, r) for stat in ("grad_norm", "weight_norm", "update_ratio")}
        for st in records[max(r, 0)]["steps"]:
            s = st["step"]
            note("grad_norm (global, pre-clip) vs clip_grad_norm_", g[s], st["clip_total"])
            for stat, key in (("grad_norm", "grad_norms"), ("weight_norm", "weight_norms"),
                              ("update_ratio", "update_ratios")):
                assert len(per[stat][s]) == len(st[key])
                for stored, ref in zip(per[stat][s], st[key]):
                    note(f"layers.{stat}", stored, ref)
        # the EMA divergence and the share of zero grad elements of the full parameters (sharded: combined
        # from every rank's pieces), against the same computed on the full tensors
        ema, zeros = series(server, rid, "ema_divergence", r), series(server, rid, "grad_zero_fraction", r)
        for st in records[max(r, 0)]["steps"]:
            note("ema_divergence", ema.get(st["step"]), st["ema_div"])
            if st["grad_zero"] is not None:
                stored = zeros.get(st["step"])
                assert stored is not None, f"grad_zero_fraction: nothing stored at step {st['step']}"
                worst["grad_zero_fraction"] = max(worst.get("grad_zero_fraction", 0.0),
                                                  abs(float(stored) - st["grad_zero"]))
        # the largest gradient element, per parameter and over the model (sharded: the largest of the ranks'
        # pieces, combined from its per-rank form alone), against the full gradients' (FSDP1: not recorded)
        absmax, per_absmax = series(server, rid, "grad_absmax", r), layers(server, rid, "grad_absmax", r)
        for st in records[max(r, 0)]["steps"]:
            if st["grad_absmax"] is not None:
                note("grad_absmax", absmax.get(st["step"]), max(st["grad_absmax"]))
                assert len(per_absmax[st["step"]]) == len(st["grad_absmax"])
                for stored, ref in zip(per_absmax[st["step"]], st["grad_absmax"]):
                    note("layers.grad_absmax", stored, ref)
    for key, value in worst.items():
        assert value <= REL, f"{mode}: {key} differs by {value:.3g} (rel) from PyTorch's"
    return worst


def _report(mode: str, worst: dict) -> None:
    print(f"\n{mode}: " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))


def _no_collectives(tmp_path: Path, mode: str, nproc: int = 2) -> None:
    """The same loop with and without the agent issues the same collectives, in the same order; the
    sender thread issues none."""
    with_agent = torchrun(mode, tmp_path / "with", nproc=nproc, extra=["--count", "--steps", "4"],
                          run=f"count-{uuid.uuid4().hex[:6]}")
    without = torchrun(mode, tmp_path / "without", nproc=nproc, extra=["--count", "--steps", "4", "--no-agent"])
    for a, b in zip(with_agent, without):
        assert a["disabled"] == [], a["disabled"]
        assert a["collective_ops"] == b["collective_ops"], (len(a["collective_ops"]), len(b["collective_ops"]))
        assert a["collective_calls"] == b["collective_calls"]
        assert a["sender_collective_ops"] == []
    if mode != "ddp":   # FSDP2's all-gathers / reduce-scatters, TP's all-reduces go through the dispatcher: seen
        assert with_agent[0]["collective_ops"], "the counter saw no collective at all"


def test_fsdp2_values_equal_pytorch(server_factory, db_url, tmp_path):
    srv = server_factory(db_url)
    name = f"fsdp2-{uuid.uuid4().hex[:6]}"
    records = torchrun("fsdp2", tmp_path / "run", server=srv, run=name)
    assert all(rec["disabled"] == [] for rec in records), [rec["disabled"] for rec in records]
    worst = compare(srv, name, records)
    _report("fsdp2", worst)
    rid = run_id(srv, name)
    _, cov = http_json("GET", f"{srv.url}/api/v1/runs/{rid}/ranks")
    assert cov["combined"] is True and cov["incomplete"] == []
    assert [r["rank"] for r in cov["ranks"]] == [-1, 0, 1]
    # the rank's own numbers are its shards': stored under their own names, never as the global norm
    assert set(series(srv, rid, "grad_norm", 0).values()) == {None}
    local = series(srv, rid, "grad_norm_local", 0)
    assert len(local) == len(records[0]["steps"]) and None not in local.values()
    _, alerts = http_json("GET", f"{srv.url}/api/v1/alerts?run={rid}")
    assert alerts["alerts"] == [], alerts   # a healthy run raises nothing (it raised loss spikes before)


def test_ddp_values_equal_pytorch_and_replicas_agree(server, tmp_path):
    name = f"ddp-{uuid.uuid4().hex[:6]}"
    records = torchrun("ddp", tmp_path / "run", server=server, run=name)
    worst = compare(server, name, records)
    _report("ddp", worst)
    rid = run_id(server, name)
    assert series(server, rid, "grad_norm", 0) == series(server, rid, "grad_norm", 1)   # bit for bit
    _, alerts = http_json("GET", f"{server.url}/api/v1/alerts?run={rid}")
    assert alerts["alerts"] == [], alerts
    _, cov = http_json("GET", f"{server.url}/api/v1/runs/{rid}/ranks")
    assert cov["combined"] is False and [r["rank"] for r in cov["ranks"]] == [0, 1]
    # where each rank runs, from its own agent's meta (torchrun's LOCAL_RANK, the model's device)
    assert [(r["local_rank"], r["device"]) for r in cov["ranks"]] == [(0, "cpu"), (1, "cpu")]
    assert all(r["host"] and r["pid"] for r in cov["ranks"]) and cov["ranks"][0]["pid"] != cov["ranks"][1]["pid"]


@pytest.mark.parametrize("mode", ["fsdp1", "fsdp1-orig", "tp"])
def test_fsdp1_and_tensor_parallel_values_equal_pytorch(server, tmp_path, mode):
    """FSDP1 (flat parameters, and their views with use_orig_params); tensor parallel: DTensor module
    outputs, whose activation statistics are those of each rank's local tensor."""
    name = f"{mode}-{uuid.uuid4().hex[:6]}"
    records = torchrun(mode, tmp_path / "run", server=server, run=name)
    assert all(rec["disabled"] == [] for rec in records)
    _report(mode, compare(server, name, records))


@pytest.mark.parametrize("where", ["ema-worker", "stale-seal"])
def test_fsdp1_ema_divergence_is_read_before_the_next_forward_swaps_the_weights(server, tmp_path, where):
    """An FSDP1 forward points each flat parameter at its gathered full tensor while it runs. The agent's
    threads that read the weights (the EMA worker; the sender sealing a stale step, here the step before
    a 1 s pause) are descheduled until the next forward has done so (descheduled_worker.py): every step
    still has its EMA divergence, equal to PyTorch's. Before: the worker read the full flat parameter, the
    shapes did not match, and steps 1-4 went without one; the sender's stale seal lost step 0's."""
    extra = ["--seal-grace", "0.3", "--base-s", "1.0"] if where == "stale-seal" else []
    name = f"fsdp1-{where}-{uuid.uuid4().hex[:6]}"
    records = torchrun("fsdp1", tmp_path / "run", server=server, run=name, extra=extra,
                       worker=WORKER.with_name("descheduled_worker.py"))
    assert all(rec["disabled"] == [] for rec in records)
    _report(f"fsdp1 ({where})", compare(server, name, records))


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_counts_each_replica_once(server, tmp_path):
    name = f"hsdp-{uuid.uuid4().hex[:6]}"
    records = torchrun("hsdp", tmp_path / "run", nproc=4, server=server, run=name)
    _report("hsdp", compare(server, name, records))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2", "tp"])
def test_the_agent_adds_no_collective(tmp_path, mode):
    _no_collectives(tmp_path, mode)


@pytest.mark.slow
def test_a_perturbed_ddp_replica_is_named(server, tmp_path):
    name = f"ddp-odd-{uuid.uuid4().hex[:6]}"
    torchrun("ddp", tmp_path / "run", nproc=4, server=server, run=name, extra=["--perturb-rank", "1"])
    rid = run_id(server, name)
    _, body = http_json("GET", f"{server.url}/api/v1/alerts?run={rid}&rule=F5")
    (alert,) = body["alerts"]
    assert alert["rank"] == 1 and alert["severity"] == "critical" and alert["first_step"] == 0
    assert alert["evidence"]["agreeing_ranks"] == [0, 2, 3]
    assert "Rank 1" in alert["message"]


# --------------------------------------------------------------------------- the server's side alone

def _batch(name: str, rank: int, steps: list[int], *, world: int = 2, meta: bool = True) -> dict:
    """What a sharded rank sends (the shape agent/wire.py produces), written by hand: two parameters of
    4 elements, each cut in two; rank r holds elements [2r, 2r+2) of each, all of value r + 1."""
    body = {"batch_id": uuid.uuid4().hex, "project": "default", "run": name, "rank": rank, "world_size": world,
            "steps": [{"step": s, "time": 1.0 + s, "loss": 1.0, "grad_norm_local": 2.0 * (rank + 1),
                       "layers": {"grad_norm_local": [math.sqrt(2) * (rank + 1)] * 2}} for s in steps]}
    if meta:
        body["meta"] = {"param_names": ["a", "b"], "param_shards": [[rank, world], [rank, world]]}
    return body


def test_a_step_missing_a_rank_is_incomplete_not_wrong(server):
    name = f"partial-{uuid.uuid4().hex[:6]}"
    assert http_json("POST", f"{server.url}/api/v1/ingest", _batch(name, 0, [0, 1, 2]))[0] == 200
    assert http_json("POST", f"{server.url}/api/v1/ingest", _batch(name, 1, [0, 1]))[0] == 200
    rid = run_id(server, name)
    # full norm of each parameter: sqrt(2 * 1^2 + 2 * 2^2) = sqrt(10); global: sqrt(20)
    g = series(server, rid, "grad_norm", -1)
    assert set(g) == {0, 1} and all(abs(v - math.sqrt(20)) < 1e-5 for v in g.values())
    per = layers(server, rid, "grad_norm", -1)
    assert all(abs(v - math.sqrt(10)) < 1e-5 for row in per.values() for v in row)
    _, cov = http_json("GET", f"{server.url}/api/v1/runs/{rid}/ranks")
    assert cov["incomplete"] == [{"step": 2, "ranks": [0]}]
    # the late rank arrives: the step completes, once
    assert http_json("POST", f"{server.url}/api/v1/ingest", _batch(name, 1, [2], meta=False))[0] == 200
    assert set(series(server, rid, "grad_norm", -1)) == {0, 1, 2}
    assert http_json("GET", f"{server.url}/api/v1/runs/{rid}/ranks")[1]["incomplete"] == []


def test_replicas_in_the_layout_are_not_counted_twice(server):
    """HSDP-like: 4 ranks, 2 replicas of 2 shards; each replica of a piece reports it, the server takes one."""
    name = f"hsdp-hand-{uuid.uuid4().hex[:6]}"
    for rank in range(4):
        b = _batch(name, rank % 2, [0], world=4)
        b["rank"] = rank
        b["meta"]["param_shards"] = [[rank % 2, 2], [rank % 2, 2]]
        assert http_json("POST", f"{server.url}/api/v1/ingest", b)[0] == 200
    rid = run_id(server, name)
    assert abs(series(server, rid, "grad_norm", -1)[0] - math.sqrt(20)) < 1e-5


def test_an_old_agent_s_multi_rank_batches_are_stored_as_before(server):
    """No layout in meta (an agent from before, or DDP): each rank's numbers as sent, no combined row."""
    name = f"old-{uuid.uuid4().hex[:6]}"
    for rank in range(2):
        body = {"batch_id": uuid.uuid4().hex, "project": "default", "run": name, "rank": rank, "world_size": 2,
                "meta": {"param_names": ["a"]},
                "steps": [{"step": 0, "time": 1.0, "loss": 1.5, "grad_norm": 0.5, "layers": {"grad_norm": [0.5]}}]}
        assert http_json("POST", f"{server.url}/api/v1/ingest", body)[0] == 200
    rid = run_id(server, name)
    assert series(server, rid, "grad_norm", 0) == {0: 0.5} == series(server, rid, "grad_norm", 1)
    assert set(series(server, rid, "grad_norm", -1).values()) <= {None}
    assert http_json("GET", f"{server.url}/api/v1/runs/{rid}/ranks")[1]["combined"] is False


def test_each_per_rank_form_combines_as_the_signal_table_declares(server):
    """Three parameters cut in two: "a" evenly, "b" whole on rank 0 (rank 1's piece is empty), "c" empty on
    both (a parameter of no elements). Norms combine as the root of the sum of squares, counts add up,
    maxima take the largest piece (agent/signals.py: combine); an empty piece adds nothing, and a share of
    0 of 0 elements is none, per parameter and in the total (agent/derived.py: share)."""
    name = f"forms-{uuid.uuid4().hex[:6]}"
    pieces = {  # rank -> per-rank statistic -> one value per parameter (a, b, c)
        0: {"grad_norm_local": [1.0, 3.0, 0.0], "grad_absmax_local": [1.0, 5.0, 0.0],
            "grad_zero_count_local": [1.0, 1.0, 0.0], "numel_local": [2.0, 3.0, 0.0]},
        1: {"grad_norm_local": [2.0, 0.0, 0.0], "grad_absmax_local": [2.0, 0.0, 0.0],
            "grad_zero_count_local": [0.0, 0.0, 0.0], "numel_local": [2.0, 0.0, 0.0]},
    }
    for rank, stats in pieces.items():
        body = {"batch_id": uuid.uuid4().hex, "project": "default", "run": name, "rank": rank, "world_size": 2,
                "meta": {"param_names": ["a", "b", "c"], "param_shards": [[rank, 2]] * 3},
                "steps": [{"step": 0, "time": 1.0, "loss": 1.0, "layers": stats}]}
        assert http_json("POST", f"{server.url}/api/v1/ingest", body)[0] == 200
    rid = run_id(server, name)
    assert layers(server, rid, "grad_absmax", -1)[0] == [2.0, 5.0, 0.0]
    assert series(server, rid, "grad_absmax", -1) == {0: 5.0}
    assert layers(server, rid, "grad_norm", -1)[0] == pytest.approx([math.sqrt(5), 3.0, 0.0], rel=1e-6)
    assert series(server, rid, "grad_norm", -1)[0] == pytest.approx(math.sqrt(14), rel=1e-6)
    zero = layers(server, rid, "grad_zero_fraction", -1)[0]
    assert zero[:2] == pytest.approx([0.25, 1 / 3], rel=1e-6) and zero[2] is None
    assert series(server, rid, "grad_zero_fraction", -1)[0] == pytest.approx(2 / 7, rel=1e-6)
