"""The step in progress: what the hooks saw since the last step ended, and its end into a :class:`StepRecord`.

The hook adapters (:mod:`agent.hooks`) call one method per event of the
training loop; the collectors (:mod:`agent.collectors`) keep their own share of
the step and add it to the record at :meth:`StepBuilder.end_step`, which hands
the record to the :class:`~agent.sealer.Sealer` (it stays open for post-step
values until the next step begins).

It names no collector: it drives them through the protocol's hook points
(:mod:`agent.collectors.base`), and finds the owner of a signal it needs in the
step (the grad norm, for the skip guard, the NaN replay and remediation) or of a
value the loop reports through ``monitor.log`` by the signal's name
(:mod:`agent.owners`). What it hands on travels in the record's named fields
(:class:`~agent.record.StepRecord`): the step in progress is a record from its
first event, and its end numbers it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradwatch.agent.capture.activation_stats import batch_shape
from gradwatch.agent.collectors.base import overrides
from gradwatch.agent.owners import LOOP_REPORTS, owner_of, report_takers
from gradwatch.agent.record import StepRecord
from gradwatch.agent.unwrap import scaler_enabled, scaler_found_inf


class StepBuilder:
    # the signals it writes itself (agent/owners.py: one writer per signal, checked at attach): the step's
    # clocks and throughputs, and the skip guard's decision
    emits = ("step_time", "data_time", "samples_per_s", "tokens_per_s", "skipped_update")

    def __init__(self, watched: Any, guards: Any, collectors: list, sealer: Any, sender: Any, warn: Any,
                 clock: Callable[[], float], wall_clock: Callable[[], float], replay: Any = None):
        self.watched, self.guards, self.sealer, self.sender, self.warn = watched, guards, sealer, sender, warn
        self.clock, self.wall_clock = clock, wall_clock
        self.config = watched.config
        # agent/capture/replay.py: the step's forwards (references), replayed on a skipped NaN step
        self.replay = replay
        # the owner of the step's grad norm (what the skip guard, the NaN replay and remediation read in the
        # step), and of each value monitor.log may report for a step signal (agent/owners.py)
        self._norm = owner_of(collectors, "grad_norm")
        self._takers = report_takers(collectors)
        self._at_forward = [c for c in collectors if overrides(c, "on_first_forward")]
        # Bound methods, looked up once: these run every step.
        self._before_step = [c.before_optimizer_step for c in collectors if overrides(c, "before_optimizer_step")]
        self._grads_final = [c.grads_final for c in collectors if overrides(c, "grads_final")]
        self._before_update = [c.before_scaler_update for c in collectors if overrides(c, "before_scaler_update")]
        self._at_end = [c.end_step for c in collectors if overrides(c, "end_step")]
        self.step = 0
        self.last_end: Optional[float] = None
        # once each (agent/resume.py): the optimizer is known, before its first step; the first step ended
        self.first_optimizer: Optional[Callable[[Any], None]] = None
        self.first_end: Optional[Callable[[int], None]] = None
        # Alerts in the loop: the monitor's inbox and what hands its news to the callbacks (None: off).
        self.inbox: Any = None
        self.deliver_alerts: Optional[Callable[[], None]] = None
        # The opt-in skip-spikes guard (agent/skip_guard.py), or None.
        self.skip: Any = None
        # The opt-in remediation (agent/rewinder.py: snapshots, LR cooling around the update), or None.
        self.remedy: Any = None
        self._sender_started = sender is None
        self._reset()

    def _reset(self) -> None:
        # the step in progress: its losses, custom values and reports so far (numbered at its end)
        self.current = StepRecord(-1)
        self.forwards = 0
        self.samples = 0
        self.tokens = 0
        self.unscaled = False
        self.in_scaler_step = False
        self.forward_at: Optional[float] = None   # the step's first training forward began (data_time)

    # ------------------------------------------------------------------ events of the loop

    def forward(self, args: tuple, kwargs: dict) -> None:
        """The model's forward begins: a step starts (the open record is sealed)."""
        replay = self.replay
        if replay is not None and replay.replaying:
            return   # the NaN-origin replay's own forward: not part of any step
        self.sealer.seal_open()
        if not torch.is_grad_enabled():
            return   # evaluation pass: not part of a training step
        if replay is not None and self.guards.on("nan_replay"):
            replay.record(args, kwargs)
        first = self.forwards == 0
        self.forwards += 1
        samples, tokens = batch_shape(args, kwargs)
        self.samples += samples
        self.tokens += tokens
        if first:
            self.forward_at = self.clock()
            step, guards = self.step, self.guards
            for c in self._at_forward:
                if c.due(step) and guards.on(c.name):
                    with guards.guard(c.name):
                        c.on_first_forward(step, args, kwargs)

    def scaled(self, outputs) -> None:
        """``scaler.scale(outputs)``: a step starts; the losses are summed into the step's."""
        if self.replay is not None and self.replay.replaying:
            return   # the replay scales its loss like the step did
        self.sealer.seal_open()
        rec = self.current
        if isinstance(outputs, torch.Tensor):
            rec.scaled_loss = summed(rec.scaled_loss, outputs)
        else:
            outputs = list(outputs) if not isinstance(outputs, (list, tuple)) else outputs
            for o in outputs:
                if isinstance(o, torch.Tensor):
                    rec.scaled_loss = summed(rec.scaled_loss, o)

    def unscaled_grads(self) -> None:
        """``scaler.unscale_()`` returned; inside ``scaler.step()`` the grads are final now."""
        self.unscaled = True
        if self.in_scaler_step:   # implicit unscale inside scaler.step(): grads are ready now
            for final in self._grads_final:
                final()

    def scaler_step_begins(self, optimizer) -> None:
        w = self.watched
        if w.optimizer is None:
            w.optimizer = optimizer
        if self.first_optimizer is not None:
            self._first_optimizer(optimizer)
        step = self.step
        for before in self._before_step:
            before(step)
        if self.unscaled or not scaler_enabled(w.scaler, unknown=True):   # a look-alike: assume it scales
            for final in self._grads_final:
                final()
        self.in_scaler_step = True
        if self.skip is not None:
            self._skip_before()
        if self.remedy is not None:
            self._remedy_before()
        if self.replay is not None and scaler_enabled(w.scaler) and self.guards.on("nan_replay"):
            with self.guards.guard("nan_replay"):
                self.replay.optimizer_seen(optimizer)

    def scaler_step_done(self, optimizer) -> None:
        """``scaler.step()`` returned: a step it skipped with a non-finite loss is replayed now,
        while the weights are still those its forward saw (agent/capture/replay.py)."""
        replay, scaler = self.replay, self.watched.scaler
        if replay is None or not scaler_enabled(scaler) or not self.guards.on("nan_replay"):
            return
        with self.guards.guard("nan_replay"):
            found = replay.after_scaler_step(optimizer, self.current.scaled_loss, scaler.scale)
            if found is not None:
                self.current.nan_replay = found

    def before_scaler_update(self) -> None:
        """``scaler.update()`` is about to run: the scaler's state of the step is read now."""
        for before in self._before_update:
            before()

    def before_optimizer_step(self) -> None:
        """The optimizer's step pre-hook (no scaler)."""
        if self.first_optimizer is not None:
            self._first_optimizer(self.watched.optimizer)
        step = self.step
        for before in self._before_step:
            before(step)
        for final in self._grads_final:
            final()
        if self.replay is not None and self.config.nan_guard and self.guards.on("nan_replay"):
            with self.guards.guard("nan_replay"):
                found = self.replay.check_before_step(self._grad_norm(), self.current.logged_loss)
                if found is not None:
                    self.current.nan_replay = found
        if self.skip is not None:
            self._skip_before()
        if self.remedy is not None:
            self._remedy_before()

    def _remedy_before(self) -> None:
        if self.guards.on("remediate"):
            with self.guards.guard("remediate"):
                self.remedy.before_update()

    def _skip_before(self) -> None:
        if self.guards.on("skip_spikes"):
            with self.guards.guard("skip_spikes"):
                self.skip.before_update()

    def update_done(self) -> None:
        """The optimizer's update is over (``scaler.step()`` returned, or the step post-hook): a cooled LR
        is put back, the skip guard decides on this step's grad norm and undoes a spike. Idempotent within
        a step."""
        if self.remedy is not None and self.guards.on("remediate"):
            with self.guards.guard("remediate"):
                self.remedy.after_update()
        if self.skip is None or not self.guards.on("skip_spikes"):
            return
        with self.guards.guard("skip_spikes"):
            w = self.watched
            found_inf = (scaler_found_inf(w.scaler, w.optimizer)   # the active GradScaler's, of this step
                         if scaler_enabled(w.scaler) and w.optimizer is not None else None)
            self.skip.after_update(self._grad_norm(), found_inf)

    def _grad_norm(self):
        """The step's grad norm measured so far (a 0-d device tensor), or None."""
        norm = self._norm
        return norm.measured("grad_norm") if norm is not None else None

    def log(self, loss, values: dict, step_per_log: bool) -> None:
        """``monitor.log()``: values for the open record (right after a step), else the step in progress.

        Four names are the loop's report of a step signal the agent may not have measured itself
        (docs/agent.md, "monitor.log"; agent/owners.py, ``LOOP_REPORTS``): ``grad_norm``,
        ``clip_max_norm``, ``overflow`` and ``loss_scale`` go to the signal's owner (its
        :meth:`~agent.collectors.base.Collector.report`), which makes the report the step's value where
        it measured none, else keeps it as a custom value; during the step the report waits in the
        record (:meth:`~agent.record.StepRecord.hold_report`) for the owner at the step's end.
        """
        sealer = self.sealer
        if step_per_log:
            sealer.seal_open()
        with sealer.lock:   # the sender thread may be sealing the open record right now
            rec = sealer.open_record
            ended = rec is not None and not step_per_log
            target = rec if ended else self.current
            if loss is not None:
                # a copy of a tensor, like the values below: the record may be read after the loop changed it
                target.logged_loss = summed(target.logged_loss,
                                            loss.detach().clone() if isinstance(loss, torch.Tensor) else loss)
            takers = self._takers
            for key, value in values.items():
                taker = takers.get(key)
                if taker is not None and taker.report(key, value, target, ended):
                    continue
                if isinstance(value, torch.Tensor):
                    if value.numel() != 1:
                        self.warn.warning("log:" + key, "gradwatch: monitor.log(%s=...) needs a scalar; ignored", key)
                        continue
                    # a copy: the record may be read after the loop changed its tensor in place
                    target.keep_custom(key, value.detach().reshape(()).clone())
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    target.keep_custom(key, float(value))
        if step_per_log:
            self.end_step()
            sealer.seal_open()

    # ------------------------------------------------------------------ step end

    def _first_optimizer(self, optimizer) -> None:
        call, self.first_optimizer = self.first_optimizer, None
        with self.guards.guard("resume"):
            call(optimizer)

    def end_step(self) -> None:
        if self.first_end is not None:
            call, self.first_end = self.first_end, None
            with self.guards.guard("resume"):
                call(self.step)
        now = self.clock()
        step = self.step
        rec = self.current
        rec.step = step
        if self.skip is not None or self.remedy is not None:
            self.update_done()      # no scaler: the optimizer's post-hook is the end of the step
        if self.skip is not None:
            decision = self.skip.take_decision()
            if decision is not None:
                rec.add("skipped_update", decision)
        host = rec.host
        host["time"] = self.wall_clock()
        step_time = now - self.last_end if self.last_end is not None else None
        host["step_time"] = step_time
        if self.forward_at is not None and self.last_end is not None:
            host["data_time"] = self.forward_at - self.last_end
        samples = self.config.batch_size or self.samples
        tokens = self.config.tokens_per_step or self.tokens
        if step_time and step_time > 0:
            host["samples_per_s"] = samples / step_time if samples else None
            host["tokens_per_s"] = tokens / step_time if tokens else None
        rec.scaler_active = scaler_enabled(self.watched.scaler)
        measured = self._grad_norm()         # the collectors hand it to the record (and forget it) below
        if self.remedy is not None:   # the LR's owner reports the LR this update really used (cooled around it)
            rec.lr_factor = self.remedy.take_step_factor()
        for contribute in self._at_end:
            contribute(step, rec)
        reported, rec.reported = rec.reported, None
        if reported:   # monitor.log(grad_norm=..., ...) during the step: to the signal's owner, now it ended
            takers = self._takers
            for key in LOOP_REPORTS:   # in one order, whatever order the loop reported in
                if key in reported:
                    takers[key].report(key, reported[key], rec, True)
        if self.replay is not None:
            self.replay.clear()
        self._reset()
        self.sealer.open(rec, torch.cuda.is_initialized())   # is_initialized implies available; a cheaper call
        self.last_end = now
        self.step += 1
        if not self._sender_started:
            self._sender_started = True
            self.sender.ensure_started()   # it seals this step if the loop stops right here
        inbox = self.inbox
        if inbox is not None and (inbox.has_news or (self.remedy is not None and inbox.has_updates)):
            self.deliver_alerts()   # the healthy step's whole cost: one attribute read (two with remediation)
        if self.remedy is not None and self.guards.on("remediate"):
            with self.guards.guard("remediate"):
                self.remedy.at_step_end(self.step, measured, rec.scaled_loss)


def summed(total, value):
    """A step's loss sum with one more micro-batch loss (a tensor, kept on its device, or a number)."""
    if total is None and value.__class__ is torch.Tensor and value.dtype is torch.float32 \
            and value.dim() == 0:   # the usual call: one fp32 loss per step
        return value.detach()
    if isinstance(value, torch.Tensor):
        v = value.detach()
        if v.dim() > 0:
            v = v.sum()
        if v.dtype != torch.float32:
            v = v.float()
    else:
        v = float(value)
    return v if total is None else total + v
