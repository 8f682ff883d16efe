"""Opt-in remediation: the :class:`Rewind` policy, and the ``rewind`` event it sends.

Leaf module: standard library (and :mod:`agent.loop_alerts`, itself a leaf) only.

``agent.attach(model, scaler, optimizer=opt, remediate=Rewind())`` keeps a few
in-memory snapshots of the training state (every ``every`` steps, the newest
``keep``) and, when an alert in ``on`` arrives, puts the newest snapshot taken
before the alert's first anomalous step back, cools the LR for a while, and
trains on with the next batches: the stretch in between is skipped, as PaLM's
restarts skipped the batches around a loss spike. An alert in ``cool_on`` (an
early warning) only cools the LR. Each action is one ``rewind`` event on the
run's charts (docs/remediation.md). The runtime is :mod:`agent.rewinder`; the
snapshots :mod:`agent.snapshots`.

Example::

    >>> policy = Rewind(every=100, keep=2, on=("A1", "A2", "C3"), lr_factor=0.5, cool_steps=200)
    >>> policy.every, policy.then
    (100, 'stop')
    >>> Rewind(every=0)
    Traceback (most recent call last):
    ...
    ValueError: Rewind: every=0: give the steps between two snapshots, an int >= 1 (100 is the default)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gradwatch.agent.loop_alerts import StopSpec, _matcher

__all__ = ["Rewind", "KIND", "ACTIONS", "rewind_event", "rewind_line"]

KIND = "rewind"
ACTIONS = ("rewind", "cool", "gave_up")
THEN = ("stop", "continue")


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Rewind:
    """What to do when the run breaks: rewind to a snapshot, cool the LR, give up after a few tries.

    Fields (defaults in brackets):

    * ``every`` [100]: steps between two snapshots (taken at the end of a step whose next step's number
      is a multiple of ``every``; a step with a non-finite loss, grad norm or weight is never snapshotted,
      the next healthy one is).
    * ``keep`` [2]: snapshots kept in memory (the newest ones). The RAM held is
      ``keep`` x (model parameters and buffers + optimizer state + EMA), reported as
      ``monitor.snapshot_bytes``. Two or more: an alert heard a few steps late may
      concern a step before the newest snapshot.
    * ``on`` [("A1", "A2")]: the alerts that rewind (non-finite loss or grads, grad explosion): rule ids or
      names, a severity (``"critical"``), or a function ``alert -> bool``, as ``stop_on``. Add ``"C3"``
      (loss spike) for a run whose spikes come from bad data; it is not a default because a converged,
      noisy loss raises C3 warnings on healthy runs too, and each would cost a rewind.
    * ``cool_on`` [()]: the alerts that only cool the LR, without a rewind (early warnings such as
      ``("H2", "H12", "H13")``).
    * ``lr_factor`` [0.5]: every param group's LR is multiplied by it for ``cool_steps`` updates after a
      rewind or a cool (1.0: never cooled). Applied around each optimizer update and taken off right
      after it, so a scheduler that writes the LR every step neither undoes nor compounds it.
    * ``cool_steps`` [200]: updates the LR stays cooled (0: not cooled).
    * ``max_rewinds`` [3]: rewinds allowed (within ``window`` steps when set); the next trigger gives up.
    * ``window`` [None]: count only the rewinds of the last ``window`` steps; None: the whole run.
    * ``then`` ["stop"]: after ``max_rewinds``: ``"stop"`` (the newest good snapshot before the trigger's
      onset is restored and the run stops at that step's end, as ``stop_on`` does: ``monitor.should_stop``
      in a plain loop, the HF / Lightning callbacks stop by themselves) or ``"continue"`` (remediation
      turns off, nothing is restored; an error line says so).
    * ``checkpoint`` [None]: with ``then="stop"``, a path where that restored state is saved
      (``torch.save``) before stopping, and recorded as the run's checkpoint.

    One ``Rewind`` object serves one monitor: it also holds what happened
    (:attr:`rewinds`, :attr:`should_stop`, :attr:`gave_up`).
    """

    every: int = 100
    keep: int = 2
    on: Any = ("A1", "A2")
    cool_on: Any = ()
    lr_factor: float = 0.5
    cool_steps: int = 200
    max_rewinds: int = 3
    window: Optional[int] = None
    then: str = "stop"
    checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        problems = []
        if not (_whole(self.every) and self.every >= 1):
            problems.append(f"every={self.every!r}: give the steps between two snapshots, an int >= 1 "
                            f"(100 is the default)")
        if not (_whole(self.keep) and self.keep >= 1):
            problems.append(f"keep={self.keep!r}: give the snapshots to keep in memory, an int >= 1 (2 is the "
                            f"default: an alert heard late may need the older one)")
        for name in ("on", "cool_on"):
            spec = getattr(self, name)
            if name == "cool_on" and (spec is None or spec == ()):
                continue
            try:
                _matcher(spec)
            except ValueError:
                problems.append(f"{name}={spec!r}: give rule ids or names (e.g. ('A1', 'C3')), a severity "
                                f"('critical'), or a function alert -> bool" + (", or () for none" if name == "cool_on"
                                                                                else ""))
        if isinstance(self.lr_factor, bool) or not isinstance(self.lr_factor, (int, float)) \
                or not 0 < self.lr_factor <= 1:
            problems.append(f"lr_factor={self.lr_factor!r}: give a number in (0, 1], the LR's multiplier while "
                            f"cooled (1.0: never cool)")
        if not (_whole(self.cool_steps) and self.cool_steps >= 0):
            problems.append(f"cool_steps={self.cool_steps!r}: give the updates the LR stays cooled, an int >= 0")
        if not (_whole(self.max_rewinds) and self.max_rewinds >= 1):
            problems.append(f"max_rewinds={self.max_rewinds!r}: give the rewinds allowed before `then`, an int >= 1")
        if self.window is not None and not (_whole(self.window) and self.window >= 1):
            problems.append(f"window={self.window!r}: give a number of steps >= 1, or None (the whole run)")
        if self.then not in THEN:
            problems.append(f"then={self.then!r}: use 'stop' (stop the run after max_rewinds) or 'continue' "
                            f"(go on without remediation)")
        if self.checkpoint is not None and (not isinstance(self.checkpoint, str) or not self.checkpoint.strip()):
            problems.append(f"checkpoint={self.checkpoint!r}: give a file path (str) or None")
        if self.checkpoint is not None and self.then != "stop":
            problems.append("checkpoint=... is written when the run stops: use it with then='stop'")
        if problems:
            raise ValueError("Rewind: " + "; ".join(problems))
        # what happened, filled by agent/rewinder.py (a frozen dataclass: the settings never change)
        object.__setattr__(self, "_state", {"rewinds": [], "gave_up": None, "should_stop": False})

    @property
    def cools(self) -> bool:
        return self.lr_factor < 1.0 and self.cool_steps > 0

    @property
    def rewinds(self) -> list[dict]:
        """The ``rewind`` events' data sent so far (every action: rewinds, cools, giving up), oldest first."""
        return list(self._state["rewinds"])

    @property
    def gave_up(self) -> Optional[dict]:
        """The ``gave_up`` event's data, once ``max_rewinds`` was reached; else None."""
        return self._state["gave_up"]

    @property
    def should_stop(self) -> bool:
        """True once the policy gave up with ``then="stop"``: end the loop at this step.

        >>> policy = Rewind()
        >>> policy.should_stop
        False
        """
        return self._state["should_stop"]

    def matches(self, alert: Any, which: str = "on") -> bool:
        """Whether a firing, not silenced ``alert`` triggers ``which`` ("on": a rewind, "cool_on": a cool)."""
        spec = getattr(self, which)
        if which == "cool_on" and (spec is None or spec == ()):
            return False
        if not getattr(alert, "firing", False) or getattr(alert, "silenced", False):
            return False
        return bool(_matcher(spec)(alert))


