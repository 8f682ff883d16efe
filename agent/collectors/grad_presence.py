"""How many trainable parameter tensors have no gradient at the optimizer step (``params_without_grad``).

A parameter whose ``.grad`` is still None when the optimizer steps took no part in the backward: a
branch that forward() never calls, a stray ``.detach()``, a frozen path the optimizer still holds, or
(under DDP) a parameter that needs ``find_unused_parameters``. The loss keeps falling on the rest, so
nothing else shows it. One number per sampled step: the per-parameter grad norms (B5) name the
parameters, this counts them without reading a tensor.

Sampled with the weight norms (``weights_every``), right before the optimizer step, where the grads
the optimizer uses are there. Cost on a sampled step: one attribute read per parameter tensor on the
host, no kernel and no host sync; nothing on the other steps. Sharded runs (FSDP / DTensor) are not
measured: a rank's empty piece of a parameter has no local grad, which is not the same thing.
"""
from __future__ import annotations

from gradwatch.agent.collectors.base import Collector


class ParamsWithoutGrad(Collector):
    name = "params_without_grad"
    order = 140
    needs = ("optimizer",)
    every = "weights_every"
    emits = ("params_without_grad",)

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.count = None     # the count on a sampled step, from before_optimizer_step to end_step

    def wanted(self) -> bool:
        return self.interval > 0 and not self.watched.local and super().wanted()

    def before_optimizer_step(self, step) -> None:
        if self.count is not None or not self.due(step) or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            self.count = sum(p.grad is None for p in self.watched.params)

    def end_step(self, step, rec) -> None:
        count, self.count = self.count, None
        if count is None or not self.guards.on(self.name):
            return
        rec.host["params_without_grad"] = count
