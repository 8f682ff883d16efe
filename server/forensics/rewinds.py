"""Rewinds made visible: what the server does when a ``rewind`` event arrives (docs/wire-format.md).

The agent's Rewind policy acts on an alert it heard of in the loop (a rewind to an earlier snapshot, a
cooled LR, or giving up after ``max_rewinds``) and says so with one ``rewind`` event per rank. The event
is stored like any other (``run_events``; ``GET /api/v1/runs/{id}/rewinds`` lists it); in the same
ingest transaction, for the first report of each rewind (the other ranks' reports of the same step,
action, target and count are the same rewind):

* **the trigger alert says it was acted on.** The alert the event names (``trigger.alert_id``, an
  alert of the same run) gets ``evidence.remediation`` (every rewind that acted on it, the latest 20)
  and, as its first action, "Acted on at step 412 by the Rewind policy: rewound to step 300, …" (only the
  latest such line; earlier ones stay in the evidence). Its ``updated_at`` moves, so the next ingest
  reply carries it and the training loop's ``monitor.alerts()`` reads the new text; the loop's
  ``on_alert`` is not called again (news is a new alert or a changed status or severity), so a
  policy that acts on alerts does not act twice on its own rewind.
* **a notification goes out at once**, not grouped: a rewind is a one-off action already taken, not
  an episode that goes on. It goes to the receivers of the routes that take the trigger alert (the
  routing file, server/routing/; without one, every webhook endpoint whose ``min_severity`` the alert's
  severity reaches, as alerts do), with the trigger alert's severity; ``gave_up`` is sent as critical
  (the run stops, or goes on unprotected). A silence covering the trigger alert's labels now covers its
  rewinds too.
  A rewind naming no alert the server has is routed by the rule it names, as a warning.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, Project, Run, RunEvent
from gradwatch.server.queries.events import rewind_key, stored_trigger
from gradwatch.server.queries.rewind_text import acted_on_text, rewind_text
from gradwatch.server.routing.config import Receiver, routing_of
from gradwatch.server.routing.labels import alert_labels
from gradwatch.server.routing.notifications import enqueue_notification
from gradwatch.server.routing.routes import routes_for
from gradwatch.server.routing.silences import active_silences, silence_covering
from gradwatch.server.webhooks import outbox
from gradwatch.server.webhooks.formats import rewind_payload

KIND = "rewind"
ACTED_ON = "Acted on at step "      # how the trigger alert's "acted on" action starts (replaced, not stacked)
MAX_REMEDIATION = 20                # rewinds kept in one alert's evidence.remediation

__all__ = ["record_rewinds", "KIND"]


def record_rewinds(session: Session, *, run: Run, project: Project, rank: int, events: list[dict], settings: Any,
                   now: float) -> int:
    """Called by ingest after the batch's events are stored: annotate the trigger alerts of the batch's
    new rewinds and enqueue their notifications. Returns the outbox rows written."""
    new = [e for e in events if e.get("kind") == KIND]
    if not new:
        return 0
    written, seen = 0, set()
    for event in new:
        data = dict(event.get("data") or {})
        key = rewind_key(data, event.get("step"))
        if key in seen or _reported_before(session, run_id=run.id, key=key, now=now):
            continue
        seen.add(key)
        trigger = stored_trigger(session, run.id, data.get("trigger"))
        alert = session.get(Alert, trigger["alert_id"]) if trigger and trigger.get("alert_id") else None
        text = rewind_text(data, trigger=trigger or {})
        if alert is not None:
            _acted_on(alert, data, text, now=now)
        written += _notify(session, run=run, project=project, rank=rank, alert=alert, trigger=trigger,
                           data=data, text=text, settings=settings, now=now)
    return written


def _reported_before(session: Session, *, run_id: int, key: tuple, now: float) -> bool:
    """Whether an earlier batch (another rank's) stored this rewind already."""
    with session.no_autoflush:
        rows = session.execute(select(RunEvent.step, RunEvent.data).where(
            RunEvent.run_id == run_id, RunEvent.kind == KIND, RunEvent.step == key[0], RunEvent.time < now)).all()
    return any(rewind_key(d or {}, s) == key for s, d in rows)


def _acted_on(alert: Alert, data: dict, text: str, *, now: float) -> None:
    ev = dict(alert.evidence or {})
    done = list(ev.get("remediation") or [])
    done.append({k: data.get(k) for k in ("action", "from_step", "to_step", "batches_skipped", "lr_factor",
                                          "cool_steps", "rewind_number", "max_rewinds", "then")} | {"text": text})
    ev["remediation"] = done[-MAX_REMEDIATION:]
    alert.evidence = ev
    alert.actions = [acted_on_text(data)] + [a for a in (alert.actions or [])
                                             if not (isinstance(a, str) and a.startswith(ACTED_ON))]
    alert.updated_at = now


def _notify(session: Session, *, run: Run, project: Project, rank: int, alert: Optional[Alert],
            trigger: Optional[dict], data: dict, text: str, settings: Any, now: float) -> int:
    severity = "critical" if data.get("action") == "gave_up" else (alert.severity if alert else "warning")
    who = alert if alert is not None else SimpleNamespace(
        id="", rule=(trigger or {}).get("rule") or "", name=(trigger or {}).get("name") or "", rank=rank,
        severity=severity)
    labels = alert_labels(who, project=project.name, run=run.name)
    # the silences in force now (one made after the alert was notified has not been written on it yet)
    if silence_covering(active_silences(session, project_id=project.id, now=now), labels) is not None:
        return 0
    cfg = routing_of(settings)
    payload = rewind_payload(data, text=text, trigger=trigger, severity=severity, rank=rank, run_id=run.id,
                             run_name=run.name, project_name=project.name,
                             dashboard_url=outbox.dashboard_url(settings, run.id),
                             incident_url=outbox.incident_url(settings, alert.id if alert is not None else None),
                             created_at=now)
    written, told = 0, set()
    for route in routes_for(cfg, labels):
        receiver = cfg.receivers.get(route.receiver) or Receiver(route.receiver)
        if receiver.name in told:
            continue
        told.add(receiver.name)
        written += enqueue_notification(session, receiver, payload, project_id=project.id, settings=settings,
                                        now=now, alert_id=alert.id if alert is not None else None)
    return written
