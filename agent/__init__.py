"""gradwatch agent: training-stability telemetry for PyTorch (mixed-precision) training loops.

One line in a training script::

    from gradwatch import agent
    monitor = agent.attach(model, scaler)          # GradScaler loop (fp16), or scaler=None

Per optimizer step it streams the loss, the global and per-parameter grad
norms after unscale and before clipping, clip events, the loss scale, overflow
(skipped step) and the running overflow count, the learning rate, step time
and throughput; sampled every K steps: weight norms and update ratios,
activation statistics per module, input non-finite counts, EMA divergence and
BatchNorm running statistics. After a non-finite loss it hunts for the first
module that produced the NaN. Nothing here syncs the device in the training
thread, raises into it, or blocks it: a background thread batches, spools to
disk when the server is down, and replays in order.

Without a GradScaler (bf16 / fp32)::

    monitor = agent.attach(model, optimizer=opt, ema=ema, run="exp-42")
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        monitor.log(loss=loss)
    monitor.close()

Settings (keyword arguments, or ``GRADWATCH_<SETTING>`` variables): see
:class:`agent.config.AgentConfig`. ``GRADWATCH_SERVER`` (default
``http://127.0.0.1:8470``), ``GRADWATCH_PROJECT``, ``GRADWATCH_RUN``,
``GRADWATCH_TOKEN`` (sent as ``Authorization: Bearer``), ``GRADWATCH_MODE``
(``online`` | ``offline`` | ``disabled``).
"""
from __future__ import annotations

# One module, one name: this folder is installed as gradwatch.agent (pyproject.toml maps it at build
# time). Imported as a top-level `agent` -- a checkout's root on sys.path -- every module
# would load a second time beside gradwatch.agent's, with its own state; refuse instead.
if __name__ != "gradwatch.agent":
    raise ImportError(f"{__path__[0]} is gradwatch's agent package: import it as `from gradwatch import agent`, "
                      f"not as {__name__!r} (that name is left to your own code)")

import atexit
import sys
import threading
from typing import Any, Optional

from gradwatch.agent.config import AgentConfig

__all__ = ["attach", "AgentConfig", "Monitor", "close_all", "Rewind"]


def __getattr__(name: str) -> Any:
    # torch is imported with the monitor, on first use: `gradwatch sync` (agent.sync, agent.spool,
    # agent.transport) then runs where torch is not installed, e.g. in the server image
    if name == "Monitor":
        from gradwatch.agent.monitor import Monitor

        return Monitor
    if name == "Rewind":
        from gradwatch.agent.remediation import Rewind

        return Rewind
    if name == "close_all":
        from gradwatch.agent.registry import close_all

        return close_all
    raise AttributeError(f"module 'gradwatch.agent' has no attribute {name!r}")


def attach(model, scaler=None, *, optimizer=None, ema=None, project: Optional[str] = None,
           run: Optional[str] = None, server: Optional[str] = None, transport: Any = None,
           step: Optional[int] = None, on_alert: Any = None, scheduler: Any = None,
           remediate: Any = None, **config: Any) -> "Monitor":
    """Start monitoring ``model`` (and ``scaler`` / ``optimizer`` / ``ema`` when given).

    Returns a :class:`Monitor`; ``monitor.close()`` (alias ``detach()``) flushes
    and removes every hook and wrapper, and the handle is a context manager.
    Attaching again to the same model with the same objects returns the
    existing handle; with different ones, the old handle is closed and
    replaced. Bad settings raise ``ValueError`` here, before training starts;
    after this call the agent never raises into the training loop.

    The training stacks' wrappers are unwrapped (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``, Fabric's ``_FabricModule`` / ``_FabricOptimizer``, a DeepSpeed engine and its
    optimizer); an optimizer or scaler gradwatch cannot hook is left out with one warning that says
    what is not measured, and the rest is monitored (docs/integrations.md).

    ``step``: the number of this process's first step, for a run resumed from a checkpoint
    (``attach(model, scaler, run="exp-42", step=ckpt["step"] + 1)``). Without it the agent
    continues from the optimizer state's step counters, and the server continues a run's
    stored steps rather than lose them (docs/resume.md).

    ``on_alert(alert)`` is called in the training thread, at a step boundary,
    for each of the run's alerts the server reports (new, or changed status or
    severity); ``monitor.alerts()`` lists them (docs/alerts-in-the-loop.md).

    ``scheduler``: the LR scheduler, read once at attach for the configuration advice (rule H8:
    a cosine schedule that ends below base_lr / 10; docs/early-warning-advice.md); with ``remediate``
    it is snapshotted and restored too.

    ``remediate``: opt-in self-healing, a :class:`~agent.remediation.Rewind` policy: snapshots of the
    training state every ``every`` steps; when an alert in ``on`` arrives, the newest snapshot from
    before its onset is restored, the LR cooled, and training goes on with the next batches; a
    ``rewind`` event marks it on the run's charts (docs/remediation.md)::

        from gradwatch.agent import Rewind
        monitor = agent.attach(model, scaler, optimizer=opt, scheduler=sched,
                               remediate=Rewind(every=100, keep=2, on=("A1", "A2", "C3"), lr_factor=0.5))
        for x, y in loader:
            ...
            if monitor.should_stop:      # Rewind(then="stop") gave up after max_rewinds
                break

    >>> import torch
    >>> from gradwatch import agent
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with agent.attach(model, optimizer=opt, mode="disabled") as monitor:
    ...     loss = model(torch.randn(8, 4)).pow(2).mean()
    ...     loss.backward(); opt.step(); opt.zero_grad()
    ...     monitor.log(loss=loss)
    >>> monitor.step
    1
    """
    from gradwatch.agent.monitor import Monitor
    from gradwatch.agent.registry import existing, remember
    from gradwatch.agent.unwrap import unwrap_model, unwrap_optimizer, unwrap_scaler

    cfg = AgentConfig.from_sources({**config, "project": project, "run": run, "server": server})
    # the training stacks' wrappers (Accelerate, Lightning, Fabric, DeepSpeed) unwrapped; what cannot be
    # hooked is dropped and said once, instead of raising into the user's script (agent/unwrap.py)
    model, why_model = unwrap_model(model)
    optimizer, why_optimizer = unwrap_optimizer(optimizer)
    scaler, why_scaler = unwrap_scaler(scaler)
    notes = [w for w in (why_model, why_optimizer, why_scaler) if w]
    if notes:
        import logging

        logging.getLogger("gradwatch.agent").warning(
            "gradwatch: %s; the rest is monitored as usual (docs/integrations.md)", "; ".join(notes))
    previous = existing(model)
    if previous is not None:
        if (previous.scaler is scaler and previous.ema is ema and remediate is None
                and (optimizer is None or previous.optimizer is optimizer)):
            if on_alert is not None:
                previous.add_alert_callback(on_alert)
            return previous
        previous.close()
    monitor = Monitor(model, scaler, optimizer=optimizer, ema=ema, config=cfg, transport=transport, step=step,
                      on_alert=on_alert, scheduler=scheduler, remediate=remediate)
    remember(model, monitor)
    _install_exit_handlers()
    return monitor


_exit_lock = threading.Lock()
_exit_installed = False


def _install_exit_handlers() -> None:
    global _exit_installed
    with _exit_lock:
        if _exit_installed:
            return
        _exit_installed = True
        from gradwatch.agent.registry import close_all

        atexit.register(close_all)
        previous = sys.excepthook

        def excepthook(exc_type, exc, tb):
            try:
                if not issubclass(exc_type, KeyboardInterrupt):
                    close_all(status="crashed")
            except Exception:  # noqa: BLE001
                pass
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
