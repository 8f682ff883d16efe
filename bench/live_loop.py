"""The training loop of bench/live_latency.py: a tiny MLP under a GradScaler at a fixed step rate.

    python bench/live_loop.py SERVER RUN STEPS RATE OUT [compute|idle]

``compute`` (the default) spends the step's time inside the step, between its forward and its
backward, as a GPU loop waits on its kernels; ``idle`` ends the step at once and then waits
before the next one (a slow data loader): the agent seals a step when the next one's forward
begins (post-step values such as the EMA update go to it until then), so ``idle`` is the worst
case for that hand-over. Each step's end (after ``scaler.update()``, when the step's numbers exist) is written to OUT as
``step wall_clock_seconds``, one line per step, so the benchmark can tell how long after its end
each step showed on an open run page. Run with the checkout under test first on PYTHONPATH.
"""
from __future__ import annotations

import sys
import time

import torch

from gradwatch import agent


def main() -> int:
    server, run, steps, rate, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    pace = sys.argv[6] if len(sys.argv) > 6 else "compute"
    if pace not in ("compute", "idle"):
        raise SystemExit(f"pace {pace!r}: compute or idle")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="live-latency", run=run, server=server)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    period = 1.0 / rate
    start = time.monotonic()
    with open(out, "w", buffering=1) as f:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if pace == "compute":
                time.sleep(max(0.0, start + (step + 1) * period - 0.002 - time.monotonic()))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            f.write(f"{step} {time.time():.6f}\n")
            time.sleep(max(0.0, start + (step + 1) * period - time.monotonic()))
    monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
