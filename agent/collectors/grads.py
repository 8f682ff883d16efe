"""Per-parameter and global grad norms after unscale, before clipping; the clip_grad_norm_ hand-off.

The step builder calls :meth:`GradNorms.measure` where the grads are final
(the unscale inside ``scaler.step()``, before ``scaler.step()`` after an
explicit ``unscale_``, the optimizer's step pre-hook); the ``clip_grad_norm_``
patch hands over clipping calls for the model's parameters (:meth:`GradNorms.on_clip`).
"""
from __future__ import annotations

from typing import Optional

import torch

from gradwatch.agent.capture import clip as clip_capture
from gradwatch.agent.capture.norms import grad_norms
from gradwatch.agent.collectors.base import Collector


class GradNorms(Collector):
    name = "grad_norms"
    # sharded parameters (FSDP, DTensor): the norms of this rank's shards, which the server combines
    emits = ("grad_norm", "layers.grad_norm", "grad_norm_local", "layers.grad_norm_local", "clip_max_norm")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.grads = None                           # (per-param norms, index, total) once measured; False: none
        self.clip_max_norm: Optional[float] = None

    def wanted(self) -> bool:
        return True   # also records clip_max_norm; the grad_norms setting only stops the measuring

    def measure(self) -> None:
        """Measure the grads now, once per step."""
        if self.grads is None and self.watched.config.grad_norms and self.guards.on("grad_norms"):
            with self.guards.guard("grad_norms"):
                w = self.watched
                self.grads = grad_norms(w.params, w.all_index, w.grads()) or False

    def remeasure(self) -> None:
        """Forget this step's measurement and measure again (the grads changed since)."""
        self.grads = None
        self.measure()

    def on_clip(self, parameters: list, max_norm, norm_type, error_if_nonfinite, foreach, original):
        """Called by the clip_grad_norm_ patch. Returns (handled, total_norm)."""
        w = self.watched
        if not parameters or id(parameters[0]) not in w.param_ids or not self.guards.on("clip"):
            return False, None
        try:
            if not isinstance(max_norm, torch.Tensor):
                self.clip_max_norm = float(max_norm)
            # Sharded: this rank's norm is not the global one, so clipping stays torch's (with the
            # collective the user asked for); the agent only measures its local shards first.
            if (self.grads is None and not w.local and not error_if_nonfinite and float(norm_type) == 2.0
                    and w.config.grad_norms and self.guards.on("grad_norms")
                    and list(map(id, parameters)) == w.param_id_list):   # the model's parameters, in order
                grads = grad_norms(w.params, w.all_index)
                if grads:
                    self.grads = grads
                    clip_capture.clip_with_norm(parameters, max_norm, grads[2], foreach)
                    return True, grads[2]
            self.measure()  # before the original clips the grads in place
        except Exception as e:  # noqa: BLE001
            self.guards.disabled.add("clip")
            self.guards.warn.warning("guard:clip", "gradwatch: clip capture failed and is now off: %r", e)
        return True, original(parameters, max_norm, norm_type=norm_type,
                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def on_clip_with_norm(self, parameters: list, max_norm) -> None:
        """Called by the ``clip_grads_with_norm_`` patch (a clip with a norm the caller computed, e.g.
        accelerate's): note the threshold and measure the grads before they are scaled in place."""
        if parameters and id(parameters[0]) in self.watched.param_ids:
            self.before_module_clip(max_norm)

    def before_module_clip(self, max_norm) -> None:
        """The model's own ``clip_grad_norm_`` (FSDP1) is about to clip: measure the grads first."""
        if self.guards.on("clip"):
            with self.guards.guard("clip"):
                if not isinstance(max_norm, torch.Tensor):
                    self.clip_max_norm = float(max_norm)
                self.measure()

    def end_step(self, step, rec) -> None:
        grads, self.grads = self.grads, None
        rec.host["clip_max_norm"], self.clip_max_norm = self.clip_max_norm, None
        if grads:
            per, index, total = grads
            local = self.watched.local
            rec.add("grad_norm_local" if local else "grad_norm", total)
            # parameters without a grad go out "not measured"
            rec.add("layers.grad_norm_local" if local else "layers.grad_norm", per,
                    None if len(index) == len(self.watched.params) else index)
