"""The README's plain loop: ``agent.attach(model, scaler)`` + the usual AMP step, with accumulation and custom scalars.

A real ``GradScaler`` (on the CPU, fp32 autocast off: it scales, unscales,
checks for inf/NaN and skips steps exactly as on a GPU). The reference
numbers are the loop's own.
"""
from __future__ import annotations

import torch

from gradwatch import agent
from tests.integrations.conftest import assert_close, run_of, series


def test_readme_loop_with_accumulation_and_custom_scalars(gw_server, run_name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    accumulation, steps = 4, 6
    step_losses, accs = [], []

    monitor = agent.attach(model, scaler, optimizer=optimizer, project="plain", run=run_name,
                           server=gw_server.url, flush_interval=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        total = 0.0
        for _ in range(accumulation):
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :1] * 3) / accumulation
            scaler.scale(loss).backward()          # the agent sees the loss here
            total += loss.item()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        scaler.step(optimizer)
        scaler.update()
        acc = 1.0 / (1.0 + total)
        monitor.log(acc=acc)                       # a custom scalar for the step that just ended
        step_losses.append(total)
        accs.append(acc)
    monitor.close()

    run = run_of(gw_server, "plain", run_name)
    loss = series(gw_server, run["id"], "loss")
    assert sorted(loss) == list(range(steps)), "one gradwatch step per optimizer step, not per micro-batch"
    assert_close([loss[s] for s in range(steps)], step_losses, rel=1e-5, what="loss")
    acc_series = series(gw_server, run["id"], "custom:acc")
    assert_close([acc_series[s] for s in range(steps)], accs, what="custom:acc")
    clipped = series(gw_server, run["id"], "clip_max_norm")
    assert set(clipped.values()) == {0.5}
    scale = series(gw_server, run["id"], "loss_scale")
    assert scale[0] == 2.0 ** 12
