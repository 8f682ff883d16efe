"""A project by name: the one lookup and the one create that ingest, tokens and the API's project-scoped
settings (silences, webhook endpoints, rule overrides) share.

Creating is race-free: INSERT … ON CONFLICT DO NOTHING, then read, so two replicas (or a token command and
a batch) creating the same project at once both get the one row.
"""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.db import dialect_insert
from gradwatch.server.storage.models import Project

# built once: it runs on every ingest batch
_PROJECT_BY_NAME = select(Project).where(Project.name == bindparam("name"))


def get_or_create_project(session: Session, *, name: str, now: Optional[float] = None) -> Project:
    """The project called ``name``, created when missing (``created_at`` = ``now``)."""
    # look first: after a project's first batch this is one indexed read and no write
    project = session.scalars(_PROJECT_BY_NAME, {"name": name}).one_or_none()
    if project is not None:
        return project
    session.execute(dialect_insert(session, Project).values(name=name, created_at=time.time() if now is None else now)
                    .on_conflict_do_nothing(index_elements=["name"]))
    return session.scalars(_PROJECT_BY_NAME, {"name": name}).one()


def project_row(session: Session, name: str, *, create: bool) -> Optional[Project]:
    """The project called ``name``; created when missing and ``create``, else None."""
    if create:
        return get_or_create_project(session, name=name)
    return session.scalars(_PROJECT_BY_NAME, {"name": name}).one_or_none()
