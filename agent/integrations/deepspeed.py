"""gradwatch for a DeepSpeed engine (``deepspeed.initialize``).

The engine owns what a GradScaler and an optimizer hook would tell the agent in a plain loop: the
loss scaler (fp16 ``DynamicLossScaler``), the global grad norm, the skipped steps, the step
boundary under gradient accumulation; under ZeRO stage 1 and 2 the model's ``p.grad`` are gone by
the time the optimizer steps (reduced into the optimizer's partitioned buffers). So :func:`watch`
reads the engine's own values at its step, instead of hooking the optimizer::

    from gradwatch.agent.integrations.deepspeed import watch

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    monitor = watch(engine, project="llm", run="zero2-7")
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()
    monitor.close()

What each signal comes from (one gradwatch step per optimizer step: ``engine.step()`` at the
accumulation boundary, ``engine.is_gradient_accumulation_boundary()``, skipped steps included):

* ``loss``: each loss passed to ``engine.backward``, divided by ``gradient_accumulation_steps`` as
  the engine divides it (``scale_wrt_gas=True``), summed over the step's micro-batches on the device;
* ``grad_norm`` and the per-parameter grad norms: the agent's own measurement of ``p.grad`` right
  before the engine's step, where ``p.grad`` holds the reduced gradients (ZeRO stage 0, fp32 or
  bf16). Under ZeRO 1/2 there is no ``p.grad`` then, and the agent stores no ``grad_norm`` of its own;
* ``custom:deepspeed_grad_norm``: ``engine.get_global_grad_norm()`` after the step, the engine's
  pre-clip global norm (ZeRO 1/2, and stage 0 with bf16/fp16; ``None`` for stage 0 fp32, which
  clips with torch's function and keeps no norm). Under ZeRO it is a tensor on the device, taken
  as it is (no sync in the training thread; the sender copies it out with the rest);
* ``custom:deepspeed_skipped_steps``: ``engine.skipped_steps``, the engine's count of steps skipped
  for an fp16 overflow (a Python int);
* ``custom:deepspeed_loss_scale``: ``engine.optimizer.cur_scale`` with fp16 (a Python float the
  loss scaler keeps), absent otherwise;
* ``custom:deepspeed_lr``: ``engine.get_lr()[0]``, the first param group's learning rate.

Nothing here syncs the device: the norm stays a tensor, the counters are Python numbers the
engine keeps.
"""
from __future__ import annotations

from typing import Any

from gradwatch import agent

from . import StepLoss, log

__all__ = ["watch"]


def watch(engine: Any, **attach_kwargs: Any) -> Any:
    """Attach to ``engine.module`` and record one step per ``engine.step()`` at the accumulation
    boundary, with the engine's own values. Returns the monitor. The engine's ``backward`` and
    ``step`` are wrapped on the instance and pass through once the monitor is closed."""
    monitor = agent.attach(engine.module, None, optimizer=None, **attach_kwargs)
    step_loss = StepLoss()
    # watch() again: replace the earlier wrappers instead of stacking second ones (the loss twice)
    backward = getattr(engine.backward, "_gradwatch_original", engine.backward)
    step = getattr(engine.step, "_gradwatch_original", engine.step)

    def wrapped_backward(loss, *args, **kwargs):
        if not monitor.closed:
            try:
                scale = kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)
                gas = engine.gradient_accumulation_steps() if scale else 1
                step_loss.add(loss.detach() / gas if gas != 1 else loss.detach())
            except Exception:  # noqa: BLE001 - never hurt the host process
                log.exception("gradwatch: could not read the loss; continuing without it")
        return backward(loss, *args, **kwargs)

    def wrapped_step(*args, **kwargs):
        boundary = False
        if not monitor.closed:
            try:
                boundary = bool(engine.is_gradient_accumulation_boundary())
                if boundary:
                    monitor.remeasure_grads()   # p.grad, reduced, before the engine clips (ZeRO stage 0)
            except Exception:  # noqa: BLE001
                log.exception("gradwatch: reading the engine failed; continuing")
        result = step(*args, **kwargs)
        if boundary and not monitor.closed:
            try:
                monitor.log(loss=step_loss.take(), **engine_values(engine))
            except Exception:  # noqa: BLE001
                log.exception("gradwatch: could not report the step; continuing without it")
        return result

    wrapped_backward._gradwatch_original, wrapped_step._gradwatch_original = backward, step
    engine.backward, engine.step = wrapped_backward, wrapped_step
    return monitor


def engine_values(engine: Any) -> dict:
    """The engine's own numbers after a step: global grad norm, skipped steps, fp16 loss scale, LR."""
    out: dict[str, Any] = {"deepspeed_skipped_steps": int(engine.skipped_steps)}
    norm = engine.get_global_grad_norm()
    if norm is not None:
        out["deepspeed_grad_norm"] = norm
    if getattr(engine, "fp16_enabled", lambda: False)():
        scale = getattr(engine.optimizer, "cur_scale", None)
        if isinstance(scale, (int, float)):
            out["deepspeed_loss_scale"] = float(scale)
    lrs = engine.get_lr()
    if lrs:
        out["deepspeed_lr"] = float(lrs[0])
    return out
