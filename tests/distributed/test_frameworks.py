"""The frameworks' own distributed launches under ``torchrun`` (gloo, CPU) with their gradwatch callbacks:
the HF ``Trainer`` (DDP) and Lightning (``strategy="ddp"``). Every stored number is compared with the
framework's own: each rank's stream is its own, under one run of ``world_size`` ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, http_json, start_sqlite_server
from tests.distributed.test_distributed import run_id, series
from tests.integrations.conftest import assert_close, require

WORKER = Path(__file__).with_name("framework_worker.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("frameworks-server"))
    yield srv
    srv.stop()


def launch(framework: str, out: Path, *, server, run: str, nproc: int = 2, steps: int = 5,
           extra: tuple[str, ...] = ()) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), framework, str(out), "--server", server.url, "--run-name", run, "--steps", str(steps),
           "--world", str(nproc), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    with open(out / "torchrun.log", "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, timeout=400)
    assert proc.returncode == 0, (out / "torchrun.log").read_text(errors="replace")[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def _run(server, name: str) -> dict:
    _, body = http_json("GET", f"{server.url}/api/v1/runs/{run_id(server, name)}")
    return body


@pytest.mark.slow
def test_hf_trainer_under_torchrun_matches_the_trainers_log(server, tmp_path):
    require("transformers")
    require("accelerate")
    name = f"hf-ddp-{uuid.uuid4().hex[:6]}"
    steps = 5
    records = launch("hf", tmp_path / "hf", server=server, run=name, steps=steps)
    assert all(r["world_size"] == 2 and r["global_step"] == steps for r in records)
    rid = run_id(server, name)
    assert _run(server, name)["world_size"] == 2
    per_rank = [series(server, rid, "loss", rank) for rank in range(2)]
    assert all(sorted(p) == list(range(steps)) for p in per_rank), "one gradwatch step per optimizer step per rank"
    # the Trainer logs the mean over ranks of each rank's loss (its _nested_gather(...).mean())
    mean = [(per_rank[0][s] + per_rank[1][s]) / 2 for s in range(steps)]
    assert_close(mean, records[0]["loss"], rel=1e-4, what="loss (mean over ranks)")
    # the all-reduced gradients are the same on both ranks: each rank's pre-clip grad norm is the Trainer's
    for rank in range(2):
        g = series(server, rid, "grad_norm", rank)
        assert_close([g[s] for s in range(steps)], records[0]["grad_norm"], rel=1e-4, what=f"grad_norm rank {rank}")
        lr = series(server, rid, "lr", rank)
        assert_close([lr[s] for s in range(steps)], records[0]["lr"], rel=1e-6, what=f"lr rank {rank}")


@pytest.mark.slow
def test_lightning_ddp_under_torchrun_matches_lightnings_numbers(server, tmp_path):
    require("lightning.pytorch")
    name = f"pl-ddp-{uuid.uuid4().hex[:6]}"
    steps = 5
    records = launch("lightning", tmp_path / "pl", server=server, run=name, steps=steps)
    assert all(r["world_size"] == 2 and r["global_step"] == steps for r in records)
    rid = run_id(server, name)
    assert _run(server, name)["world_size"] == 2
    for rank, rec in enumerate(records):
        loss = series(server, rid, "loss", rank)
        assert sorted(loss) == list(range(steps))
        # each rank's own batches (Lightning's distributed sampler): its stream is its own loss
        assert_close([loss[s] for s in range(steps)], rec["loss"], rel=1e-5, what=f"loss rank {rank}")
        g = series(server, rid, "grad_norm", rank)
        assert_close([g[s] for s in range(steps)], rec["grad_norm"], rel=1e-4, what=f"grad_norm rank {rank}")
    # the all-reduce: both ranks' grad norms are one number, their losses are not
    assert_close(records[0]["grad_norm"], records[1]["grad_norm"], rel=1e-6, what="replicas' grad norms")
    assert records[0]["loss"] != records[1]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_the_ranks_agree_to_stop_on_an_alert_and_stop_at_the_same_step(server, tmp_path, framework):
    """``stop_on`` under DDP (the HF ``Trainer``, Lightning ``strategy="ddp"``): rank 1's loss turns NaN at
    step 8 (the all-reduce then spreads it); the alerts reach the ranks at different moments, and a rank
    that stopped alone would leave the other waiting at its next all-reduce. The callbacks agree every 5
    steps (one all-reduce of one integer), so both ranks stop at the same step, long before max_steps,
    and the job ends (no hang)."""
    if framework == "hf":
        require("transformers")
        require("accelerate")
    else:
        require("lightning")
    name = f"{framework}-stop-{uuid.uuid4().hex[:6]}"
    records = launch(framework, tmp_path / "stop", server=server, run=name, steps=400,
                     extra=("--nan-step", "8", "--nan-rank", "1", "--step-sleep", "0.05"))
    steps = {r["rank"]: r["global_step"] for r in records}
    assert steps[0] == steps[1], steps
    assert 8 < steps[0] < 400, steps       # stopped after the NaN, long before the end
    # each rank stopped for a critical alert it heard itself, or because the other one had
    assert all(r["stopped_by"] is not None or r["stopped_by_other_rank"] for r in records), records
    assert any(r["stopped_by"] is not None for r in records), records
