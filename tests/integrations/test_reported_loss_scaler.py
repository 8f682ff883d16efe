"""``monitor.log(overflow=..., loss_scale=...)``: a loss scaler the agent has no GradScaler for (DeepSpeed's
fp16 ``DynamicLossScaler``, which tests/integrations/test_deepspeed.py runs for real) reports its own skip
flag and scale, and they become the step's ``overflow`` / ``overflow_count`` / ``loss_scale``, read back from
a real server. Where the agent has a GradScaler of its own, its values win and the reported ones are
custom values.
"""
from __future__ import annotations

import uuid

import torch

from gradwatch import agent
from tests.integrations.stacks import stored


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :1] * 2.0


def _run_id(server, project: str, name: str) -> int:
    status, body = server.get(f"/api/v1/runs?project={project}&name={name}")
    assert status == 200, body
    (run,) = [r for r in body["runs"] if r["name"] == name]
    return run["id"]


def _series(server, project: str, name: str, *signals: str) -> list[dict]:
    rid = _run_id(server, project, name)
    return [stored(server, rid, s) for s in signals]


def test_a_reported_loss_scaler_is_the_steps_overflow_count_and_scale(gw_server, tmp_path):
    """A hand-made loss scaler (no GradScaler): it multiplies the loss by its scale, skips the update on
    the steps it is told overflowed and halves the scale there, like DeepSpeed's. During the step (before
    the update) and right after it (the open record), with a flag as a bool or a 0-d tensor and the scale
    as a number or a tensor: each step's stored values are the scaler's."""
    name = f"scaler-{uuid.uuid4().hex[:6]}"
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = agent.attach(model, optimizer=opt, project="reported-scaler", run=name, server=gw_server.url,
                           spool_dir=str(tmp_path / "spool"), flush_interval=0.1)
    scale, skips, flags, scales, counts = 1024.0, 0, [], [], []
    for i in range(8):
        x, y = _batch(i)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * scale).backward()
        skip = i in (0, 1, 5)
        flags.append(float(skip))
        scales.append(scale)
        skips += skip
        counts.append(skips)
        if i % 2:   # during the step: decided at its end
            monitor.log(loss=loss, overflow=torch.tensor(skip), loss_scale=torch.tensor(scale))
        if not skip:
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()
        else:   # skipped: no grads, a no-op update that still ends the agent's step (its optimizer hook)
            opt.zero_grad()
            opt.step()
        if not i % 2:   # right after the step: its open record
            monitor.log(loss=loss, overflow=skip, loss_scale=scale)
        scale = scale / 2 if skip else scale
    monitor.close()
    overflow, count, loss_scale = _series(gw_server, "reported-scaler", name, "overflow", "overflow_count",
                                          "loss_scale")
    assert [overflow[s] for s in range(8)] == flags
    assert [count[s] for s in range(8)] == counts
    assert [loss_scale[s] for s in range(8)] == scales


def test_the_agents_own_gradscaler_wins_over_reported_values(gw_server, tmp_path):
    """With a GradScaler the agent reads its flag and scale itself; reported ones are custom values."""
    name = f"own-{uuid.uuid4().hex[:6]}"
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    monitor = agent.attach(model, scaler, optimizer=opt, project="reported-scaler", run=name,
                           server=gw_server.url, spool_dir=str(tmp_path / "spool"), flush_interval=0.1)
    own = []
    for i in range(4):
        x, y = _batch(i)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        own.append(float(scaler.get_scale()))
        if i % 2:
            monitor.log(overflow=True, loss_scale=3.0)   # during the step
        scaler.step(opt)
        scaler.update()
        if not i % 2:
            monitor.log(overflow=True, loss_scale=3.0)   # right after it
    monitor.close()
    overflow, count, loss_scale, custom_flag, custom_scale = _series(
        gw_server, "reported-scaler", name, "overflow", "overflow_count", "loss_scale", "custom:overflow",
        "custom:loss_scale")
    assert [overflow[s] for s in range(4)] == [0.0] * 4 and [count[s] for s in range(4)] == [0.0] * 4
    assert [loss_scale[s] for s in range(4)] == own
    assert [custom_flag[s] for s in range(4)] == [1.0] * 4 and [custom_scale[s] for s in range(4)] == [3.0] * 4
