"""gradwatch for a Lightning Fabric loop (``lightning.fabric.Fabric``).

``agent.attach`` takes Fabric's wrappers as they are (``_FabricModule`` is unwrapped to the module
Fabric calls, ``_FabricOptimizer`` to the torch optimizer; ``agent/unwrap.py``)::

    model, opt = fabric.setup(model, opt)
    monitor = agent.attach(model, optimizer=opt)
    ...
    fabric.backward(loss); monitor.log(loss=loss)

:func:`watch` adds the scaler of Fabric's precision plugin (``precision="16-mixed"`` on a GPU) and,
without one, reports the loss from ``fabric.backward``::

    from gradwatch.agent.integrations.fabric import watch

    monitor = watch(fabric, model, opt, project="vision", run="resnet-7")
    for i, (x, y) in enumerate(loader):
        accumulating = (i + 1) % accum != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(criterion(model(x), y) / accum)
        if not accumulating:
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step(); opt.zero_grad()
    monitor.close()

What each signal comes from:

* steps: the torch optimizer's step hooks (``_FabricOptimizer.step`` -> the strategy -> the
  optimizer's ``step``): one gradwatch step per optimizer step;
* loss: with :func:`watch` and no scaler, each tensor passed to ``fabric.backward`` (pass
  ``loss / accum``, as the loop back-propagates it), summed over the step's micro-batches on the
  device; with a scaler, the tensors Fabric passes to ``scaler.scale()``;
* grad norm: pre-clip, as ``fabric.clip_gradients`` returns it (Fabric unscales, then calls
  ``torch.nn.utils.clip_grad_norm_``, which the agent's patch computes once and hands back).
"""
from __future__ import annotations

from typing import Any

from gradwatch import agent

from . import log

__all__ = ["watch"]


def watch(fabric: Any, model: Any, optimizer: Any = None, **attach_kwargs: Any) -> Any:
    """``agent.attach(model, <Fabric's GradScaler or None>, optimizer=optimizer, ...)``, and the loss from
    ``fabric.backward`` when no GradScaler sees it. Returns the monitor."""
    precision = getattr(getattr(fabric, "strategy", None), "precision", None)
    scaler = getattr(precision, "scaler", None)   # lightning.fabric MixedPrecision.scaler (public attribute)
    monitor = agent.attach(model, scaler, optimizer=optimizer, **attach_kwargs)
    if scaler is None:
        # watch() again: replace the earlier wrapper instead of stacking a second one (the loss twice)
        original = getattr(fabric.backward, "_gradwatch_original", fabric.backward)

        def backward(tensor, *args, **kwargs):
            if not monitor.closed:
                try:
                    monitor.log(loss=tensor.detach())
                except Exception:  # noqa: BLE001 - never hurt the host process
                    log.exception("gradwatch: could not report the loss; continuing without it")
            return original(tensor, *args, **kwargs)

        backward._gradwatch_original = original
        fabric.backward = backward
    return monitor
