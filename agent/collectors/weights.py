"""Weight norms and update norms ‖Δθ‖ (the update ratio's numerator), every ``weights_every`` steps."""
from __future__ import annotations

import torch

from gradwatch.agent.capture.norms import tensor_norms
from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.signals import per_rank


class WeightNorms(Collector):
    name = "weights"
    order = 40
    every = "weights_every"
    # update norms: the update ratio's numerator (agent/derived.py); sharded, each rank's pieces of both, under
    # the per-rank names the signal table declares (agent/signals.py, per_rank)
    emits = ("layers.weight_norm", "layers.update_norm")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.before = None   # the weights before this step's optimizer step, on sampled steps

    def wanted(self) -> bool:
        return self.interval > 0

    def before_optimizer_step(self, step) -> None:
        if self.before is None and self.due(step) and self.guards.on("weights"):
            with self.guards.guard("weights"), torch.no_grad():
                self.before = [p.detach().clone() for p in self.watched.weights()]

    def end_step(self, step, rec) -> None:
        before, self.before = self.before, None
        if self.due(step) and self.guards.on("weights"):
            with self.guards.guard("weights"):
                params = self.watched.weights()
                local = self.watched.local
                rec.add(per_rank("layers.weight_norm", local), tensor_norms(params))
                if before is not None:
                    delta = torch._foreach_sub([p.detach() for p in params], before)
                    rec.add(per_rank("layers.update_norm", local), tensor_norms(delta))
