"""One incident, as its page shows it (dashboard/pages/incident.py, ``/incidents/<alert_id>``).

``get_incident(session, alert_id=...)`` gathers, for one alert: the alert itself, the other alerts of
its incident (the run's alerts on any rank whose steps overlap the incident's window: from 200 steps
before its first anomalous step to 200 after its last step; not its notification group, which lives
as long as the run and would pull in every later episode), the checkpoint to roll back to, the rewinds
of the agent's Rewind policy that acted on it (``rewinds``), and one timeline in step order (precursors,
loss-scale halvings, NaN-origin events, checkpoints, alerts, rewinds). Reads only, through ``server.queries``' alert and
event shapes; bounded by the run's alerts and events, which ``queries`` already caps.

The checkpoint to roll back to is the last ``checkpoint`` run event (data ``{"path", "step"}``) at or
before the incident's *first anomalous step*: the earliest precursor's ``from_step`` when a precursor
was found, else the alert's first step. An alert whose evidence already names a rollback point
(``evidence.rollback``, written by the checkpoint-advice rules) is shown as it says.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy.orm import Session

from gradwatch.server import queries
from gradwatch.server.forensics.precursors import format_ratio

WINDOW_STEPS = 200     # steps around the incident that the page charts, and that make another alert part of it


def first_anomalous_step(alert: dict) -> int:
    """The earliest precursor's onset, else the alert's first step."""
    ev = alert.get("evidence") or {}
    onsets = [p.get("from_step") for p in ev.get("precursors") or () if isinstance(p, dict)
              and p.get("from_step") is not None]
    return int(min([*onsets, alert["first_step"]]))


def rollback_checkpoint(checkpoints: list[dict], before_step: int) -> Optional[dict]:
    """The last checkpoint recorded at or before ``before_step`` (None: none recorded before it)."""
    usable = [c for c in checkpoints if c.get("step") is not None and c["step"] <= before_step]
    return max(usable, key=lambda c: c["step"]) if usable else None


def stated_rollback(evidence: dict) -> Optional[dict]:
    """The advice rollback.py wrote into a critical alert (``evidence.rollback``: ``checkpoint`` = its path,
    ``step``, ``skip_batches``) in the shape a checkpoint has here (``path``, ``step``, ``skip``); None when
    the alert has none, or it names no checkpoint."""
    stated = evidence.get("rollback")
    if not isinstance(stated, dict) or stated.get("step") is None:
        return None
    return {**stated, "path": stated.get("path", stated.get("checkpoint")),
            "skip": stated.get("skip", stated.get("skip_batches"))}


def get_incident(session: Session, *, alert_id: int, window: int = WINDOW_STEPS) -> Optional[dict[str, Any]]:
    """``{"alert", "run", "alerts", "checkpoints", "rollback", "timeline", "window", "first_anomalous_step"}``,
    or None for no such alert."""
    record = queries.get_alert(session, alert_id=alert_id)
    if record is None:
        return None
    alert = record.model_dump()
    run = queries.get_run(session, run_id=alert["run_id"])
    first = first_anomalous_step(alert)
    lo, hi = min(first, alert["first_step"]) - window, alert["last_step"] + window
    if run is not None and run.last_step is not None:   # charts end with the run's data, not past it
        hi = min(hi, max(run.last_step, alert["last_step"] + 1))
    related = []
    for a in queries.list_alerts(session, run_id=alert["run_id"]):
        a = a.model_dump()
        if a["id"] == alert_id:
            continue
        if a["first_step"] <= hi and a["last_step"] >= lo:
            related.append(a)
    related.sort(key=lambda a: (a["first_step"], a["rank"], a["id"]))
    checkpoints = [{"step": e.step, "path": (e.data or {}).get("path"), "rank": e.rank, "time": e.time}
                   for e in queries.list_events(session, run_id=alert["run_id"], kind="checkpoint")]
    rollback = stated_rollback(alert.get("evidence") or {}) or rollback_checkpoint(checkpoints, first)
    rewinds = incident_rewinds(queries.list_rewinds(session, run_id=alert["run_id"]),
                               {alert_id, *(a["id"] for a in related)}, lo, hi)
    return {"alert": alert, "run": run.model_dump() if run is not None else None, "alerts": related,
            "checkpoints": checkpoints, "rollback": rollback, "first_anomalous_step": first,
            "window": [max(0, lo), hi], "rewinds": rewinds,
            "timeline": timeline(alert, related, checkpoints,
                                 queries.list_events(session, run_id=alert["run_id"], kind="nan_origin"), lo, hi,
                                 rewinds=rewinds)}


def incident_rewinds(rewinds, alert_ids: set, lo: int, hi: int) -> list[dict]:
    """The run's rewinds that belong to the incident: those whose trigger is one of its alerts, and those
    made inside its window (a rewind names the alert the agent heard of first, which may be a related one)."""
    out = []
    for r in rewinds:
        trigger_id = (r.trigger or {}).get("alert_id")
        if trigger_id in alert_ids or lo <= r.step <= hi:
            out.append(r.model_dump())
    return out


def timeline(alert: dict, related: list[dict], checkpoints: list[dict], origins, lo: int, hi: int,
             rewinds: list[dict] = ()) -> list[dict]:
    """Every dated thing of the incident in step order: ``{"step", "kind", "text", "lead_steps"?}``; a rewind
    is listed at the step it was made (``from_step``), with ``to_step``."""
    failure = alert["first_step"]
    out: list[dict] = []
    for p in (alert.get("evidence") or {}).get("precursors") or ():
        if not isinstance(p, dict):
            continue
        if p.get("event") == "halved":
            out.append({"step": p["step"], "kind": "loss_scale", "lead_steps": failure - p["step"],
                        "text": f"loss scale halved ({p.get('from')} → {p.get('to')})"})
        elif p.get("from_step") is not None:
            who = f"{p['layer']} " if p.get("layer") else ""
            what = p["signal"].split(".", 1)[-1].replace("_", " ")
            size = (f"{format_ratio(p['ratio'])} its median" if p.get("ratio") is not None
                    else f"{p.get('z')}σ above its median")
            out.append({"step": p["from_step"], "kind": "precursor", "lead_steps": failure - p["from_step"],
                        "text": f"{who}{what} left its normal band ({size} by step {p.get('peak_step')})"})
    for c in checkpoints:
        if c.get("step") is not None and lo - 10 * WINDOW_STEPS <= c["step"] <= hi:
            out.append({"step": c["step"], "kind": "checkpoint", "text": f"checkpoint {c.get('path') or ''}".strip()})
    for e in origins:
        if e.step is not None and lo <= e.step <= hi:
            where = (e.data or {}).get("module") or (e.data or {}).get("param") or "?"
            out.append({"step": e.step, "kind": "nan_origin",
                        "text": f"NaN origin: {where} ({(e.data or {}).get('where', 'activation')}), rank {e.rank}"})
    for a in [alert, *related]:
        out.append({"step": a["first_step"], "kind": "alert", "alert_id": a["id"], "severity": a["severity"],
                    "text": f"{a['severity']} {a['rule']} {a['name']} (rank {a['rank']}): {a['message']}"})
    for r in rewinds:
        out.append({"step": r["step"], "kind": "rewind", "action": r["action"], "to_step": r.get("to_step"),
                    "alert_id": (r.get("trigger") or {}).get("alert_id"),
                    "text": r["text"][:1].upper() + r["text"][1:]})
    order = {"checkpoint": 0, "precursor": 1, "loss_scale": 2, "nan_origin": 3, "alert": 4, "rewind": 5}
    out.sort(key=lambda t: (t["step"], order.get(t["kind"], 9)))
    return out
