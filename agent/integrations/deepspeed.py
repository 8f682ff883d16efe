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
  the engine divides it (``scale_wrt_gas=True``), summed over the step's micro-batches on the device,
  both in fp32 whatever the loss's dtype (a bf16 loss is converted before it is divided);
* ``grad_norm``: ``engine.get_global_grad_norm()`` after the step, the engine's pre-clip global norm,
  reported with ``monitor.log(grad_norm=...)`` (also kept as ``custom:grad_norm``). Under ZeRO 1/2 the
  model has no ``p.grad`` at the step (they are reduced into the optimizer's partitions), so this is
  the only norm, and the stored ``grad_norm`` is the engine's; under ZeRO it is a tensor on the device,
  taken as it is (no sync in the training thread; the sender copies it out with the rest). A step
  the fp16 loss scaler skipped reports none (the engine's is an ``inf`` marker then; the step's
  ``overflow`` says it was skipped);
* ``grad_norm`` and the per-parameter grad norms at ZeRO stage 0: the agent's own measurement of
  ``p.grad`` right before the engine's step, where ``p.grad`` holds the reduced gradients; the
  agent's value wins over the engine's (stage 0 fp32 keeps no norm of the engine's: it clips with its
  own function). With fp16 at stage 0 DeepSpeed 0.19.8 does not scale the loss in
  ``engine.backward`` (only a ZeRO optimizer's ``scale_if_loss`` does), so ``p.grad`` are unscaled
  there and the engine's norm is theirs;
* ``clip_max_norm`` (and so ``clipped``): the config's ``gradient_clipping`` when it is above 0,
  reported with ``monitor.log(clip_max_norm=...)`` (the engine clips without torch's
  ``clip_grad_norm_``, which the agent would see);
* ``overflow`` (and so ``overflow_count``), with fp16: true on a step the engine skipped
  (``engine.skipped_steps`` grew in its ``engine.step()``), reported with ``monitor.log(overflow=...)``:
  the engine's loss scaler is the step's, as a GradScaler's would be (A5 reads it; the agent has no
  GradScaler here). bf16 / fp32 report none: stored false, as for any loop without a loss scaler;
* ``loss_scale``, with fp16: ``engine.optimizer.loss_scale`` read right before ``engine.step()``, the
  loss scaler's scale for the step (the one a ZeRO optimizer multiplied the step's loss by; at stage
  0 the scaler's nominal one, see above), as the GradScaler path stores the scale before
  ``update()`` (an overflowing step shows the scale that overflowed), reported with
  ``monitor.log(loss_scale=...)``; none with bf16 / fp32;
* ``custom:deepspeed_skipped_steps``: ``engine.skipped_steps``, the engine's count of steps skipped
  for an fp16 overflow or, in bf16, a non-finite grad norm (a Python int);
* ``custom:deepspeed_loss_scale``: ``engine.optimizer.loss_scale`` after the step (the next step's
  ``loss_scale``), with fp16 (a Python number the loss scaler keeps), absent otherwise;
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
                # divided in fp32: a bf16 loss divided while still bf16 was rounded to 8 bits of mantissa
                # before it was summed (rel 2e-3 off with 3 micro-steps); StepLoss sums in fp32
                value = loss.detach().float()
                step_loss.add(value / gas if gas != 1 else value)
            except Exception:  # noqa: BLE001 - never hurt the host process
                log.exception("gradwatch: could not read the loss; continuing without it")
        return backward(loss, *args, **kwargs)

    def wrapped_step(*args, **kwargs):
        boundary, skipped_before, scale_used = False, 0, None
        if not monitor.closed:
            try:
                boundary = bool(engine.is_gradient_accumulation_boundary())
                if boundary:
                    skipped_before = int(engine.skipped_steps)
                    scale_used = loss_scale(engine)   # before the loss scaler updates it in this step
                    monitor.remeasure_grads()   # p.grad, reduced, before the engine clips (ZeRO stage 0)
            except Exception:  # noqa: BLE001
                log.exception("gradwatch: reading the engine failed; continuing")
        result = step(*args, **kwargs)
        if boundary and not monitor.closed:
            try:
                monitor.log(loss=step_loss.take(), **engine_values(engine, skipped_before, scale_used))
            except Exception:  # noqa: BLE001
                log.exception("gradwatch: could not report the step; continuing without it")
        return result

    wrapped_backward._gradwatch_original, wrapped_step._gradwatch_original = backward, step
    engine.backward, engine.step = wrapped_backward, wrapped_step
    return monitor


def engine_values(engine: Any, skipped_before: int = 0, scale_used: Any = None) -> dict:
    """The engine's own numbers after a step: global grad norm and clip threshold (as the step's
    ``grad_norm`` / ``clip_max_norm`` where the agent measured none), skipped steps, LR, and with
    fp16 the loss scaler's: ``overflow`` (the engine skipped this step: ``skipped_steps`` grew past
    ``skipped_before``) and ``loss_scale`` (``scale_used``, read before the step), the step's signals
    where the agent has no GradScaler (none of its own here), and the scale after the step as custom."""
    skipped = int(engine.skipped_steps)
    out: dict[str, Any] = {"deepspeed_skipped_steps": skipped}
    fp16 = _fp16(engine)
    if fp16:   # the engine's loss scaler is this step's, as a GradScaler's would be
        out["overflow"] = skipped > skipped_before
        if isinstance(scale_used, (int, float)):
            out["loss_scale"] = float(scale_used)
    norm = engine.get_global_grad_norm()
    # an fp16 step the loss scaler skipped: the engine's norm is the inf it sets as a marker (ZeRO
    # 1/2 set it without computing one), the scaler doing its job, which the step's overflow says; no
    # norm then, as before overflow was reported (a GradScaler loop stores its measured inf there).
    # bf16 / fp32 skip on a non-finite norm too, but there it is the explosion A2 is for
    if norm is not None and not (fp16 and skipped > skipped_before):
        out["grad_norm"] = norm
    clip = engine.gradient_clipping()
    if isinstance(clip, (int, float)) and clip > 0:
        out["clip_max_norm"] = float(clip)
    if fp16:   # the scale the next step uses (the loss scaler updated it in this one)
        scale = loss_scale(engine)
        if isinstance(scale, (int, float)):
            out["deepspeed_loss_scale"] = float(scale)
    lrs = engine.get_lr()
    if lrs:
        out["deepspeed_lr"] = float(lrs[0])
    return out


def loss_scale(engine: Any) -> Any:
    """The fp16 loss scaler's current scale (``engine.optimizer.loss_scale``, a Python number), or None."""
    if not _fp16(engine):
        return None
    scale = getattr(engine.optimizer, "loss_scale", None)
    return scale if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None


def _fp16(engine: Any) -> bool:
    return bool(getattr(engine, "fp16_enabled", lambda: False)())
