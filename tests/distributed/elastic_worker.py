"""One rank of a DDP job that torchrun's elastic agent restarts (``--max-restarts``): rank ``--crash-rank``
dies (``os._exit``) in the middle of step ``--crash-at`` in the first attempt (after its forward, as an
out-of-memory error in the backward would); torchrun then restarts every rank. Each
rank checkpoints its model and optimizer after every step (what a job that survives restarts does), and a
restarted rank loads its checkpoint and goes on: its optimizer's step counters say where, and the agent
continues the run's step axis from them (docs/resume.md). Each attempt of each rank writes the steps it
trained and their losses to ``<out>/rank<r>-attempt<k>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--server", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--crash-at", type=int, default=9)
    args = ap.parse_args()
    out = Path(args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = out / f"ckpt-rank{rank}.pt"
    start = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["rng"])
        start = state["next_step"]
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)

    from gradwatch import agent
    # no step= given: the restarted rank's agent reads the step from the loaded optimizer's counters
    monitor = agent.attach(ddp, optimizer=opt, run=args.run_name, server=args.server, flush_interval=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(args.steps)]
    trained = []
    for step in range(start, args.steps):
        x, y = data[step]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if attempt == 0 and rank == args.crash_rank and step == args.crash_at:
            # the forward of this step sealed the previous one; the sender journals it within
            # milliseconds (docs/checkpoints.md): then the process dies, this step untrained
            time.sleep(0.5)
            os._exit(1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        monitor.log(loss=loss)
        trained.append((step, loss.item()))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                    "next_step": step + 1}, ckpt)
        (out / f"rank{rank}-attempt{attempt}.json").write_text(json.dumps({"steps": trained}))
        dist.barrier()     # the ranks go step by step, as a DDP job's all-reduce makes them
    monitor.close(timeout=20)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
