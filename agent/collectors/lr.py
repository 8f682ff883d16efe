"""The learning rate of each parameter group, every step (tensor LRs stay on the device).

With remediation cooling an update (agent/rewinder.py), a float ``lr`` is the one that update used: the
step builder hands the factor over in the record (``rec.lr_factor``), and this, the signal's one writer,
applies it.
"""
from __future__ import annotations

import torch

from gradwatch.agent.collectors.base import Collector


class LearningRate(Collector):
    name = "lr"
    order = 30
    needs = ("optimizer",)
    emits = ("lr",)    # the other groups' LRs go as custom scalars, "lr/<group>"

    def end_step(self, step, rec) -> None:
        opt = self.watched.optimizer
        if opt is None or not self.guards.on("lr"):
            return
        host = rec.host
        with self.guards.guard("lr"):
            groups = opt.param_groups
            lr = groups[0].get("lr") if len(groups) == 1 else None
            if lr.__class__ is float:   # the usual case: one group, a float LR
                host["lr"] = lr if rec.lr_factor is None else lr * rec.lr_factor
                groups = ()
            for i, g in enumerate(groups):
                lr = g.get("lr")
                key = "lr" if i == 0 else f"lr/{i}"
                if isinstance(lr, torch.Tensor):
                    rec.add(key if i == 0 else "custom:" + key, lr.detach().clone())
                elif lr is not None:
                    if i == 0:
                        host["lr"] = float(lr) if rec.lr_factor is None else float(lr) * rec.lr_factor
                    elif len(groups) > 1:
                        rec.keep_custom(key, float(lr))
