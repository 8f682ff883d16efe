"""gradwatch for Lightning (``lightning.pytorch``, or the older ``pytorch_lightning``).

Add the callback; nothing else in the training script changes::

    from gradwatch.agent.integrations.lightning import GradwatchCallback

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

try:  # the unified package first, then the standalone one
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import Callback  # type: ignore[no-redef]

from . import log
from .callback import GradwatchCallbackBase

__all__ = ["GradwatchCallback"]


class GradwatchCallback(GradwatchCallbackBase, Callback):
    """Streams a Lightning ``Trainer.fit`` run to gradwatch.

    Takes the arguments of :class:`~agent.integrations.callback.GradwatchCallbackBase`
    (``ema=``, ``project=``, ``run=``, ``server=`` and any other ``agent.attach`` setting).
    """

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self._checkpoints_pending: list[int] = []   # steps of checkpoints being saved, path not known yet

    # ------------------------------------------------------------------ Lightning hooks

    def on_train_start(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            return
        optimizers = list(trainer.optimizers)
        if len(optimizers) > 1:
            log.warning("gradwatch: %d optimizers; monitoring the first (learning rate, steps)", len(optimizers))
        configs = list(getattr(trainer, "lr_scheduler_configs", None) or [])
        self._attach(pl_module, getattr(trainer.precision_plugin, "scaler", None),
                     optimizers[0] if optimizers else None, run=self.run, global_step=trainer.global_step,
                     scheduler=getattr(configs[0], "scheduler", None) if configs else None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # The agent closes a step's record at the model's next forward call, but
        # a LightningModule's training_step need not call its own forward
        # (``self.net(x)`` instead of ``self(x)``): close it here, at the start
        # of every micro-batch, so that no step waits for a forward that never comes.
        if self.monitor is None:
            return
        if self._checkpoints_pending:
            self._record_saved_checkpoints(trainer)
        self._call("seal_step")

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
            self._call("remeasure_grads")
        self._report_step_loss()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # Called while the checkpoint dict is built, before the file is written, and Lightning
        # tells no callback the file's path: note the step and name the path at the next hook,
        # once the ModelCheckpoint that saved it has recorded it (_record_saved_checkpoints).
        if self.monitor is not None:
            self._checkpoints_pending.append(int(trainer.global_step))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # stop_on: Lightning ends the fit after this batch (checkpoint callbacks still run at its end)
        if self._stop_requested():
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._record_saved_checkpoints(trainer)
        self._finish()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._record_saved_checkpoints(trainer)
        self._finish(crashed=not isinstance(exception, KeyboardInterrupt))

    # ------------------------------------------------------------------ helpers

    def _record_saved_checkpoints(self, trainer) -> None:
        """Record the checkpoints noted by on_save_checkpoint, with the path each ModelCheckpoint wrote.

        ModelCheckpoint keeps the file it wrote last and its step only in private attributes
        (``_last_checkpoint_saved``, ``_last_global_step_saved``, Lightning 2.x); read with
        getattr, so a Lightning without them, or a user's own ``trainer.save_checkpoint(path)``,
        records the checkpoint's step with no path."""
        pending, self._checkpoints_pending = self._checkpoints_pending, []
        for step in dict.fromkeys(pending):
            paths = []
            try:
                for cb in getattr(trainer, "checkpoint_callbacks", None) or ():
                    saved = getattr(cb, "_last_checkpoint_saved", None)
                    if saved and getattr(cb, "_last_global_step_saved", None) == step and saved not in paths:
                        paths.append(str(saved))
            except Exception:  # noqa: BLE001 - a path is a nicety; the step is recorded anyway
                paths = []
            for path in paths or [None]:
                self._record_checkpoint(path, step, "lightning")
