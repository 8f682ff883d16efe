"""One rank of a custom training loop on a training stack, under ``torchrun`` (gloo, CPU; one process
or several), monitored by gradwatch: ``accelerate`` (``Accelerator(cpu=True)``), ``fabric``
(``lightning.fabric.Fabric``), ``deepspeed`` (``deepspeed.initialize`` on its CPU accelerator).

Each rank writes what the stack itself computed to ``<out>/rank<r>.json``: per optimizer step the
loss the loop back-propagated (summed over the step's micro-batches), the grad norm the stack
returned (``accelerator.clip_grad_norm_``, ``fabric.clip_gradients``, ``engine.get_global_grad_norm()``
or, for DeepSpeed stage 0 fp32, which keeps none, torch's norm of the reduced ``p.grad``), and
DeepSpeed's ``skipped_steps``, loss scale (fp16: before each step, the scale its loss was multiplied
by, and after it) and ``gradient_clipping``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import torch

ACCUM_BATCH = 4
DS_CLIP = 3.0


def _data(args, world: int):
    """Enough batches for ``args.steps`` optimizer steps on every rank, no ragged end."""
    n = ACCUM_BATCH * args.accum * args.steps * world
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 2.0 + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _attach_kwargs(args) -> dict:
    return {"project": "stacks", "run": args.run_name, "server": args.server, "flush_interval": 0.1}


class _Unknown:
    """--wrapper: an optimizer wrapper gradwatch has never seen: no ``optimizer`` attribute, none of
    ``torch.optim.Optimizer``'s private hook dictionaries; it steps the optimizer it hides."""

    def __init__(self, inner):
        self._hidden = inner

    @property
    def param_groups(self):
        return self._hidden.param_groups

    def step(self, closure=None):
        return self._hidden.step(closure)

    def zero_grad(self, set_to_none=True):
        return self._hidden.zero_grad(set_to_none=set_to_none)


def run_accelerate(args, out: Path) -> dict:
    from accelerate import Accelerator

    from gradwatch import agent
    from gradwatch.agent.integrations.accelerate import watch

    acc = Accelerator(cpu=True, mixed_precision=args.precision, gradient_accumulation_steps=args.accum)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(_data(args, acc.num_processes), batch_size=ACCUM_BATCH, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    if args.plain:   # the line, as a new user writes it; the loss through monitor.log
        monitor = agent.attach(model, acc.scaler, optimizer=opt, **_attach_kwargs(args))
    else:
        monitor = watch(acc, model, opt, **_attach_kwargs(args))
        if args.twice:   # attaching again is harmless: the same monitor, the loss reported once
            assert watch(acc, model, opt, **_attach_kwargs(args)) is monitor
    losses, norms, current = [], [], 0.0
    for x, y in loader:
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            if args.plain:
                monitor.log(loss=loss.detach() / args.accum)
            current += loss.item() / args.accum
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
                losses.append(current)
                current = 0.0
            opt.step()
            opt.zero_grad()
    monitor.close()
    return {"world_size": acc.num_processes, "steps": len(losses), "loss": losses, "grad_norm": norms,
            "distributed_type": str(acc.distributed_type), "model": type(model).__name__}


def run_fabric(args, out: Path) -> dict:
    from lightning.fabric import Fabric

    from gradwatch import agent
    from gradwatch.agent.integrations.fabric import watch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    precision = {"no": "32-true", "bf16": "bf16-mixed"}[args.precision]
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", precision=precision)
    fabric.launch()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(args, world), batch_size=ACCUM_BATCH,
                                                                  shuffle=False))
    if args.wrapper:
        opt = _Unknown(opt)
        monitor = agent.attach(model, optimizer=opt, **_attach_kwargs(args))
    else:
        monitor = watch(fabric, model, opt, **_attach_kwargs(args))
    losses, norms, current, step_loss = [], [], 0.0, None
    for i, (x, y) in enumerate(loader):
        accumulating = (i + 1) % args.accum != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) / args.accum
            fabric.backward(loss)
            step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
            current += loss.item()
        if not accumulating:
            norms.append(float(fabric.clip_gradients(model, opt, max_norm=1.0)))
            losses.append(current)
            current = 0.0
            opt.step()
            opt.zero_grad()
            if args.wrapper:   # no optimizer hook: each monitor.log(loss=...) is one step, after the update
                monitor.log(loss=step_loss)
            step_loss = None
    monitor.close()
    return {"world_size": fabric.world_size, "steps": len(losses), "loss": losses, "grad_norm": norms,
            "model": type(model).__name__}


