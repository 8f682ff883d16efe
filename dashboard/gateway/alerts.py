"""Alerts: the list, the runs list's recovery and early-warning badges, an incident, acknowledging one."""
from __future__ import annotations

from typing import Optional, Sequence

from gradwatch.dashboard.gateway.context import run_visible, scoped, session, unwrap


def list_alerts(*, run_id: Optional[int] = None, severity: Optional[str] = None, rule: Optional[str] = None,
                status: Optional[str] = None) -> list[dict]:
    from gradwatch.server import queries
    with session() as s:
        return unwrap(queries.list_alerts(s, run_id=run_id, severity=severity or None, rule=rule or None,
                                           status=status or None, project=scoped(None)), "alerts")


def recoveries(run_ids: Sequence[int]) -> dict[int, tuple[int, Optional[str]]]:
    """For the runs list's health badge: each run's resolved warning / critical alerts, (count, "C3 at step
    80" for the latest). One read of the newest 1000 resolved alerts in scope (the query layer's cap): a run
    whose resolved alerts are all older than those shows no count."""
    from gradwatch.dashboard.alert_cards import recovery
    from gradwatch.server import queries
    wanted = set(run_ids)
    with session() as s:
        resolved = unwrap(queries.list_alerts(s, status="resolved", project=scoped(None)), "alerts")
    by_run: dict[int, list] = {}
    for a in resolved:
        if a.get("run_id") in wanted:
            by_run.setdefault(a["run_id"], []).append(a)
    return {rid: recovery(alerts) for rid, alerts in by_run.items()}


def early_warnings(run_ids: Sequence[int]) -> dict[int, dict[str, list]]:
    """The runs' firing early-warning alerts (``server.queries.early_warnings``), for the runs list's badge."""
    from gradwatch.server import queries
    with session() as s:
        return queries.early_warnings(s, run_ids=list(run_ids))


def get_incident(alert_id: int) -> Optional[dict]:
    """One alert's incident (``server.forensics.incident.get_incident``): the alert, its incident's other
    alerts, the checkpoint to roll back to and the timeline; None for no such alert (or another project's)."""
    from gradwatch.server.forensics import incident
    with session() as s:
        found = incident.get_incident(s, alert_id=alert_id)
        if found is None or not run_visible(s, found["alert"]["run_id"]):
            return None
        return found


def acknowledge_alert(alert_id: int) -> None:
    from gradwatch.server import queries
    from gradwatch.server.rules import alerts
    with session(write=True) as s:
        alert = queries.get_alert(s, alert_id=alert_id)
        if alert is None or not run_visible(s, alert.run_id):
            raise LookupError(f"no alert {alert_id}")
        alerts.acknowledge_alert(s, alert_id=alert_id)
