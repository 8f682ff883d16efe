"""A tiny real training loop whose setup a test chooses: the precision, the clip and its order, the
EMA, the LR scheduler. Trained through the real agent against a real server; the notes H5-H9 are
the server's reading of the ``run_setup`` event the agent sends with the first step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from gradwatch import agent
from gradwatch.agent.demo import EMA, TinyLM, make_batch

PROJECT = "advice"


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def train(server: str, run: str, *, transformer: bool = False, amp: Optional[torch.dtype] = None,
          clip: Optional[float] = 1.0, order: str = "unscale_clip_step", ema: Any = None,
          scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None, steps: int = 3,
          project: str = PROJECT, with_optimizer: bool = True) -> dict:
    """Train ``steps`` steps of the checklist's 9.1 loop under ``project`` / ``run``.

    ``order``: ``"unscale_clip_step"`` (checklist 6.1), ``"clip_without_unscale"`` or ``"clip_after_step"``.
    ``ema``: None, a decay (the checklist's EMA class) or a callable model -> EMA object.
    ``with_optimizer=False``: ``attach(model, scaler)``, the agent learns the optimizer at ``scaler.step``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TinyLM(vocab=32, d=16, layers=1, heads=2, seq=8) if transformer else mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = scheduler(opt) if scheduler is not None else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    shadow = EMA(model, ema) if isinstance(ema, float) else ema(model) if callable(ema) else None
    monitor = agent.attach(model, scaler, optimizer=opt if with_optimizer else None, ema=shadow, scheduler=sched, project=project, run=run,
                           server=server, flush_interval=0.1)
    try:
        for _ in range(steps):
            if transformer:
                x, y = make_batch(g, 4, 8, 32)
            else:
                x = torch.randn(16, 8, generator=g)
                y = x[:, :1] * 2
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
                out = model(x)
            loss = (F.cross_entropy(out.float().reshape(-1, 32), y.reshape(-1)) if transformer
                    else F.mse_loss(out.float(), y))
            scaler.scale(loss).backward()
            if order == "unscale_clip_step":
                scaler.unscale_(opt)
            if clip and order != "clip_after_step":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            if clip and order == "clip_after_step":
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.update()
            if sched is not None:
                sched.step()
            if isinstance(shadow, EMA):
                shadow.update(model)
            elif shadow is not None:
                shadow.update_parameters(model)
    finally:
        monitor.close()
    return {"steps": steps}