def run_deepspeed(args, out: Path) -> dict:
    import deepspeed

    from gradwatch.agent.integrations.deepspeed import watch

    # clipping at 3.0: this loop's grad norms lie between 1.9 and 4.1, so steps on both sides of it
    config = {"train_micro_batch_size_per_gpu": ACCUM_BATCH, "gradient_accumulation_steps": args.accum,
              "gradient_clipping": DS_CLIP, "zero_optimization": {"stage": args.zero_stage},
              "steps_per_print": 10 ** 9}
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.precision == "fp16":   # DeepSpeed's DynamicLossScaler (2^16 to start: this loop overflows at once)
        config["fp16"] = {"enabled": True, "initial_scale_power": args.scale_power}
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    world = engine.world_size
    monitor = watch(engine, **_attach_kwargs(args))
    sampler = torch.utils.data.distributed.DistributedSampler(_data(args, world), num_replicas=world,
                                                              rank=engine.global_rank, shuffle=False)
    loader = torch.utils.data.DataLoader(_data(args, world), batch_size=ACCUM_BATCH, sampler=sampler)
    dtype = next(engine.module.parameters()).dtype
    losses, norms, own_norms, skipped, scales, scales_used, current = [], [], [], [], [], [], 0.0
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(loss)
        current += loss.item() / args.accum
        if boundary:
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            own_norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g.double()) for g in grads]))) if grads else None)
            # the scale this step's loss was multiplied by (the loss scaler updates it in engine.step())
            scales_used.append(float(engine.optimizer.loss_scale) if args.precision == "fp16" else None)
        engine.step()
        if boundary:
            n = engine.get_global_grad_norm()
            norms.append(None if n is None else float(n))
            skipped.append(int(engine.skipped_steps))
            scales.append(float(engine.optimizer.loss_scale) if args.precision == "fp16" else None)
            losses.append(current)
            current = 0.0
    monitor.close()
    return {"world_size": world, "steps": len(losses), "loss": losses, "grad_norm": norms,
            "p_grad_norm": own_norms, "skipped_steps": skipped, "optimizer": type(engine.optimizer).__name__,
            "clip": engine.gradient_clipping(), "loss_scale": scales, "loss_scale_used": scales_used}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("stack", choices=("accelerate", "fabric", "deepspeed"))
    ap.add_argument("out")
    ap.add_argument("--server", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--precision", choices=("no", "bf16", "fp16"), default="no",
                    help="fp16: deepspeed only (its DynamicLossScaler)")
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--scale-power", type=int, default=16, help="deepspeed fp16: initial_scale_power")
    ap.add_argument("--plain", action="store_true", help="accelerate: agent.attach + monitor.log, not watch()")
    ap.add_argument("--wrapper", action="store_true", help="fabric: hide the optimizer in an unknown wrapper")
    ap.add_argument("--twice", action="store_true", help="accelerate: call watch() twice")
    args = ap.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logging.getLogger("gradwatch.agent").addHandler(Keep(level=logging.WARNING))
    record = {"accelerate": run_accelerate, "fabric": run_fabric, "deepspeed": run_deepspeed}[args.stack](args, out)
    record.update(rank=rank, warnings=warnings)
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
