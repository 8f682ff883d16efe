"""The share of gradient elements that are exactly zero after unscale: per parameter and over the model.

fp16 gradients below ~6e-8 underflow to zero (the checklist's section 2.1): the loss scale exists to
keep them representable, and a loss scale that collapses, or a layer whose gradients shrink, shows as
a rising share of exact zeros well before training visibly stalls. Sampled with the weight norms
(``weights_every``), right before the optimizer step, where the grads are unscaled.

Cost on a sampled step: two small kernels per parameter tensor (a comparison and a sum), no host sync;
nothing on the other steps.
"""
from __future__ import annotations

import torch

from gradwatch.agent.collectors.base import Collector, scatter_measured


class GradZeroFraction(Collector):
    name = "grad_zero_fraction"
    needs = ("optimizer",)
    every = "weights_every"
    emits = ("grad_zero_fraction", "layers.grad_zero_fraction", "layers.grad_zero_count_local", "layers.numel_local")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.zeros = None     # (per-parameter zero counts, which parameters had a grad) on a sampled step

    def wanted(self) -> bool:
        return self.interval > 0 and super().wanted()

    def before_optimizer_step(self, step) -> None:
        if self.zeros is not None or not self.due(step) or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name), torch.no_grad():
            w = self.watched
            grads = w.grads() or [p.grad for p in w.params]
            have = [g is not None for g in grads]
            if not any(have):
                return
            counts = torch.stack([(g == 0).sum() for g in grads if g is not None])
            self.zeros = (counts, have)

    def end_step(self, step, rec) -> None:
        zeros, self.zeros = self.zeros, None
        if zeros is None or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            counts, have = zeros
            params = self.watched.weights()   # sharded: the local elements this rank counted
            sizes = [max(p.numel(), 1) for p, h in zip(params, have) if h]   # an empty shard counts 0 of 1
            size_t = torch.tensor(sizes, dtype=torch.float32, device=counts.device)
            frac = counts.to(torch.float32) / size_t
            rec.add("grad_zero_fraction", counts.sum().to(torch.float32) / float(sum(sizes)))
            index = [i for i, h in enumerate(have) if h]
            rec.add("layers.grad_zero_fraction", scatter_measured(frac, index, len(params)))
            if self.watched.local:
                # sharded: this rank's zero counts and element counts per parameter, which the server adds
                # up over the distinct pieces into the full parameters' share (server/ranks.py). An empty
                # piece counts 0 of 0 there (``sizes`` above counts it as 1 only to divide by it here).
                numel = torch.tensor([float(p.numel()) for p, h in zip(params, have) if h], device=counts.device)
                rec.add("layers.grad_zero_count_local", scatter_measured(counts, index, len(params)))
                rec.add("layers.numel_local", scatter_measured(numel, index, len(params)))
