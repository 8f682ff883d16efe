"""Webhook endpoints and the delivery log: the data-access functions the API, CLI and dashboard call.

Every function takes a Session and keyword arguments and does not commit;
the caller owns the transaction. Bad input raises ``ValueError`` saying what
is wrong.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Optional
from urllib.parse import urlparse

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Project, WebhookDelivery, WebhookEndpoint
from gradwatch.server.storage.projects import project_row
from gradwatch.server.rules.catalogue import RULES_BY_ID, SEVERITIES
from gradwatch.server.webhooks.formats import FORMATS, alert_payload
from gradwatch.server.webhooks.outbox import dashboard_url, new_delivery
from gradwatch.server.webhooks.targets import check_target




def validate_endpoint(*, url: str, format: str, min_severity: str, secret: Optional[str]) -> None:
    parsed = urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"url: expected an http:// or https:// URL, got {url!r}")
    if len(url) > 2000:
        raise ValueError("url: longer than 2000 characters")
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}")
    if min_severity not in SEVERITIES:
        raise ValueError(f"min_severity: expected one of {', '.join(SEVERITIES)}, got {min_severity!r}")
    if secret is not None and not (1 <= len(secret) <= 200):
        raise ValueError("secret: expected 1 to 200 characters")


def create_endpoint(session: Session, *, project: str, url: str, format: str = "json", min_severity: str = "info",
                    secret: Optional[str] = None, settings: Any = None) -> WebhookEndpoint:
    """Add a webhook endpoint for ``project`` (created if it does not exist yet).

    ``settings``: the server's, for an endpoint a project token holder or dashboard user adds; its target
    is then checked (server/webhooks/targets.py) when ``settings.checks_webhook_targets``. The operator's
    CLI passes none: its endpoints are trusted as given.

    Example: ``create_endpoint(s, project="vision", url="https://hooks.slack.com/services/…", format="slack",
    min_severity="warning", secret="s3cret")``.
    """
    validate_endpoint(url=url, format=format, min_severity=min_severity, secret=secret)
    if settings is not None and settings.checks_webhook_targets:
        check_target(url, allow=settings.webhook_allow)
    proj = project_row(session, project, create=True)
    ep = WebhookEndpoint(project_id=proj.id, url=url, format=format, min_severity=min_severity, secret=secret,
                         enabled=True, created_at=time.time())
    session.add(ep)
    session.flush()
    return ep


def list_endpoints(session: Session, *, project: Optional[str] = None, server_wide: bool = True) -> list[WebhookEndpoint]:
    """Endpoints of ``project`` plus, with ``server_wide``, the server-wide ones; all endpoints when
    ``project`` is None. A project token holder gets ``server_wide=False``: the operator's URLs (for
    Slack and Discord, credentials) are the operator's alone."""
    q = select(WebhookEndpoint).order_by(WebhookEndpoint.id)
    if project is not None:
        proj = project_row(session, project, create=False)
        own = WebhookEndpoint.project_id == (proj.id if proj is not None else -1)
        q = q.where(own | WebhookEndpoint.project_id.is_(None) if server_wide else own)
    elif not server_wide:
        q = q.where(WebhookEndpoint.project_id.is_not(None))
    return list(session.scalars(q))


def get_endpoint(session: Session, *, endpoint_id: int) -> Optional[WebhookEndpoint]:
    return session.get(WebhookEndpoint, endpoint_id)


def delete_endpoint(session: Session, *, endpoint_id: int) -> bool:
    """Delete an endpoint; its pending deliveries expire. False when there is no such endpoint."""
    ep = session.get(WebhookEndpoint, endpoint_id)
    if ep is None:
        return False
    now = time.time()
    for d in session.scalars(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id,
                                                           WebhookDelivery.status == "pending")):
        d.status, d.last_error, d.next_attempt_at = "expired", "endpoint deleted", now
    session.delete(ep)
    session.flush()
    return True


def send_test(session: Session, *, endpoint_id: int, settings: Any, now: float) -> WebhookDelivery:
    """Enqueue a sample alert to one endpoint (``event: "alert.test"``). The worker sends it at once after wake()."""
    ep = session.get(WebhookEndpoint, endpoint_id)
    if ep is None:
        raise ValueError(f"endpoint_id: no webhook endpoint {endpoint_id}")
    project = session.get(Project, ep.project_id).name if ep.project_id is not None else "(server-wide)"
    spec = RULES_BY_ID["A1"]
    sample = SimpleNamespace(
        id=None, rule=spec.id, name=spec.name, severity="critical", status="firing", run_id=0, rank=0,
        first_step=1234, last_step=1234, message="Test alert from gradwatch: loss is NaN at step 1234",
        diagnosis=spec.diagnosis, actions=list(spec.actions),
        evidence={"loss": "NaN", "grad_norm_before": 0.83, "grad_norm_median": 0.9, "cause": "loss_computation"},
        created_at=now)
    payload = alert_payload(sample, run_name="gradwatch-test", project_name=project,
                            dashboard_url=dashboard_url(settings, 0), test=True)
    d = new_delivery(ep, payload, alert_id=None, now=now)
    session.add(d)
    session.flush()
    return d


def list_deliveries(session: Session, *, endpoint_id: Optional[int] = None, limit: int = 100,
                    status: Optional[str] = None) -> list[WebhookDelivery]:
    """The delivery log, newest first."""
    q = select(WebhookDelivery).order_by(WebhookDelivery.id.desc()).limit(max(1, min(limit, 10_000)))
    if endpoint_id is not None:
        q = q.where(WebhookDelivery.endpoint_id == endpoint_id)
    if status is not None:
        q = q.where(WebhookDelivery.status == status)
    return list(session.scalars(q))


def endpoint_to_dict(ep: WebhookEndpoint, project_name: Optional[str] = None) -> dict[str, Any]:
    return {"id": ep.id, "project": project_name, "project_id": ep.project_id, "url": ep.url, "format": ep.format,
            "min_severity": ep.min_severity, "has_secret": bool(ep.secret), "enabled": ep.enabled,
            "server_wide": ep.project_id is None, "created_at": ep.created_at}


def delivery_to_dict(d: WebhookDelivery) -> dict[str, Any]:
    return {"id": d.id, "endpoint_id": d.endpoint_id, "alert_id": d.alert_id, "url": d.url, "status": d.status,
            "attempts": d.attempts, "next_attempt_at": d.next_attempt_at, "expires_at": d.expires_at,
            "last_status_code": d.last_status_code, "last_error": d.last_error, "created_at": d.created_at,
            "delivered_at": d.delivered_at}
