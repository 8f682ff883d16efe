"""A project by name: the one lookup the API's project-scoped settings share (silences, webhook
endpoints, rule overrides). Ingest has its own race-free upsert (ingest.get_or_create_project),
because replicas create projects concurrently there."""
from __future__ import annotations

import time
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import Project


def project_row(session: Session, name: str, *, create: bool) -> Optional[Project]:
    """The project called ``name``; created (and flushed) when missing and ``create``, else None."""
    row = session.scalar(select(Project).where(Project.name == name))
    if row is None and create:
        row = Project(name=name, created_at=time.time())
        session.add(row)
        session.flush()
    return row
