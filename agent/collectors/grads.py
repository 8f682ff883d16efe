"""Per-parameter and global grad norms after unscale, before clipping; the clip_grad_norm_ hand-off.

The step builder calls :meth:`GradNorms.grads_final` where the grads are final
(the unscale inside ``scaler.step()``, before ``scaler.step()`` after an
explicit ``unscale_``, the optimizer's step pre-hook); the ``clip_grad_norm_``
patch hands over clipping calls for the model's parameters (:meth:`GradNorms.on_clip`).

The one writer of ``grad_norm`` and ``clip_max_norm`` (agent/owners.py): a loop that knows them where
the agent measured nothing (DeepSpeed under ZeRO 1/2 leaves no ``p.grad``; its engine clips without
torch's function) reports them through ``monitor.log``, and :meth:`GradNorms.report` decides.
"""
from __future__ import annotations

from typing import Optional

import torch

from gradwatch.agent.capture import clip as clip_capture
from gradwatch.agent.capture.norms import grad_norms
from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.signals import per_rank


class GradNorms(Collector):
    name = "grad_norms"
    order = 10
    # sharded parameters (FSDP, DTensor): the norms of this rank's shards, under their per-rank names (the
    # signal table's, agent/signals.py), which the server combines
    emits = ("grad_norm", "layers.grad_norm", "clip_max_norm")
    reports = ("grad_norm", "clip_max_norm")

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

    grads_final = measure   # the hook point the step builder calls (agent/collectors/base.py)

    def measured(self, name: str):
        """This step's global grad norm so far (a 0-d device tensor; sharded: this rank's shards'), or None."""
        grads = self.grads
        return grads[2] if grads else None

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
            local = self.watched.local   # sharded: under the per-rank names the table declares (per_rank)
            rec.add(per_rank("grad_norm", local), total)
            # parameters without a grad go out "not measured"
            rec.add(per_rank("layers.grad_norm", local), per, None if len(index) == len(self.watched.params) else index)

    def report(self, key, value, rec, ended) -> bool:
        """The loop's ``clip_max_norm`` (a number: the one the agent saw wins) or global ``grad_norm`` (a
        float or a 0-d tensor: the step's unless the agent measured its own, then a custom scalar; not a
        scalar, or sharded parameters, where the server combines the ranks' norms: the custom path)."""
        if key == "clip_max_norm":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self.guards.warn.warning("log:clip_max_norm",
                                         "gradwatch: monitor.log(clip_max_norm=...) needs a number; ignored")
            elif not ended:   # the step is still going: end_step puts the threshold on the record
                if self.clip_max_norm is None:
                    self.clip_max_norm = float(value)
            elif rec.host.get("clip_max_norm") is None:   # the ended step's: the one end_step wrote wins
                rec.host["clip_max_norm"] = float(value)
            return True
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return False   # the custom path warns
            value = value.detach().reshape(()).clone()   # the loop's tensor may change in place
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        else:
            value = float(value)
        if self.watched.local:
            return False   # sharded: the agent's norms are this rank's shards', the server combines them
        if not ended:   # the step is still going: the agent may measure at its end
            rec.hold_report(key, value)
        elif any(k in _OWN_NORMS for k, _ in rec.parts):
            rec.keep_custom(key, value)   # the agent's own measurement won
        else:
            # A number goes in as a 0-d CPU tensor, a part like the measured norm (read the same way by the
            # wire); with a record on CUDA that means one more copy at the seal, for a loop that already synced.
            rec.add("grad_norm", value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32))
        return True


# the step totals end_step writes (one process, a sharded rank): either means the agent measured the step's norm
_OWN_NORMS = ("grad_norm", per_rank("grad_norm", True))
