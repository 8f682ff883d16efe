"""Tiny real training loops for the alerts-in-the-loop tests (one step each takes a millisecond on the CPU)."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch


def regression_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 4, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5


def scaler_loop(model, optimizer, scaler, *, steps: int, nan_at: set[int] = frozenset(),
                until: Optional[Callable[[int], bool]] = None, pause: float = 0.0, first: int = 0) -> int:
    """The usual GradScaler step; a NaN loss on the steps in ``nan_at`` (the scaler skips them: a transient
    NaN that never recurs). Stops early once ``until(step)`` is true. Returns the steps taken. ``first``: the
    first step's number (a resumed loop sees the batches it would have seen)."""
    for step in range(first, first + steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in nan_at:
            loss = loss * torch.tensor(float("nan"))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if until is not None and until(step):
            return step + 1 - first
        if pause:
            time.sleep(pause)     # the loop's pace; the alert's round trip happens meanwhile
    return steps
