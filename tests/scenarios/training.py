"""The training loop every scenario runs: the checklist's loop (section 9.1) with the real agent.

autocast (optional) → GradScaler.scale → backward → unscale_ → clip → step → update → EMA,
with hooks where a scenario injects its failure. Nothing here fakes a signal:
the agent measures what the loop does.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from gradwatch import agent
from gradwatch.agent.demo import EMA   # the checklist's EMA (section 4.4), as the demo uses it

# Collectors sampled every 5 steps (the agent's defaults are 10-100) so that short
# runs give the layer rules (B5, D3, E1-E3) enough samples; the same for every run.
AGENT_CONFIG = dict(weights_every=5, activations_every=5, bn_every=5, inputs_every=1, ema_every=1,
                    flush_interval=0.2)


@dataclass
class Scenario:
    """One row of the confusion table: a real run that must fire ``target`` (None: a healthy run that
    must raise nothing above info).

    Early-warning scenarios also give ``onset``: the loop's losses -> the step where the failure shows
    in the loss (the first loss spike or NaN, :func:`loss_onset`). The lead time, ``onset`` minus the
    target alert's first step, goes into the table and must be at least ``min_lead`` steps."""
    name: str
    target: Optional[str]
    project: str
    build: Callable[[], Any]
    what: str
    onset: Optional[Callable[[list[float]], Optional[int]]] = None
    min_lead: Optional[int] = None
    held_out: bool = False          # not used to tune its rule's thresholds: reported apart (docs/rules.md)


def loss_onset(losses: list[float], *, factor: float = 3.0, window: int = 50, start: int = 20) -> Optional[int]:
    """The first step, from ``start`` on, whose loss is non-finite or above ``factor`` times the median of
    the ``window`` losses before it: where a loss spike or divergence begins. None: the loss never did."""
    for i in range(start, len(losses)):
        x = losses[i]
        if not math.isfinite(x):
            return i
        prior = [v for v in losses[max(0, i - window):i] if math.isfinite(v)]
        if prior and x > factor * statistics.median(prior):
            return i
    return None


@dataclass
class Loop:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]          # step -> (x, y)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]         # (output, y) -> loss
    steps: int
    amp: Optional[torch.dtype] = None
    scaler: Optional[Any] = None                                       # default: GradScaler("cpu")
    clip: Optional[float] = 1.0
    ema_decay: Optional[float] = 0.99
    schedule: Optional[Callable[[int], float]] = None                  # step -> lr multiplier
    before_step: Optional[Callable[[int, "Loop"], None]] = None        # failure injection
    agent_config: dict = field(default_factory=lambda: dict(AGENT_CONFIG))

    def run(self, *, server: str, project: str, run: str) -> dict:
        torch.set_num_threads(1)
        scaler = self.scaler if self.scaler is not None else torch.amp.GradScaler("cpu")
        ema = EMA(self.model, self.ema_decay) if self.ema_decay else None
        base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        monitor = agent.attach(self.model, scaler, optimizer=self.optimizer, ema=ema, project=project, run=run,
                               server=server, **self.agent_config)
        losses = []
        try:
            for step in range(self.steps):
                if self.schedule is not None:
                    for g, lr in zip(self.optimizer.param_groups, base_lrs):
                        g["lr"] = lr * self.schedule(step)
                if self.before_step is not None:
                    self.before_step(step, self)
                x, y = self.batch(step)
                self.optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                    out = self.model(x)
                loss = self.loss(out.float(), y)
                scaler.scale(loss).backward()
                scaler.unscale_(self.optimizer)
                if self.clip:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                scaler.step(self.optimizer)
                scaler.update()
                if ema is not None:
                    ema.update(self.model)
                losses.append(float(loss.detach()))
        finally:
            monitor.close()
        finite = [v for v in losses if math.isfinite(v)]
        return {"steps": self.steps, "first_loss": losses[0] if losses else None,
                "last_finite_loss": finite[-1] if finite else None,
                "nonfinite_steps": sum(1 for v in losses if not math.isfinite(v)), "losses": losses}


def mlp(d_in: int = 8, hidden: int = 32, d_out: int = 1, depth: int = 2, act=nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth):
        layers += [nn.Linear(d, hidden), act()]
        d = hidden
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


def regression_data(seed: int, batch: int = 64, d_in: int = 8, noise: float = 0.1):
    """A learnable smooth target with label noise, fresh batches each step."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, 1, generator=g)

    def make(step: int):
        x = torch.randn(batch, d_in, generator=g)
        y = torch.tanh(x @ w) + 0.5 * torch.sin(x[:, :1] * 2) + noise * torch.randn(batch, 1, generator=g)
        return x, y
    return make


def classification_data(seed: int, batch: int = 64, d_in: int = 8, classes: int = 4):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, d_in, generator=g) * 2

    def make(step: int):
        y = torch.randint(0, classes, (batch,), generator=g)
        x = centers[y] + torch.randn(batch, d_in, generator=g)
        return x, y
    return make
