"""The step's loss scale and overflow flag: the GradScaler's private tensors, cloned, no sync; or the loop's report.

``GradScaler.get_scale()`` syncs (STYLE point 3), so this reads ``_scale`` and
``_per_optimizer_states[...]["found_inf_per_device"]`` (:func:`agent.unwrap.scaler_found_inf`)
before the original ``update()`` runs.

The one writer of ``overflow`` and ``loss_scale`` (agent/owners.py), so it is composed without a
GradScaler too: a loss scaler the agent does not hook (DeepSpeed's fp16 ``DynamicLossScaler``) is
reported through ``monitor.log(overflow=..., loss_scale=...)``, and :meth:`LossScale.report` makes the
report the step's value where the GradScaler gave none.
"""
from __future__ import annotations

import torch

from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.unwrap import scaler_enabled, scaler_found_inf


class LossScale(Collector):
    name = "scaler"
    order = 20
    emits = ("loss_scale", "overflow")
    reports = ("overflow", "loss_scale")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.scale = None
        self.found_inf = None

    def before_scaler_update(self) -> None:
        """Right before ``scaler.update()``: the scale used for this step and whether it overflowed."""
        s = self.watched.scaler
        self.scale = self.found_inf = None
        if not scaler_enabled(s) or getattr(s, "_scale", None) is None:
            return
        self.scale = s._scale.detach().clone()
        self.found_inf = scaler_found_inf(s, device=s._scale.device)

    def end_step(self, step, rec) -> None:
        if self.scale is not None:
            rec.add("loss_scale", self.scale)
        if self.found_inf is not None:
            rec.add("overflow", self.found_inf)   # found_inf: 1 (or more, one per device) when it skipped the step
        self.scale = self.found_inf = None

    def report(self, key, value, rec, ended) -> bool:
        """A loss scaler's ``overflow`` flag (a bool, true on a step it skipped) or ``loss_scale`` (the scale
        the step's loss was multiplied by), reported by the loop: the step's, unless the GradScaler gave
        its own (then a custom scalar). Not a scalar of the right type: ignored, with a warning (a tensor
        of several values: the custom path warns)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return False
            value = value.detach().reshape(()).clone()   # the loop's tensor may change in place
        elif isinstance(value, bool) and key == "overflow" or \
                isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        else:
            self.guards.warn.warning("log:" + key, "gradwatch: monitor.log(%s=...) needs %s; ignored", key,
                                     "a bool" if key == "overflow" else "a number")
            return True
        if not ended:   # the step is still going: the GradScaler may give its own at the end
            rec.hold_report(key, value)
        elif rec.host.get(key) is not None or any(k == key for k, _ in rec.parts):
            rec.keep_custom(key, value)   # the GradScaler's own won
        elif key == "overflow":
            # A part, where the GradScaler's found_inf goes (the wire counts overflow_count from it), made on
            # the device of the record's other parts so the seal stays one copy (a fill, no sync). It marks
            # the step's loss scaler active, as a GradScaler would: the wire stores the flag only then, and a
            # non-finite grad norm on such a step is the scaler's business, not an incident.
            if isinstance(value, torch.Tensor):
                flag = value.float()
            else:
                device = rec.parts[0][1].device if rec.parts else None
                flag = torch.full((), value, dtype=torch.float32, device=device)
            rec.add("overflow", flag)
            rec.scaler_active = True
        elif isinstance(value, torch.Tensor):
            rec.add("loss_scale", value.float())
        else:
            rec.host["loss_scale"] = value
        return True
