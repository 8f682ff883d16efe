"""Dependencies shared by the routers (``Annotated`` aliases)."""
from __future__ import annotations

from typing import Annotated, Iterator, Optional

from fastapi import Depends, HTTPException, Request
from sqlalchemy.orm import Session

from gradwatch.server.storage.db import Database
from gradwatch.server.access.scope import in_scope, other_project
from gradwatch.server.operations.settings import Settings


# async: they only read the app's state, so they run on the event loop instead of costing each request a
# trip through the thread pool (each trip waits for the GIL, behind heatmaps being built: /api/health)
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_database(request: Request) -> Database:
    return request.app.state.database


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.database.sessionmaker() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
DatabaseDep = Annotated[Database, Depends(get_database)]
SessionDep = Annotated[Session, Depends(get_session)]


def get_read_scope(request: Request) -> Optional[str]:
    """The project a read is limited to: None when auth is off (everything readable)."""
    if getattr(request.app.state, "auth", None) is None:
        return None
    from gradwatch.server.access.auth import project_of

    project = project_of(request)
    if project is None:  # the middleware lets no such request through; be safe anyway
        raise HTTPException(401, "authentication required")
    return project


ReadScopeDep = Annotated[Optional[str], Depends(get_read_scope)]


def check_scope(scope: Optional[str], project: Optional[str], *, field: str = "") -> None:
    """403 when a token of another project names ``project`` (``field``: where the request named it)."""
    if not in_scope(scope, project):
        raise HTTPException(403, (f"{field}: " if field else "") + other_project(scope, project))
