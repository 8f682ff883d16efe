"""gradwatch for the Hugging Face ``transformers.Trainer``.

Add the callback; nothing else in the training script changes::

    from gradwatch.agent.integrations.hf import GradwatchCallback

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

import os
import sys
from typing import Any, Optional

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from . import log
from .callback import GradwatchCallbackBase

__all__ = ["GradwatchCallback", "watch"]


class GradwatchCallback(GradwatchCallbackBase, TrainerCallback):
    """Streams a ``transformers.Trainer`` run to gradwatch.

    Takes the arguments of :class:`~agent.integrations.callback.GradwatchCallbackBase`
    (``ema=``, ``project=``, ``run=``, ``server=`` and any other ``agent.attach`` setting);
    ``run`` defaults to ``TrainingArguments.run_name`` when that is set.
    """

    def __init__(self, **settings: Any) -> None:
        super().__init__(**settings)
        self._trainer: Optional[Trainer] = None
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
        scaler = getattr(optimizer, "scaler", None) or getattr(accelerator, "scaler", None)
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        if model is None and trainer is not None:
            model = trainer.model
        if not self._attach(model, scaler, torch_optimizer, run=self.run or _explicit_run_name(args),
                            global_step=state.global_step, scheduler=kwargs.get("lr_scheduler")):
            return
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
        self._report_step_loss()

    def on_save(self, args, state, control, **kwargs):
        # The Trainer has just written output_dir/checkpoint-<global_step> (its _save_checkpoint);
        # resuming from it continues with step global_step, the checkpoint's step.
        if self.monitor is None:
            return
        path = os.path.join(args.output_dir or "", f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._record_checkpoint(path, state.global_step, "transformers")

    def on_step_end(self, args, state, control, **kwargs):
        # stop_on: the Trainer ends the run after this step (its own save / log at the end still happen)
        if self._stop_requested():
            control.should_training_stop = True

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
        super()._finish(crashed=crashed)


def watch(trainer: Trainer, **attach_kwargs: Any) -> GradwatchCallback:
    """Add a bound :class:`GradwatchCallback` to an existing trainer and return it."""
    callback = GradwatchCallback(**attach_kwargs).bind(trainer)
    trainer.add_callback(callback)
    return callback


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
