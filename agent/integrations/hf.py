"""gradwatch for the Hugging Face ``transformers.Trainer``.

Add the callback; nothing else in the training script changes::

    from agent.integrations.hf import GradwatchCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[GradwatchCallback(project="nlp", run="bert-ft-3")])
    trainer.train()

or, for a trainer that already exists, ``watch(trainer, project="nlp")``.

What it attaches to, when training begins:

* the model the Trainer trains (``trainer.model``, unwrapped);
* the optimizer the Trainer steps — the plain ``torch.optim`` optimizer
  inside Accelerate's ``AcceleratedOptimizer``;
* the ``GradScaler`` Accelerate uses with ``fp16=True`` on a GPU (none in
  bf16 / fp32, where no loss scaling happens).

gradwatch's step numbers are the Trainer's (``state.global_step`` − 1): a
run resumed from a checkpoint under the same run name continues where it
stopped instead of writing over its first steps.

The loss: with a scaler the agent sees every tensor Accelerate passes to
``scaler.scale()``. Without one, the callback reports the value each
``Trainer.training_step`` returns — the loss already divided for gradient
accumulation — summed over the micro-batches of one optimizer step. That is
the number the Trainer itself logs as ``loss`` with ``logging_steps=1``: one
value per optimizer step, never one per micro-batch. (Unlike the Trainer's
own log, a NaN loss is reported as NaN: ``logging_nan_inf_filter`` only
hides it from the Trainer's logs.)

The Trainer does not hand callbacks the per-step loss, so the callback wraps
``training_step`` on the trainer instance for the duration of ``train()`` and
restores it afterwards. It finds the trainer it belongs to by itself (the
trainer whose callback list holds it); ``watch(trainer)`` or
``callback.bind(trainer)`` says so explicitly.
"""
from __future__ import annotations

import sys
from typing import Any, Optional

from transformers import Trainer, TrainerCallback

import agent

from . import StepLoss, close_monitor, log, report_loss

__all__ = ["GradwatchCallback", "watch"]


class GradwatchCallback(TrainerCallback):
    """Streams a ``transformers.Trainer`` run to gradwatch.

    Args:
        ema: the EMA to compare against (as for ``agent.attach``), if any.
        project, run, server: as for ``agent.attach``; ``run`` defaults to
            ``TrainingArguments.run_name`` when that is set.
        **config: any other ``agent.attach`` setting (``token=``,
            ``activations_every=``, …).
    """

    def __init__(self, *, ema: Any = None, project: Optional[str] = None, run: Optional[str] = None,
                 server: Optional[str] = None, **config: Any) -> None:
        self.ema = ema
        self.project = project
        self.run = run
        self.server = server
        self.config = config
        self.monitor: Any = None
        self.scaler: Any = None
        self._trainer: Optional[Trainer] = None
        self._step_loss = StepLoss()
        self._wrapped_training_step = False

    # ------------------------------------------------------------------ public

    def bind(self, trainer: Trainer) -> "GradwatchCallback":
        """Name the trainer explicitly (``watch`` does this)."""
        self._trainer = trainer
        return self

    # ------------------------------------------------------------------ Trainer events

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.monitor is not None:
            return
        trainer = self._trainer or _find_trainer(self)
        self._trainer = trainer
        accelerator = getattr(trainer, "accelerator", None)
        self.scaler = getattr(optimizer, "scaler", None) or getattr(accelerator, "scaler", None)
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        if model is None and trainer is not None:
            model = trainer.model
        run = self.run or _explicit_run_name(args)
        try:
            self.monitor = agent.attach(model, self.scaler, optimizer=torch_optimizer, ema=self.ema,
                                        project=self.project, run=run, server=self.server, **self.config)
        except ValueError:
            raise  # bad configuration: say so before training starts
        except Exception:  # noqa: BLE001 - never hurt the host process
            log.exception("gradwatch: attach failed; training continues unmonitored")
            return
        _continue_at(self.monitor, state.global_step)
        if self.scaler is None:
            if trainer is None:
                log.warning("gradwatch: could not find the Trainer this callback belongs to; the loss is not "
                            "reported. Use agent.integrations.hf.watch(trainer) to name it.")
            else:
                self._wrap_training_step(trainer)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # Before optimizer.step(): the loss belongs to the step being taken.
        if self.monitor is None:
            return
        report_loss(self.monitor, self._step_loss.take())

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()

    # ------------------------------------------------------------------ helpers

    def _wrap_training_step(self, trainer: Trainer) -> None:
        original = trainer.training_step  # bound method (or a user's own override)
        step_loss = self._step_loss

        def training_step(*a, **kw):
            loss = original(*a, **kw)
            try:
                step_loss.add(loss)
            except Exception:  # noqa: BLE001
                log.exception("gradwatch: could not read the training_step loss")
            return loss

        training_step.__gradwatch_original__ = original  # type: ignore[attr-defined]
        trainer.training_step = training_step  # instance attribute: shadows the method for this trainer only
        self._wrapped_training_step = True

    def _unwrap_training_step(self) -> None:
        trainer = self._trainer
        if trainer is None or not self._wrapped_training_step:
            return
        current = trainer.__dict__.get("training_step")
        if current is not None and hasattr(current, "__gradwatch_original__"):
            del trainer.training_step
        self._wrapped_training_step = False

    def _finish(self, *, crashed: bool = False) -> None:
        self._unwrap_training_step()
        monitor, self.monitor = self.monitor, None
        self._step_loss.take()
        close_monitor(monitor, crashed=crashed)


def watch(trainer: Trainer, **attach_kwargs: Any) -> GradwatchCallback:
    """Add a bound :class:`GradwatchCallback` to an existing trainer and return it."""
    callback = GradwatchCallback(**attach_kwargs).bind(trainer)
    trainer.add_callback(callback)
    return callback


def _continue_at(monitor: Any, global_step: int) -> None:
    """Number gradwatch's steps like the Trainer's: a run resumed from a checkpoint continues at its step."""
    if global_step and hasattr(monitor, "step"):
        monitor.step = int(global_step)


def _explicit_run_name(args) -> Optional[str]:
    name = getattr(args, "run_name", None)
    # TrainingArguments fills run_name with output_dir (or a default) when unset; only a name the
    # user chose is worth using, otherwise gradwatch generates one.
    if not name or name == getattr(args, "output_dir", None) or name == "trainer_output":
        return None
    return name


def _find_trainer(callback: GradwatchCallback, max_depth: int = 12) -> Optional[Trainer]:
    """The Trainer whose callback handler holds ``callback``, found in the calling frames.

    Callbacks are invoked from inside ``Trainer`` methods, so the trainer is a
    few frames up as ``self``.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer) and callback in getattr(obj.callback_handler, "callbacks", ()):
            return obj
        frame = frame.f_back
    return None
