"""One rank of a small distributed training job, for tests/distributed (run under torchrun, gloo, CPU).

``python -m torch.distributed.run --standalone --nproc_per_node=N worker.py MODE OUT_DIR [options]``

Every rank trains the same tiny MLP on its own data, monitored by the agent (unless ``--no-agent``),
and writes PyTorch's own numbers for every step to ``OUT_DIR/rank<k>.json``: the loss, what
``clip_grad_norm_`` returned, and the full (unsharded) parameters' grad norms, weight norms, update
ratios and largest gradient elements, and the modules' activation statistics; with ``--count`` also every collective issued by this
process, so a run with the agent and one without can be compared.

MODE: ``ddp``, ``fsdp2`` (``fully_shard`` on each Linear and the root), ``hsdp`` (``fully_shard`` on a
2-D mesh: replicate x shard), ``fsdp1`` / ``fsdp1-orig`` (``FullyShardedDataParallel`` with
``use_orig_params`` False / True, ``ShardedGradScaler``), ``tp`` (tensor parallel: DTensor outputs),
``local`` (a process group but no wrapper: each rank trains its own copy, no collective per step).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")
_PY_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                   "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
                   "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list")


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives torch dispatches on this thread (c10d ops, functional collectives) and, by
    wrapping ``torch.distributed``'s functions, those called from any thread."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.calls: list[str] = []
        self.threads: set[str] = set()
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def wrap(self):
        from torch.distributed import distributed_c10d
        for module in (dist, distributed_c10d):
            for name in _PY_COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self._saved[(module, name)] = fn

                def counted(*a, __fn=fn, __name=name, **kw):
                    self.calls.append(__name)
                    self.threads.add(threading.current_thread().name)
                    return __fn(*a, **kw)
                setattr(module, name, counted)

    def unwrap(self):
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)


def count_the_sender(counter: CollectiveCounter) -> None:
    """The agent's sender thread's own work, under a counter of its own: patched before ``attach`` starts it."""
    from gradwatch.agent.sender import Sender
    run_sender = Sender._run

    def counted_run(self):
        with counter:
            run_sender(self)
    Sender._run = counted_run


def full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_norm(t, sharded_locally: bool) -> float:
    """The norm of a whole parameter (or grad): a DTensor's full tensor; FSDP1's local shards' squares
    summed over the ranks (its flat parameters and views hold disjoint pieces); anything else as is."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return float(t.full_tensor().norm())
    if sharded_locally:
        sq = t.detach().float().pow(2).sum()
        dist.all_reduce(sq)
        return float(sq.sqrt())
    return float(t.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("out")
    ap.add_argument("--server", default=None)
    ap.add_argument("--run-name", default="dist")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--count", action="store_true", help="count collectives (the training loop runs inside)")
    ap.add_argument("--perturb-rank", type=int, default=-1, help="DDP: add 1e-3 to this rank's grads after the all-reduce")
    ap.add_argument("--nan-rank", type=int, default=-1, help="this rank's loss is NaN from --nan-at on")
    ap.add_argument("--nan-at", type=int, default=10**9)
    ap.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-s extra per step")
    ap.add_argument("--slow-s", type=float, default=0.03)
    ap.add_argument("--base-s", type=float, default=0.0,
                    help="every rank sleeps this per step (a step time of a realistic size: a CPU step of a "
                         "tiny model takes ~2 ms, where a loaded machine's jitter alone can be 1.5x)")
    ap.add_argument("--slow-where", default="before-forward", choices=("before-forward", "before-end"),
                    help="where the slow rank sleeps: before its forward (a slow data loader: outside any "
                         "collective), or after backward, before the optimizer step")
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seal-grace", type=float, default=5.0,
                    help="the agent's seal_grace (the default 5 s keeps the sender from sealing a step while "
                         "the reference numbers are computed; a small one makes it seal during --base-s)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    names = [n for n, _ in model.named_parameters()]
    mode = args.mode
    scaler = None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    elif mode in ("fsdp2", "hsdp"):
        from torch.distributed.fsdp import fully_shard
        mesh = None
        if mode == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode in ("fsdp1", "fsdp1-orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        model = FullyShardedDataParallel(model, use_orig_params=mode == "fsdp1-orig", device_id=torch.device("cpu"))
        scaler = ShardedGradScaler(enabled=False)   # CPU: no fp16 grads to scale; its wrappers still run
    elif mode == "tp":
        # tensor parallel: the first Linear column-wise with a DTensor output (Shard(-1)), through Tanh
        # (a DTensor too) into the second Linear row-wise; the last Linear's parameters replicated DTensors
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=False),
                                         "2": RowwiseParallel(input_layouts=Shard(-1))})
        distribute_module(model[4], mesh,
                          input_fn=lambda mod, inputs, mesh: tuple(
                              DTensor.from_local(x, mesh, [Replicate()]) for x in inputs),
                          output_fn=lambda mod, out, mesh: out.to_local())
    elif mode == "local":
        pass          # every rank trains its own copy: no collective per step, the ranks do not wait for each other
    else:
        raise SystemExit(f"unknown mode {mode}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # an EMA of the weights in their own layout (DTensor shards under FSDP2 / TP, flat shards under FSDP1):
    # the agent measures each rank's pieces, the server combines them into the full divergence
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    monitor = None
    sender_counter = CollectiveCounter() if args.count else None
    if not args.no_agent:
        from gradwatch import agent
        if sender_counter is not None:
            count_the_sender(sender_counter)
        # without --server nothing is sent anywhere (offline: the spool under OUT_DIR only)
        monitor = agent.attach(model, scaler, optimizer=opt, ema=ema, run=args.run_name, server=args.server,
                               mode="online" if args.server else "offline",
                               weights_every=1, activations_every=1, ema_every=1, flush_interval=0.1,
                               # the reference numbers below take collectives of their own between steps;
                               # on a loaded machine they must not look like a stall (docs/agent.md)
                               seal_grace=args.seal_grace,
                               spool_dir=os.path.join(args.out, "spool"))
    watched = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Tanh, torch.nn.ReLU))]
    acts: dict[str, list] = {}

    def act_hook(name):
        def hook(module, inp, out):
            x = out.detach()
            # a DTensor output (tensor parallel) is measured on this rank's local tensor
            x = (x.to_local() if hasattr(x, "to_local") else x).float()
            std, mean = torch.std_mean(x, correction=0)
            acts[name] = [float(mean), float(std), float(x.abs().max())]
        return hook
    hooks = [m.register_forward_hook(act_hook(n)) for n, m in watched]

    counter = CollectiveCounter() if args.count else None
    if counter is not None:
        counter.wrap()
        counter.__enter__()
    # tensor parallel ranks compute one model on the same batch; data parallel ones each have their own
    g = torch.Generator().manual_seed(100 + (0 if mode == "tp" else rank))
    records = []
    params = list(model.parameters())
    for step in range(args.steps):
        x = torch.randn(4, 8, generator=g)
        y = torch.randint(0, 3, (4,), generator=g)
        opt.zero_grad()
        if args.base_s:
            time.sleep(args.base_s)
        if args.slow_rank == rank and args.slow_where == "before-forward":
            time.sleep(args.slow_s)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if args.nan_rank == rank and step >= args.nan_at:
            # a poisoned rank: its loss (and so, through the all-reduce, every rank's grads) NaN
            loss = loss * float("nan")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if args.perturb_rank == rank:
            # backward returned, so DDP's all-reduce has written the averaged grads on every rank:
            # a silent corruption of this rank's copy only
            with torch.no_grad():
                for p in params:
                    p.grad.add_(1e-3)
        if args.slow_rank == rank and args.slow_where == "before-end":
            time.sleep(args.slow_s)
        fsdp1 = mode.startswith("fsdp1")
        # FSDP1 with use_orig_params: a rank holding none of a parameter has no grad for it (an empty piece)
        grad_norms = [full_norm(p.grad if p.grad is not None else p.detach()[:0], fsdp1)
                      if p.grad is not None or fsdp1 else None for p in params]
        before = [full(p.detach()).clone() for p in params]
        grad_zero = None
        if not fsdp1:   # FSDP1's flat shards carry padding (zero grads) that is not the model's
            fulls = [full(p.grad) for p in params if p.grad is not None]
            grad_zero = sum(int((g == 0).sum()) for g in fulls) / sum(g.numel() for g in fulls)
        if fsdp1:   # FSDP1 clips with its own method (torch's function would see the local shards only)
            total = model.clip_grad_norm_(args.max_norm)
        else:
            total = torch.nn.utils.clip_grad_norm_(params, args.max_norm)
        # the largest gradient element of each full parameter, as the optimizer is about to use it (clipped)
        grad_absmax = None if fsdp1 else [float(full(p.grad).abs().max()) for p in params]
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if monitor is not None:
            monitor.log(loss=loss)
        with torch.no_grad():
            for n, p in model.named_parameters():
                ema[n].lerp_(p.detach(), 0.1)
            ema_num = sum(full_norm(ema[n] - p.detach(), fsdp1) ** 2 for n, p in model.named_parameters())
            ema_den = sum(full_norm(p.detach(), fsdp1) ** 2 for n, p in model.named_parameters())
        after = [full(p.detach()) for p in params]
        rec = {"step": step, "loss": float(loss.detach()), "clip_total": float(full(total)),
               "grad_norms": grad_norms,
               "weight_norms": [full_norm(a, fsdp1) for a in after],
               "update_ratios": [full_norm(a - b, fsdp1) / full_norm(a, fsdp1) for a, b in zip(after, before)],
               "acts": dict(acts), "ema_div": (ema_num ** 0.5) / (ema_den ** 0.5), "grad_zero": grad_zero,
               "grad_absmax": grad_absmax}
        records.append(rec)
    if counter is not None:
        counter.__exit__(None, None, None)
    for h in hooks:
        h.remove()
    if monitor is not None:
        monitor.flush(timeout=20)
        monitor.close(timeout=20)
    if counter is not None:
        counter.unwrap()
    finish(args.out, {"rank": rank, "world_size": world, "mode": mode,
                      "param_names": [n for n, _ in model.named_parameters()], "plain_param_names": names,
                      "steps": records}, monitor, counter, sender_counter)


def finish(out_dir: str, out: dict, monitor, counter, sender_counter) -> None:
    """Add what the agent disabled or dropped and the collectives counted to this rank's record, write it to
    ``out_dir/rank<k>.json``, and leave the process group with the other ranks."""
    out["disabled"] = sorted(getattr(monitor, "_disabled", ())) if monitor is not None else []
    out["dropped"] = monitor.dropped_steps if monitor is not None else 0
    if counter is not None:
        out.update(collective_ops=counter.ops, collective_calls=counter.calls,
                   collective_threads=sorted(counter.threads), sender_collective_ops=sender_counter.ops)
    Path(out_dir, f"rank{out['rank']}.json").write_text(json.dumps(out, allow_nan=True))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
