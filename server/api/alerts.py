"""``/api/v1/alerts`` (list, acknowledge) and ``/api/v1/rules`` (catalogue, per-project overrides)."""
from __future__ import annotations

from typing import Annotated, Any, Optional

from fastapi import APIRouter, Body, HTTPException, Query, Request

from gradwatch.server import queries
from gradwatch.server.rules.alerts import acknowledge_alert
from gradwatch.server.rules.catalogue import RULES_BY_ID, describe
from gradwatch.server.rules.config import RuleConfigError, get_rule_config, set_rule_override
from gradwatch.server.wire.schemas import AlertListOut, AlertOut
from gradwatch.server.access.scope import in_scope
from gradwatch.server.api.deps import ReadScopeDep, SessionDep, SettingsDep, check_scope

router = APIRouter(tags=["alerts"])


@router.get("/api/v1/alerts", response_model=AlertListOut)
def list_alerts(session: SessionDep, scope: ReadScopeDep,
                run: Annotated[Optional[int], Query(ge=0, le=2**62)] = None,
                severity: Annotated[Optional[str], Query(max_length=16)] = None,
                rule: Annotated[Optional[str], Query(max_length=64)] = None,
                status: Annotated[Optional[str], Query(max_length=16)] = None) -> AlertListOut:
    """Newest first; filters: run id, severity, rule (id or name), status (firing | resolved)."""
    alerts = queries.list_alerts(session, run_id=run, severity=severity, rule=rule, status=status, project=scope)
    return AlertListOut(alerts=alerts)


@router.post("/api/v1/alerts/{alert_id}/ack")
def ack_alert(alert_id: int, request: Request, scope: ReadScopeDep,
              body: Annotated[Optional[dict[str, Any]], Body()] = None) -> AlertOut:
    """Acknowledge an alert (``{"acknowledged": false}`` takes it back)."""
    value = True if not body else body.get("acknowledged", True)
    if not isinstance(value, bool):
        raise HTTPException(422, "acknowledged: expected true or false")
    with request.app.state.database.write_sessionmaker() as session:
        if scope is not None:
            owner = queries.run_project(session, run_id=_alert_run(session, alert_id))
            if not in_scope(scope, owner):
                raise HTTPException(404, f"no alert {alert_id}")    # another project's: not told whose
        alert = acknowledge_alert(session, alert_id=alert_id, acknowledged=value)
        if alert is None:
            raise HTTPException(404, f"no alert {alert_id}")
        session.commit()
        return queries.get_alert(session, alert_id=alert_id)


@router.get("/api/v1/alerts/{alert_id}/incident")
def alert_incident(alert_id: int, session: SessionDep, scope: ReadScopeDep) -> dict[str, Any]:
    """The alert's incident (docs/incidents.md): the precursor timeline, the incident's other alerts,
    the checkpoints and the one to roll back to; what ``/incidents/<alert_id>`` shows."""
    from gradwatch.agent.nonfinite import encode_json

    from gradwatch.server.forensics.incident import get_incident

    found = get_incident(session, alert_id=alert_id)
    if found is None or not in_scope(scope, (found["run"] or {}).get("project")):
        raise HTTPException(404, f"no alert {alert_id}")
    run = found["run"] or {}
    found["run"] = {k: run.get(k) for k in ("id", "project", "name", "status", "world_size")}
    return encode_json(found)


def _alert_run(session, alert_id: int) -> int:
    from gradwatch.server.storage.models import Alert

    alert = session.get(Alert, alert_id)
    if alert is None:
        raise HTTPException(404, f"no alert {alert_id}")
    return alert.run_id


@router.get("/api/v1/rules")
def list_rules(session: SessionDep, settings: SettingsDep, scope: ReadScopeDep,
               project: Annotated[str, Query(min_length=1, max_length=200)] = "default") -> dict[str, Any]:
    """The catalogue with the settings in force for ``project`` (defaults ← rules file ← API overrides)."""
    check_scope(scope, project)
    cfg = get_rule_config(session, project=project, settings=settings)
    rules = []
    for rid, values in cfg.items():
        spec = RULES_BY_ID[rid]
        rules.append({**values, "fires_when": describe(spec, values), "diagnosis": spec.diagnosis,
                      "actions": list(spec.actions), "checklist": spec.checklist})
    return {"project": project, "rules": rules}


@router.put("/api/v1/rules/{project}/{rule}")
def put_rule(project: str, rule: str, request: Request, settings: SettingsDep, scope: ReadScopeDep,
             values: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """Override one rule's settings for a project, e.g. ``{"factor": 20, "severity": "warning"}``;
    ``null`` removes an override. 422 names the rule and the key on a bad setting."""
    check_scope(scope, project)
    with request.app.state.database.write_sessionmaker() as session:
        try:
            out = set_rule_override(session, project=project, rule=rule, settings=settings, **values)
        except RuleConfigError as e:
            raise HTTPException(422, str(e)) from None
        session.commit()
    return out
