"""Agent overhead under FSDP2: 2 CPU ranks (gloo), the loop with and without the agent, side by side.

    .venv/bin/python bench/fsdp_overhead.py                 # torchrun --standalone --nproc_per_node=2 itself
    .venv/bin/python bench/fsdp_overhead.py --steps 400 --ranks 2

Each rank builds two identical copies of an MLP (8 blocks of Linear(256, 1024) → GELU → Linear(1024, 256),
~4.2 M parameters), each ``fully_shard``-ed per block and at the root, with AdamW and
``clip_grad_norm_(…, 1.0)`` on DTensor gradients, fp32. The copies are stepped alternately, so both
see the same machine load step by step; the agent (default telemetry, offline spool, the sharded
norms it sends on FSDP2) sits on copy 0 for the first half and on copy 1 for the second half, so
that a copy that happens to be faster favours neither side. Both ranks run the same sequence (the
collectives must match). Each rank writes its step times to its own file; the driver prints, per
rank and over both, the ratio of median step times (wall, and the training thread's CPU time),
agent / bare. Target (issue 17): ≤ 1.03×.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def make():
        torch.manual_seed(0)
        blocks = [torch.nn.Sequential(torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(),
                                      torch.nn.Linear(4 * args.width, args.width)) for _ in range(args.blocks)]
        model = torch.nn.Sequential(*blocks, torch.nn.Linear(args.width, 1))
        for b in blocks:
            fully_shard(b)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    copies = [make(), make()]
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g))
            for _ in range(8)]

    def step(c, i):
        model, opt = c
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    from gradwatch import agent

    spool = tempfile.mkdtemp(prefix=f"gw-fsdp-bench-{rank}-")
    wall = {0: [], 1: []}    # 0: the copy with the agent, 1: the bare one
    cpu = {0: [], 1: []}
    half = args.steps // 2
    for part, (with_agent, bare) in enumerate(((0, 1), (1, 0))):
        a, b = copies[with_agent], copies[bare]
        monitor = agent.attach(a[0], optimizer=a[1], project="bench", run=f"fsdp-{os.getpid()}-{part}",
                               mode="offline", spool_dir=spool)
        for i in range(args.warmup):
            monitor.log(loss=step(a, i))
            step(b, i)
        for i in range(half):
            for k in ((0, 1) if i % 2 else (1, 0)):
                t0, c0 = time.perf_counter(), time.thread_time()
                if k == 0:
                    monitor.log(loss=step(a, i))
                else:
                    step(b, i)
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.thread_time() - c0)
        monitor.close(timeout=10)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(
        {"agent_wall": wall[0], "bare_wall": wall[1], "agent_cpu": cpu[0], "bare_cpu": cpu[1],
         "load": os.getloadavg()[0]}))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="measured steps per copy (half with the agent each)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    import checkout

    out = tempfile.mkdtemp(prefix="gw-fsdp-bench-")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           __file__, "--rank-main", "--out", out, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--width", str(args.width), "--blocks", str(args.blocks), "--batch", str(args.batch)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **checkout.pythonpath(REPO)}
    t0 = time.time()
    with open(Path(out, "torchrun.log"), "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO).returncode
    if rc != 0:
        print(Path(out, "torchrun.log").read_text(errors="replace")[-4000:])
        return rc
    ratios_wall, ratios_cpu = [], []
    print(f"FSDP2, {args.ranks} CPU ranks (gloo), {args.blocks} blocks of width {args.width}, batch {args.batch}, "
          f"{args.steps} steps per copy, {time.time() - t0:.0f} s")
    for r in range(args.ranks):
        d = json.loads(Path(out, f"rank{r}.json").read_text())
        w = statistics.median(d["agent_wall"]) / statistics.median(d["bare_wall"])
        c = statistics.median(d["agent_cpu"]) / statistics.median(d["bare_cpu"])
        ratios_wall.append(w)
        ratios_cpu.append(c)
        print(f"rank {r}: bare step median {statistics.median(d['bare_wall']) * 1e3:.1f} ms wall, "
              f"{statistics.median(d['bare_cpu']) * 1e3:.1f} ms CPU; agent / bare: wall {w:.3f}x, "
              f"training-thread CPU {c:.3f}x (load {d['load']:.1f})")
    print(f"agent / bare over the ranks: wall {max(ratios_wall):.3f}x (worst rank), "
          f"training-thread CPU {max(ratios_cpu):.3f}x (worst rank); target <= 1.03x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
