"""One group notification → outbox rows for one receiver: a webhook delivery per endpoint, one email.

The body keeps the single-alert payload of docs/webhooks.md (the group's lead alert: the most severe,
then the earliest), so receivers written for it go on working, and adds ``group``: every alert in the
notification with its rank, the ranks, and how many alerts of the incident were held back.

The ranks are every rank an alert covers: an alert of a rule with ``one_alert_across_ranks`` (A1,
the F family) lists in ``evidence.ranks`` the ranks that joined it, led by ``alert.rank``, the one
that went first. ``group.first`` names the incident's first rank and step: the lead alert's.
"""
from __future__ import annotations

import json
import unicodedata
from typing import Any, Optional

from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, NotificationGroup, WebhookDelivery
from gradwatch.server.routing.config import Receiver
from gradwatch.server.rules.catalogue import SEVERITY_RANK
from gradwatch.server.webhooks import outbox
from gradwatch.server.webhooks.formats import alert_payload, notification_title, rewind_sentence

EMAIL_SCHEME = "mailto:"


def lead_alert(alerts: list[Alert]) -> Alert:
    return min(alerts, key=lambda a: (-SEVERITY_RANK.get(a.severity, 0), a.first_step, a.id))


def alert_ranks(alert: Alert) -> list[int]:
    """The ranks one alert covers: its own, and those that joined it (``evidence.ranks``)."""
    ranks = (alert.evidence or {}).get("ranks") if isinstance(alert.evidence, dict) else None
    return sorted({alert.rank, *(int(r) for r in ranks or ())})


def group_payload(group: NotificationGroup, alerts: list[Alert], *, held_back: int, run_names: dict[int, str],
                  project_name: str, settings: Any) -> dict[str, Any]:
    lead = lead_alert(alerts)
    payload = alert_payload(lead, run_name=run_names.get(lead.run_id, ""), project_name=project_name,
                            dashboard_url=outbox.dashboard_url(settings, lead.run_id),
                            incident_url=outbox.incident_url(settings, lead.id))
    ordered = sorted(alerts, key=lambda a: (a.first_step, a.rank, a.rule, a.id))
    payload["group"] = {
        "id": group.id, "key": group.group_key, "route": group.route, "receiver": group.receiver,
        "labels": dict(group.labels or {}), "count": len(alerts), "held_back": held_back,
        "ranks": sorted({r for a in alerts for r in alert_ranks(a)}),
        # which rank went first, at which step: the lead alert's (the most severe, then the earliest; an
        # alert of several ranks is led by the rank that went first), read when the group is flushed, so
        # whatever order the ranks' batches arrived in. Not simply the earliest alert: under DDP a warning
        # on every rank (A3's NaN grads after the all-reduce) comes at the same step as the rank whose
        # loss went NaN
        "first": {"rank": lead.rank, "step": lead.first_step, "rule": lead.rule},
        "alerts": [{"alert_id": a.id, "rule": a.rule, "name": a.name, "severity": a.severity, "status": a.status,
                    "run": run_names.get(a.run_id, ""), "rank": a.rank, "ranks": alert_ranks(a),
                    "first_step": a.first_step,
                    "last_step": a.last_step, "message": a.message} for a in ordered],
    }
    return payload


def header_text(text: str) -> str:
    """One header line: control characters and Unicode line/paragraph separators become a visible
    ``\\x..`` escape (a name stored before ingest refused them must not end the Subject line, nor
    make ``EmailMessage`` refuse the header and the outbox retry it for a day).

    >>> header_text("exp-1\\r\\nBcc: x@y.z")
    'exp-1\\\\x0d\\\\x0aBcc: x@y.z'
    """
    return "".join((f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
                   if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in text)


def rewind_email_body(payload: dict[str, Any]) -> dict[str, Any]:
    """A rewind notification (server/forensics/rewinds.py) as an email: its title, its sentence, the links."""
    lines = [rewind_sentence(payload), ""]
    if payload.get("incident_url"):
        lines.append(f"Open the incident: {payload['incident_url']}")
    lines.append(f"Open the run: {payload['dashboard_url']}")
    return {"subject": header_text(f"[gradwatch] {notification_title(payload)}"), "text": "\n".join(lines)}


def email_body(payload: dict[str, Any]) -> dict[str, Any]:
    if payload.get("event") == "rewind":
        return rewind_email_body(payload)
    g = payload.get("group") or {}
    subject = header_text(f"[gradwatch] {payload['severity'].upper()} {payload['rule']} {payload['name']}: "
                          f"{payload['project']}/{payload['run']}")
    if g.get("count", 1) > 1:
        subject += f" (+{g['count'] - 1} more)"
    lines = [payload["message"], "", f"Diagnosis: {payload['diagnosis']}", "", "What to do:"]
    lines += [f"  - {a}" for a in payload.get("actions") or []]
    if g:
        lines += ["", f"Alerts in this incident (ranks {', '.join(map(str, g['ranks']))}):"]
        if g.get("first") and len(g["ranks"]) > 1:
            lines.insert(len(lines) - 1, f"First: rank {g['first']['rank']} at step {g['first']['step']} "
                                         f"({g['first']['rule']})")
        lines += [f"  {a['severity']:<8} {a['rule']} {a['name']} rank {a['rank']} step {a['first_step']}: "
                  f"{a['message']}" for a in g["alerts"]]
        if g.get("held_back"):
            lines.append(f"  ({g['held_back']} more held back: suppressed, silenced, muted or pending)")
    lines.append("")
    if payload.get("incident_url"):
        lines.append(f"Open the incident: {payload['incident_url']}")
    lines.append(f"Open the run: {payload['dashboard_url']}")
    return {"subject": subject, "text": "\n".join(lines)}


def enqueue_notification(session: Session, receiver: Receiver, payload: dict[str, Any], *, project_id: int,
                         settings: Any, now: float, alert_id: Optional[int]) -> int:
    """The outbox rows for one notification to one receiver, in the caller's transaction (a group's, or
    a rewind's: ``payload["event"] == "rewind"``, no group)."""
    count = 0
    group_id = (payload.get("group") or {}).get("id")
    if receiver.webhooks:
        outbox.ensure_server_endpoints(session, settings)
        endpoints = outbox.matching_endpoints(session, project_id=project_id, severity=payload["severity"])
        if receiver.webhooks != "all":
            endpoints = [e for e in endpoints if e.url in receiver.webhooks]
        for ep in endpoints:
            session.add(outbox.new_delivery(ep, payload, alert_id=alert_id, now=now, group_id=group_id))
            count += 1
    if receiver.email:
        body = json.dumps({"to": list(receiver.email), **email_body(payload)}, allow_nan=False, default=str)
        session.add(WebhookDelivery(endpoint_id=None, alert_id=alert_id, group_id=group_id,
                                    url=EMAIL_SCHEME + ",".join(receiver.email),
                                    body=body, status="pending", attempts=0, next_attempt_at=now,
                                    expires_at=now + outbox.TTL_S, created_at=now))
        count += 1
    return count
