"""Webhook endpoints and their deliveries: list, create, delete, send a test."""
from __future__ import annotations

import time
from typing import Optional, Sequence

from gradwatch.dashboard.gateway.context import server, session, signed_in_project, writable


def list_endpoints(projects: Sequence[str] = ()) -> list[dict]:
    """Every webhook endpoint (with auth on: the signed-in project's only; server-wide endpoints are the
    operator's); ``project`` is filled in for those of the given projects."""
    from gradwatch.server.webhooks import endpoints
    mine = signed_in_project()
    with session() as s:
        names = {}
        for name in ([mine] if mine else projects):
            for ep in endpoints.list_endpoints(s, project=name):
                if ep.project_id is not None:
                    names[ep.id] = name
        shown = endpoints.list_endpoints(s, project=mine, server_wide=False) if mine else endpoints.list_endpoints(s)
        return [endpoints.endpoint_to_dict(ep, names.get(ep.id)) for ep in shown]


def _own_endpoint(session, endpoint_id: int) -> None:
    mine = signed_in_project()
    if mine is None:
        return
    from gradwatch.server.webhooks import endpoints
    if endpoint_id not in {ep.id for ep in endpoints.list_endpoints(session, project=mine, server_wide=False)}:
        raise LookupError(f"no webhook endpoint {endpoint_id} in project {mine}")


def create_endpoint(*, url: str, project: str, format: str = "json", min_severity: str = "info",
                    secret: Optional[str] = None) -> dict:
    """Raises ``ValueError`` saying what is wrong with the URL, format, severity or secret."""
    from gradwatch.server.webhooks import endpoints
    project = writable(project)
    with session(write=True) as s:
        ep = endpoints.create_endpoint(s, project=project, url=url, format=format, min_severity=min_severity,
                                       secret=secret or None, settings=server.settings)
        return endpoints.endpoint_to_dict(ep, project)


def delete_endpoint(endpoint_id: int) -> bool:
    from gradwatch.server.webhooks import endpoints
    with session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        return endpoints.delete_endpoint(s, endpoint_id=endpoint_id)


def send_test(endpoint_id: int) -> dict:
    """Queue a sample alert to one endpoint; the server's delivery worker sends it right away."""
    from gradwatch.server.webhooks import endpoints
    with session(write=True) as s:
        _own_endpoint(s, endpoint_id)
        delivery = endpoints.delivery_to_dict(endpoints.send_test(s, endpoint_id=endpoint_id, settings=server.settings,
                                                                  now=time.time()))
    if server.deliveries_queued is not None:   # committed: wake the worker instead of waiting for its poll
        server.deliveries_queued()
    return delivery


def list_deliveries(*, limit: int = 50) -> list[dict]:
    from gradwatch.server.webhooks import endpoints
    mine = signed_in_project()
    with session() as s:
        own = None if mine is None else {ep.id for ep in endpoints.list_endpoints(s, project=mine, server_wide=False)}
        return [endpoints.delivery_to_dict(d) for d in endpoints.list_deliveries(s, limit=limit)
                if own is None or d.endpoint_id in own]
