"""Activation mean / std / abs-max / non-finite count per module, every ``activations_every`` steps
and on every step of a NaN hunt.

The per-module forward hooks (and a model-level post hook that removes them)
are registered on the sampled step's first forward and removed when it
returns, so other steps pay nothing for them.
"""
from __future__ import annotations

from typing import Any

import torch

from gradwatch.agent.capture.activations import activation_stats, first_tensor
from gradwatch.agent.collectors.base import Collector


class ActivationStats(Collector):
    name = "activations"
    every = "activations_every"
    while_hunting = True

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.acts: list[tuple[int, torch.Tensor]] = []
        self.seen: set[int] = set()
        self.handles: list[Any] = []

    def on_first_forward(self, step, args, kwargs) -> None:
        # Removes these hooks after this forward; installed only on such steps, so the
        # usual forward has no post hook to run.
        self.handles.append(self.watched.model.register_forward_hook(self._on_forward_post))
        for i, (_, m) in enumerate(self.watched.modules):
            self.handles.append(m.register_forward_hook(self._hook(i)))

    def _on_forward_post(self, module, args, output):
        if self.handles:
            for h in self.handles:
                h.remove()
            self.handles = []
        return None

    def _hook(self, index: int):
        def hook(module, args, output):
            if index in self.seen or "activations" in self.guards.disabled:
                return None
            with self.guards.guard("activations"):
                t = first_tensor(output)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                    self.seen.add(index)
                    self.acts.append((index, activation_stats(t)))
            return None
        return hook

    def end_step(self, step, rec) -> None:
        acts = self.acts
        if acts:
            self.acts, self.seen = [], set()
            rec.host["act_index"] = [i for i, _ in acts]
            rec.add("act", torch.stack([s for _, s in acts]))
        elif self.seen:
            self.seen = set()

    def detach(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self.handles = []
