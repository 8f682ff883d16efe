"""One rank of a DDP job with ``remediate=Rewind(...)``, for tests/remediation/test_remediation_ddp.py.

``python -m torch.distributed.run --standalone --nproc_per_node=2 ddp_worker.py OUT_DIR --server URL [options]``

Every rank trains the same tiny MLP (DDP, gloo, CPU, Adam, no GradScaler) on its own batches; with
``--poison-at N`` rank 0's batch N holds an Inf, so the all-reduced gradients and every rank's weights go
NaN. ``--late-rank K --late-s S``: rank K's agent reads every reply S seconds after its POST, so it hears
the run's alerts long after the other ranks. ``--after-rewind N``: stop N steps after the first rewind
(``--steps`` caps the loop), so a slow machine that hears the alert late still trains past it. ``--off``: no remediation. ``--count``: count the collectives
the training loop issues (tests/distributed/worker.py's counter). Each rank writes ``OUT_DIR/rank<k>.json``:
its losses, its rewinds, a hash of its parameters right after each rewind and at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: tests.* imports


def params_hash(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class LateTransport:
    """The agent's HTTP transport, every reply held ``delay`` seconds after the POST: this rank's steps reach
    the server on time, so the server's alert is not held back for the other rank (holding the POST instead
    delayed the alert for both, and rank 0 sometimes heard last: the FSDP2 test met it), but this rank hears
    the replies, and the alerts in them, late."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay

    def post(self, body: bytes):
        reply = self.inner.post(body)
        time.sleep(self.delay)
        return reply

    def __getattr__(self, name):
        return getattr(self.inner, name)


def rank_batches(rank: int, poison_at: int):
    """This rank's batch of each step (the same on every launch); rank 0's batch ``poison_at`` holds an Inf."""
    w_true = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))

    def batch(step: int):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(32, 8, generator=g)
        y = torch.tanh(x @ w_true)
        if step == poison_at and rank == 0:
            x[3, 2] = math.inf
        return x, y
    return batch


def rank_transport(server: str, rank: int, late_rank: int, late_s: float):
    """The agent's HTTP transport; the late rank's hears its replies ``late_s`` late."""
    from gradwatch.agent.transport import HttpTransport
    transport = HttpTransport(server, None, 5.0)
    return LateTransport(transport, late_s) if rank == late_rank else transport


def rewound_long_enough(after_rewind: list[dict], step: int, after: int) -> bool:
    """With ``--after-rewind N``: the loop has run N steps past the first rewind. The ranks agree on the rewind
    inside the gradient collective, so they all reach it at the same loop step and stop together (a rank
    that stopped alone would leave the other waiting in a collective); ``--steps`` is then only the cap."""
    first = next((a["loop_step"] for a in after_rewind if a["data"]["action"] == "rewind"), None)
    return after > 0 and first is not None and step >= first + after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--server", required=True)
    ap.add_argument("--run-name", default="ddp-rewind")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--poison-at", type=int, default=-1)
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--off", action="store_true")
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--pace", type=float, default=0.003)
    ap.add_argument("--after-rewind", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from gradwatch import agent
    from gradwatch.agent import Rewind

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    batch = rank_batches(rank, args.poison_at)
    transport = rank_transport(args.server, rank, args.late_rank, args.late_s)
    rewind = None if args.off else Rewind(every=50, keep=2, lr_factor=0.5, cool_steps=50)
    monitor = agent.attach(model, optimizer=opt, project="remediation-ddp", run=args.run_name, server=args.server,
                           transport=transport, remediate=rewind, flush_interval=0.1, announce=False)
    counter = None
    if args.count:
        from tests.distributed.worker import CollectiveCounter
        counter = CollectiveCounter()
        counter.wrap()
        counter.__enter__()
    losses, after_rewind = [], []
    seen = 0
    try:
        for step in range(args.steps):
            x, y = batch(step)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            monitor.log(loss=loss)
            losses.append(float(loss.detach()))
            if rewind is not None and len(rewind.rewinds) > seen:
                seen = len(rewind.rewinds)
                after_rewind.append({"loop_step": step, "data": rewind.rewinds[-1], "hash": params_hash(model)})
            if rewound_long_enough(after_rewind, step, args.after_rewind):
                break
            if args.pace:
                time.sleep(args.pace)
    finally:
        if counter is not None:
            counter.__exit__(None, None, None)
            counter.unwrap()
        monitor.close()
    out = {"rank": rank, "world": world, "losses": losses, "after_rewind": after_rewind,
           "rewinds": rewind.rewinds if rewind is not None else [], "final_hash": params_hash(model),
           "agent_steps": monitor.step}
    if counter is not None:
        out["collective_calls"] = counter.calls
        out["collective_ops"] = counter.ops
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