def rewind_event(*, from_step: int, to_step: int, lr_factor: float, cool_steps: int, trigger: dict,
                 rewind_number: int, max_rewinds: int, action: str, snapshot_bytes: Optional[int] = None,
                 then: Optional[str] = None) -> dict:
    """The wire event of one action (docs/remediation.md, "The event"); ``step`` is ``from_step``.

    >>> e = rewind_event(from_step=412, to_step=300, lr_factor=0.5, cool_steps=200, rewind_number=1,
    ...                  max_rewinds=3, action="rewind",
    ...                  trigger={"rule": "A1", "alert_id": 17, "step": 405, "name": "nan_loss"})
    >>> e["kind"], e["step"], e["data"]["batches_skipped"], e["data"]["snapshot_age_steps"]
    ('rewind', 412, 112, 112)
    """
    if action not in ACTIONS:
        raise ValueError(f"action={action!r}: one of {', '.join(ACTIONS)}")
    data = {"from_step": int(from_step), "to_step": int(to_step), "batches_skipped": int(from_step - to_step),
            "lr_factor": float(lr_factor), "cool_steps": int(cool_steps), "trigger": dict(trigger),
            "snapshot_age_steps": int(from_step - to_step), "rewind_number": int(rewind_number),
            "max_rewinds": int(max_rewinds), "action": action}
    if then is not None:                 # gave_up: what the run does next
        data["then"] = then
    if snapshot_bytes is not None:       # the RAM the snapshots hold (not in the contract: stored as sent)
        data["snapshot_bytes"] = int(snapshot_bytes)
    return {"step": int(from_step), "kind": KIND, "data": data}


def rewind_line(data: dict) -> str:
    """The log line of one action, from its event's data.

    >>> rewind_line({"action": "rewind", "to_step": 300, "batches_skipped": 112, "lr_factor": 0.5,
    ...              "cool_steps": 200, "trigger": {"rule": "A1", "step": 405}})
    'gradwatch: rewound to step 300, skipped 112 batches, LR x0.5 for 200 steps (A1 at step 405)'
    """
    t = data.get("trigger") or {}
    why = f"({t.get('rule')} at step {t.get('step')})"
    cool = (f"LR x{data['lr_factor']:g} for {data['cool_steps']} steps" if data["lr_factor"] < 1 and data["cool_steps"]
            else "LR unchanged")
    if data["action"] == "rewind":
        return (f"gradwatch: rewound to step {data['to_step']}, skipped {data['batches_skipped']} batches, "
                f"{cool} {why}")
    if data["action"] == "cool":
        return f"gradwatch: {cool}, no rewind {why}"
    return (f"gradwatch: gave up after {data['rewind_number']} rewinds (max_rewinds={data['max_rewinds']}) {why}")
