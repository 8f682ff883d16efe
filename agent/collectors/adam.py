"""Adam's second moment going stale (H1): per parameter, this step's mean(g²) over Adam's mean(v̂).

Adam divides each update by √v̂, an exponential average of g² that, with β2 = 0.999 or 0.9999,
remembers a thousand steps or more. When a layer's gradients suddenly grow past what v̂ remembers,
the update m̂ / (√v̂ + ε) grows with them, and the loss spikes a few steps later ("consistently 1-8
iterations after", Wortsman et al. 2023, arXiv:2304.13013). What this collector records, for every
parameter tensor Adam holds state for::

    adam_g2_over_v = mean(g²) / (mean(v̂_prev) + ε²)      v̂_prev = exp_avg_sq / (1 - β2^step)

where g is the gradient the optimizer is about to use (unscaled, after clipping) and ``exp_avg_sq``
and ``step`` are read from ``optimizer.state[p]`` right before the optimizer step (``max_exp_avg_sq``
with ``amsgrad``). A healthy layer sits near 1; a stale one reads 100 or more.

Cost: a handful of kernels on vectors of one value per parameter, no weight or state copied. sum(v)
comes from Adam's own recursion, sum(v) = β2·sum(v) + (1 - β2)·‖g‖² (exact: v ≥ 0 is updated element by
element), carried in float64 from step to step, where a parameter's step counter says Adam updated it;
it is read from the state with one fused ``torch._foreach_norm(exp_avg_sq, 1)`` (v ≥ 0: its L1 norm is its
sum) on the first measured step, after any change of the optimizer's state, after a step not measured,
with ``amsgrad`` (a running max) and every :attr:`AdamStaleness.EXACT_EVERY` steps. ‖g‖² comes from the
grad norms :class:`~agent.collectors.grads.GradNorms` measures anyway (the clipping factor
``min(1, max_norm / (norm + 1e-6))`` applied as ``clip_grad_norm_`` does).
No host sync: the step counters are stacked where they live (CPU tensors by default, sent on through
pinned memory; device ones, capturable or fused, stay on the device).

Composed for optimizers whose state holds ``exp_avg_sq`` and ``step`` (torch.optim.Adam / AdamW, in
their for-loop, foreach and fused forms); another optimizer turns it off at its first step. Not on
sharded runs (FSDP / DTensor): the clipping factor there needs the global norm (docs/signals.md).
"""
from __future__ import annotations

from typing import Optional

import torch

from gradwatch.agent.collectors.base import Collector, place_measured, to_device


def adam_like(optimizer) -> bool:
    """An optimizer whose per-parameter state this collector can read (betas and eps in its defaults).

    >>> m = torch.nn.Linear(2, 1)
    >>> adam_like(torch.optim.AdamW(m.parameters())), adam_like(torch.optim.SGD(m.parameters(), lr=0.1))
    (True, False)
    """
    defaults = getattr(optimizer, "defaults", None)
    return isinstance(defaults, dict) and "betas" in defaults and "eps" in defaults


def _stackable(steps: list) -> bool:
    """Adam's step counters are 0-d tensors on one device (the usual case): one ``torch.stack`` reads them."""
    return (all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in steps)
            and len({t.device for t in steps}) == 1)


def _step_counts(steps: list, device: torch.device, stackable: bool) -> torch.Tensor:
    """Adam's step counters as one float64 vector on ``device``, without reading a device value: CPU
    tensors (Adam's default) are stacked there and sent through pinned memory; device ones (capturable,
    fused on CUDA) are stacked on the device."""
    if stackable:
        stacked = torch.stack(steps).to(torch.float64)
        if stacked.device == device or device.type == "cpu":
            return stacked.to(device)
        return (stacked.pin_memory() if device.type == "cuda" else stacked).to(device, non_blocking=True)
    if all(isinstance(t, torch.Tensor) for t in steps):
        return torch.stack([t.reshape(()).to(device, torch.float64, non_blocking=True) for t in steps])
    return to_device([float(t) for t in steps], torch.float64, device)   # plain numbers


