"""The logged run the import tests share: a healthy stretch, then a poisoned one.

Every value is a float32 (TensorBoard's SummaryWriter stores scalars as float32, W&B
as float64), so one list is what both loggers hold and what gradwatch must store.
Steps 0-239 train normally; then a loss spike (C3), a grad-norm explosion (A2), the
loss scale halving every step until it is below 1 (B3) and a NaN loss (A1).
"""
from __future__ import annotations

import math

import numpy as np

STEPS = 320
SPIKE_STEP, EXPLOSION_STEP, COLLAPSE_FROM, NAN_STEP = 240, 260, 280, 300

# tag -> signal, as the default tag map reads these names (HF Trainer's, and a GradScaler logged by hand)
TAGS = {"train/loss": "loss", "train/grad_norm": "grad_norm", "train/learning_rate": "lr", "scaler/scale": "loss_scale"}
UNMAPPED = ("train/epoch",)


def f32(x: float) -> float:
    return float(np.float32(x))


def series() -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {t: [] for t in (*TAGS, *UNMAPPED)}
    scale = 65536.0
    for i in range(STEPS):
        loss = 2.5 * math.exp(-i / 400) + 0.03 * math.sin(i * 0.7)
        if i == SPIKE_STEP:
            loss = 40.0
        if i >= NAN_STEP:
            loss = math.nan
        grad = 1.0 + 0.1 * math.sin(i * 1.3)
        if i == EXPLOSION_STEP:
            grad = 900.0
        if i >= NAN_STEP:
            grad = math.inf
        lr = 1e-3 * min(1.0, (i + 1) / 50)
        if i == 100:
            scale *= 2           # the scaler's growth after its growth interval of clean steps
        if i >= COLLAPSE_FROM:
            scale /= 2
        out["train/loss"].append((i, f32(loss)))
        out["train/grad_norm"].append((i, f32(grad)))
        out["train/learning_rate"].append((i, f32(lr)))
        out["scaler/scale"].append((i, f32(scale)))
        out["train/epoch"].append((i, f32(i / 100)))
    return out


def by_signal() -> dict[str, dict[int, float]]:
    """signal -> {step: value}: what gradwatch must hold after the import."""
    return {TAGS[t]: dict(points) for t, points in series().items() if t in TAGS}


def wire_steps(times: dict[int, float]) -> list[dict]:
    """The same series as the agent would send it (docs/wire-format.md), for the live comparison."""
    def wire(v: float):
        return v if math.isfinite(v) else ("NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity"))

    signals = by_signal()
    return [{"step": i, "time": times[i], **{sig: wire(vals[i]) for sig, vals in signals.items()}} for i in range(STEPS)]
