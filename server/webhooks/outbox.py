"""The webhook outbox: delivery rows written in the batch's transaction, sent by the worker.

``new_delivery`` builds one ``webhook_deliveries`` row; routing
(``server/routing``) adds them inside the ingest transaction, so an alert and
its deliveries are committed together or not at all, and a delivery outlives
any restart.
``claim_due`` / ``record_attempt`` are the worker's side: claiming is one
UPDATE … RETURNING that pushes the row's ``next_attempt_at`` one lease into
the future (PostgreSQL additionally uses ``FOR UPDATE SKIP LOCKED``), so two
replicas never send the same delivery at the same time, and a replica that
dies mid-send leaves the row to be retried when the lease runs out.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import WebhookDelivery, WebhookEndpoint
from gradwatch.server.rules.catalogue import SEVERITY_RANK
from gradwatch.server.webhooks.formats import guess_format, render

# Retry policy: exponential backoff from BACKOFF_BASE_S, capped, until TTL_S after enqueueing.
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 300.0
TTL_S = 24 * 3600.0
LEASE_S = 10.0      # > the worker's request timeout (5 s): a claim is never taken twice while in flight
CLAIM_LIMIT = 50


def backoff_s(attempts: int) -> float:
    """Delay before attempt ``attempts + 1`` (attempts already made ≥ 1), with ±10 % jitter."""
    delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, attempts - 1))
    return delay * random.uniform(0.9, 1.1)


def dashboard_url(settings: Any, run_id: int) -> str:
    base = getattr(settings, "dashboard_base", None) or (getattr(settings, "public_url", "") or "").rstrip("/")
    return f"{base}/runs/{run_id}"


def incident_url(settings: Any, alert_id: Optional[int]) -> Optional[str]:
    """The alert's incident page (dashboard/pages/incident.py), or None for an alert without an id."""
    if alert_id is None:
        return None
    base = getattr(settings, "dashboard_base", None) or (getattr(settings, "public_url", "") or "").rstrip("/")
    return f"{base}/incidents/{alert_id}"


_synced: set[tuple[str, tuple[str, ...]]] = set()


def sync_server_endpoints(session: Session, settings: Any) -> None:
    """Make the server-wide endpoints (``--webhook`` / GRADWATCH_WEBHOOK_URLS) rows of ``webhook_endpoints``.

    Server-wide rows no longer configured are disabled (their log stays).
    """
    urls = tuple(getattr(settings, "webhook_urls", ()) or ())
    secret = getattr(settings, "webhook_secret", None) or None
    rows = list(session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.project_id.is_(None))))
    by_url = {r.url: r for r in rows}
    import time as _time

    for url in urls:
        row = by_url.get(url)
        if row is None:
            session.add(WebhookEndpoint(project_id=None, url=url, format=guess_format(url), min_severity="info",
                                        secret=secret, enabled=True, created_at=_time.time()))
        else:
            row.enabled = True
            if secret and row.secret != secret:
                row.secret = secret
    for row in rows:
        if row.url not in urls and row.enabled:
            row.enabled = False
    session.flush()
    _synced.add((str(getattr(settings, "database_url", "")), urls))


def ensure_server_endpoints(session: Session, settings: Any) -> None:
    """``sync_server_endpoints`` once per (database, configured URLs) in this process."""
    key = (str(getattr(settings, "database_url", "")), tuple(getattr(settings, "webhook_urls", ()) or ()))
    if key not in _synced:
        sync_server_endpoints(session, settings)
        _synced.add(key)


def matching_endpoints(session: Session, *, project_id: int, severity: str) -> list[WebhookEndpoint]:
    rows = session.scalars(select(WebhookEndpoint).where(
        WebhookEndpoint.enabled.is_(True),
        (WebhookEndpoint.project_id == project_id) | WebhookEndpoint.project_id.is_(None)))
    rank = SEVERITY_RANK.get(severity, 0)
    return [e for e in rows if rank >= SEVERITY_RANK.get(e.min_severity, 0)]


def new_delivery(endpoint: WebhookEndpoint, payload: dict[str, Any], *, alert_id: Optional[int],
                 now: float, group_id: Optional[int] = None) -> WebhookDelivery:
    return WebhookDelivery(endpoint_id=endpoint.id, alert_id=alert_id, group_id=group_id, url=endpoint.url,
                           body=render(endpoint.format, payload), status="pending", attempts=0,
                           next_attempt_at=now, expires_at=now + TTL_S, created_at=now)


# --------------------------------------------------------------------------- worker side

@dataclass
class Claimed:
    id: int
    endpoint_id: Optional[int]
    url: str
    body: str
    attempts: int
    expires_at: float
    group_id: Optional[int] = None      # the notification group it tells, if routed
    secret: Optional[str] = None
    project_endpoint: bool = False      # a project's endpoint (checked target), not the operator's


def claim_due(session: Session, *, now: float, limit: int = CLAIM_LIMIT) -> list[Claimed]:
    """Take up to ``limit`` due deliveries for this worker (one lease). The caller commits."""
    due = (select(WebhookDelivery.id)
           .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
           .order_by(WebhookDelivery.next_attempt_at).limit(limit))
    if session.bind.dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    rows = session.execute(
        update(WebhookDelivery).where(WebhookDelivery.id.in_(due.scalar_subquery()))
        .values(next_attempt_at=now + LEASE_S)
        .returning(WebhookDelivery.id, WebhookDelivery.endpoint_id, WebhookDelivery.url, WebhookDelivery.body,
                   WebhookDelivery.attempts, WebhookDelivery.expires_at, WebhookDelivery.group_id)
        .execution_options(synchronize_session=False)
    ).all()
    claimed = [Claimed(*r) for r in rows]
    ids = {c.endpoint_id for c in claimed if c.endpoint_id is not None}
    if ids:
        found = {i: (secret, project_id) for i, secret, project_id in session.execute(
            select(WebhookEndpoint.id, WebhookEndpoint.secret, WebhookEndpoint.project_id)
            .where(WebhookEndpoint.id.in_(ids))).all()}
        for c in claimed:
            secret, project_id = found.get(c.endpoint_id, (None, None))
            c.secret, c.project_endpoint = secret, project_id is not None
    return claimed


def record_attempt(session: Session, claimed: Claimed, *, now: float, status_code: Optional[int],
                   error: Optional[str]) -> str:
    """Store one attempt's outcome; returns the delivery's new status."""
    attempts = claimed.attempts + 1
    values: dict[str, Any] = {"attempts": attempts, "last_status_code": status_code,
                              "last_error": (error or None) and error[:2000]}
    if error is None and status_code is not None and 200 <= status_code < 300:
        values.update(status="delivered", delivered_at=now)
    else:
        nxt = now + backoff_s(attempts)
        if nxt > claimed.expires_at:
            values.update(status="expired", next_attempt_at=nxt)
        else:
            values.update(status="pending", next_attempt_at=nxt)
    session.execute(update(WebhookDelivery).where(WebhookDelivery.id == claimed.id).values(**values)
                    .execution_options(synchronize_session=False))
    return values["status"]


def next_due_at(session: Session) -> Optional[float]:
    from sqlalchemy import func

    return session.scalar(select(func.min(WebhookDelivery.next_attempt_at))
                          .where(WebhookDelivery.status == "pending"))
