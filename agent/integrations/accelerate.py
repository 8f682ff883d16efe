"""gradwatch for a Hugging Face Accelerate loop (``accelerate.Accelerator``).

``agent.attach`` takes Accelerate's prepared objects as they are (the ``AcceleratedOptimizer`` is
unwrapped to the torch optimizer it holds, ``agent/unwrap.py``)::

    model, opt, loader = accelerator.prepare(model, opt, loader)
    monitor = agent.attach(model, accelerator.scaler, optimizer=opt)

With a scaler (``mixed_precision="fp16"`` on a GPU) that is all: the agent sees each loss Accelerate
passes to ``scaler.scale()``. Without one (``"no"``, ``"bf16"``) the loss comes from
``monitor.log(loss=...)``; :func:`watch` does that for you, from ``accelerator.backward``::

    from gradwatch.agent.integrations.accelerate import watch

    monitor = watch(accelerator, model, opt, project="nlp", run="exp-42")
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = criterion(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad()
    monitor.close()

What each signal comes from:

* steps: the torch optimizer's step hooks. ``AcceleratedOptimizer.step`` calls the optimizer only
  when Accelerate syncs the gradients (``accelerator.sync_gradients``), so one gradwatch step is one
  real optimizer step, not one micro-batch of ``gradient_accumulation_steps``;
* loss: with :func:`watch` and no scaler, the tensor ``accelerator.backward`` receives divided by
  ``gradient_accumulation_steps`` (what Accelerate itself back-propagates), summed over the step's
  micro-batches on the device (no sync): the step's mean loss;
* grad norm: the pre-clip norm of the gradients ``accelerator.clip_grad_norm_`` clips, the value it
  returns (Accelerate >= 1.16 computes it with ``torch.nn.utils.get_total_norm`` and clips with
  ``clip_grads_with_norm_``, which the agent observes; agent/capture/clip.py).
"""
from __future__ import annotations

from typing import Any

from gradwatch import agent

from . import log

__all__ = ["watch"]


def watch(accelerator: Any, model: Any, optimizer: Any = None, **attach_kwargs: Any) -> Any:
    """``agent.attach(model, accelerator.scaler, optimizer=optimizer, ...)``, and the loss from
    ``accelerator.backward`` when no GradScaler sees it. Returns the monitor.

    The wrapper is set on the accelerator instance and does nothing once the monitor is closed."""
    scaler = getattr(accelerator, "scaler", None)
    monitor = agent.attach(model, scaler, optimizer=optimizer, **attach_kwargs)
    if scaler is None:   # with a scaler (enabled or not) Accelerate calls scaler.scale(loss): the agent sees it
        _report_backward_loss(accelerator, monitor)
    return monitor


def _report_backward_loss(accelerator: Any, monitor: Any) -> None:
    # watch() again: replace the earlier wrapper instead of stacking a second one (the loss twice)
    original = getattr(accelerator.backward, "_gradwatch_original", accelerator.backward)

    def backward(loss, **kwargs):
        if not monitor.closed:
            try:
                # Accelerate divides by gradient_accumulation_steps in backward(), except under its
                # DeepSpeed plugin, where the engine divides (accelerate 1.x, Accelerator.backward)
                steps = getattr(accelerator, "gradient_accumulation_steps", 1) or 1
                if str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED"):
                    steps = 1
                value = loss.detach()
                monitor.log(loss=value / steps if steps != 1 else value)
            except Exception:  # noqa: BLE001 - never hurt the host process
                log.exception("gradwatch: could not report the loss; continuing without it")
        return original(loss, **kwargs)

    backward._gradwatch_original = original
    accelerator.backward = backward
