"""Opt-in remediation: skip an optimizer update whose grad norm spikes far above its recent history.

``agent.attach(..., skip_spikes=True)`` (settings ``skip_sigma``, 6, and
``skip_window``, 128): an update whose pre-clip grad norm is more than
``skip_sigma`` standard deviations above the mean of the last ``skip_window``
accepted steps is undone, as OLMo-core's skip-step optimizers do (6σ over 128
steps; no decision before ``max(20, window // 2)`` steps of history). An
update with a non-finite grad norm is undone too, from the first step:
without a GradScaler (bf16 / fp32) nothing else would stop it from writing NaN
into the weights, and even with one, finite fp32 grads of ~1e20 and more have
an infinite norm (the sum of squares overflows) that the scaler does not
skip. A step the scaler skipped itself (``found_inf``) is left to it and is
not counted here.

Why a snapshot and not zeroed grads: an optimizer with state (Adam's moments,
momentum, weight decay) still moves the weights on a zero gradient. So, right
before the update, the parameters and the optimizer's state tensors are
copied into buffers kept for the purpose (one fused copy), and right after
it, ``torch.where(skip, saved, now)`` puts them back on a spike — elementwise
selection, so a NaN in the rejected update cannot leak through, and the
decision stays a device tensor: **no host-device sync**. The cost is memory
for one copy of the parameters and optimizer state, and two passes over them
per step; that is why it is opt-in.

What is not restored: state that lives on another device than its parameter
(torch's Adam keeps ``step`` on the CPU unless ``capturable`` / ``fused``; it
would need a sync), so on a GPU a skipped step still counts in Adam's bias
correction; the LR scheduler (it stepped, as OLMo-core's does); the
GradScaler's scale. Each skip sets the step's ``skipped_update`` signal (a
flag on the grad-norm chart); :attr:`SkipSpikes.count` is the running total on
the device.

Sharded parameters (FSDP / DTensor): each rank sees only its shard's norm, and
ranks deciding differently would desynchronise the model, so the guard stays
off there (logged once). DDP ranks see the same all-reduced grads and decide alike.

Imports torch only.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class SkipSpikes:
    """The guard of one monitor: :meth:`before_update` / :meth:`after_update` around each optimizer update."""

    name = "skip_spikes"

    def __init__(self, watched: Any, guards: Any, *, sigma: float, window: int):
        self.watched, self.guards = watched, guards
        self.sigma, self.window = float(sigma), int(window)
        self.min_history = max(20, self.window // 2)
        self.count: Optional[torch.Tensor] = None     # skipped updates so far (device, int64)
        self._history: Optional[torch.Tensor] = None  # last `window` accepted grad norms; NaN: an empty slot
        self._slot = 0
        self._live: list[torch.Tensor] = []           # parameters and optimizer state tensors ...
        self._saved: list[torch.Tensor] = []          # ... and their snapshot buffers
        self._shape_key: Any = None
        self._armed = False                            # a snapshot of this update is waiting
        self._decision: Optional[torch.Tensor] = None  # this step's skip flag, for the step record

    def usable(self) -> bool:
        if self.watched.local:
            self.guards.warn.warning("skip_spikes:sharded", "gradwatch: skip_spikes is off for sharded parameters "
                                     "(each rank sees only its shard's grad norm; ranks must decide alike)")
            return False
        if not self.watched.config.grad_norms:
            self.guards.warn.warning("skip_spikes:grad_norms", "gradwatch: skip_spikes needs grad_norms=True "
                                     "(it reads the agent's pre-clip grad norm); it is off")
            return False
        return True

    # ------------------------------------------------------------------ training thread

    def before_update(self) -> None:
        """Right before the optimizer changes the weights: snapshot what it will change."""
        opt = self.watched.optimizer
        if opt is None:
            return
        self._refresh(opt)
        if self._live:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, self._live)
            self._armed = True

    def after_update(self, grad_norm: Optional[torch.Tensor], found_inf: Optional[torch.Tensor]) -> None:
        """Right after the update (or after the scaler skipped it): decide on the device, undo a spike.

        ``found_inf``: the GradScaler's overflow flag of this step (None without an active scaler)."""
        if not self._armed:
            return
        self._armed = False
        if grad_norm is None:
            return
        with torch.no_grad():
            g = grad_norm.detach().reshape(()).float()
            if self._history is None or self._history.device != g.device:
                self._history = torch.full((self.window,), float("nan"), device=g.device)
                self.count = torch.zeros((), dtype=torch.int64, device=g.device)
            h = self._history
            valid = ~torch.isnan(h)
            mean = torch.nanmean(h)
            std = torch.nanmean((h - mean).square()).sqrt()
            finite = torch.isfinite(g)
            spike = finite & (valid.sum() >= self.min_history) & (g > mean + self.sigma * std)
            skip = spike | ~finite
            if found_inf is not None:      # the scaler skipped this one itself
                skip = skip & (found_inf.to(g.device).reshape(()) == 0)
            # the history holds accepted steps only: a spike must not widen the band for the next one, and
            # a rejected step (a spike, an overflow) keeps the slot's older accepted value rather than evict it
            slot = h[self._slot]
            h[self._slot] = torch.where(skip | ~finite, slot, g)
            self._slot = (self._slot + 1) % self.window
            for live, saved in zip(self._live, self._saved):
                torch.where(skip.to(live.device), saved, live, out=live)
            for fresh in self._created_by_update():
                # state the optimizer created in this very update (its first step) had no value before it:
                # zero is what a fresh start amounts to (Adam's moments and step count, SGD's momentum)
                torch.where(skip.to(fresh.device), torch.zeros((), dtype=fresh.dtype, device=fresh.device), fresh,
                            out=fresh)
            self.count += skip
            self._decision = skip

    def take_decision(self) -> Optional[torch.Tensor]:
        """This step's flag (0-d bool tensor), for the ``skipped_update`` signal; None when none was made."""
        d, self._decision = self._decision, None
        return d

    # ------------------------------------------------------------------ private

    def _created_by_update(self) -> list[torch.Tensor]:
        """Optimizer state tensors that appeared during the update just made (none but on its first step)."""
        opt = self.watched.optimizer
        if opt is None or self._shape_key is None or len(opt.state) == self._shape_key[1]:
            return []
        known = {id(t) for t in self._live}
        return [t for group in opt.param_groups for p in group["params"] for t in opt.state.get(p, {}).values()
                if isinstance(t, torch.Tensor) and t.device == p.device and t.numel() > 0 and id(t) not in known]

    def _refresh(self, opt: Any) -> None:
        """(Re)build the snapshot buffers when the optimizer's tensors changed (its state appears lazily,
        at its first step)."""
        state = opt.state
        key = (id(opt), len(state), sum(len(g["params"]) for g in opt.param_groups))
        if key == self._shape_key:
            return
        live: list[torch.Tensor] = []
        for group in opt.param_groups:
            for p in group["params"]:
                live.append(p)
                for t in state.get(p, {}).values():
                    # state on another device than its parameter (Adam's CPU `step`) would need a sync
                    if isinstance(t, torch.Tensor) and t.device == p.device and t.numel() > 0:
                        live.append(t)
        old = {id(t): s for t, s in zip(self._live, self._saved)}
        self._live = live
        self._saved = [old.get(id(t)) if id(t) in old and old[id(t)].shape == t.shape else torch.empty_like(t)
                       for t in live]
        self._shape_key = key
