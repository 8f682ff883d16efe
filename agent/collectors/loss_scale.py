"""The GradScaler's loss scale and overflow flag of the step: its private tensors, cloned, no sync.

``GradScaler.get_scale()`` syncs (STYLE point 3), so this reads ``_scale`` and
``_per_optimizer_states[...]["found_inf_per_device"]`` before the original
``update()`` runs.
"""
from __future__ import annotations

import torch

from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.unwrap import scaler_enabled


class LossScale(Collector):
    name = "scaler"
    needs = ("scaler",)
    emits = ("loss_scale", "overflow")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.scale = None
        self.found_inf = None

    def read(self) -> None:
        """Right before ``scaler.update()``: the scale used for this step and whether it overflowed."""
        s = self.watched.scaler
        self.scale = self.found_inf = None
        if not scaler_enabled(s) or getattr(s, "_scale", None) is None:
            return
        self.scale = s._scale.detach().clone()
        states = s._per_optimizer_states
        if len(states) == 1:   # one optimizer (the usual case): no nested comprehension
            for state in states.values():
                found = list(state["found_inf_per_device"].values())
        else:
            found = [f for state in states.values() for f in state["found_inf_per_device"].values()]
        if len(found) == 1:
            self.found_inf = found[0]   # update() only adds into it when there are several
        elif found:
            dev = s._scale.device
            self.found_inf = torch.stack([f.to(dev, non_blocking=True).reshape(()) for f in found]).sum()

    def end_step(self, step, rec) -> None:
        if self.scale is not None:
            rec.add("loss_scale", self.scale)
        if self.found_inf is not None:
            rec.add("overflow", self.found_inf)   # found_inf: 1 (or more, one per device) when it skipped the step
        self.scale = self.found_inf = None

