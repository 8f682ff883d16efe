"""Alert lifecycle: one alert per episode, firing → resolved, cooldown, acknowledge.

The engine feeds each rule's per-step verdict into ``Episode.feed``:
``Hit`` (the condition holds at this step), ``False`` (it is clear) or ``None``
(no data for this rule at this step: changes nothing). A first hit opens an
alert (returned for the webhook outbox); later hits extend it; ``clear_steps``
clear steps in a row resolve it; a new hit within ``cooldown_steps`` of the
last one reopens the same alert without a new notification. An escalation
(e.g. C3 warning → critical) is notified again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.models import Alert
from server.rules.catalogue import SEVERITY_RANK, RuleSpec
from server.rules.stats import enc


@dataclass
class Hit:
    """The rule's condition holds at this step."""

    evidence: dict[str, Any]
    message: str
    severity: Optional[str] = None          # None: the rule's configured severity
    diagnosis: Optional[str] = None         # None: the catalogue's diagnosis
    actions: Optional[list[str]] = None     # None: the catalogue's actions


@dataclass
class Episode:
    session: Session
    run_id: int
    rank: int
    spec: RuleSpec
    cfg: dict[str, Any]
    state: dict[str, Any]
    now: float
    notify: list[Alert] = field(default_factory=list)   # alerts to send to webhooks
    _alert: Optional[Alert] = None

    def _load(self) -> Optional[Alert]:
        aid = self.state.get("alert_id")
        if aid is None:
            return None
        if self._alert is None or self._alert.id != aid:
            with self.session.no_autoflush:   # a lookup by key: pending rule states need not be flushed first
                self._alert = self.session.get(Alert, aid)
            if self._alert is None:          # deleted by a user: start afresh
                self.state.pop("alert_id", None)
                self.state["firing"] = False
        return self._alert

    @property
    def firing(self) -> bool:
        return bool(self.state.get("firing"))

    def feed(self, step: int, result: Any) -> None:
        if result is None:
            return
        if result is False:
            if self.firing:
                self.state["clear"] = self.state.get("clear", 0) + 1
                if self.state["clear"] >= self.cfg.get("clear_steps", 20):
                    self.resolve(step)
            return
        self.hit(step, result)

    def hit(self, step: int, h: Hit) -> None:
        severity = h.severity or self.cfg.get("severity", self.spec.severity)
        self.state["clear"] = 0
        alert = self._load()
        if alert is not None and self.firing:
            alert.last_step = max(alert.last_step, step)
            alert.updated_at = self.now
            ev = dict(alert.evidence or {})
            ev["hits"] = ev.get("hits", 1) + 1
            ev["last"] = enc(h.evidence)
            alert.evidence = ev
            if SEVERITY_RANK.get(severity, 0) > SEVERITY_RANK.get(alert.severity, 0):
                alert.severity = severity
                alert.message = h.message
                alert.acknowledged = False
                self.notify.append(alert)
            return
        cooldown = self.cfg.get("cooldown_steps", 50)
        if alert is not None and step - alert.last_step <= cooldown and step >= alert.first_step:
            # the same episode flaring up again: reopen, do not notify again
            alert.status = "firing"
            alert.resolved_at = None
            alert.last_step = step
            alert.updated_at = self.now
            ev = dict(alert.evidence or {})
            ev["hits"] = ev.get("hits", 1) + 1
            ev["reopened"] = ev.get("reopened", 0) + 1
            ev["last"] = enc(h.evidence)
            alert.evidence = ev
            self.state["firing"] = True
            return
        alert = Alert(
            run_id=self.run_id, rule=self.spec.id, name=self.spec.name, severity=severity, status="firing",
            acknowledged=False, rank=self.rank, first_step=step, last_step=step, message=h.message,
            diagnosis=h.diagnosis or self.spec.diagnosis, actions=list(h.actions or self.spec.actions),
            evidence=enc({**h.evidence, "hits": 1}), created_at=self.now, updated_at=self.now, resolved_at=None,
        )
        self.session.add(alert)
        self.session.flush()
        self._alert = alert
        self.state.update(alert_id=alert.id, firing=True, clear=0)
        self.notify.append(alert)

    def resolve(self, step: int) -> None:
        alert = self._load()
        self.state["firing"] = False
        self.state["clear"] = 0
        if alert is not None and alert.status != "resolved":
            alert.status = "resolved"
            alert.resolved_at = self.now
            alert.updated_at = self.now

    def add_evidence(self, **values: Any) -> None:
        """Attach late evidence (NaN origin, top grad norms) to the open alert."""
        alert = self._load()
        if alert is None or not self.firing:
            return
        ev = dict(alert.evidence or {})
        ev.update(enc(values))
        alert.evidence = ev
        alert.updated_at = self.now


# --------------------------------------------------------------------------- data access

def acknowledge_alert(session: Session, *, alert_id: int, acknowledged: bool = True) -> Optional[Alert]:
    """Mark an alert acknowledged (or not); returns it, or None if there is no such alert."""
    alert = session.get(Alert, alert_id)
    if alert is None:
        return None
    alert.acknowledged = acknowledged
    alert.updated_at = time.time()
    session.flush()
    return alert


def list_alerts(session: Session, *, run_id: Optional[int] = None, severity: Optional[str] = None,
                rule: Optional[str] = None, status: Optional[str] = None, project_id: Optional[int] = None,
                limit: int = 500) -> list[Alert]:
    """Alerts, newest first, filtered by run / minimum-exact severity / rule / status / project."""
    from server.models import Run

    q = select(Alert)
    if run_id is not None:
        q = q.where(Alert.run_id == run_id)
    if project_id is not None:
        q = q.where(Alert.run_id.in_(select(Run.id).where(Run.project_id == project_id)))
    if severity:
        q = q.where(Alert.severity == severity)
    if rule:
        q = q.where((Alert.rule == rule.upper()) | (Alert.name == rule))
    if status:
        q = q.where(Alert.status == status)
    q = q.order_by(Alert.id.desc()).limit(limit)
    return list(session.scalars(q))


def alert_to_dict(alert: Alert) -> dict[str, Any]:
    """The API shape of an alert (docs/wire-format.md)."""
    return {
        "id": alert.id, "run_id": alert.run_id, "rule": alert.rule, "name": alert.name,
        "severity": alert.severity, "status": alert.status, "step": alert.first_step,
        "first_step": alert.first_step, "last_step": alert.last_step, "rank": alert.rank,
        "message": alert.message, "diagnosis": alert.diagnosis, "actions": list(alert.actions or []),
        "evidence": alert.evidence or {}, "acknowledged": bool(alert.acknowledged),
        "created_at": alert.created_at, "updated_at": alert.updated_at, "resolved_at": alert.resolved_at,
    }
