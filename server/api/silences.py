"""``/api/v1/silences``: create, list and expire silences (server/routing/silences.py).

A project token sees and makes its project's silences only; a silence over every project
(no ``project``) is the operator's (auth off, or the CLI).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Optional

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, Field

from gradwatch.server.storage.models import Project
from gradwatch.server.wire.schemas import Name
from gradwatch.server.routing import silences as data
from gradwatch.server.api.deps import ReadScopeDep, SessionDep, check_scope

router = APIRouter(tags=["silences"])


class SilenceIn(BaseModel):
    project: Optional[Name] = None
    matchers: list[Annotated[str, Field(max_length=2000)]] = Field(min_length=1, max_length=20)
    starts_at: Optional[float] = None
    ends_at: Optional[float] = None
    duration_s: Optional[float] = Field(default=None, gt=0)
    created_by: str = Field(default="", max_length=200)
    comment: str = Field(default="", max_length=2000)


def _name(session, project_id: Optional[int]) -> Optional[str]:
    if project_id is None:
        return None
    p = session.get(Project, project_id)
    return p.name if p else None


@router.post("/api/v1/silences", status_code=201)
def create_silence(body: SilenceIn, request: Request, scope: ReadScopeDep) -> dict[str, Any]:
    """``{"project": "nlp", "matchers": ["run=exp-42", "rule=~\\"C.*\\""], "duration_s": 7200,
    "created_by": "ana", "comment": "known bad shard"}``; 422 says what is wrong with a matcher."""
    check_scope(scope, body.project, field="project")
    with request.app.state.database.write_sessionmaker() as session:
        try:
            row = data.create_silence(session, project=body.project, matchers=body.matchers,
                                      created_by=body.created_by, comment=body.comment, starts_at=body.starts_at,
                                      ends_at=body.ends_at, duration_s=body.duration_s)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        session.commit()
        out = data.silence_to_dict(row, body.project)
    request.app.state.delivery_worker.wake()
    return out


@router.get("/api/v1/silences")
def list_silences(session: SessionDep, scope: ReadScopeDep,
                  project: Annotated[Optional[str], Query(min_length=1, max_length=200)] = None,
                  active: bool = False) -> dict[str, Any]:
    """Newest first; ``project``: its silences and those over every project; ``active``: not yet ended."""
    if scope is not None:
        if project is not None:
            check_scope(scope, project)
        project = scope
    rows = data.list_silences(session, project=project, active_only=active)
    if scope is not None:
        rows = [r for r in rows if r.project_id is not None]     # the operator's are the operator's
    now = time.time()
    return {"silences": [data.silence_to_dict(r, _name(session, r.project_id), now) for r in rows]}


@router.post("/api/v1/silences/{silence_id}/expire")
def expire_silence(silence_id: int, request: Request, scope: ReadScopeDep) -> dict[str, Any]:
    """End a silence now: its alerts that still fire are notified (after the groups' timers)."""
    with request.app.state.database.write_sessionmaker() as session:
        row = data.expire_silence(session, silence_id=silence_id, project=scope)
        if row is None:
            raise HTTPException(404, f"no silence {silence_id}")
        session.commit()
        out = data.silence_to_dict(row, _name(session, row.project_id))
    request.app.state.delivery_worker.wake()
    return out


@router.delete("/api/v1/silences/{silence_id}")
def delete_silence(silence_id: int, request: Request, scope: ReadScopeDep) -> dict[str, Any]:
    """The same as expire (kept in the list as expired, for the record)."""
    return expire_silence(silence_id, request, scope)
