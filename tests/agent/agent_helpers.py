"""Agent test helpers: tiny real models, the checklist's training loops, a recording transport."""
from __future__ import annotations

import json
import threading
from typing import Optional

import torch

from agent.transport import Delivery


class RecordingTransport:
    """Stands in for the HTTP transport (STYLE point 7: injected through ``transport=``).

    Keeps every batch body it was given; ``status`` makes it answer errors.
    """

    def __init__(self, status: int = 200):
        self.status = status
        self.bodies: list[dict] = []
        self._lock = threading.Lock()

    def post(self, body: bytes) -> Delivery:
        with self._lock:
            if self.status >= 300 or self.status == 0:
                return Delivery(self.status, "refused")
            self.bodies.append(json.loads(body))
            return Delivery(self.status, '{"accepted": 1}')

    @property
    def steps(self) -> list[dict]:
        with self._lock:
            return [s for b in self.bodies for s in b["steps"]]

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [e for b in self.bodies for e in b.get("events", [])]

    def meta(self) -> Optional[dict]:
        with self._lock:
            return next((b["meta"] for b in self.bodies if b.get("meta")), None)


class TinyNet(torch.nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, bn: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.bn = torch.nn.BatchNorm1d(hidden) if bn else torch.nn.Identity()
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.bn(self.fc1(x))))


class ShadowEMA:
    """The checklist's EMA class (section 4.4), verbatim in behaviour."""

    def __init__(self, model, decay=0.9):
        self.shadow = {}
        self.decay = decay
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.shadow[name] = param.data.clone()

    def update(self, model):
        for name, param in model.named_parameters():
            if param.requires_grad:
                new_average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]
                self.shadow[name] = new_average.clone()


def batches(n: int, batch: int = 16, d_in: int = 8, d_out: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(n)]


def checklist_step(model, opt, scaler, x, y, ema=None, max_norm=1.0, amp=False):
    """One iteration of the checklist's loop (sections 2.4 / 9.1)."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
        loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
    scaler.step(opt)
    scaler.update()
    if ema is not None:
        ema.update(model)
    return loss.detach(), total
