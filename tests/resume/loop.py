"""A tiny real training loop with everything checklist 7.3 says a checkpoint must hold.

A Linear-BatchNorm-Linear model, AdamW with a warm-up LambdaLR, a real ``GradScaler`` on the CPU
(it scales, unscales, checks for inf and grows the scale exactly as on a GPU), a dict EMA shadow,
the torch RNG drawing the batches. ``resume`` rebuilds everything fresh and restores all of it
from a ``torch.save`` checkpoint except the parts named in ``forget``.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from gradwatch import agent

PARTS = ("scaler", "optimizer", "ema", "batchnorm", "scheduler", "rng")
WARMUP = 10


class Loop:
    def __init__(self, seed: int = 0, optimizer: str = "adamw"):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 1))
        if optimizer == "adamw":
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        else:   # SGD with momentum: a state, but no step counters to continue from
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / WARMUP))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=5)
        self.ema = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.monitor = None

    def attach(self, server, run: str, project: str = "resume", with_optimizer: bool = True, **kw):
        """``server``: a URL or a live server fixture. ``with_optimizer=False``: the agent learns the
        optimizer at the first ``scaler.step(optimizer)``, as with ``agent.attach(model, scaler)``."""
        url = server if isinstance(server, str) else server.url
        self.monitor = agent.attach(self.model, self.scaler, optimizer=self.opt if with_optimizer else None,
                                    ema=self.ema, project=project, run=run, server=url, flush_interval=0.1, **kw)
        return self.monitor

    def train(self, steps: int, overflow_at: Optional[int] = None) -> None:
        for i in range(steps):
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(self.model(x), x[:, :1] * 2)
            if i == overflow_at:
                loss = loss * math.inf   # the scaler finds inf grads and skips the step
            self.lrs.append(self.opt.param_groups[0]["lr"])
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            with torch.no_grad():
                for n, p in self.model.named_parameters():
                    self.ema[n].mul_(0.9).add_(p.detach(), alpha=0.1)
            self.opt.zero_grad()
            self.losses.append(loss.item())

    def save(self, path: Path) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                    "ema": {k: v.clone() for k, v in self.ema.items()}, "rng": torch.get_rng_state()}, path)


def resume(path: Path, forget: tuple[str, ...] = (), optimizer: str = "adamw") -> Loop:
    """A fresh loop (a new process would build the same) restored from ``path`` except ``forget``."""
    loop = Loop(seed=123, optimizer=optimizer)
    ckpt = torch.load(path, weights_only=False)
    loop.model.load_state_dict(ckpt["model"])
    if "batchnorm" in forget:     # the weights loaded, the buffers not (a parameters-only state dict)
        for m in loop.model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.reset_running_stats()
    if "optimizer" not in forget:
        loop.opt.load_state_dict(ckpt["optimizer"])
    if "scheduler" not in forget:
        loop.sched.load_state_dict(ckpt["scheduler"])
    if "scaler" not in forget:
        loop.scaler.load_state_dict(ckpt["scaler"])
    if "ema" in forget:           # re-initialised from the loaded weights
        loop.ema = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    else:
        loop.ema = ckpt["ema"]
    if "rng" not in forget:
        torch.set_rng_state(ckpt["rng"])
    return loop


@dataclass
class ResumedRun:
    """A scenario (tests/scenarios): ``first`` steps, a checkpoint, a resume under the same run name
    that forgets ``forget``, ``second`` more steps. Same ``run()`` as the scenarios' ``Loop``."""

    forget: tuple[str, ...] = ()
    first: int = 30
    second: int = 12

    def run(self, *, server: str, project: str, run: str) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ckpt.pt"
            a = Loop()
            a.attach(server, run, project=project)
            a.train(self.first)
            a.save(path)
            a.monitor.close()
            b = resume(path, forget=self.forget)
            b.attach(server, run, project=project)
            b.train(self.second)
            b.monitor.close()
        losses = a.losses + b.losses
        return {"steps": len(losses), "first_loss": losses[0], "last_finite_loss": losses[-1],
                "nonfinite_steps": sum(1 for v in losses if not math.isfinite(v))}
