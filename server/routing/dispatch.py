"""The seam between the rule engine and the outbox: ``route_alerts`` (ingest, the timer rules) and
``flush_due`` (the delivery worker's clock).

``route_alerts`` runs in the batch's transaction: the new or escalated alerts are decided (inhibited,
silenced, muted, so the UI says so at once), put in their routes' groups, and the groups that are due
now (``group_wait = 0``, the default without a routing file) are flushed in the same transaction, so
an alert and its first notification are committed together, as before routing existed.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, Project, Run
from gradwatch.server.routing import groups
from gradwatch.server.routing.config import routing_of
from gradwatch.server.routing.labels import alert_labels
from gradwatch.server.routing.routes import routes_for


def route_alerts(session: Session, alerts: list[Alert], *, run: Run, project: Project, settings: Any,
                 now: float) -> int:
    """Route the engine's alerts; returns the outbox rows written now (the worker sends them on wake())."""
    if not alerts:
        return 0
    cfg = routing_of(settings)
    session.flush()
    ctx = groups.DecisionContext(session, project, cfg, settings, now)
    ctx.runs[run.id] = run
    touched: list[int] = []
    for alert in alerts:
        groups.decide(session, alert, ctx)
        labels = alert_labels(alert, project=project.name, run=run.name)
        for route in routes_for(cfg, labels):
            gid = groups.join_group(session, alert, route, labels, project_id=project.id, now=now)
            if gid not in touched:
                touched.append(gid)
    session.flush()
    return groups.flush_groups(session, cfg=cfg, settings=settings, now=now, ids=touched)


def route_timer_alerts(session: Session, alerts: list[Alert], *, settings: Any, now: float) -> int:
    """``route_alerts`` for alerts of several runs (the timer rules' scan)."""
    written = 0
    for alert in alerts:
        run = session.get(Run, alert.run_id)
        written += route_alerts(session, [alert], run=run, project=session.get(Project, run.project_id),
                                settings=settings, now=now)
    return written


def flush_due(session: Session, *, settings: Any, now: float) -> tuple[int, Optional[float]]:
    """Flush every due group; returns (outbox rows written, when the next group is due). Caller commits."""
    written = groups.flush_groups(session, cfg=routing_of(settings), settings=settings, now=now)
    session.flush()
    return written, groups.next_flush_at(session)
