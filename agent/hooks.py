"""Hook adapters: where the agent plugs into PyTorch, each a thin hook with a cheap early return.

* the model's forward pre-hook (a step begins);
* the GradScaler's ``scale`` / ``unscale_`` / ``step`` / ``update``, wrapped on
  the instance (``update()`` ends a step);
* without a scaler, the optimizer's step pre- and post-hooks (the post-hook ends a step);
* the ``clip_grad_norm_`` patch (:mod:`agent.capture.clip`);
* with an EMA, a global optimizer step pre-hook that waits for whatever reads
  the weights off the training thread.

Each hook body runs under its guard (:mod:`agent.guard`) and calls one method
of the :class:`~agent.step_builder.StepBuilder`. :meth:`HookAdapters.uninstall`
removes every hook and restores the scaler's methods.
"""
from __future__ import annotations

from typing import Any, Callable

from torch.optim.optimizer import register_optimizer_step_pre_hook

from gradwatch.agent.capture import clip as clip_capture
from gradwatch.agent.registry import process


class HookAdapters:
    def __init__(self, watched: Any, builder: Any, guards: Any, barrier: Callable[[], None], clip_owner: Any):
        self.watched, self.builder, self.guards = watched, builder, guards
        self.barrier = barrier           # waits for readers of the weights off the training thread
        self.clip_owner = clip_owner     # has on_clip(...): the owner of clip_max_norm (the grad norm collector)
        self._wrapped_clip = None        # the model's own clip_grad_norm_ (FSDP1) before it was wrapped
        self._handles: list[Any] = []
        self._wrapped_scaler: dict[str, Any] = {}
        # The guards these hooks run under, looked up once (the wrappers run several times a step).
        self._forward_guard = guards.guard("forward")
        self._scaler_guard = guards.guard("scaler")
        self._optimizer_guard = guards.guard("optimizer")

    def install(self) -> None:
        w = self.watched
        self._handles.append(w.model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True))
        clip_capture.register(self.clip_owner)
        scaler = w.scaler
        if scaler is not None:
            for name in ("scale", "unscale_", "step", "update"):
                original = getattr(scaler, name)
                self._wrapped_scaler[name] = (name in scaler.__dict__, scaler.__dict__.get(name))
                setattr(scaler, name, getattr(self, "_wrap_" + name.rstrip("_"))(original))
        elif w.optimizer is not None:
            self._handles.append(w.optimizer.register_step_pre_hook(self._on_optimizer_pre))
            self._handles.append(w.optimizer.register_step_post_hook(self._on_optimizer_post))
        if callable(getattr(type(w.model), "clip_grad_norm_", None)):
            # FSDP1's own FullyShardedDataParallel.clip_grad_norm_ (torch's function would see only the
            # local shards): the grads are measured right before it clips them, so the norm stays pre-clip
            original = w.model.clip_grad_norm_
            self._wrapped_clip = "clip_grad_norm_" in w.model.__dict__, w.model.__dict__.get("clip_grad_norm_")
            object.__setattr__(w.model, "clip_grad_norm_", self._wrap_module_clip(original))
        if w.ema is not None:
            # Any optimizer step (through the scaler or not) waits for an EMA divergence job reading
            # the weights it is about to change.
            self._handles.append(register_optimizer_step_pre_hook(self._barrier_hook))

    def uninstall(self) -> None:
        for h in self._handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles = []
        clip_capture.unregister(self.clip_owner)
        scaler = self.watched.scaler
        for name, (had_own, previous) in self._wrapped_scaler.items():
            try:
                if had_own:
                    setattr(scaler, name, previous)
                else:
                    scaler.__dict__.pop(name, None)
            except Exception:  # noqa: BLE001
                pass
        self._wrapped_scaler = {}
        if self._wrapped_clip is not None:
            had_own, previous = self._wrapped_clip
            if had_own:
                object.__setattr__(self.watched.model, "clip_grad_norm_", previous)
            else:
                self.watched.model.__dict__.pop("clip_grad_norm_", None)
            self._wrapped_clip = None

    def _wrap_module_clip(self, original: Callable) -> Callable:
        guards, owner = self.guards, self.clip_owner

        def clip_grad_norm_(max_norm, norm_type=2.0):
            if not guards.closed and process.pid == guards.pid:
                owner.before_module_clip(max_norm)
            return original(max_norm, norm_type)
        return clip_grad_norm_

    # ------------------------------------------------------------------ model

    def _on_forward_pre(self, module, args, kwargs):
        guards = self.guards
        if guards.closed or process.pid != guards.pid:
            return None
        with self._forward_guard:
            self.builder.forward(args, kwargs)
        return None

    # ------------------------------------------------------------------ scaler wrappers

    def _wrap_scale(self, original):
        guards, builder, guard = self.guards, self.builder, self._scaler_guard

        def scale(outputs):
            if guards.on("scaler"):
                with guard:
                    builder.scaled(outputs)
            return original(outputs)
        return scale

    def _wrap_unscale(self, original):
        guards, builder, guard = self.guards, self.builder, self._scaler_guard

        def unscale_(optimizer):
            result = original(optimizer)
            if guards.on("scaler"):
                with guard:
                    builder.unscaled_grads()
            return result
        return unscale_

    def _wrap_step(self, original):
        guards, builder, barrier, guard = self.guards, self.builder, self.barrier, self._scaler_guard

        def step(optimizer, *args, **kwargs):
            # An EMA divergence job reads the weights this step changes. The global optimizer
            # hook waits for it too, but only for torch optimizers; the scaler takes any object.
            barrier()
            if guards.on("scaler"):
                with guard:
                    builder.scaler_step_begins(optimizer)
            try:
                result = original(optimizer, *args, **kwargs)
            finally:
                builder.in_scaler_step = False
                if builder.skip is not None or builder.remedy is not None:
                    builder.update_done()   # right after the update: a cooled LR put back, a spike undone
            if guards.on("scaler"):
                with guard:
                    builder.scaler_step_done(optimizer)
            return result
        return step

    def _wrap_update(self, original):
        guards, builder, guard = self.guards, self.builder, self._scaler_guard

        def update(new_scale=None):
            if guards.on("scaler"):
                with guard:
                    builder.before_scaler_update()   # before the original update() changes the scaler's state
            result = original(new_scale)
            if guards.on("scaler"):
                with guard:
                    builder.end_step()
            return result
        return update

    # ------------------------------------------------------------------ optimizer hooks (no scaler)

    def _on_optimizer_pre(self, optimizer, args, kwargs):
        if self.guards.on("optimizer"):
            with self._optimizer_guard:
                self.builder.before_optimizer_step()
        return None

    def _on_optimizer_post(self, optimizer, args, kwargs):
        if self.guards.on("optimizer"):
            with self._optimizer_guard:
                self.builder.end_step()
        return None

    def _barrier_hook(self, optimizer, args, kwargs):
        self.barrier()
        return None
