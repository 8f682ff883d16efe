"""What the framework callbacks share: attach at train start, report each step's loss, close at the end.

Framework-free (torch and :mod:`agent` only): :class:`GradwatchCallbackBase` is
mixed into each framework's callback class (``agent.integrations.hf``,
``agent.integrations.lightning``), which maps its framework's events onto these
methods. Everything here goes through the monitor's public methods
(``agent.attach``, ``monitor.log``, ``monitor.seal_step``,
``monitor.remeasure_grads``, ``monitor.step``, ``monitor.close``), as a user's
own loop would.
"""
from __future__ import annotations

from typing import Any, Optional

from gradwatch import agent
from gradwatch.agent.loop_alerts import LoopAlert, StopOn
from . import StepLoss, close_monitor, log, report_loss


# steps between two agreements of the ranks on stop_on (GradwatchCallbackBase, stop_agree_every)
STOP_AGREE_EVERY = 10


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank: one all-reduce of one integer (on the current CUDA device
    under NCCL, which takes no CPU tensor; a host sync there, once per ``stop_agree_every`` steps)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class GradwatchCallbackBase:
    """The state and steps both framework callbacks share.

    Args:
        ema: the EMA to compare against (as for ``agent.attach``), if any.
        project, run, server: as for ``agent.attach``.
        stop_on: stop training at the end of the step during which an alert that
            matches arrives: a severity (``"critical"``), rule ids or names
            (``{"A1", "A2"}``), or a function ``alert -> bool``
            (:class:`~agent.loop_alerts.StopOn`; docs/alerts-in-the-loop.md). None: never.
            Under ``torch.distributed`` (world size > 1) the ranks agree first, every
            ``stop_agree_every`` steps, so that all stop at the same step (a rank that stopped
            alone would leave the others waiting at their next collective).
        stop_agree_every: with ``stop_on`` on several ranks: the steps between two agreements,
            each one all-reduce of one integer (the only collective gradwatch issues, and only
            when ``stop_on`` is set); a run stops at most this many steps after an alert.
        **config: any other ``agent.attach`` setting (``token=``,
            ``activations_every=``, ``on_alert=``, ``remediate=Rewind(...)`` — whose
            ``then="stop"`` stops the run like ``stop_on``, docs/remediation.md — …).
    """

    def __init__(self, *, ema: Any = None, project: Optional[str] = None, run: Optional[str] = None,
                 server: Optional[str] = None, stop_on: Any = None, stop_agree_every: int = STOP_AGREE_EVERY,
                 **config: Any) -> None:
        super().__init__()
        # Made here, not at train start: a bad stop_on raises where the callback is built.
        self.stop_on: Optional[StopOn] = StopOn(stop_on) if stop_on is not None else None
        if isinstance(stop_agree_every, bool) or not isinstance(stop_agree_every, int) or stop_agree_every < 1:
            raise ValueError(f"stop_agree_every={stop_agree_every!r}: give a whole number of steps >= 1")
        self.stop_agree_every = stop_agree_every
        self._stop_checks = 0
        self._stop_logged = False
        self.stopped_by: Optional[LoopAlert] = None   # the alert the run was stopped for
        # several ranks: True when the run stopped because another rank heard a stop_on alert first
        self.stopped_by_other_rank = False
        self.ema = ema
        self.project = project
        self.run = run
        self.server = server
        self.config = config
        self.monitor: Any = None
        self.scaler: Any = None
        self._step_loss = StepLoss()

    def _attach(self, model: Any, scaler: Any, optimizer: Any, *, run: Optional[str], global_step: int,
                scheduler: Any = None) -> bool:
        """``agent.attach`` at train start; True when attached.

        Bad settings raise (before training starts); any other failure is logged and
        training goes on unmonitored. A run resumed from a checkpoint (``global_step`` > 0)
        continues its step numbers instead of writing over its first steps.

        G6 (the RNG state at the resume) is off by default here: the frameworks restore the RNG
        later than train start (the HF Trainer in its epoch loop) or not at all (Lightning's
        checkpoints hold none), so the state at attach is not the checkpoint's; ``resume_rng=True``
        turns it on (docs/resume.md). ``scheduler``: the framework's LR scheduler, read once for the
        configuration advice (H8, docs/early-warning-advice.md)."""
        self.scaler = scaler
        config = {"resume_rng": False, **self.config}
        try:
            self.monitor = agent.attach(model, scaler, optimizer=optimizer, ema=self.ema,
                                        project=self.project, run=run, server=self.server,
                                        step=int(global_step) if global_step else None, scheduler=scheduler,
                                        **config)
        except ValueError:
            raise  # bad configuration: say so before training starts
        except Exception:  # noqa: BLE001 - never hurt the host process
            log.exception("gradwatch: attach failed; training continues unmonitored")
            return False
        if self.stop_on is not None:
            self.monitor.add_alert_callback(self.stop_on)
        return True

    def _stop_requested(self) -> bool:
        """At a step's end: whether to stop for an alert matching ``stop_on`` (logged once when so).

        Several ranks: every ``stop_agree_every``-th call, on every rank alike (the framework calls this
        at every step's end on every rank, whether or not its monitor attached: the ranks must make the
        same collectives), one all-reduce (MAX) of "this rank heard one"; all ranks stop when any did."""
        # remediate=Rewind(then="stop") gave up after max_rewinds (docs/remediation.md). Under DDP the ranks
        # decide that together, at the same step (agent/rewind_agreement.py), so no rank returns early alone
        # (no stop_on collective skipped by one rank only); elsewhere under torch.distributed remediation is off.
        if self.monitor is not None and getattr(self.monitor, "should_stop", False):
            if not self._stop_logged:
                self._stop_logged = True
                log.warning("gradwatch: stopping training after this step: remediation gave up (%s)",
                            (self.monitor.rewinds or [{}])[-1].get("trigger"))
            return True
        stop = self.stop_on
        if stop is None:
            return False
        heard = stop.triggered is not None
        world = _world_size()
        if world > 1:
            self._stop_checks += 1
            if self._stop_checks % self.stop_agree_every:
                return False
            agreed = _any_rank(heard)
            if agreed and not heard:
                self.stopped_by_other_rank = True
            heard = agreed
        if not heard:
            return False
        if not self._stop_logged:
            self.stopped_by = stop.triggered
            self._stop_logged = True
            log.warning("gradwatch: stopping training after this step: %s",
                        stop.triggered if stop.triggered is not None else "another rank heard a stop_on alert")
        return True

    def _report_step_loss(self) -> None:
        """Before the optimizer steps: the summed loss of the step's micro-batches goes to that step."""
        report_loss(self.monitor, self._step_loss.take())

    def _call(self, name: str) -> None:
        """One of the monitor's public step-boundary methods; never raises into training."""
        try:
            getattr(self.monitor, name)()
        except Exception:  # noqa: BLE001
            log.exception("gradwatch: %s failed", name)

    def _record_checkpoint(self, path: Any, step: int, source: str) -> None:
        """A checkpoint the framework saved: ``monitor.checkpoint`` (docs/checkpoints.md); never raises."""
        if self.monitor is None:
            return
        try:
            self.monitor.checkpoint(path, step=int(step), source=source)
        except Exception:  # noqa: BLE001
            log.exception("gradwatch: recording a checkpoint failed")

    def _finish(self, *, crashed: bool = False) -> None:
        """Flush and detach; ``crashed`` reports the run as crashed."""
        monitor, self.monitor = self.monitor, None
        self._step_loss.take()
        close_monitor(monitor, crashed=crashed)
