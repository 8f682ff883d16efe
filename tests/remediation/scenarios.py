"""Runs that really break, and the same runs healed by ``remediate=Rewind(...)`` (docs/remediation.md).

Each scenario is a tiny real model trained on the CPU by a plain loop (no GradScaler: nothing else stops
a NaN from reaching the weights) with the real agent and a real server:

* ``poisoned_batch``: one batch holds an Inf feature; the loss is NaN and, without a scaler, the
  weights go NaN with it: every later step is NaN (rule A1);
* ``bad_stretch``: 30 batches whose labels are off by a factor of 50 (a corrupt shard); the loss
  spikes (C3), Adam's moments blow up and the model needs hundreds of steps to recover;
* ``lr_spike``: an LR override multiplies the LR by 200 for 10 steps of the loop (not of the
  scheduler: a rewind restores the scheduler, and a fault in the schedule itself would come back);
  the grad norm explodes and the weights go non-finite (A2, A1);
* ``attention_divergence``: the attention-logit growth of tests/scenarios/early_logits.py (a
  Transformer LM on a copy task, AdamW at 0.12 on the queries and keys, no qk-layernorm): the logits
  grow until the softmax turns one-hot and the loss degrades (H2 / H12 warn early; C3 as it breaks).

Three runs each (:func:`run_three`): ``clean`` (no fault), ``broken`` (the fault, no remediation),
``remediated`` (the fault, ``remediate=policy(name)``). The loop is paced at ``PACE_S`` a step
(a real model's step is longer than these tiny ones'): the alert's round trip then takes a few
tens of steps, as it would. Only rank 0, a single process.

    python -m tests.remediation.scenarios poisoned_batch      # the three runs of one, with a server
"""
from __future__ import annotations

import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
from gradwatch.agent import Rewind

PACE_S = 0.003
AGENT_CONFIG = dict(flush_interval=0.2, announce=False)


@dataclass
class Loop:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Callable[[int], tuple]                       # step -> (x, y)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    steps: int
    fault: Callable[[int, tuple, "Loop"], tuple] = lambda step, xy, loop: xy   # (step, batch) -> batch
    lr_at: Optional[Callable[[int], float]] = None     # step -> LR multiplier (a scheduler writing the LR)
    clip: Optional[float] = None
    amp: Optional[torch.dtype] = None                   # CPU autocast dtype (bf16)
    extra: dict = field(default_factory=dict)

    def run(self, *, server: Optional[str], project: str, run: str, remediate: Optional[Rewind] = None,
            faulty: bool = True, pace: float = PACE_S, mode: str = "online") -> dict:
        """Train ``steps`` steps; the losses and what the agent did. ``server`` None: no agent at all."""
        torch.set_num_threads(1)
        sched = (torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_at) if self.lr_at is not None else None)
        monitor = None
        if server is not None or mode != "online":
            monitor = agent.attach(self.model, optimizer=self.optimizer, scheduler=sched, project=project, run=run,
                                   server=server, remediate=remediate, mode=mode, **AGENT_CONFIG)
        losses: list[float] = []
        stopped_at = None
        try:
            for step in range(self.steps):
                xy = self.batch(step)
                if faulty:
                    xy = self.fault(step, xy, self)
                x, y = xy
                self.optimizer.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=self.amp or torch.bfloat16, enabled=self.amp is not None):
                    out = self.model(x)
                loss = self.loss(out.float(), y)
                loss.backward()
                if self.clip:
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                self.optimizer.step()
                if sched is not None:
                    sched.step()
                if monitor is not None:
                    monitor.log(loss=loss)
                losses.append(float(loss.detach()))
                if monitor is not None and monitor.should_stop:
                    stopped_at = step
                    break
                if pace:
                    time.sleep(pace)
        finally:
            info = {"rewinds": monitor.rewinds if monitor is not None else [],
                    "snapshot_bytes": monitor.snapshot_bytes if monitor is not None else 0}
            if monitor is not None:
                monitor.close()
        return {"losses": losses, "stopped_at": stopped_at, **info}


def final_loss(losses: list[float], tail: int = 20) -> float:
    """The mean of the last ``tail`` losses (NaN when any is non-finite: a broken run ends broken)."""
    last = losses[-tail:]
    return sum(last) / len(last) if last and all(math.isfinite(v) for v in last) else math.nan


# --------------------------------------------------------------------------- the scenarios

def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def _regression(seed: int, batch: int = 64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 1, generator=g)

    def make(step: int):
        gs = torch.Generator().manual_seed(seed * 100_003 + step)   # batch i is the same in every run
        x = torch.randn(batch, 8, generator=gs)
        y = torch.tanh(x @ w) + 0.5 * torch.sin(x[:, :1] * 2) + 0.05 * torch.randn(batch, 1, generator=gs)
        return x, y
    return make


