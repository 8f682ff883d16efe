"""The :class:`Monitor` handle: the public face of one attached model, composed of the agent's parts.

* :mod:`agent.hooks` — the hook adapters (model forward, GradScaler wrappers,
  optimizer hooks, the ``clip_grad_norm_`` patch);
* :mod:`agent.step_builder` — the step in progress and its end into a ``StepRecord``;
* :mod:`agent.collectors` — one kind of measurement each, behind a small protocol;
* :mod:`agent.sealer` — the hand-over of the ended step's record to the sender,
  by the training thread or, after ``seal_grace``, by the sender thread;
* :mod:`agent.sender` — batching, spooling, delivery (its own thread).

Step boundaries:

* with a ``GradScaler`` (enabled or not): ``scaler.update()`` ends a step;
* without one but with an optimizer: the optimizer's step post-hook ends it;
* with neither: each ``monitor.log(loss=...)`` is one step.

Every hook body runs under a guard (:mod:`agent.guard`): an exception is
logged once, that collector turns itself off, and training goes on.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import quote

import torch

from gradwatch.agent import collectors as collector_kinds
from gradwatch.agent.checkpoints import checkpoint_event
from gradwatch.agent.capture.ema_pairs import check_ema
from gradwatch.agent.capture.replay import StepReplay
from gradwatch.agent.collectors.base import Watched, check_emits, overrides
from gradwatch.agent.collectors.ema import EmaDivergence
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.guard import Guards
from gradwatch.agent.hooks import HookAdapters
from gradwatch.agent.loop_alerts import AlertInbox, LoopAlert, run_callbacks
from gradwatch.agent.owners import check_owners, owner_of
from gradwatch.agent.registry import close_all, forget
from gradwatch.agent.remediation import Rewind
from gradwatch.agent.resume import ResumeState
from gradwatch.agent.sealer import Sealer
from gradwatch.agent.sender import OnceLogger, Sender
from gradwatch.agent.setup import SetupWatch
from gradwatch.agent.skip_guard import SkipSpikes
from gradwatch.agent.spool import Spool
from gradwatch.agent.step_builder import StepBuilder
from gradwatch.agent.tail import TailJournal
from gradwatch.agent.transport import HttpTransport
from gradwatch.agent.unwrap import scaler_enabled
from gradwatch.agent.wire import NanHunt, StepAssembler

__all__ = ["Monitor", "close_all"]

log = logging.getLogger("gradwatch.agent")


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:100] or "_"


class Monitor:
    """Handle returned by :func:`agent.attach`.

    Example::

        monitor = agent.attach(model, scaler, ema=ema, run="exp-42")
        for x, y in loader:
            ...
            scaler.update()
            ema.update(model)
            monitor.log(acc=accuracy)       # optional extra scalars
        monitor.close()                      # or use `with agent.attach(...) as monitor:`

    ``collectors`` (default :data:`agent.collectors.DEFAULT`) are the collector
    classes to compose; each one whose needs this monitor meets is used.

    ``step``: the number of the first step this process records (a run resumed from a
    checkpoint continues its step axis); None infers it from the optimizer state's step
    counters, else counts from 0 — and the server continues a guessed numbering after the
    run's stored steps rather than lose them (docs/resume.md).

    ``on_alert(alert)`` runs in the training thread at a step boundary for each
    alert news of the run (docs/alerts-in-the-loop.md); ``monitor.alerts()`` lists them.

    ``scheduler``: the LR scheduler, read once for the configuration advice (a cosine schedule's
    final LR, rule H8; docs/early-warning-advice.md), and snapshotted with ``remediate``.

    ``remediate``: a :class:`~agent.remediation.Rewind` policy (opt-in): snapshots of the training
    state every ``every`` steps, a rewind to the newest one before an alert's onset, the LR cooled
    for a while (docs/remediation.md).
    """

    def __init__(self, model: torch.nn.Module, scaler=None, *, optimizer=None, ema=None,
                 config: Optional[AgentConfig] = None, transport=None, step: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter, wall_clock: Callable[[], float] = time.time,
                 collectors=collector_kinds.DEFAULT, on_alert: Optional[Callable[[LoopAlert], None]] = None,
                 scheduler=None, remediate: Optional[Rewind] = None):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={type(model).__name__}: pass the torch.nn.Module you train")
        if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")):
            raise ValueError(f"scaler={type(scaler).__name__}: pass a torch.amp.GradScaler (or None)")
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise ValueError(f"optimizer={type(optimizer).__name__}: pass a torch.optim.Optimizer (or None)")
        if ema is not None:
            check_ema(ema)
        if remediate is not None and not isinstance(remediate, Rewind):
            raise ValueError(f"remediate={remediate!r}: pass gradwatch.agent.Rewind(...) (or None), e.g. "
                             f"remediate=Rewind(every=100, keep=2, on=('A1', 'A2', 'C3'))")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step={step!r}: pass the number of the first step to record (an int >= 0), or None")
        check_emits(collectors)   # the names each collector writes are the signal table's (agent/signals.py)
        check_owners((StepBuilder, Sealer, *collectors))   # and one writer per name (agent/owners.py)
        self.config = cfg = config or AgentConfig()
        self.model, self.ema = model, ema
        self.wall_clock = wall_clock
        self._pid = os.getpid()
        self._warn = OnceLogger(log)
        self._guards = Guards(self._warn, self._pid)
        self._disabled = self._guards.disabled   # the collectors switched off (read by tests)

        self.rank, self.world_size = 0, 1
        try:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        except Exception:  # noqa: BLE001
            pass

        self.hunt = NanHunt(cfg.nan_hunt, cfg.nan_hunt_steps)
        self._watched = w = Watched(model, scaler, optimizer, ema, cfg, self.hunt)
        self.collectors = parts = [c for c in (kind(w, self._guards) for kind in collectors) if c.wanted()]
        # the owner of the grad norms and clip threshold: the clip patch hands it clipping calls
        self._grad_norms = owner_of(parts, "clip_max_norm")
        # CPU-trained models compute the sampled EMA divergence on this thread (see ema_worker.py).
        self._ema_worker = next((c.worker for c in parts if isinstance(c, EmaDivergence)), None)

        if on_alert is not None and not callable(on_alert):
            raise ValueError(f"on_alert={on_alert!r}: pass a function taking one alert (or None)")
        # The run's alerts as the server reports them in its ingest replies (docs/alerts-in-the-loop.md).
        self._inbox = AlertInbox() if cfg.loop_alerts and cfg.mode == "online" else None
        self._alert_callbacks: list[Callable[[LoopAlert], None]] = [on_alert] if on_alert is not None else []

        self.sender: Optional[Sender] = None
        if cfg.mode != "disabled":
            spool_path = Path(cfg.spool_dir) / _safe_name(cfg.project) / _safe_name(cfg.run) / f"rank{self.rank}"
            self.sender = Sender(
                cfg,
                transport=transport or HttpTransport(cfg.server, cfg.token, cfg.http_timeout),
                spool=Spool(spool_path, cfg.spool_max_bytes),
                journal=(TailJournal(spool_path, fsync=cfg.crash_tail_fsync)
                         if cfg.crash_tail and cfg.spool_max_bytes > 0 else None),
                assembler=StepAssembler(w.param_names, [n for n, _ in w.modules], [n for n, _ in w.bns], self.hunt),
                header={"project": cfg.project, "run": cfg.run, "rank": self.rank, "world_size": self.world_size,
                        # this process's step numbering, for the server's resume bookkeeping (server/ingest/resume.py)
                        "session": uuid.uuid4().hex, "step_origin": "process", "step_start": 0},
                meta=self._meta(),
                warn=self._warn,
                inbox=self._inbox,
            )
        self._sealer = Sealer(cfg, self.sender, self._guards, [c for c in parts if overrides(c, "at_seal")],
                              self._ema_worker, stale_finish=lambda rec: self._finish_record(rec, False))
        # the exact-step NaN origin (docs/nan-origin.md); sharded parameters are not replayed
        self._replay = StepReplay(w, [n for n, _ in w.modules]) if cfg.nan_replay and not w.local else None
        self._builder = StepBuilder(w, self._guards, parts, self._sealer, self.sender, self._warn,
                                    clock, wall_clock, replay=self._replay)
        self._resume: Optional[ResumeState] = None
        if step is not None:
            self._builder.step = step
        with self._guards.guard("resume"):
            self._resume = ResumeState(w, step=step, rng=cfg.resume_rng)
            self._builder.step = self._resume.start
            if not self._resume.optimizer_read:
                self._builder.first_optimizer = self._optimizer_known
            self._builder.first_end = self._first_step_ended
            self._numbering()
        if self._inbox is not None:
            self._builder.inbox, self._builder.deliver_alerts = self._inbox, self._deliver_alerts
        self._skip: Optional[SkipSpikes] = None
        if cfg.skip_spikes:
            guard = SkipSpikes(w, self._guards, sigma=cfg.skip_sigma, window=cfg.skip_window)
            if guard.usable():
                self._skip = self._builder.skip = guard
        self._remedy = None
        if remediate is not None:
            self._remedy = self._remediation(remediate, scheduler)
            self._builder.remedy = self._remedy
        # the run's setup, once, for the checklist's configuration advice (agent/setup.py, rules H5-H9);
        # before the hooks: its clip_grad_norm_ observer must see a call before the grad-norm collector takes it
        self._setup: Optional[SetupWatch] = None
        if cfg.setup_advice and self.sender is not None:
            with self._guards.guard("setup"):
                setup = SetupWatch(w, scheduler)
                setup.install()
                self._setup = setup
                self._builder.first_end = self._first_step_ended
        self._hooks = HookAdapters(w, self._builder, self._guards, self._sealer.barrier, self._grad_norms)
        self._hooks.install()
        if self.sender is not None:
            self.sender.on_poll = self._sealer.seal_stale
        if cfg.announce and self.rank == 0 and cfg.mode != "disabled":
            self._announce()

    # ------------------------------------------------------------------ public API

    @property
    def scaler(self):
        return self._watched.scaler

    @property
    def optimizer(self):
        """The optimizer given to ``attach``, or the one the scaler's ``step()`` was first called with."""
        return self._watched.optimizer

    @property
    def step(self) -> int:
        """The number the next step record gets (steps recorded so far, unless set).

        Settable: a run resumed from a checkpoint continues its step numbers
        (``monitor.step = trainer.global_step``)."""
        return self._builder.step

    @step.setter
    def step(self, value: int) -> None:
        self._builder.step = int(value)
        if self._resume is not None and self._builder.first_end is not None:   # before the first step ended
            self._resume.given(int(value))
            self._numbering()

    @property
    def step_shift(self) -> int:
        """How far the server moved this process's step numbers to continue the run's stored steps
        (0: stored as numbered). Known after the first batch was delivered; the sender logs it."""
        return self.sender.step_shift if self.sender is not None else 0

    @property
    def already_stored_steps(self) -> int:
        """Steps of this process the server did not write because steps of the same numbers were
        stored already (``attach(step=N)`` below the run's last step); the sender warns once."""
        return self.sender.already_stored if self.sender is not None else 0

    @property
    def closed(self) -> bool:
        return self._guards.closed

    def log(self, loss=None, **values) -> None:
        """Record the loss (when there is no GradScaler) and any extra scalars for the current step.

        Tensors stay on their device (no sync); numbers are taken as they are.
        Called right after a step ends (before the next forward), values go to
        that step. With neither a scaler nor an optimizer, every call that
        carries ``loss=`` is one step.

        Every other name is charted as ``custom:<name>``. Two of them also stand for the step
        signal of that name, for a loop that knows what the agent could not measure (DeepSpeed
        under ZeRO 1/2 keeps no ``p.grad`` at the step): ``grad_norm=`` (the global pre-clip
        norm) becomes the step's ``grad_norm`` when the agent measured none for that step;
        when it did, the agent's own wins and the reported one is kept as ``custom:grad_norm``.
        ``clip_max_norm=`` (a number) is the step's clip threshold unless the agent saw a
        clipping call, so ``clipped`` is derived from it. With sharded parameters (FSDP,
        DTensor) a reported ``grad_norm`` stays custom: there the server combines the ranks' norms.
        ``overflow=`` (a bool or a 0-d tensor: the loop's loss scaler skipped this step) and
        ``loss_scale=`` (the scale this step's loss was multiplied by, before the scaler updates
        it) are a loss scaler's the agent has no GradScaler for (DeepSpeed's fp16 engine): they
        become the step's ``overflow`` (counted in ``overflow_count``; the step then counts as
        having an active loss scaler, as with a GradScaler: a non-finite grad norm on it is not an
        incident) and ``loss_scale``; where the agent's own GradScaler reported them, its values
        win and the reported ones are ``custom:overflow`` / ``custom:loss_scale``.

        >>> monitor.log(loss=loss)                 # doctest: +SKIP
        >>> monitor.log(acc=0.91, tokens_seen=n)   # doctest: +SKIP
        >>> monitor.log(grad_norm=engine.get_global_grad_norm(), clip_max_norm=1.0)   # doctest: +SKIP
        >>> monitor.log(overflow=skipped, loss_scale=scale_used)   # doctest: +SKIP
        """
        if self._guards.closed or os.getpid() != self._pid:
            return
        with self._guards.guard("log"):
            w = self._watched
            step_per_log = loss is not None and w.scaler is None and w.optimizer is None
            self._builder.log(loss, values, step_per_log)

    def replayable(self, fn: Callable[[], object]) -> None:
        """Give the agent a way to recompute this step's loss, should the step go non-finite.

        ``fn()`` runs the model and the loss on this step's batch, as the step did, and returns the
        loss (a tensor, or an output with ``.loss``). Call it once per forward (per micro-batch),
        before ``scaler.step()``; the agent keeps the reference until the step ends and calls it
        only to replay a step the scaler skipped with a NaN/Inf loss, under the forward's RNG and
        autocast state, with ``scaler.scale(loss).backward()``. With it the NaN origin is also
        found in the loss computation and in the backward; without it, in the model's forward
        only (docs/nan-origin.md). Bind the batch as default arguments, so that a later
        iteration's ``x`` is never read. Never raises.

        >>> monitor.replayable(lambda x=x, y=y: loss_fn(model(x), y))   # doctest: +SKIP
        """
        if self._replay is None or self._guards.closed or os.getpid() != self._pid:
            return
        with self._guards.guard("nan_replay"):
            self._replay.closure(fn)

    def checkpoint(self, path, step: Optional[int] = None, *, source: Optional[str] = None) -> bool:
        """Record that a checkpoint was written to ``path`` (sent with the next batch).

        ``step`` defaults to :attr:`step`, the optimizer steps taken so far: the step the run
        continues with after loading it. A critical alert then names the last checkpoint at or
        before its first anomalous step and the batches to skip (docs/checkpoints.md). The HF and
        Lightning callbacks call this for every checkpoint they save. Never raises: a bad
        argument is logged once and nothing is recorded; returns whether it was recorded.

        >>> torch.save(state, f"ckpt/step-{monitor.step}.pt")     # doctest: +SKIP
        >>> monitor.checkpoint(f"ckpt/step-{monitor.step}.pt")     # doctest: +SKIP
        True
        """
        if self._guards.closed or os.getpid() != self._pid or self.sender is None:
            return False
        try:
            event = checkpoint_event(path, self._builder.step if step is None else step,
                                     wall_time=self.wall_clock(), source=source)
        except ValueError as e:
            self._warn.warning("checkpoint:args", "gradwatch: checkpoint not recorded: %s", e)
            return False
        with self._guards.guard("checkpoint"):
            self.sender.submit(event)
            return True
        return False

    def seal_step(self) -> None:
        """A step begins here: seal and send the record of the step that ended before it.

        The agent sees a step begin at the model's forward, ``scaler.scale()`` or an
        optimizer step; a loop (or framework) whose step begins without any of them
        (e.g. a LightningModule whose ``training_step`` calls ``self.net(x)``, not
        ``self(x)``) calls this at the start of each batch, so that no step's record
        waits for a forward that never comes. Values logged after this go to the
        next step. Never raises.

        >>> monitor.seal_step()      # doctest: +SKIP
        """
        if self._guards.closed or os.getpid() != self._pid:
            return
        with self._guards.guard("seal"):
            self._sealer.seal_open()

    def remeasure_grads(self) -> None:
        """Measure this step's grad norms again, now (the grads changed since the agent measured them).

        The agent measures the grads where they are final for the usual loop (after
        unscale, or at the optimizer's step pre-hook). A loop that runs backward
        inside ``optimizer.step(closure)`` — Lightning without a scaler — has them
        only after the pre-hook: it calls this after backward, before clipping.
        Never raises.

        >>> loss.backward(); monitor.remeasure_grads(); clip_grad_norm_(...)   # doctest: +SKIP
        """
        if self._guards.closed or os.getpid() != self._pid:
            return
        with self._guards.guard("grad_norms"):
            self._grad_norms.remeasure()

    def alerts(self) -> list[LoopAlert]:
        """The run's alerts heard of since attach, newest first (the latest version of each).

        The server reports them in its answers to the agent's batches, within about
        ``flush_interval`` of the step that raised them (a non-finite step is sent at
        once). Alerts of an earlier process of the same run (a resumed run) are not in
        it; they are on the dashboard. Empty with ``mode="offline"`` / ``"disabled"``
        or ``loop_alerts=False``. Never raises.

        >>> [a.rule for a in monitor.alerts() if a.firing]      # doctest: +SKIP
        ['A1']
        """
        return self._inbox.alerts() if self._inbox is not None else []

    def add_alert_callback(self, callback: Callable[[LoopAlert], None]) -> None:
        """Call ``callback(alert)`` for every alert news from now on (as ``attach(on_alert=...)``).

        News is a new alert, or one whose status or severity changed. The callback
        runs in the training thread, at the end of the step during which the news
        arrived (inside ``scaler.update()``, the optimizer's step, or
        ``monitor.log(loss=...)``), never in the agent's thread; an exception in it is
        logged once and training goes on.

        >>> monitor.add_alert_callback(lambda alert: print(alert))   # doctest: +SKIP
        """
        if not callable(callback):
            raise ValueError(f"callback={callback!r}: pass a function taking one alert")
        self._alert_callbacks.append(callback)

    def flush(self, timeout: float = 5.0) -> bool:
        """Send everything recorded so far; True when it reached the server or the spool in time."""
        if os.getpid() != self._pid or self.sender is None:
            return True
        deadline = time.monotonic() + timeout
        with self._guards.guard("flush"):
            self._sealer.seal_open()
            self._sealer.await_stale_seal(timeout)
            self._sealer.barrier()
        return self.sender.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: Optional[float] = None, status: str = "finished") -> None:
        """Flush (at most ``timeout`` seconds, default ``exit_timeout``), remove every hook and wrapper."""
        if self._guards.closed:
            return
        if os.getpid() == self._pid:
            try:
                self._sealer.seal_open()
                self._sealer.await_stale_seal(self.config.exit_timeout if timeout is None else timeout)
                if self._ema_worker is not None:
                    self._ema_worker.stop()   # its record reaches the sender before the close marker
            except Exception:  # noqa: BLE001
                pass
        self._hooks.uninstall()
        if self._setup is not None:
            self._setup.remove()
        for c in self.collectors:
            c.detach()
        if self._replay is not None:
            self._replay.detach()
        self._guards.closed = True
        forget(self)
        if self.sender is not None and os.getpid() == self._pid:
            self.sender.close(self.config.exit_timeout if timeout is None else timeout, status=status)
            # a run whose batches all reached the server leaves no spool folder behind (issue 42)
            try:
                if not self.sender.spool.has_backlog():
                    self.sender.spool.prune(self.config.spool_dir)
            except Exception:  # noqa: BLE001 - tidying up never raises into the caller
                pass

    detach = close

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="crashed" if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
                   else "finished")

    @property
    def skipped_updates(self) -> int:
        """Updates the ``skip_spikes`` guard undid so far (0 when it is off).

        Reads the guard's device counter, so it waits for the device: read it at the
        end of training or at a checkpoint, not every step (the per-step
        ``skipped_update`` signal reaches the dashboard without any wait)."""
        skip = self._skip
        if skip is None or skip.count is None:
            return 0
        try:
            return int(skip.count.item())
        except Exception as e:  # noqa: BLE001 - a broken device must not raise into the loop from here
            self._warn.warning("skipped_updates", "gradwatch: could not read the skipped-update count: %r", e)
            return 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of host memory the ``remediate`` snapshots hold now (0 without remediation)."""
        return self._remedy.snapshot_bytes if self._remedy is not None else 0

    @property
    def rewinds(self) -> list[dict]:
        """The ``rewind`` events' data of this run so far (rewinds, cools, giving up), oldest first."""
        return self._remedy.policy.rewinds if self._remedy is not None else []

    @property
    def should_stop(self) -> bool:
        """True once ``remediate=Rewind(then="stop")`` gave up: end the training loop at this step."""
        return self._remedy is not None and self._remedy.policy.should_stop

    @property
    def dropped_steps(self) -> int:
        """Steps lost so far (queue full, spool full or unwritable, batches rejected)."""
        if self.sender is None:
            return 0
        return self.sender.dropped_steps + (self.sender.queue_drops - self.sender._queue_drops_seen)

    # ------------------------------------------------------------------ private

    def _numbering(self) -> None:
        if self.sender is not None and self._resume is not None:
            self.sender.header.update(step_origin=self._resume.origin, step_start=self._resume.start)

    def _optimizer_known(self, optimizer) -> None:
        """The first optimizer step begins (its optimizer was not given to attach): read its state
        as loaded, and continue from its step counters when no step was given."""
        r = self._resume
        r.optimizer_known(optimizer)
        self._builder.step = r.start
        self._numbering()

    def _first_step_ended(self, step: int) -> None:
        """The resume snapshot goes out with the first step's number (queued before that step's record)."""
        if self.sender is not None and self._resume is not None:
            self._numbering()
            self.sender.submit(self._resume.event(step))
        setup, self._setup = self._setup, None
        if self.sender is not None and setup is not None:
            with self._guards.guard("setup"):
                self.sender.submit(setup.event(step, module_clip=self._grad_norms.clip_max_norm))

    def _announce(self) -> None:
        """Rank 0 says where the run can be seen, in one line, and echoes the run's new alerts to stderr as
        `gradwatch demo` does (``announce=False`` / ``GRADWATCH_ANNOUNCE=0``: quiet)."""
        cfg = self.config
        try:
            base = cfg.server.rstrip("/")
            if cfg.mode == "offline":
                where = f"offline: spooled under {cfg.spool_dir}; upload it later with `gradwatch sync`"
            else:
                where = f"{base}/?project={quote(cfg.project)}&run={quote(cfg.run)}"
            print(f"gradwatch: run {cfg.run!r} (project {cfg.project!r}): {where}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - a print never costs the training loop
            return
        if self._inbox is None:
            return
        seen: set[int] = set()

        def echo(alert: LoopAlert) -> None:
            if alert.id in seen or alert.status != "firing":
                return
            seen.add(alert.id)
            print(f"gradwatch: ALERT {alert.rule} {alert.name} ({alert.severity}) at step {alert.step}: "
                  f"{alert.message}  {base}/runs/{alert.run_id}", file=sys.stderr, flush=True)
        self._alert_callbacks.append(echo)

    def _remediation(self, policy: Rewind, scheduler):
        """The runtime of ``remediate=`` (agent/rewinder.py), or None where it cannot act (said once)."""
        from gradwatch.agent.rewinder import Remedy

        why = None
        agreement = None
        if self._inbox is None:
            why = "it acts on the run's alerts, which the agent hears only with mode='online' and loop_alerts=True"
        elif self.world_size > 1:
            # every rank must restore the same snapshot at the same step: DDP's ranks agree in its own
            # gradient all-reduce (agent/rewind_agreement.py), FSDP2's in its gradient reduce-scatter
            # (agent/rewind_agreement_fsdp.py); other parallelisms are not supported yet
            from gradwatch.agent.rewind_agreement_fsdp import FsdpAgreement, is_fsdp2

            model = self._watched.model
            if is_fsdp2(model):
                try:   # reads FSDP2's internals (its param groups, mesh, reduce-scatter): never hurt the host
                    why = FsdpAgreement.usable(model, self.world_size)
                    if why is None:
                        agreement = FsdpAgreement(model, self.world_size)
                except Exception as e:  # noqa: BLE001
                    why = f"this torch's FSDP2 internals are not the ones the agreement reads ({e!r})"
            else:
                from gradwatch.agent.rewind_agreement import DdpAgreement

                why = DdpAgreement.usable(model)
                if why is None:
                    agreement = DdpAgreement(model, self.world_size)
        if why:
            self._warn.warning("remediate:off", "gradwatch: remediate=Rewind(...) is off: %s (docs/remediation.md)",
                               why)
            return None
        return Remedy(policy, self._watched, scheduler=scheduler, submit=self.sender.submit,
                      barrier=self._sealer.barrier, agreement=agreement,
                      record_checkpoint=lambda path, step: self.checkpoint(path, step=step, source="gradwatch.rewind"))

    def _deliver_alerts(self) -> None:
        """At a step boundary, in the training thread: the inbox's news to remediation, then the callbacks."""
        if self._guards.closed or os.getpid() != self._pid:
            return
        news = self._inbox.take_news()
        remedy = self._remedy
        if remedy is not None and self._guards.on("remediate"):
            updates = self._inbox.take_updates()   # an episode still firing after a rewind: acted on too
            if news or updates:
                with self._guards.guard("remediate"):
                    acted = remedy.on_news(news, self._builder.step, updates=updates)
                    for alert in acted:
                        if alert.remediation is not None:
                            self._inbox.annotate(alert)
                    news = acted[:len(news)]
        if news and self._alert_callbacks:
            run_callbacks(self._alert_callbacks, news, self._warn)

    @property
    def _open(self):
        """The ended step's record still open (None: none)."""
        return self._sealer.open_record

    def _finish_record(self, rec, in_training_thread: bool) -> None:
        """Seal and submit a record taken out of the open slot (the sender thread's stale seal
        goes through here: tests slow it down to catch a flush in the middle of it)."""
        self._sealer.finish(rec, in_training_thread)

    def _meta(self) -> dict:
        w = self._watched
        amp = None
        try:
            if scaler_enabled(w.scaler):
                amp = "float16"
        except Exception:  # noqa: BLE001
            pass
        meta = {
            "param_names": w.param_names,
            "module_names": [n for n, _ in w.modules],
            "bn_names": [n for n, _ in w.bns],
            "config": {**self.config.public(), "amp_dtype": amp, "scaler": w.scaler is not None,
                       "ema": type(self.ema).__name__ if self.ema is not None else None},
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "torch": torch.__version__.split("+")[0],
            "started_at": self.wall_clock(),
            # where this rank runs, for the run header (host-side facts only: no device query)
            **_placement(w.model),
        }
        if self.world_size > 1 and isinstance(w.model, torch.nn.parallel.DistributedDataParallel):
            # DDP all-reduces the grads: every rank's grad norm must be bit-identical (rule F5)
            meta["grad_replicas"] = "ddp"
        if w.layout is not None:
            # which piece of each parameter this rank holds: the server combines the ranks' partial
            # norms with it (docs/integrations.md, "Distributed"); absent on unsharded runs
            meta["param_shards"] = [[index, count] for index, count in w.layout]
        return meta


def _placement(model) -> dict:
    """``local_rank`` (torchrun's LOCAL_RANK) and ``device`` of the model's first parameter
    ("cuda:3"); what is not known is left out. Never raises: meta is best effort."""
    out: dict = {}
    try:
        local = os.environ.get("LOCAL_RANK")
        if local is not None and local.strip().isdigit():
            out["local_rank"] = int(local)
        p = next(model.parameters(), None)
        if p is not None:
            out["device"] = str(p.device)
    except Exception:  # noqa: BLE001 - a model without parameters() or an odd one: no placement
        pass
    return out
