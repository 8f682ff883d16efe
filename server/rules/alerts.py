"""Alert lifecycle: one alert per episode, firing → resolved, cooldown, acknowledge.

The engine feeds each rule's per-step verdict into ``Episode.feed``:
``Hit`` (the condition holds at this step), ``False`` (it is clear) or ``None``
(no data for this rule at this step: changes nothing). A first hit opens an
alert (returned for the webhook outbox); later hits extend it; ``clear_steps``
clear steps in a row resolve it; a new hit within ``cooldown_steps`` of the
last one reopens the same alert without a new notification. An escalation
(e.g. C3 warning → critical; A2's second grad spike, also when it reopens the
alert within the cooldown) is notified again.

A rule declaring ``one_alert_across_ranks`` (A1, the F family) keeps one alert per incident, not
per rank: a rank hitting the condition while another rank's alert of the rule is firing in the same
run (within ``cooldown_steps``) joins it. The alert then lists the ranks (``evidence.ranks``, those
still firing in ``evidence.firing_ranks``) and is led by the rank that went first (``alert.rank``,
``first_step``, ``evidence.first_rank``), whatever order the ranks' batches arrive in: a rank whose
batch arrives late with an earlier step takes the lead and the alert is notified again, so the
notification names the right rank. It resolves when every rank has cleared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert
from gradwatch.server.rules.spec import SEVERITY_RANK, Hit, RuleSpec
from gradwatch.server.rules.stats import enc

__all__ = ["Episode", "Hit", "acknowledge_alert"]


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

    @property
    def _shared(self) -> bool:
        # the combined row (rank -1) is no rank of the incident: its alerts stay its own
        return self.spec.one_alert_across_ranks and self.rank >= 0

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
            # the message as of the latest hit (it names its step): the page shows it beside the first one,
            # whose numbers describe the step the alert opened at (issue 42)
            ev["last_message"] = h.message
            alert.evidence = ev
            self._escalate(alert, severity, h)
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
            if self._shared and "ranks" in ev:      # an alert of several ranks: this one fires again
                ev["firing_ranks"] = sorted({*ev.get("firing_ranks", ()), self.rank})
            alert.evidence = ev
            self.state["firing"] = True
            # a flare-up can be worse than the first hit (A2: a second grad spike within its window): escalated
            # and notified as a firing alert's escalation is
            self._escalate(alert, severity, h)
            return
        if self._shared:
            incident = self._open_incident(step, cooldown)
            if incident is not None:
                self._join(incident, step, h)
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

    def _escalate(self, alert: Alert, severity: str, h: Hit) -> None:
        """A hit more severe than the alert: the alert takes its severity, message and diagnosis (the escalated
        state, e.g. A2's single spike that recurred), is unacknowledged, and is notified again."""
        if SEVERITY_RANK.get(severity, 0) <= SEVERITY_RANK.get(alert.severity, 0):
            return
        alert.severity = severity
        alert.message = h.message
        alert.diagnosis = h.diagnosis or self.spec.diagnosis
        alert.acknowledged = False
        self.notify.append(alert)

    def _open_incident(self, step: int, cooldown: int) -> Optional[Alert]:
        """Another rank's alert of this rule in this run that ``step`` belongs to: within ``cooldown``
        steps of it, firing or resolved (a rank's batch runs its whole lifecycle at once: the rank that
        went first may have cleared and resolved the alert before a later rank's batch with the same
        incident arrives; that reopens it, as a rank's own flare-up within the cooldown does). The
        run's batches are serialised by its row lock, so two ranks cannot both open one."""
        with self.session.no_autoflush:
            return self.session.scalars(
                select(Alert).where(Alert.run_id == self.run_id, Alert.rule == self.spec.id, Alert.rank >= 0,
                                    Alert.first_step <= step + cooldown, Alert.last_step >= step - cooldown)
                .order_by(Alert.first_step, Alert.id).limit(1)).first()

    def _join(self, alert: Alert, step: int, h: Hit) -> None:
        ev = dict(alert.evidence or {})
        ev["ranks"] = sorted({*ev.get("ranks", [alert.rank]), self.rank})
        ev["firing_ranks"] = sorted({*ev.get("firing_ranks", [alert.rank]), self.rank})
        firsts = dict(ev.get("rank_first_steps") or {str(alert.rank): alert.first_step})
        firsts[str(self.rank)] = min(step, firsts.get(str(self.rank), step))
        ev["rank_first_steps"] = firsts
        ev["hits"] = ev.get("hits", 1) + 1
        ev.setdefault("lead_message", alert.message)
        if alert.status != "firing":
            alert.status, alert.resolved_at = "firing", None
            ev["reopened"] = ev.get("reopened", 0) + 1
            ev["firing_ranks"] = [self.rank]
        if (step, self.rank) < (alert.first_step, alert.rank):
            # this rank went first though its batch came later: it leads the alert, and the alert is
            # notified again (the first notification named a rank that only followed)
            ev.update(lead_message=h.message, first=enc(h.evidence))
            alert.rank, alert.first_step = self.rank, step
            alert.diagnosis = h.diagnosis or self.spec.diagnosis
            alert.actions = list(h.actions or self.spec.actions)
            self.notify.append(alert)
        else:
            ev["last"] = enc(h.evidence)
        # the rank keys appear when a second rank joins: a one-rank alert's evidence stays as it was
        ev["first_rank"], ev["first_step"] = alert.rank, alert.first_step
        ranks = ev["ranks"]
        alert.message = (f"{ev['lead_message']} (ranks {', '.join(map(str, ranks))}; rank {alert.rank} first, "
                         f"at step {alert.first_step})")
        alert.evidence = ev
        alert.last_step = max(alert.last_step, step)
        alert.updated_at = self.now
        self._alert = alert
        self.state.update(alert_id=alert.id, firing=True, clear=0)

    def resolve(self, step: int) -> None:
        alert = self._load()
        self.state["firing"] = False
        self.state["clear"] = 0
        if alert is not None and alert.status != "resolved" and self._shared:
            ev = dict(alert.evidence or {})
            still = [r for r in ev.get("firing_ranks", [alert.rank]) if r != self.rank]
            if still:      # the incident goes on on other ranks
                alert.evidence = {**ev, "firing_ranks": still}
                alert.updated_at = self.now
                return
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
