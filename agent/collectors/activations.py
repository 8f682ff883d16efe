"""Activation mean / std / abs-max / non-finite count per module, every ``activations_every`` steps
and on every step of a NaN hunt.

Each module is watched on the sampled step's first forward only
(:func:`~agent.collectors.base.after_forward`, undone by a model-level post hook when
that forward returns), so other steps pay nothing for it.
"""
from __future__ import annotations

import torch

from gradwatch.agent.capture.activation_stats import activation_stats, first_tensor
from gradwatch.agent.collectors.base import OneForwardHooks, after_forward


class ActivationStats(OneForwardHooks):
    name = "activations"
    order = 50
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
        self.hook_this_forward([after_forward(m, self._seen(i)) for i, (_, m) in enumerate(modules)])

    def _seen(self, index: int):
        guards, guard = self.guards, self.guards.guard("activations")

        def seen(output):
            if index in self.seen or "activations" in guards.disabled:
                return
            with guard:
                t = first_tensor(output)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                    self.seen.add(index)
                    self.acts.append((index, activation_stats(t)))
        return seen

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
