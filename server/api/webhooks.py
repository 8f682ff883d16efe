"""``/api/v1/webhooks``: endpoints per project, a test delivery, and the delivery log."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Optional

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field

from gradwatch.server.storage.models import Project
from gradwatch.server.webhooks import endpoints as ep_data
from gradwatch.server.access.scope import in_scope
from gradwatch.server.api.deps import ReadScopeDep, SessionDep, SettingsDep, check_scope

router = APIRouter(tags=["webhooks"])


class EndpointIn(BaseModel):
    project: str = Field(min_length=1, max_length=200)
    url: str = Field(min_length=1, max_length=2000)
    format: Literal["json", "slack", "discord"] = "json"
    min_severity: Literal["info", "warning", "critical"] = "info"
    secret: Optional[str] = Field(default=None, min_length=1, max_length=200)


def _project_name(session, project_id: Optional[int]) -> Optional[str]:
    if project_id is None:
        return None
    p = session.get(Project, project_id)
    return p.name if p else None


def _own_endpoint(session, scope: Optional[str], endpoint_id: int):
    """The endpoint, or 404 when it does not exist or is not the token's project's: another project's
    (or the operator's) endpoint is answered as missing, so its project's name is not told."""
    ep = ep_data.get_endpoint(session, endpoint_id=endpoint_id)
    if ep is None or (scope is not None and not in_scope(scope, _project_name(session, ep.project_id))):
        raise HTTPException(404, f"no webhook endpoint {endpoint_id}")
    return ep


@router.get("/api/v1/webhooks")
def list_endpoints(session: SessionDep, scope: ReadScopeDep,
                   project: Annotated[Optional[str], Query(max_length=200)] = None) -> dict[str, Any]:
    """Endpoints of ``project`` plus the server-wide ones (all when no project is given); with a project
    token, that project's only (server-wide endpoints are the operator's)."""
    project = scope or project
    rows = ep_data.list_endpoints(session, project=project, server_wide=scope is None)
    return {"endpoints": [ep_data.endpoint_to_dict(e, _project_name(session, e.project_id)) for e in rows]}


@router.post("/api/v1/webhooks", status_code=201)
def create_endpoint(body: EndpointIn, request: Request, settings: SettingsDep, scope: ReadScopeDep) -> dict[str, Any]:
    check_scope(scope, body.project)
    with request.app.state.database.write_sessionmaker() as session:
        try:
            ep = ep_data.create_endpoint(session, project=body.project, url=body.url, format=body.format,
                                         min_severity=body.min_severity, secret=body.secret, settings=settings)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        out = ep_data.endpoint_to_dict(ep, body.project)
        session.commit()
    return out


@router.delete("/api/v1/webhooks/{endpoint_id}")
def delete_endpoint(endpoint_id: int, request: Request, scope: ReadScopeDep) -> dict[str, Any]:
    with request.app.state.database.write_sessionmaker() as session:
        _own_endpoint(session, scope, endpoint_id)
        ep_data.delete_endpoint(session, endpoint_id=endpoint_id)
        session.commit()
    return {"deleted": endpoint_id}


@router.post("/api/v1/webhooks/{endpoint_id}/test", status_code=202)
def send_test(endpoint_id: int, request: Request, settings: SettingsDep, scope: ReadScopeDep) -> dict[str, Any]:
    """Send a sample alert to this endpoint now (retried like any delivery); see the log for the outcome."""
    with request.app.state.database.write_sessionmaker() as session:
        _own_endpoint(session, scope, endpoint_id)
        d = ep_data.send_test(session, endpoint_id=endpoint_id, settings=settings, now=time.time())
        out = ep_data.delivery_to_dict(d)
        session.commit()
    worker = getattr(request.app.state, "delivery_worker", None)
    if worker is not None:
        worker.wake()
    return out


@router.get("/api/v1/webhooks/deliveries")
def list_deliveries(session: SessionDep, scope: ReadScopeDep,
                    endpoint_id: Annotated[Optional[int], Query(ge=0)] = None,
                    status: Annotated[Optional[Literal["pending", "delivered", "expired"]], Query()] = None,
                    limit: Annotated[int, Query(ge=1, le=10_000)] = 100) -> dict[str, Any]:
    """The delivery log, newest first."""
    if scope is not None and endpoint_id is None:
        raise HTTPException(422, "endpoint_id: required with a project token")
    if scope is not None:
        _own_endpoint(session, scope, endpoint_id)
    rows = ep_data.list_deliveries(session, endpoint_id=endpoint_id, limit=limit, status=status)
    return {"deliveries": [ep_data.delivery_to_dict(d) for d in rows]}
