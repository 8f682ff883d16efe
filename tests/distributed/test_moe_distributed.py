"""Attention logits and a mixture of experts' router under DDP and FSDP2, end to end: real ``torchrun`` jobs
(gloo, CPU) of a tiny MoE language model against a real server.

The agent finds attention and routers by what the forward computes (agent/capture/attention.py), on each
rank's own forward; nothing else in tests/distributed trains a model that has either. Each rank of
``moe_worker.py`` records the ground truth in plain PyTorch (float64, no agent code): per step and block
the largest unmasked attention logit and the router spread. Every stored ``attn_logit_max`` and
``router_logit_spread`` (per module, and the step's max over the modules) is read back through the API
and compared with its own rank's numbers; the ranks train on different data, so a value stored under the
wrong rank shows. Nothing is mocked.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.conftest import http_json, start_sqlite_server
from tests.distributed.test_distributed import layers, rel, run_id, series, torchrun

WORKER = Path(__file__).with_name("moe_worker.py")
REL = 1e-4
# the statistic, the worker's ground truth for it (one value per block), the worker's modules that compute it
MEASURES = (("attn_logit_max", "attn", "attn_modules"), ("router_logit_spread", "router", "moe_modules"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("moe-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def job(request, server, tmp_path_factory):
    """One monitored run per mode, shared by the tests below (a torchrun costs ~10-15 s here): ``--count``
    records its collectives too, for the comparison with a run without the agent."""
    mode = request.param
    name = f"moe-{mode}-{uuid.uuid4().hex[:6]}"
    out = tmp_path_factory.mktemp(f"moe-{mode}")
    records = torchrun(mode, out / "run", server=server, run=name, extra=["--count"], worker=WORKER)
    return {"mode": mode, "name": name, "rid": run_id(server, name), "records": records, "out": out}


def test_every_rank_stores_its_own_attention_logits_and_router_spreads(server, job):
    """Per rank (both modes keep these under each rank's own row: they are measured on the rank's own
    forward, not pieces of a sharded parameter), every step, every block: the stored value equals that
    rank's ground truth, and the step signal is the max over the blocks."""
    rid, records = job["rid"], job["records"]
    assert all(rec["disabled"] == [] and rec["dropped"] == 0 for rec in records), \
        [(rec["disabled"], rec["dropped"]) for rec in records]
    n_steps = len(records[0]["steps"])
    assert all(len(st["attn"]) == 2 and len(st["router"]) == 2 for rec in records for st in rec["steps"]), \
        "the worker recorded one forward per step and block"
    # different data on each rank: a rank's row holding another rank's numbers would not match
    assert records[0]["steps"][0]["attn"] != records[1]["steps"][0]["attn"]
    assert records[0]["steps"][0]["router"] != records[1]["steps"][0]["router"]
    _, run = http_json("GET", f"{server.url}/api/v1/runs/{rid}")
    modules = run["module_names"]
    worst: dict[str, float] = {}
    for rec in records:
        r = rec["rank"]
        for stat, truth, owners in MEASURES:
            rows = [modules.index(m) for m in rec[owners]]
            per = layers(server, rid, stat, r)
            top = series(server, rid, stat, r)
            assert sorted(per) == list(range(n_steps)), f"{stat} rank {r}: steps {sorted(per)}"
            assert sorted(top) == list(range(n_steps)), f"{stat} rank {r}: steps {sorted(top)}"
            for st in rec["steps"]:
                s = st["step"]
                for block, row in enumerate(rows):
                    stored = per[s][row]
                    assert stored is not None, f"{stat} rank {r} step {s}: nothing stored for {modules[row]}"
                    worst[stat] = max(worst.get(stat, 0.0), rel(stored, st[truth][block]))
                assert top[s] is not None, f"{stat} rank {r} step {s}: no step value"
                worst[f"{stat} (step)"] = max(worst.get(f"{stat} (step)", 0.0), rel(top[s], max(st[truth])))
    print(f"\n{job['mode']}: " + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
    for key, value in worst.items():
        assert value <= REL, f"{job['mode']}: {key} differs by {value:.3g} (rel) from the rank's own"


def test_each_figure_is_credited_to_the_module_that_calls_the_softmax(server, job):
    """The attention logits go to the attention modules and the spreads to the MoE modules (the innermost
    modules whose forward calls the softmax: not the blocks holding them, not the gate Linear that made
    the router's logits), under the names the wrapped model gives them (DDP: ``module.``-prefixed), and
    every other module's value is null."""
    rid, records = job["rid"], job["records"]
    _, run = http_json("GET", f"{server.url}/api/v1/runs/{rid}")
    modules = run["module_names"]
    prefix = "module." if job["mode"] == "ddp" else ""
    for rec in records:
        assert rec["attn_modules"] == [f"{prefix}blocks.{i}.attn" for i in range(2)]
        assert rec["moe_modules"] == [f"{prefix}blocks.{i}.moe" for i in range(2)]
        for stat, _, owners in MEASURES:
            for step, row in layers(server, rid, stat, rec["rank"]).items():
                assert len(row) == len(modules)
                credited = [modules[i] for i, v in enumerate(row) if v is not None]
                assert credited == rec[owners], f"{stat} rank {rec['rank']} step {step}: credited to {credited}"
        # the run says which attention each rank's agent measured (the coverage event), under the same names
        _, body = http_json("GET", f"{server.url}/api/v1/runs/{rid}/events?kind=attention_coverage")
        measured = [e["data"]["measured"] for e in body["events"] if e["rank"] == rec["rank"]]
        assert measured == [rec["attn_modules"]], measured


def test_a_sharded_run_keeps_them_per_rank_only(server, job):
    """Under FSDP2 the server adds a combined row (rank -1) for the parameters' statistics; the attention
    logits and router spreads are each rank's own, so that row holds none of them (not rank 0's copied,
    not a max over the ranks). Under DDP there is no combined row at all."""
    rid = job["rid"]
    _, cov = http_json("GET", f"{server.url}/api/v1/runs/{rid}/ranks")
    if job["mode"] == "ddp":
        assert cov["combined"] is False and [r["rank"] for r in cov["ranks"]] == [0, 1]
        return
    assert cov["combined"] is True and cov["incomplete"] == []
    assert [r["rank"] for r in cov["ranks"]] == [-1, 0, 1]
    n_steps = len(job["records"][0]["steps"])
    assert sorted(layers(server, rid, "grad_norm", -1)) == list(range(n_steps)), "the combined row is there"
    for stat, _, _ in MEASURES:
        assert set(series(server, rid, stat, -1).values()) <= {None}, stat
        assert all(v is None for row in layers(server, rid, stat, -1).values() for v in row), stat


def test_the_healthy_run_raises_nothing_above_info(server, job):
    """Eight steps of a small LR on a tiny model: no attention logit or router runs away (H2, H12-H14), no
    rank disagrees with the others. Notes of severity info (setup advice) are allowed."""
    _, body = http_json("GET", f"{server.url}/api/v1/alerts?run={job['rid']}")
    loud = [(a["rule"], a["severity"], a.get("message")) for a in body["alerts"] if a["severity"] != "info"]
    assert loud == [], loud


def test_the_agent_adds_no_collective(job):
    """The same loop without the agent issues the same collectives, in the same order (attention and router
    measurements included: they run on each rank's own forward); the sender thread issues none."""
    with_agent = job["records"]
    without = torchrun(job["mode"], job["out"] / "without", extra=["--count", "--no-agent"], worker=WORKER)
    for a, b in zip(with_agent, without):
        assert a["collective_ops"] == b["collective_ops"], (len(a["collective_ops"]), len(b["collective_ops"]))
        assert a["collective_calls"] == b["collective_calls"]
        assert a["sender_collective_ops"] == []
        assert a["steps"] == b["steps"], "the agent changed what the model computed"
    if job["mode"] == "fsdp2":   # its all-gathers and reduce-scatters go through the dispatcher: seen
        assert with_agent[0]["collective_ops"], "the counter saw no collective at all"