class AdamStaleness(Collector):
    name = "adam_state"
    order = 100
    needs = ("optimizer",)
    every = "adam_every"
    emits = ("adam_g2_over_v_max", "layers.adam_g2_over_v")
    # sum(v) is read from the state (one fused L1 norm) on the first measured step, after any change of
    # the optimizer's state, after a step not measured, and every EXACT_EVERY steps; in between it is
    # carried forward with Adam's own recursion (float64), which bounds any drift to EXACT_EVERY steps
    EXACT_EVERY = 100

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.pending = None       # (mean v̂ + eps² per kept parameter, kept indices) between the hooks
        self._cached: Optional[tuple] = None   # (key, layout) of :meth:`_layout`
        # (layout, step, sum(v) per kept parameter before that step, Adam's counters then, that step's g²)
        self.carry: Optional[tuple] = None
        self._index_cache: dict[tuple, tuple] = {}

    def wanted(self) -> bool:
        w = self.watched
        if self.interval <= 0 or w.local or not super().wanted():
            return False
        return w.optimizer is None or adam_like(w.optimizer)   # a scaler may hand the optimizer over later

    def _layout(self, opt) -> Optional[tuple]:
        """(kept parameter indices, their second moments, their step counters, [sizes, eps²] and β2 on the
        device), rebuilt only when the optimizer's state or settings change: Adam updates its state
        tensors in place, so step after step they are the same objects (a ``load_state_dict`` replaces
        ``optimizer.state``, a parameter's first step adds an entry, a β2 / eps change shows in the key)."""
        state, groups = opt.state, opt.param_groups
        key = (id(opt), id(state), len(state), len(groups),
               tuple((g["betas"][1], g["eps"], bool(g.get("amsgrad")), len(g["params"])) for g in groups))
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        group_of = {id(p): g for g in groups for p in g["params"]}
        keep: list[int] = []
        vs: list[torch.Tensor] = []
        steps: list = []
        beta2s: list[float] = []
        eps2: list[float] = []
        sizes: list[int] = []
        exact_only = False    # amsgrad: v̂ is a running max, which no recursion of sums follows
        for i, p in enumerate(self.watched.params):
            st = state.get(p)
            g = group_of.get(id(p))
            if not st or g is None:
                continue          # no state yet (Adam's first step) or not this optimizer's
            v = st.get("max_exp_avg_sq" if g.get("amsgrad") else "exp_avg_sq")
            t = st.get("step")
            if v is None or t is None or v.numel() == 0:
                continue
            keep.append(i)
            vs.append(v)
            steps.append(t)
            exact_only = exact_only or bool(g.get("amsgrad"))
            beta2s.append(float(g["betas"][1]))
            eps2.append(float(g["eps"]) ** 2)
            sizes.append(v.numel())
        layout = None
        if vs:
            dev = vs[0].device
            # β2 in float64: 1 - β2^t loses digits to cancellation in float32 (early steps)
            # float64 throughout: 1 - β2^t loses digits to cancellation in float32 (early steps)
            beta2_t = to_device(beta2s, torch.float64, dev)
            n_eps2 = to_device([n * e for n, e in zip(sizes, eps2)], torch.float64, dev)
            layout = (keep, vs, steps, n_eps2, beta2_t, 1.0 - beta2_t, dev, exact_only, _stackable(steps))
        self._cached = (key, layout)
        return layout

    def before_optimizer_step(self, step) -> None:
        if self.pending is not None or not self.due(step) or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name), torch.no_grad():
            opt = self.watched.optimizer
            if opt is None or not adam_like(opt):
                self.guards.disabled.add(self.name)   # not an Adam: the signal does not exist
                return
            layout = self._layout(opt)
            if layout is None:
                return
            keep, vs, steps, n_eps2, beta2_t, one_minus_beta2, dev, exact_only, stackable = layout
            counts = _step_counts(steps, dev, stackable)   # Adam's counters now: after the previous update
            carry, self.carry = self.carry, None
            if (carry is not None and carry[0] is layout and carry[1] == step - 1 and step % self.EXACT_EVERY
                    and not exact_only):
                # sum(v) after the previous update, from the one before: v = β2 v + (1 - β2) g² element by
                # element, so sum(v) = β2 sum(v) + (1 - β2) ‖g‖², where the counter says Adam updated it
                _, _, sums, before, g2 = carry
                sums = torch.where(counts > before, torch.addcmul(g2 * one_minus_beta2, beta2_t, sums), sums)
            else:
                sums = torch.stack(torch._foreach_norm(vs, 1)).to(torch.float64)   # v >= 0: L1 norm = sum
            # n · (mean(v̂) + eps²) = sum(v) / (1 - β2^t) + n · eps²: the denominator of
            # mean(g²) / (mean(v̂) + eps²) = ‖g‖² / that, computed before the step changes v
            denom = (sums / (1.0 - beta2_t ** counts) + n_eps2).float()
            self.pending = (denom, keep, layout, sums, counts)

    def end_step(self, step, rec) -> None:
        pending, self.pending = self.pending, None
        if pending is None or not self.guards.on(self.name):
            return
        with self.guards.guard(self.name):
            denom, keep, layout, sums, counts = pending
            parts = dict(rec.parts)    # GradNorms (composed first) added this step's grad norms already
            per, total = parts.get("layers.grad_norm"), parts.get("grad_norm")
            if per is None or total is None:
                return
            grad_index = rec.index.get("layers.grad_norm", self.watched.all_index)
            found = self._indices(tuple(keep), grad_index, per.device)
            if found is None:
                return
            rows, cols, scatter = found      # None: every position, in order (the usual step)
            g2 = (per if cols is None else per.index_select(0, cols)).float() ** 2
            max_norm = rec.host.get("clip_max_norm")
            if max_norm is not None:
                coef = torch.clamp(max_norm / (total.float() + 1e-6), max=1.0)
                g2 = g2 * (coef * coef)
            if rows is None:
                ratio = g2 / denom
                g2_kept = g2            # float32: the float64 recursion promotes it
            else:
                ratio = g2 / denom.index_select(0, rows)
                g2_kept = torch.zeros(len(keep), dtype=torch.float64, device=g2.device).index_copy(
                    0, rows, g2.double())
            # what the next step needs to advance sum(v) without reading v (a parameter without a grad:
            # Adam skipped it, its counter did not move, so its g² is never used)
            self.carry = (layout, step, sums, counts, g2_kept)
            out = ratio
            if scatter is not None:    # some parameters without state or grad: "not measured" there
                out = place_measured(ratio, scatter, len(self.watched.params))
            rec.add("adam_g2_over_v_max", ratio.max())
            rec.add("layers.adam_g2_over_v", out)

    def _indices(self, keep: tuple, grad_index: list, device) -> Optional[tuple]:
        """(positions in the kept list, positions in the grad-norm vector, positions among all parameters)
        of the parameters that have both Adam state and a grad this step, each None where it is every
        position in order; None when there are none. Cached: it is the same step after step."""
        key = (keep, tuple(grad_index), str(device))
        if key in self._index_cache:
            return self._index_cache[key]
        at = {p: k for k, p in enumerate(grad_index)}
        both = [(r, at[p], p) for r, p in enumerate(keep) if p in at]
        hit = None
        if both:
            def index(values: list, n: int):
                return None if values == list(range(n)) else to_device(values, torch.long, device)
            hit = (index([r for r, _, _ in both], len(keep)), index([c for _, c, _ in both], len(grad_index)),
                   index([p for _, _, p in both], len(self.watched.params)))
        if len(self._index_cache) > 64:
            self._index_cache.clear()
        self._index_cache[key] = hit
        return hit
