"""The step in progress: what the hooks saw since the last step ended, and its end into a :class:`StepRecord`.

The hook adapters (:mod:`agent.hooks`) call one method per event of the
training loop; the collectors (:mod:`agent.collectors`) keep their own share of
the step and add it to the record at :meth:`StepBuilder.end_step`, which hands
the record to the :class:`~agent.sealer.Sealer` (it stays open for post-step
values until the next step begins).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from gradwatch.agent.capture.activation_stats import batch_shape
from gradwatch.agent.collectors.base import overrides
from gradwatch.agent.collectors.grads import GradNorms
from gradwatch.agent.collectors.loss_scale import LossScale
from gradwatch.agent.record import StepRecord
from gradwatch.agent.unwrap import scaler_enabled


class StepBuilder:
    def __init__(self, watched: Any, guards: Any, collectors: list, sealer: Any, sender: Any, warn: Any,
                 clock: Callable[[], float], wall_clock: Callable[[], float], replay: Any = None):
        self.watched, self.guards, self.sealer, self.sender, self.warn = watched, guards, sealer, sender, warn
        self.clock, self.wall_clock = clock, wall_clock
        self.config = watched.config
        # agent/capture/replay.py: the step's forwards (references), replayed on a skipped NaN step
        self.replay = replay
        # The two collectors the loop's events drive by name (the others only through the hook points).
        self.grads: GradNorms = next(c for c in collectors if isinstance(c, GradNorms))
        self.loss_scale: Optional[LossScale] = next((c for c in collectors if isinstance(c, LossScale)), None)
        self._at_forward = [c for c in collectors if overrides(c, "on_first_forward")]
        # Bound methods, looked up once: these run every step.
        self._before_step = [c.before_optimizer_step for c in collectors if overrides(c, "before_optimizer_step")]
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
        self._reset()

    def _reset(self) -> None:
        self.pending: dict[str, Any] = {}   # loss / custom values for the step in progress
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
        if isinstance(outputs, torch.Tensor):
            accumulate(self.pending, "scaled_loss", outputs)
        else:
            outputs = list(outputs) if not isinstance(outputs, (list, tuple)) else outputs
            for o in outputs:
                if isinstance(o, torch.Tensor):
                    accumulate(self.pending, "scaled_loss", o)

    def unscaled_grads(self) -> None:
        """``scaler.unscale_()`` returned; inside ``scaler.step()`` the grads are final now."""
        self.unscaled = True
        if self.in_scaler_step:   # implicit unscale inside scaler.step(): grads are ready now
            self.grads.measure()

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
            self.grads.measure()
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
            found = replay.after_scaler_step(optimizer, self.pending.get("scaled_loss"), scaler.scale)
            if found is not None:
                self.pending["nan_replay"] = found

    def before_optimizer_step(self) -> None:
        """The optimizer's step pre-hook (no scaler)."""
        if self.first_optimizer is not None:
            self._first_optimizer(self.watched.optimizer)
        step = self.step
        for before in self._before_step:
            before(step)
        self.grads.measure()
        if self.replay is not None and self.config.nan_guard and self.guards.on("nan_replay"):
            with self.guards.guard("nan_replay"):
                grads = self.grads.grads
                found = self.replay.check_before_step(grads[2] if grads else None, self.pending.get("logged_loss"))
                if found is not None:
                    self.pending["nan_replay"] = found
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
            grads = self.grads.grads
            self.skip.after_update(grads[2] if grads else None, self._found_inf())

    def _found_inf(self):
        """The active GradScaler's overflow flag of this step (a device tensor), or None: no sync."""
        w = self.watched
        scaler = w.scaler
        if not scaler_enabled(scaler) or w.optimizer is None:
            return None
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(w.optimizer))
        found = list((state or {}).get("found_inf_per_device", {}).values())
        if not found:
            return None
        return found[0] if len(found) == 1 else torch.stack([f.to(found[0].device).reshape(()) for f in found]).sum()

    def log(self, loss, values: dict, step_per_log: bool) -> None:
        """``monitor.log()``: values for the open record (right after a step), else the step in progress.

        Two names are the loop's report of a step signal the agent may not have measured itself
        (docs/agent.md, "monitor.log"): ``grad_norm`` becomes the step's ``grad_norm`` part when the
        record holds no norm of the agent's, else it is kept as the custom value ``grad_norm``;
        ``clip_max_norm`` (a number) becomes the step's clip threshold when the agent saw no
        clipping call, so ``clipped`` is derived from either norm. Two more are a loss scaler's
        that the agent has no GradScaler for (DeepSpeed's fp16 ``DynamicLossScaler``): ``overflow``
        (a bool, true on a step the scaler skipped) and ``loss_scale`` (the scale the step's loss was
        multiplied by) become the step's ``overflow`` / ``loss_scale`` when the agent's own GradScaler
        reported none, else they are custom values.
        """
        sealer = self.sealer
        if step_per_log:
            sealer.seal_open()
        with sealer.lock:   # the sender thread may be sealing the open record right now
            rec = sealer.open_record
            target = rec.host if (rec is not None and not step_per_log) else self.pending
            if loss is not None:
                # a copy of a tensor, like the values below: the record may be read after the loop changed it
                accumulate(target, "logged_loss", loss.detach().clone() if isinstance(loss, torch.Tensor) else loss)
            for key, value in values.items():
                if key == "clip_max_norm":
                    self._report_clip_max_norm(value, None if target is self.pending else target)
                    continue
                if key == "grad_norm" and self._report_grad_norm(value, None if target is self.pending else rec):
                    continue
                if key in ("overflow", "loss_scale") and self._report_scaler(key, value,
                                                                            None if target is self.pending else rec):
                    continue
                if isinstance(value, torch.Tensor):
                    if value.numel() != 1:
                        self.warn.warning("log:" + key, "gradwatch: monitor.log(%s=...) needs a scalar; ignored", key)
                        continue
                    # a copy: the record may be read after the loop changed its tensor in place
                    target.setdefault("custom_dev", {})[key] = value.detach().reshape(()).clone()
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    target.setdefault("custom", {})[key] = float(value)
        if step_per_log:
            self.end_step()
            sealer.seal_open()

    def _report_grad_norm(self, value, ended: Any) -> bool:
        """The loop's global grad norm (``monitor.log(grad_norm=...)``, e.g. DeepSpeed's under ZeRO 1/2,
        where no ``p.grad`` is left for the agent): True when it is, or may become, the step's
        ``grad_norm``; False: it is a custom value (the agent measured its own, or not a scalar)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return False   # the custom path warns
            value = value.detach().reshape(()).clone()   # the loop's tensor may change in place
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        else:
            value = float(value)
        if self.watched.local:
            return False   # sharded: the agent's norms are this rank's shards', the server combines them
        if ended is None:  # the step is still going: the agent may measure at its end (end_step decides)
            self.pending["reported_grad_norm"] = value
            return True
        return fill_grad_norm(ended, value)

    def _report_scaler(self, key: str, value, ended: Any) -> bool:
        """A loss scaler's flag or scale the agent has no GradScaler for (``monitor.log(overflow=...,
        loss_scale=...)``, e.g. DeepSpeed's fp16 loss scaler): True when it is, or may become, the
        step's ``overflow`` / ``loss_scale``, or was kept as a custom value here; False: the custom
        path takes it (a tensor of several values: it warns)."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                return False
            value = value.detach().reshape(()).clone()   # the loop's tensor may change in place
        elif isinstance(value, bool) and key == "overflow" or \
                isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        else:
            self.warn.warning("log:" + key, "gradwatch: monitor.log(%s=...) needs %s; ignored", key,
                              "a bool" if key == "overflow" else "a number")
            return True
        if ended is None:   # the step is still going: the GradScaler may report at its end (end_step decides)
            self.pending["reported_" + key] = value
            return True
        if not fill_loss_scaler(ended, key, value):
            keep_as_custom(ended.host, key, value)
        return True

    def _report_clip_max_norm(self, value, ended: Optional[dict]) -> None:
        """The loop's clip threshold (``monitor.log(clip_max_norm=...)``, e.g. DeepSpeed's
        ``gradient_clipping``, which clips without torch's function): the one the agent saw wins."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.warn.warning("log:clip_max_norm", "gradwatch: monitor.log(clip_max_norm=...) needs a number; ignored")
            return
        if ended is None:   # the step is still going: GradNorms puts its threshold on the record at its end
            if self.grads.clip_max_norm is None:
                self.grads.clip_max_norm = float(value)
        elif ended.get("clip_max_norm") is None:   # the open record's host values: GradNorms' already there
            ended["clip_max_norm"] = float(value)

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
        rec = StepRecord(step)
        if self.skip is not None or self.remedy is not None:
            self.update_done()      # no scaler: the optimizer's post-hook is the end of the step
        if self.skip is not None:
            decision = self.skip.take_decision()
            if decision is not None:
                rec.add("skipped_update", decision)
        host = rec.host
        host.update(self.pending)
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
        host["scaler_active"] = scaler_enabled(self.watched.scaler)
        measured = self.grads.grads          # the collectors hand it to the record (and forget it) below
        for contribute in self._at_end:
            contribute(step, rec)
        if self.remedy is not None:
            factor = self.remedy.take_step_factor()
            if factor is not None and isinstance(host.get("lr"), float):
                host["lr"] *= factor     # the LR this update really used (cooled around it, agent/rewinder.py)
        for key, pending_key, fill in _REPORTED:   # monitor.log(grad_norm=..., ...) during the step
            reported = host.pop(pending_key, None)
            if reported is not None and not fill(rec, key, reported):
                keep_as_custom(host, key, reported)   # the agent's own measurement won
        if self.replay is not None:
            self.replay.clear()
        self._reset()
        self.sealer.open(rec, torch.cuda.is_initialized())   # is_initialized implies available; a cheaper call
        self.last_end = now
        self.step += 1
        if self.sender is not None and self.sender._thread is None:
            self.sender.ensure_started()   # it seals this step if the loop stops right here
        inbox = self.inbox
        if inbox is not None and (inbox.has_news or (self.remedy is not None and inbox.has_updates)):
            self.deliver_alerts()   # the healthy step's whole cost: one attribute read (two with remediation)
        if self.remedy is not None and self.guards.on("remediate"):
            with self.guards.guard("remediate"):
                self.remedy.at_step_end(self.step, measured[2] if measured else None, host.get("scaled_loss"))


def fill_grad_norm(rec: StepRecord, value) -> bool:
    """A reported global grad norm as the step's ``grad_norm``, unless the record holds the agent's own.

    A number goes in as a 0-d CPU tensor, a part like the measured norm (read the same way by the
    wire); with a record on CUDA that means one more copy at the seal, for a loop that already synced.
    """
    if any(key in ("grad_norm", "grad_norm_local") for key, _ in rec.parts):
        return False
    rec.add("grad_norm", value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32))
    return True


def keep_as_custom(host: dict, key: str, value) -> None:
    """A reported value the agent's own measurement won over, kept as the step's custom value ``key``."""
    host.setdefault("custom_dev" if isinstance(value, torch.Tensor) else "custom", {})[key] = value


def fill_loss_scaler(rec: StepRecord, key: str, value) -> bool:
    """A reported loss scaler's ``overflow`` flag or ``loss_scale`` (a float or a 0-d tensor) as the
    step's, unless the record holds the agent's own GradScaler's (agent/collectors/loss_scale.py).

    ``overflow`` goes in as a part, where the wire reads the GradScaler's ``found_inf`` (it counts
    ``overflow_count`` from it), made on the device of the record's other parts so the seal stays one
    copy (a fill, no sync); it also marks the step's loss scaler active (``scaler_active``), as a
    GradScaler would: the wire stores the flag only then, and a non-finite grad norm on such a step
    is the scaler's business, not an incident. A number ``loss_scale`` is a host value.
    """
    if rec.host.get(key) is not None or any(k == key for k, _ in rec.parts):
        return False
    if key == "overflow":
        if isinstance(value, torch.Tensor):
            flag = value.float()
        else:
            device = rec.parts[0][1].device if rec.parts else None
            flag = torch.full((), value, dtype=torch.float32, device=device)
        rec.add("overflow", flag)
        rec.host["scaler_active"] = True
    elif isinstance(value, torch.Tensor):
        rec.add("loss_scale", value.float())
    else:
        rec.host["loss_scale"] = value
    return True


# values reported during the step (monitor.log): (signal, the key holding it in the step's pending values
# until end_step, the function making it the step's signal unless the agent measured its own)
_REPORTED = (("grad_norm", "reported_grad_norm", lambda rec, _, value: fill_grad_norm(rec, value)),
             ("overflow", "reported_overflow", fill_loss_scaler),
             ("loss_scale", "reported_loss_scale", fill_loss_scaler))


def accumulate(target: dict, key: str, value) -> None:
    """Sum of a step's micro-batch losses, kept on the device."""
    if key not in target and value.__class__ is torch.Tensor and value.dtype is torch.float32 \
            and value.dim() == 0:   # the usual call: one fp32 loss per step
        target[key] = value.detach()
        return
    if isinstance(value, torch.Tensor):
        v = value.detach()
        if v.dim() > 0:
            v = v.sum()
        if v.dtype != torch.float32:
            v = v.float()
    else:
        v = float(value)
    prev = target.get(key)
    target[key] = v if prev is None else prev + v
