"""A training loop at about 10 steps/s for the crash-tail test: ``python crash_loop.py URL RUN PROGRESS START STEPS``.

Trains a tiny model with a GradScaler (checklist order) and, after each finished step (after
``scaler.update()``, where the agent ends the step), appends the step's number to PROGRESS and
flushes it to the kernel (and records a checkpoint every 5 steps), so a test that SIGKILLs this process knows the last step it finished.
START > 0 resumes the run's step axis there (``monitor.step``); the loop closes its monitor at the
end (a run that is not killed).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn as nn

from gradwatch import agent

STEP_TIME = 0.1


def main(server: str, run: str, progress: str, start: int, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="crash", run=run, server=server)
    monitor.step = start
    x = torch.randn(32, 8)
    y = x.sum(dim=1, keepdim=True)
    with open(progress, "a") as out:
        for step in range(start, start + steps):
            began = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if (step + 1) % 5 == 0:   # an event in the tail too: the crash-tail tests count them
                monitor.checkpoint(f"ckpt/step-{step + 1}.pt")
            out.write(f"{step}\n")
            out.flush()
            time.sleep(max(0.0, STEP_TIME - (time.perf_counter() - began)))
    monitor.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
