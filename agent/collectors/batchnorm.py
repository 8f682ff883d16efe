"""Norms of every BatchNorm's running_mean and running_var, every ``bn_every`` steps."""
from __future__ import annotations

from gradwatch.agent.capture.norms import tensor_norms
from gradwatch.agent.collectors.base import Collector


class BatchNormStats(Collector):
    name = "bn"
    order = 60
    every = "bn_every"
    needs = ("batchnorm",)
    emits = ("layers.bn_mean_norm", "layers.bn_var_norm")

    def end_step(self, step, rec) -> None:
        if self.due(step) and self.guards.on("bn"):
            with self.guards.guard("bn"):
                bns = self.watched.bns
                rec.add("layers.bn_mean_norm", tensor_norms([m.running_mean for _, m in bns]))
                rec.add("layers.bn_var_norm", tensor_norms([m.running_var for _, m in bns]))