def poisoned_batch() -> Loop:
    model = _mlp(1)

    def fault(step, xy, loop):
        x, y = xy
        if step == 250:
            x = x.clone()
            x[5, 3] = math.inf          # one corrupt record: inf * w - inf * w = NaN in the first layer
        return x, y
    return Loop(model, torch.optim.Adam(model.parameters(), lr=2e-3), _regression(1), F.mse_loss, steps=600,
                fault=fault)


def bad_stretch() -> Loop:
    model = _mlp(2)

    def fault(step, xy, loop):
        x, y = xy
        return (x, y * 50.0 + 20.0) if 250 <= step < 280 else (x, y)   # a corrupt shard: 30 batches
    return Loop(model, torch.optim.Adam(model.parameters(), lr=3e-3), _regression(2), F.mse_loss, steps=600,
                fault=fault)


def lr_spike() -> Loop:
    """An LR override that hits for 10 steps of wall time (someone's hot fix, a stale config push): the loop
    writes the LR each step, as a scheduler would, from its own step count, so a rewind does not replay it."""
    model = _mlp(3)
    base = 0.05

    def fault(step, xy, loop):
        for g in loop.optimizer.param_groups:
            g["lr"] = base * (200.0 if 250 <= step < 260 else 1.0)
        return xy
    return Loop(model, torch.optim.SGD(model.parameters(), lr=base, momentum=0.9), _regression(3), F.mse_loss,
                steps=600, fault=fault)


def attention_divergence(qk_norm: bool = False) -> Loop:
    from tests.scenarios.early_logits import build_loop

    src = build_loop("attn", qk_norm=qk_norm)
    warm = 400

    def lr_at(step: int) -> float:
        return min(1.0, (step + 1) / warm)
    # the same model, optimizer, data and loss as the early-warning scenario; its warm-up as a LambdaLR
    return Loop(src.model, src.optimizer, src.batch, src.loss, steps=src.steps, lr_at=lr_at)


def policy(name: str) -> Rewind:
    """A fresh policy object for one run (it records what it did)."""
    return {
        # C3 only where the spikes come from the data: on these small MLPs' converged, noisy losses C3 also
        # warns on healthy stretches, and each such warning would cost a rewind (docs/remediation.md)
        "poisoned_batch": lambda: Rewind(every=100, keep=2, on=("A1", "A2"), lr_factor=1.0, cool_steps=0),
        "bad_stretch": lambda: Rewind(every=100, keep=3, on=("A1", "A2", "C3"), lr_factor=0.5, cool_steps=100),
        "lr_spike": lambda: Rewind(every=100, keep=2, on=("A1", "A2"), lr_factor=0.5, cool_steps=100),
        "attention_divergence": lambda: Rewind(every=50, keep=3, on=("A1", "A2", "C3"), cool_on=("H2", "H12"),
                                               lr_factor=0.25, cool_steps=1000),
    }[name]()


BUILDERS: dict[str, Callable[[], Loop]] = {
    "poisoned_batch": poisoned_batch,
    "bad_stretch": bad_stretch,
    "lr_spike": lr_spike,
    "attention_divergence": attention_divergence,
}


def clean_loop(name: str) -> Loop:
    loop = BUILDERS[name]()
    if name == "attention_divergence":
        # the clean run: the same LM and LRs with qk-layernorm (the repository's healthy control,
        # tests/scenarios/early_logits.py attention_qk_norm): the fault is the missing normalisation
        return attention_divergence(qk_norm=True)
    return loop


def run_three(name: str, server: str, project: str = "remediation", pace: float = PACE_S) -> dict[str, Any]:
    """The clean, broken and remediated runs of one scenario, against ``server``."""
    tag = uuid.uuid4().hex[:6]
    out: dict[str, Any] = {}
    out["clean"] = clean_loop(name).run(server=server, project=project, run=f"{name}-clean-{tag}", faulty=False,
                                        pace=pace)
    broken = BUILDERS[name]()
    out["broken"] = broken.run(server=server, project=project, run=f"{name}-broken-{tag}", pace=pace)
    healed = BUILDERS[name]()
    out["remediated"] = healed.run(server=server, project=project, run=f"{name}-remediated-{tag}",
                                   remediate=policy(name), pace=pace)
    out["runs"] = {k: f"{name}-{k}-{tag}" for k in ("clean", "broken", "remediated")}
    return out


if __name__ == "__main__":   # pragma: no cover - a developer's look at one scenario
    from tests.conftest import start_sqlite_server
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        srv = start_sqlite_server(Path(tmp))
        try:
            for n in sys.argv[1:] or list(BUILDERS):
                r = run_three(n, srv.url)
                print(n, {k: (round(final_loss(v["losses"]), 4), len(v["rewinds"]))
                          for k, v in r.items() if k != "runs"})
                for d in r["remediated"]["rewinds"]:
                    print("   ", d)
        finally:
            srv.stop()
