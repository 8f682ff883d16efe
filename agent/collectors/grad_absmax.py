"""The largest gradient element by magnitude, after unscale: per parameter and over the model.

fp16 holds nothing above 65504: a GradScaler's scaled gradients overflow where max |g| times the scale
passes it, and the scaler skips the step (A5). The per-parameter maximum shows which layer sits nearest
that edge, and a layer whose largest elements grow step after step, before an overflow storm or a
divergence shows in the norm (a norm averages a single huge element away over millions of small ones).
Sampled with the weight norms (``weights_every``), right before the optimizer step, where the grads are
unscaled (and clipped, as the optimizer uses them).

A sharded run's rank measures its pieces of each parameter, and the server takes the largest piece: the
per-rank form and its combination are declared in agent/signals.py, as for every sharded signal.

Cost on a sampled step: one fused max-reduction over the parameter tensors on a GPU (one ``aminmax`` per
tensor on CPU, where the fused kernel is slower: agent/capture/norms.py), no host sync; nothing on the
other steps.
"""
from __future__ import annotations

import torch

from gradwatch.agent.capture.norms import abs_maxima
from gradwatch.agent.collectors.base import Collector, scatter_measured
from gradwatch.agent.signals import per_rank


class GradAbsMax(Collector):
    name = "grad_absmax"
    order = 130
    needs = ("optimizer",)
    every = "weights_every"
    emits = ("grad_absmax", "layers.grad_absmax")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.maxima = None     # (per-parameter max |g|, the parameters that had a grad) on a sampled step

    def wanted(self) -> bool:
        return self.interval > 0 and super().wanted()

    def before_optimizer_step(self, step) -> None:
        if self.maxima is not None or not self.due(step) or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name), torch.no_grad():
            grads = self.watched.present_grads()
            index = [i for i, g in enumerate(grads) if g is not None]
            if not index:
                return
            # an empty piece (a rank holding none of a small parameter) holds no element: its max is 0, which
            # leaves the other pieces' max as it is ("inf" norm: no identity for an empty tensor)
            filled = [grads[i] for i in index if grads[i].numel()]
            if len(filled) == len(index):
                self.maxima = (abs_maxima(filled), index)
                return
            found = iter(abs_maxima(filled) if filled else ())
            zero = torch.zeros((), dtype=torch.float32, device=grads[index[0]].device)
            self.maxima = (torch.stack([next(found) if grads[i].numel() else zero for i in index]), index)

    def end_step(self, step, rec) -> None:
        maxima, self.maxima = self.maxima, None
        if maxima is None or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            values, index = maxima
            rec.add("grad_absmax", values.max())
            rec.add(per_rank("layers.grad_absmax", self.watched.local),
                    scatter_measured(values, index, len(self.watched.params)))
