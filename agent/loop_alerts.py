"""Alerts in the loop: the run's alerts as the training process hears of them, and what it does then.

Leaf module: standard library only.

The server answers every ingest batch with the run's alerts created or
changed since the agent's cursor (docs/alerts-in-the-loop.md, "On the
wire"). The sender thread hands each reply to :meth:`AlertInbox.receive`;
the training thread takes the news at its next step boundary
(:meth:`AlertInbox.take_news`) and runs the ``on_alert`` callbacks there,
never in the sender thread. :class:`StopOn` is such a callback: it remembers
the first alert that should stop the run (the framework callbacks' ``stop_on=``).

Example::

    >>> inbox = AlertInbox()
    >>> inbox.receive([{"id": 7, "run_id": 1, "rule": "A1", "name": "loss_nonfinite", "severity": "critical",
    ...                 "status": "firing", "first_step": 37, "last_step": 37, "rank": 0, "message": "loss is NaN",
    ...                 "diagnosis": "", "actions": [], "evidence": {}, "updated_at": 100.0}], cursor=100.0)
    >>> stop = StopOn("critical")
    >>> for alert in inbox.take_news():
    ...     stop(alert)
    >>> stop.triggered.rule, stop.triggered.step
    ('A1', 37)
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Union

__all__ = ["LoopAlert", "AlertInbox", "StopOn", "SEVERITIES", "run_callbacks"]

SEVERITIES = ("info", "warning", "critical")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class LoopAlert:
    """One alert of the run, as the server last described it.

    ``step`` is where the episode started (the first anomalous step), ``last_step``
    the latest step it covers; ``status`` is ``"firing"`` or ``"resolved"``.
    ``silenced``: a silence covers it (a person said "I know"), so :class:`StopOn`
    does not act on it; ``suppressed_by``: the id of an alert inhibiting its
    notification (routing), or None. ``remediation``: what ``remediate=Rewind(...)`` did
    about it (the ``rewind`` event's data: ``action``, ``to_step``, ``batches_skipped`` …),
    or None (docs/remediation.md).
    """

    id: int
    run_id: int
    rule: str                  # "A1"
    name: str                  # "loss_nonfinite"
    severity: str              # info | warning | critical
    status: str                # firing | resolved
    step: int
    last_step: int
    rank: int
    message: str
    diagnosis: str
    actions: tuple = ()
    evidence: dict = field(default_factory=dict)
    updated_at: float = 0.0
    silenced: bool = False
    suppressed_by: Optional[int] = None
    remediation: Optional[dict] = None

    @classmethod
    def from_wire(cls, a: dict) -> "LoopAlert":
        return cls(id=int(a["id"]), run_id=int(a.get("run_id", 0)), rule=str(a["rule"]), name=str(a["name"]),
                   severity=str(a["severity"]), status=str(a["status"]),
                   step=int(a.get("first_step", a.get("step", 0))), last_step=int(a.get("last_step", 0)),
                   rank=int(a.get("rank", 0)), message=str(a.get("message", "")),
                   diagnosis=str(a.get("diagnosis", "")), actions=tuple(a.get("actions") or ()),
                   evidence=dict(a.get("evidence") or {}), updated_at=float(a.get("updated_at", 0.0)),
                   silenced=a.get("silenced_by") is not None, suppressed_by=a.get("suppressed_by"))

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    def __str__(self) -> str:
        text = f"{self.rule} {self.name} ({self.severity}, {self.status}) at step {self.step}: {self.message}"
        r = self.remediation
        if r:
            text += (f" [rewound to step {r.get('to_step')}, skipped {r.get('batches_skipped')} batches]"
                     if r.get("action") == "rewind" else f" [remediation: {r.get('action')}]")
        return text


class AlertInbox:
    """The run's alerts seen so far, and the news not yet handed to the training thread.

    The sender thread calls :meth:`receive`; the training thread :meth:`take_news`
    and :meth:`alerts`. ``has_news`` is a plain attribute the training thread reads
    at every step boundary (no lock, no call: healthy steps pay one attribute read).

    News is an alert seen for the first time, or one whose ``status`` or
    ``severity`` changed (a warning escalated to critical, a resolved episode
    flaring up again, an episode resolved); a firing alert merely extended to a
    later step updates :meth:`alerts` without being news again.
    """

    def __init__(self, max_news: int = 1000):
        self._lock = threading.Lock()
        self._by_id: dict[int, LoopAlert] = {}
        self._news: collections.deque = collections.deque(maxlen=max_news)
        self.has_news = False
        # Alerts changed without being news (a firing episode extended to later steps), for remediation
        # (agent/rewinder.py: an anomaly that goes on after a rewind); read only when someone asks.
        self._updates: dict[int, LoopAlert] = {}
        self.has_updates = False
        # The server's clock at this process's first answered batch: anything older is an earlier
        # process's history (a resumed run), which the server's look-back may repeat but is not news.
        self._start: Optional[float] = None
        self.cursor = 0.0          # what the next batch sends as ``alerts_after`` (sender thread only)

    # ------------------------------------------------------------------ sender thread

    def receive(self, alerts: Iterable[dict], cursor: Optional[float]) -> None:
        """One reply's alerts (wire dicts, newest first) and its cursor."""
        if cursor is not None:
            if self._start is None:
                self._start = float(cursor)
            self.cursor = max(self.cursor, float(cursor))
        fresh = []
        for raw in alerts or ():
            alert = LoopAlert.from_wire(raw)
            if self._start is not None and alert.updated_at < self._start:
                continue
            fresh.append(alert)
        if not fresh:
            return
        news = []
        with self._lock:
            for alert in reversed(fresh):          # oldest first: news keeps the order things happened in
                known = self._by_id.get(alert.id)
                if known is not None and known.updated_at >= alert.updated_at:
                    continue                       # seen already (the look-back repeats recent alerts)
                if known is not None and known.remediation is not None:   # what was done about it stays said
                    alert = replace(alert, remediation=known.remediation)
                self._by_id[alert.id] = alert
                if known is None or known.status != alert.status or known.severity != alert.severity:
                    news.append(alert)
                else:
                    self._updates[alert.id] = alert
                    self.has_updates = True
            if news:
                self._news.extend(news)
                self.has_news = True

    # ------------------------------------------------------------------ training thread

    def take_news(self) -> list[LoopAlert]:
        """The news since the last call, oldest first (empties it)."""
        with self._lock:
            news = list(self._news)
            self._news.clear()
            self.has_news = False
        return news

    def take_updates(self) -> list[LoopAlert]:
        """The alerts changed since the last call without being news (e.g. extended to later steps),
        the latest version of each (empties it)."""
        with self._lock:
            updates = list(self._updates.values())
            self._updates.clear()
            self.has_updates = False
        return updates

    def annotate(self, alert: LoopAlert) -> None:
        """Keep ``alert``'s ``remediation`` on the stored version of it (training thread), so
        :meth:`alerts` says what was done about it."""
        with self._lock:
            known = self._by_id.get(alert.id)
            if known is not None and alert.remediation is not None:
                self._by_id[alert.id] = replace(known, remediation=alert.remediation)

    def alerts(self) -> list[LoopAlert]:
        """Every alert of the run heard of since attach, newest first (latest version of each)."""
        with self._lock:
            out = list(self._by_id.values())
        out.sort(key=lambda a: (a.updated_at, a.id), reverse=True)
        return out


StopSpec = Union[str, Iterable[str], Callable[[LoopAlert], bool]]


class StopOn:
    """An ``on_alert`` callback that remembers the first alert the run should stop for.

    ``spec``: a severity (``"critical"``: critical alerts; ``"warning"``: warning or
    worse), rule ids or names (``{"A1", "A2"}``, ``"loss_nonfinite"``), a mix of both,
    or a function ``alert -> bool``. Only a firing alert counts, and not one a
    silence covers (someone decided the run may go on).

    >>> stop = StopOn({"A1", "grad_explosion"})
    >>> stop.matches(LoopAlert(1, 1, "A2", "grad_explosion", "warning", "firing", 5, 5, 0, "", ""))
    True
    >>> stop.matches(LoopAlert(2, 1, "C3", "loss_spike", "critical", "firing", 5, 5, 0, "", ""))
    False
    """

    def __init__(self, spec: StopSpec):
        self.triggered: Optional[LoopAlert] = None
        self._test = _matcher(spec)

    def matches(self, alert: LoopAlert) -> bool:
        return alert.firing and not alert.silenced and self._test(alert)

    def __call__(self, alert: LoopAlert) -> None:
        if self.triggered is None and self.matches(alert):
            self.triggered = alert

    def __bool__(self) -> bool:
        return self.triggered is not None


def _matcher(spec: StopSpec) -> Callable[[LoopAlert], bool]:
    if callable(spec):
        return spec
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items or not all(isinstance(i, str) and i.strip() for i in items):
        raise ValueError(f"stop_on={spec!r}: give a severity ({', '.join(SEVERITIES)}), rule ids or names "
                         f"(e.g. {{'A1', 'A2'}}), or a function alert -> bool")
    floor = min((_SEVERITY_RANK[i] for i in items if i in _SEVERITY_RANK), default=None)
    rules = {i for i in items if i not in _SEVERITY_RANK}

    def test(alert: LoopAlert) -> bool:
        if floor is not None and _SEVERITY_RANK.get(alert.severity, -1) >= floor:
            return True
        return alert.rule in rules or alert.name in rules

    return test


def run_callbacks(callbacks: list, news: list[LoopAlert], warn: Any) -> None:
    """Call every callback with every news alert; a callback that raises is logged once and kept."""
    for alert in news:
        for cb in list(callbacks):
            try:
                cb(alert)
            except Exception as e:  # noqa: BLE001 - the training loop must not die of a user's callback
                warn.warning("on_alert:%x" % id(cb), "gradwatch: on_alert callback %r raised %r (training "
                             "continues; later alerts still reach it)", cb, e)
