"""Alerts in their one shape outside the database (the API, the dashboard, the CLI); the firing alerts
counted per run (the runs list's health) and the early-warning badge."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, Project, Run
from gradwatch.server.rules.registry import ids_of_family
from gradwatch.server.wire.schemas import AlertOut
from gradwatch.server.rules.spec import EARLY_WARNING


_SEVERITY_ORDER = {"critical": 2, "warning": 1}


def alert_counts(session: Session, run_ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    if not run_ids:
        return {}
    rows = session.execute(
        select(Alert.run_id, Alert.severity, func.count())
        .where(Alert.status == "firing", Alert.run_id.in_(list(run_ids)))
        .group_by(Alert.run_id, Alert.severity)
    ).all()
    out: dict[int, tuple[int, str]] = {}
    for run_id, severity, n in rows:
        count, health = out.get(run_id, (0, "ok"))
        if _SEVERITY_ORDER.get(severity, 0) > _SEVERITY_ORDER.get(health, 0):
            health = severity
        out[run_id] = (count + n, health)
    return out


def alert_out(a: Any, inhibitors: Optional[dict[int, str]] = None) -> AlertOut:
    """An alert row as its one shape outside the database (``schemas.AlertOut``): what the API answers, the
    ingest reply carries, the dashboard, the incident page and the CLI read. ``a``: an ORM ``Alert`` or a
    Core row of the ``alerts`` table's columns (the ingest reply reads those, server/api/ingest.py).

    ``inhibitors``: alert id → "A1 loss_nonfinite rank 2" for the alerts that suppress others."""
    return AlertOut(
        id=a.id, run_id=a.run_id, rule=a.rule, name=a.name, severity=a.severity, status=a.status,
        step=a.first_step, first_step=a.first_step, last_step=a.last_step, rank=a.rank, message=a.message,
        diagnosis=a.diagnosis, actions=list(a.actions or []), evidence=dict(a.evidence or {}),
        acknowledged=bool(a.acknowledged), created_at=a.created_at, updated_at=a.updated_at,
        resolved_at=a.resolved_at, suppressed_by=a.suppressed_by,
        suppressed_by_rule=(inhibitors or {}).get(a.suppressed_by) if a.suppressed_by is not None else None,
        silenced_by=a.silenced_by, muted=a.muted,
    )


def _inhibitors(session: Session, alerts: list[Alert]) -> dict[int, str]:
    ids = {a.suppressed_by for a in alerts if a.suppressed_by is not None}
    if not ids:
        return {}
    return {i: f"{rule} {name} rank {rank}" for i, rule, name, rank in session.execute(
        select(Alert.id, Alert.rule, Alert.name, Alert.rank).where(Alert.id.in_(ids)))}


def list_alerts(session: Session, *, run_id: Optional[int] = None, severity: Optional[str] = None,
                rule: Optional[str] = None, status: Optional[str] = None, project: Optional[str] = None,
                limit: int = 1000) -> list[AlertOut]:
    """Alerts, newest first. ``rule`` matches the id ("A1") or the name ("loss_nonfinite")."""
    q = select(Alert)
    if run_id is not None:
        q = q.where(Alert.run_id == run_id)
    if severity:
        q = q.where(Alert.severity == severity)
    if rule:
        q = q.where(or_(Alert.rule == rule, Alert.name == rule))
    if status:
        q = q.where(Alert.status == status)
    if project:
        q = q.join(Run, Run.id == Alert.run_id).join(Project, Project.id == Run.project_id).where(Project.name == project)
    q = q.order_by(Alert.updated_at.desc(), Alert.id.desc()).limit(limit)
    alerts = list(session.scalars(q))
    inhibitors = _inhibitors(session, alerts)
    return [alert_out(a, inhibitors) for a in alerts]


def get_alert(session: Session, *, alert_id: int) -> Optional[AlertOut]:
    a = session.get(Alert, alert_id)
    return None if a is None else alert_out(a, _inhibitors(session, [a]))


def early_warnings(session: Session, *, run_ids: Sequence[int]) -> dict[int, dict[str, list]]:
    """Per run, its firing early-warning alerts (the rules of family ``spec.EARLY_WARNING``, docs/
    early-warning-advice.md: H1-H4 read step signals, H5-H9 the setup), acknowledged or not: ``{"warnings":
    [[rule, name, severity], ...]}`` above info and ``{"advice": [[rule, name], ...]}`` at info, by rule
    id. One grouped query for all the runs; a run with none is absent."""
    if not run_ids:
        return {}
    rows = session.execute(
        select(Alert.run_id, Alert.rule, Alert.name, Alert.severity)
        .where(Alert.status == "firing", Alert.run_id.in_(list(run_ids)),
               Alert.rule.in_(ids_of_family(EARLY_WARNING)))
        .group_by(Alert.run_id, Alert.rule, Alert.name, Alert.severity)
    ).all()
    out: dict[int, dict[str, list]] = {}
    for run_id, rule, name, severity in sorted(rows, key=lambda r: (r[0], r[1], -_SEVERITY_ORDER.get(r[3], 0))):
        mine = out.setdefault(run_id, {"warnings": [], "advice": []})
        if any(rule == w[0] for w in mine["warnings"]) or any(rule == a[0] for a in mine["advice"]):
            continue   # the rule's worst firing severity counts (one per rank could differ)
        if severity == "info":
            mine["advice"].append([rule, name])
        else:
            mine["warnings"].append([rule, name, severity])
    return out
