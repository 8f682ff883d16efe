"""The runtime of ``remediate=Rewind(...)``: snapshots at a cadence, and the rewind when an alert says so.

Everything here runs in the training thread, at step boundaries the
:class:`~agent.step_builder.StepBuilder` already has:

* around each optimizer update (:meth:`Remedy.before_update` / :meth:`Remedy.after_update`):
  while cooled, every param group's LR is multiplied by ``lr_factor`` right before
  the update and put back right after it. A scheduler that writes the LR each step
  (``LambdaLR``) or multiplies it (``ExponentialLR``) runs outside the update, so it
  never sees the cooled value: nothing to undo, nothing compounded;
* at a step's end (:meth:`Remedy.at_step_end`): a snapshot when one is due;
* with the alert news of that step's end (:meth:`Remedy.on_news`, before the ``on_alert``
  callbacks): the rewind, the cool, or giving up, each one ``rewind`` event
  (:func:`agent.remediation.rewind_event`) and one warning line. Under DDP and FSDP2 the
  news is only proposed, and every rank acts at the first step end where all have heard
  (:mod:`agent.rewind_agreement`, :mod:`agent.rewind_agreement_fsdp`).

Imports torch, :mod:`agent.remediation` and :mod:`agent.snapshots`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Optional

import torch

from gradwatch.agent.remediation import Rewind, rewind_event, rewind_line
from gradwatch.agent.snapshots import SnapshotStore

log = logging.getLogger("gradwatch.agent")


class Remedy:
    """One monitor's remediation: the policy's settings, its snapshots, its cooling and its count."""

    def __init__(self, policy: Rewind, watched: Any, *, scheduler: Any, submit: Callable[[dict], None],
                 barrier: Callable[[], None], record_checkpoint: Callable[[str, int], Any], agreement: Any = None):
        self.policy, self.watched = policy, watched
        self.store = SnapshotStore(watched, scheduler, keep=policy.keep)
        self.submit, self.barrier, self.record_checkpoint = submit, barrier, record_checkpoint
        self.active = True
        self._due = False                  # a snapshot is due and not taken yet (a non-finite step defers it)
        self._cool_left = 0                # updates still to cool
        self._saved_lrs: Optional[list] = None   # the groups' LRs while an update runs cooled
        self._step_factor: Optional[float] = None
        self._last_from = -1               # from_step of the latest rewind: older episodes are undone history
        self._rewind_steps: list[int] = []
        self._state = policy._state
        # DDP: the ranks act together, when all have heard (agent/rewind_agreement.py); None: act at once
        self.agreement = agreement
        self._pending: list = []           # (alert, "on" | "cool_on", step heard) not acted on yet (DDP)
        self._extra: Optional[dict] = None
        self._unvouched: Optional[int] = None   # FSDP2: the step of the copy awaiting the ranks' verdict

    # ------------------------------------------------------------------ around each update

    def before_update(self) -> None:
        if self._cool_left <= 0 or self._saved_lrs is not None:
            return
        opt = self.watched.optimizer
        if opt is None:
            return
        factor = self.policy.lr_factor
        self._saved_lrs = [g.get("lr") for g in opt.param_groups]
        for g, lr in zip(opt.param_groups, self._saved_lrs):
            if isinstance(lr, torch.Tensor):
                g["lr"] = lr * factor        # a new tensor: the user's stays as it was
            elif isinstance(lr, (int, float)):
                g["lr"] = lr * factor

    def after_update(self) -> None:
        saved, self._saved_lrs = self._saved_lrs, None
        if saved is None:
            return
        opt = self.watched.optimizer
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr
        self._cool_left -= 1
        self._step_factor = self.policy.lr_factor

    def take_step_factor(self) -> Optional[float]:
        """The LR factor the step that just ended was updated with (None: not cooled), for its ``lr`` signal."""
        f, self._step_factor = self._step_factor, None
        return f

    # ------------------------------------------------------------------ step end

    def at_step_end(self, next_step: int, grad_norm: Any, loss: Any) -> None:
        """A snapshot when ``next_step`` is on the cadence (or one was deferred by a non-finite step)."""
        if not self.active:
            return
        if self.agreement is not None:
            self._agreed(next_step)
            if not getattr(self.agreement, "shards", False):
                loss = None                  # DDP: a rank's own loss; the ranks must agree on every snapshot
            if not self.active:
                return
        if next_step % self.policy.every == 0:
            self._due = True
        if not self._due:
            return
        if getattr(self.agreement, "shards", False):
            # FSDP2: each rank holds other shards; the ranks vouch for the copy together in the next
            # reduce-scatter (agent/rewind_agreement_fsdp.py); one copy awaits its verdict at a time
            if self._unvouched is None:
                finite = self.store.take_unvouched(next_step, grad_norm, loss)
                if finite is not None:
                    self._unvouched, self._due = next_step, False
                    self.agreement.vouch(finite)
        elif self.store.take(next_step, grad_norm, loss):
            self._due = False

    @property
    def snapshot_bytes(self) -> int:
        return self.store.nbytes

    # ------------------------------------------------------------------ alerts

    def on_news(self, news: list, next_step: int, updates: list = ()) -> list:
        """Act on the alerts of this step's news, then on ``updates`` (alerts changed without being news:
        an episode that stayed firing and reached steps after the last rewind, i.e. the anomaly came back
        after it); returns them (news first), each acted-on one carrying its action's data in
        ``remediation`` (so ``on_alert`` and ``monitor.alerts()`` say what was done)."""
        out = []
        for alert in [*news, *updates]:
            data = None
            if self.active and alert.last_step >= self._last_from:
                which = ("on" if self.policy.matches(alert, "on") else
                         "cool_on" if self.policy.matches(alert, "cool_on") else None)
                if which is not None and self.agreement is not None:
                    self._pending.append((alert, which, next_step))   # acted on when every rank has heard one
                    self.agreement.propose(max(alert.step, self._last_from), which == "on")
                elif which == "on":
                    data = self._rewind(alert, next_step)
                elif which == "cool_on":
                    data = self._cool(alert, next_step)
            out.append(dataclasses.replace(alert, remediation=data) if data is not None else alert)
        return out

    def _agreed(self, next_step: int) -> None:
        """DDP: every rank has heard a trigger by this step's all-reduce: all act now, with the same onset."""
        decided = self.agreement.decided()
        if getattr(self.agreement, "shards", False):
            verdict = self.agreement.verdict()       # the same on every rank: settled before any rewind
            if verdict is not None and self._unvouched is not None:
                self.store.settle(self._unvouched, verdict)
                if not verdict:
                    self._due = True                 # every rank snapshots again, now
                self._unvouched = None
        if decided is None:
            return
        onset, rewind = decided
        pending, self._pending = self._pending, []
        if not pending:
            return
        alert, _, heard = min(pending, key=lambda p: p[0].step)
        # this rank's own: the ranks heard at different steps and acted at one (an extra key of the event)
        self._extra = {"heard_at_step": heard}
        try:
            self._rewind(alert, next_step, onset=onset) if rewind else self._cool(alert, next_step)
        finally:
            self._extra = None

    def _trigger(self, alert: Any) -> dict:
        return {"rule": alert.rule, "alert_id": alert.id, "step": alert.step, "name": alert.name}

    def _send(self, data_step: int, **fields: Any) -> dict:
        event = rewind_event(from_step=data_step, max_rewinds=self.policy.max_rewinds,
                             snapshot_bytes=self.store.nbytes, **fields)
        data = event["data"]
        if self._extra:
            data.update(self._extra)
        self._state["rewinds"].append(data)
        self.submit(event)
        return data

    def _start_cooling(self) -> tuple[float, int]:
        p = self.policy
        if not p.cools:
            return 1.0, 0
        self._cool_left = p.cool_steps       # a new trigger restarts the countdown, never compounds
        return float(p.lr_factor), int(p.cool_steps)

    def _cool(self, alert: Any, next_step: int, why: str = "") -> Optional[dict]:
        if self._cool_left > 0 and not why:
            return None   # already cooled (an early warning that flaps fires again and again): once is enough
        factor, steps = self._start_cooling()
        if steps == 0 and not why:
            return None
        data = self._send(next_step, to_step=next_step, lr_factor=factor, cool_steps=steps,
                          trigger=self._trigger(alert), rewind_number=len(self._rewind_steps), action="cool")
        log.warning("%s%s", rewind_line(data), why)
        return data

    def _rewind(self, alert: Any, next_step: int, onset: Optional[int] = None) -> Optional[dict]:
        p = self.policy
        recent = [s for s in self._rewind_steps if p.window is None or s > next_step - p.window]
        onset = max(alert.step if onset is None else onset, self._last_from)
        if len(recent) >= p.max_rewinds:
            return self._give_up(alert, next_step, onset)
        snap = self.store.newest_before(onset)
        if snap is None:
            have = self.store.steps()
            return self._cool(alert, next_step, why=(
                f"; no snapshot at or before step {onset} to rewind to (snapshots: {have or 'none yet'}; "
                f"every={p.every}, keep={p.keep})"))
        self.barrier()                       # an EMA divergence job off the training thread reads the weights
        missing = self.store.restore(snap)
        self.store.forget_after(snap.step)   # the newer ones hold the stretch just abandoned
        self._due = False
        factor, steps = self._start_cooling()
        self._rewind_steps.append(next_step)
        self._last_from = next_step
        data = self._send(next_step, to_step=snap.step, lr_factor=factor, cool_steps=steps,
                          trigger=self._trigger(alert), rewind_number=len(self._rewind_steps), action="rewind")
        log.warning("%s", rewind_line(data))
        if missing:
            log.warning("gradwatch: the rewind could not restore %d tensor(s) that appeared or changed shape since "
                        "the snapshot (e.g. %s); they keep their current values", len(missing), missing[0])
        return data

    def _give_up(self, alert: Any, next_step: int, onset: int) -> dict:
        p = self.policy
        to_step = next_step
        saved = None
        if p.then == "stop":
            snap = self.store.newest_before(onset)
            if snap is not None:
                # the run stops on its last good state: whatever the loop saves at its end holds that, and
                # so does the checkpoint
                self.barrier()
                self.store.restore(snap)
                to_step = snap.step
                if p.checkpoint:
                    saved = self._save_checkpoint(p.checkpoint, snap.step)
            self._state["should_stop"] = True
        self.active = False
        self._cool_left = 0
        data = self._send(next_step, to_step=to_step, lr_factor=1.0, cool_steps=0, trigger=self._trigger(alert),
                          rewind_number=len(self._rewind_steps), action="gave_up", then=p.then)
        self._state["gave_up"] = data
        if p.then == "stop":
            log.error("%s: stopping the run%s%s", rewind_line(data),
                      f" on the state of step {to_step}" if to_step != next_step else "",
                      f", saved in {saved}" if saved else "")
        else:
            log.error("%s: REMEDIATION IS OFF for the rest of this run (then='continue'); the run goes on with "
                      "whatever state it has", rewind_line(data))
        return data

    def _save_checkpoint(self, path: str, step: int) -> Optional[str]:
        w = self.watched
        state: dict = {"step": step, "model": w.model.state_dict()}
        if w.optimizer is not None:
            state["optimizer"] = w.optimizer.state_dict()
        if w.scaler is not None and hasattr(w.scaler, "state_dict"):
            state["scaler"] = w.scaler.state_dict()
        if self.store.scheduler is not None and hasattr(self.store.scheduler, "state_dict"):
            state["scheduler"] = self.store.scheduler.state_dict()
        try:
            folder = os.path.dirname(path)
            if folder:
                os.makedirs(folder, exist_ok=True)
            torch.save(state, path)
        except Exception as e:  # noqa: BLE001 - never hurt the host: the stop still happens
            log.error("gradwatch: could not save the checkpoint %s: %r", path, e)
            return None
        self.record_checkpoint(path, step)
        return path
