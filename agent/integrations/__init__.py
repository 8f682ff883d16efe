"""Framework integrations: a callback per framework, or a ``watch`` per custom-loop stack, that calls
``agent.attach`` for you.

* :mod:`agent.integrations.hf` — ``GradwatchCallback`` for ``transformers.Trainer``
* :mod:`agent.integrations.lightning` — ``GradwatchCallback`` for Lightning's ``Trainer``
* :mod:`agent.integrations.accelerate` — ``watch(accelerator, model, optimizer)`` for an Accelerate loop
* :mod:`agent.integrations.fabric` — ``watch(fabric, model, optimizer)`` for a Lightning Fabric loop
* :mod:`agent.integrations.deepspeed` — ``watch(engine)`` for a DeepSpeed engine

This package imports neither framework: each submodule imports its own
framework when it is imported, so ``from gradwatch import agent`` stays torch + standard
library only. The shared bookkeeping below, and the callbacks' common base
(:mod:`agent.integrations.callback`), are framework-free.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

log = logging.getLogger("gradwatch.integrations")


class StepLoss:
    """Sums the loss tensors of one optimizer step's micro-batches, on their device.

    The frameworks back-propagate ``loss / accumulation_steps`` per micro-batch;
    the sum of those tensors over one optimizer step is the step's mean loss,
    the number both frameworks log. Tensors are detached and added on the
    device: no host-device sync happens here.
    """

    __slots__ = ("total", "parts")

    def __init__(self) -> None:
        self.total: Optional[torch.Tensor] = None
        self.parts = 0

    def add(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor):
            return
        value = loss.detach().float()
        if value.numel() != 1:
            value = value.mean()
        value = value.reshape(())
        self.total = value if self.total is None else self.total + value
        self.parts += 1

    def take(self) -> Optional[torch.Tensor]:
        """The step's summed loss (None if nothing was added), and a fresh start."""
        total, self.total, self.parts = self.total, None, 0
        return total


def report_loss(monitor: Any, loss: Optional[torch.Tensor]) -> None:
    """``monitor.log(loss=...)`` that never raises into the training loop."""
    if monitor is None or loss is None:
        return
    try:
        monitor.log(loss=loss)
    except Exception:  # noqa: BLE001 - never hurt the host process
        log.exception("gradwatch: could not report the loss; continuing without it")


def close_monitor(monitor: Any, *, crashed: bool = False) -> None:
    if monitor is None:
        return
    try:
        if crashed and hasattr(monitor, "close"):
            try:
                monitor.close(status="crashed")
                return
            except TypeError:
                pass
        monitor.close()
    except Exception:  # noqa: BLE001
        log.exception("gradwatch: closing the monitor failed")
