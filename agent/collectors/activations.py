"""Activation mean / std / abs-max / non-finite count per module, every ``activations_every`` steps
and on every step of a NaN hunt.

The per-module forward hooks (and a model-level post hook that removes them)
are registered on the sampled step's first forward and removed when it
returns, so other steps pay nothing for them.
"""
from __future__ import annotations

import torch

from gradwatch.agent.capture.activation_stats import activation_stats, first_tensor
from gradwatch.agent.collectors.base import OneForwardHooks


class ActivationStats(OneForwardHooks):
    name = "activations"
    every = "activations_every"
    while_hunting = True
    # in the order of capture.activation_stats.activation_stats's four values
    emits = ("layers.act_mean", "layers.act_std", "layers.act_absmax", "layers.act_nonfinite")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.acts: list[tuple[int, torch.Tensor]] = []
        self.seen: set[int] = set()

    def on_first_forward(self, step, args, kwargs) -> None:
        modules = self.watched.modules
        self.hook_this_forward([m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(modules)])

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
            index = [i for i, _ in acts]   # the modules measured, in forward (completion) order
            stats = torch.stack([s for _, s in acts]).unbind(1)
            for name, values in zip(self.emits, stats):
                rec.add(name, values, index)
        elif self.seen:
            self.seen = set()
