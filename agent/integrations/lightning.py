"""gradwatch for Lightning (``lightning.pytorch``, or the older ``pytorch_lightning``).

Add the callback; nothing else in the training script changes::

    from agent.integrations.lightning import GradwatchCallback

    trainer = L.Trainer(max_epochs=3, accumulate_grad_batches=4, gradient_clip_val=1.0,
                        callbacks=[GradwatchCallback(project="vision", run="resnet-7")])
    trainer.fit(model, datamodule)

What it attaches to, when training starts:

* the ``LightningModule`` being trained;
* the optimizer Lightning steps (``trainer.optimizers[0]``);
* the precision plugin's ``GradScaler`` (``trainer.precision_plugin.scaler``,
  present with ``precision="16-mixed"``; none in bf16 / fp32).

gradwatch's step numbers are Lightning's (``trainer.global_step`` − 1), so a
fit resumed from a checkpoint continues the run's steps.

The loss: with a scaler the agent sees every tensor Lightning passes to
``scaler.scale()``. Without one, the callback sums the tensors Lightning
back-propagates (``on_before_backward``: the ``training_step`` loss divided
by ``accumulate_grad_batches``) over the micro-batches of one optimizer step
and reports the sum just before the optimizer steps: one value per optimizer
step — the step's mean loss — never one per micro-batch.
"""
from __future__ import annotations

from typing import Any, Optional

try:  # the unified package first, then the standalone one
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import Callback  # type: ignore[no-redef]

import agent

from . import StepLoss, close_monitor, log, report_loss

__all__ = ["GradwatchCallback"]


class GradwatchCallback(Callback):
    """Streams a Lightning ``Trainer.fit`` run to gradwatch.

    Args:
        ema: the EMA to compare against (as for ``agent.attach``), if any.
        project, run, server: as for ``agent.attach``.
        **config: any other ``agent.attach`` setting (``token=``,
            ``activations_every=``, …).
    """

    def __init__(self, *, ema: Any = None, project: Optional[str] = None, run: Optional[str] = None,
                 server: Optional[str] = None, **config: Any) -> None:
        super().__init__()
        self.ema = ema
        self.project = project
        self.run = run
        self.server = server
        self.config = config
        self.monitor: Any = None
        self.scaler: Any = None
        self._step_loss = StepLoss()

    # ------------------------------------------------------------------ Lightning hooks

    def on_train_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            return
        self.scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            log.warning("gradwatch: %d optimizers; monitoring the first (learning rate, steps)", len(optimizers))
        optimizer = optimizers[0] if optimizers else None
        try:
            self.monitor = agent.attach(pl_module, self.scaler, optimizer=optimizer, ema=self.ema,
                                        project=self.project, run=self.run, server=self.server, **self.config)
        except ValueError:
            raise  # bad configuration: say so before training starts
        except Exception:  # noqa: BLE001 - never hurt the host process
            log.exception("gradwatch: attach failed; training continues unmonitored")
            return
        if trainer.global_step and hasattr(self.monitor, "step"):
            # resumed from a checkpoint: continue the run's step numbers instead of writing over them
            self.monitor.step = int(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The agent closes a step's record at the model's next forward call, but
        # a LightningModule's training_step need not call its own forward
        # (``self.net(x)`` instead of ``self(x)``): close it here, at the start
        # of every micro-batch, so that no step waits for a forward that never comes.
        if self.monitor is None:
            return
        _agent_call(self.monitor, "_seal_open")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # With a scaler this tensor is already scaled, and the agent sees the
        # unscaled one in scaler.scale(): adding it here would count it twice.
        if self.monitor is None or self.scaler is not None:
            return
        self._step_loss.add(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.monitor is None:
            return
        if self.scaler is None:
            # Without a scaler Lightning calls ``optimizer.step(closure)``: the
            # optimizer's step pre-hook, where the agent measures the grads,
            # runs before the closure's backward. Measure them again now, after
            # backward and before clipping (which Lightning does right after
            # this hook).
            if hasattr(self.monitor, "_grads"):
                self.monitor._grads = None
            _agent_call(self.monitor, "_compute_grads")
        report_loss(self.monitor, self._step_loss.take())

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._finish(crashed=not isinstance(exception, KeyboardInterrupt))

    # ------------------------------------------------------------------ helpers

    def _finish(self, *, crashed: bool = False) -> None:
        monitor, self.monitor = self.monitor, None
        self._step_loss.take()
        close_monitor(monitor, crashed=crashed)


def _agent_call(monitor: Any, name: str) -> None:
    """Call one of the agent's step-boundary methods when it has it; never raise into training."""
    method = getattr(monitor, name, None)
    if method is None:
        return
    try:
        method()
    except Exception:  # noqa: BLE001
        log.exception("gradwatch: %s failed", name)
