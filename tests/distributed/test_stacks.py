"""Custom loops on the training stacks with 2 CPU processes (gloo): Accelerate launched by
``accelerate launch --multi_gpu --num_processes 2`` (DDP; the script's ``Accelerator(cpu=True)``
makes it MULTI_CPU), Lightning Fabric ``strategy="ddp"`` and DeepSpeed ZeRO 1 / 2 under ``torchrun``.

Each rank's stream is its own, under one run of 2 ranks; every stored loss and grad norm is
compared with the stack's own on that rank (tests/distributed/stacks_worker.py). The HF ``Trainer``
and Lightning's ``Trainer`` under DDP are covered by tests/distributed/test_frameworks.py.
"""
from __future__ import annotations

import sys
import uuid

import pytest

from tests.conftest import start_sqlite_server
from tests.integrations.stacks import (check_loss_scaler, launch, max_rel, needs_cpu_fp16, require_installed,
                                      run_id, stored)

STEPS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("stacks-server"))
    yield srv
    srv.stop()


def _check(server, name: str, records: list[dict], skipped: tuple[int, ...] = ()) -> None:
    """``skipped``: steps DeepSpeed's fp16 loss scaler skipped, which store no grad norm."""
    assert [r["world_size"] for r in records] == [2, 2] and [r["steps"] for r in records] == [STEPS, STEPS]
    rid = run_id(server, name)
    for rank, rec in enumerate(records):
        assert rec["warnings"] == []
        loss = stored(server, rid, "loss", rank)
        assert sorted(loss) == list(range(STEPS)), f"rank {rank}: one gradwatch step per optimizer step"
        assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} rank {rank} loss") <= 1e-6
        norm = stored(server, rid, "grad_norm", rank)
        kept = [s for s in range(STEPS) if s not in skipped]
        assert max_rel([norm[s] for s in kept], [rec["grad_norm"][s] for s in kept],
                       f"{name} rank {rank} grad_norm") <= 1e-6
        assert all(norm.get(s) is None for s in skipped)
    # the gradients are all-reduced: one grad norm on both ranks; each rank's loss its own batches'
    assert max_rel(*[[r["grad_norm"][s] for s in range(STEPS) if s not in skipped] for r in records]) <= 1e-6
    assert records[0]["loss"] != records[1]["loss"]


@pytest.mark.slow
def test_accelerate_launch_two_cpu_processes_with_accumulation(server, tmp_path):
    require_installed("accelerate")
    name = f"acc-ddp-{uuid.uuid4().hex[:6]}"
    # `python -m accelerate.commands.launch` is the `accelerate launch` CLI (the `accelerate` script also
    # imports every subcommand, timm's included, which fails where timm is installed without torchvision)
    launcher = (sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0")
    records = launch("accelerate", tmp_path, server=server, run=name, nproc=2, steps=STEPS,
                     extra=("--accum", "2"), launcher=launcher)
    assert all(r["distributed_type"] == "DistributedType.MULTI_CPU" and r["model"] == "DistributedDataParallel"
               for r in records)
    _check(server, name, records)


@pytest.mark.slow
def test_fabric_ddp_two_cpu_processes(server, tmp_path):
    require_installed("lightning")
    name = f"fabric-ddp-{uuid.uuid4().hex[:6]}"
    records = launch("fabric", tmp_path, server=server, run=name, nproc=2, steps=STEPS,
                     extra=("--accum", "2", "--precision", "bf16"))
    _check(server, name, records)


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(1, "bf16"), (2, "no"),
                                             pytest.param(2, "fp16", marks=needs_cpu_fp16)])
def test_deepspeed_zero_two_cpu_processes(server, tmp_path, stage, precision):
    require_installed("deepspeed")
    name = f"ds-z{stage}-{precision}-{uuid.uuid4().hex[:6]}"
    records = launch("deepspeed", tmp_path, server=server, run=name, nproc=2, steps=STEPS,
                     extra=("--zero-stage", str(stage), "--precision", precision, "--accum", "2"))
    # the steps the fp16 loss scaler skipped (the ranks agree: the overflow check is all-reduced)
    counts = records[0]["skipped_steps"]
    skipped = tuple(s for s in range(STEPS) if counts[s] > (counts[s - 1] if s else 0))
    assert bool(skipped) == (precision == "fp16") and records[1]["skipped_steps"] == counts
    # ZeRO: no p.grad at the step; each rank's stored grad_norm is its engine.get_global_grad_norm()
    _check(server, name, records, skipped)
    rid = run_id(server, name)
    for rank, rec in enumerate(records):
        skips = stored(server, rid, "custom:deepspeed_skipped_steps", rank)
        assert [skips[s] for s in range(STEPS)] == rec["skipped_steps"]
        overflow, clipped = stored(server, rid, "overflow", rank), stored(server, rid, "clipped", rank)
        if precision == "fp16":   # each rank's stored flags, count and scale are its engine's loss scaler's
            check_loss_scaler(server, rid, rec, STEPS, rank)
        else:
            assert [overflow[s] for s in range(STEPS)] == [0] * STEPS, "no loss scaler: no overflow is ever stored"
            assert all(v is None for v in stored(server, rid, "loss_scale", rank).values())
        assert [clipped.get(s) for s in range(STEPS)] == [None if s in skipped else float(n > rec["clip"])
                                                           for s, n in enumerate(rec["grad_norm"])]
