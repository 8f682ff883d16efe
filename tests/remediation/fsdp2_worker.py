"""One rank of an FSDP2 job with ``remediate=Rewind(...)``, for tests/remediation/test_remediation_fsdp2.py.

``python -m torch.distributed.run --standalone --nproc_per_node=2 fsdp2_worker.py OUT_DIR --server URL [options]``

Every rank trains the same tiny MLP (``fully_shard`` on each Linear and on the root, gloo, CPU, Adam) on its
own batches; with ``--poison-at N`` rank 0's batch N holds an Inf, so the reduce-scattered gradients and every
rank's shards go NaN. ``--late-rank K --late-s S``: rank K's agent reads every reply S seconds after its POST, so it
hears the run's alerts long after the other rank. ``--after-rewind N``: stop N steps after the first rewind
(``--steps`` caps the loop). ``--off``: no remediation. ``--count``: count the
collectives the training loop issues (tests/distributed/worker.py's counter). ``--refuse-at N``: rank
``--refuse-rank``'s snapshot copy at step N counts as non-finite.

Each rank writes ``OUT_DIR/rank<k>.json``: its losses, its rewinds, a hash of its local shards (parameters
and optimizer state, ``to_local()``: no gather) after every step keyed by the step the run continues with,
the same hash right after each rewind, and whether those shards equal the snapshot restored (its buffers
in the agent's store) bit for bit.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: tests.* imports

# the batches and the late rank's transport (its replies held a few seconds): the same as the DDP worker's
from tests.remediation.ddp_worker import rank_batches, rank_transport, rewound_long_enough  # noqa: E402


def local_state(model, opt) -> list[torch.Tensor]:
    """This rank's shards of the parameters and of the optimizer's tensors, in a fixed order."""
    out = []
    for p in model.parameters():
        out.append(p.to_local())
        for key in sorted(opt.state.get(p, {})):
            t = opt.state[p][key]
            if isinstance(t, torch.Tensor):
                out.append(t.to_local() if hasattr(t, "to_local") else t)
    return out


def shards_hash(model, opt) -> str:
    h = hashlib.sha256()
    for t in local_state(model, opt):
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def equals_snapshot(monitor, to_step: int) -> bool:
    """The live local shards equal the restored snapshot's buffers, bit for bit (every tensor it holds)."""
    store = monitor._remedy.store
    slot = next(s for s in store.slots if s.step == to_step)
    names, live = store.live_tensors()
    held = dict(zip(slot.names, slot.buffers))
    return names == slot.names and all(torch.equal(held[n].view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
                                       for n, t in zip(names, live))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--server", required=True)
    ap.add_argument("--run-name", default="fsdp2-rewind")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--poison-at", type=int, default=-1)
    ap.add_argument("--late-rank", type=int, default=-1)
    ap.add_argument("--late-s", type=float, default=0.0)
    ap.add_argument("--off", action="store_true")
    ap.add_argument("--count", action="store_true")
    ap.add_argument("--pace", type=float, default=0.003)
    ap.add_argument("--refuse-at", type=int, default=-1)
    ap.add_argument("--refuse-rank", type=int, default=1)
    ap.add_argument("--after-rewind", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.fsdp import fully_shard

    from gradwatch import agent
    from gradwatch.agent import Rewind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    batch = rank_batches(rank, args.poison_at)
    transport = rank_transport(args.server, rank, args.late_rank, args.late_s)
    rewind = None if args.off else Rewind(every=50, keep=2, lr_factor=0.5, cool_steps=50)
    monitor = agent.attach(model, optimizer=opt, project="remediation-fsdp2", run=args.run_name, server=args.server,
                           transport=transport, remediate=rewind, flush_interval=0.1, announce=False)
    if args.refuse_at >= 0 and rank == args.refuse_rank:
        # this rank's copy at that step counts as non-finite (as a shard holding an Inf would): every rank
        # must drop its own copy of that step too, and snapshot again at the next one
        store = monitor._remedy.store
        take = store.take_unvouched
        store.take_unvouched = lambda step, *a: False if step == args.refuse_at else take(step, *a)
    counter = None
    if args.count:
        import tests.distributed.worker as counting
        from tests.distributed.worker import CollectiveCounter
        # FSDP2's own collectives are the *_single ones: counted too (read at wrap time)
        counting._PY_COLLECTIVES = (*counting._PY_COLLECTIVES, "reduce_scatter_single", "all_gather_single")
        counter = CollectiveCounter()
        counter.wrap()
        counter.__enter__()
    losses, after_rewind, history = [], [], {}
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
                data = rewind.rewinds[-1]
                after_rewind.append({"loop_step": step, "data": data, "hash": shards_hash(model, opt),
                                     "equals_snapshot": (equals_snapshot(monitor, data["to_step"])
                                                         if data["action"] == "rewind" else None)})
            else:
                # the state the run continues with at monitor.step (what a snapshot at that step holds)
                history[monitor.step] = shards_hash(model, opt)
            if rewound_long_enough(after_rewind, step, args.after_rewind):
                break
            if args.pace:
                time.sleep(args.pace)
    finally:
        if counter is not None:
            counter.__exit__(None, None, None)
            counter.unwrap()
        monitor.close()
    out = {"rank": rank, "world": world, "losses": losses, "after_rewind": after_rewind, "history": history,
           "rewinds": rewind.rewinds if rewind is not None else [], "final_hash": shards_hash(model, opt),
           "agent_steps": monitor.step,
           "snapshots": ([s.step for s in monitor._remedy.store.slots if s.step is not None and s.valid]
                         if rewind is not None else [])}
    if counter is not None:
        out["collective_calls"] = counter.calls
        out["collective_ops"] = counter.ops
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
