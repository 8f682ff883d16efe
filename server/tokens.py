"""Project API tokens: the data access for ``api_tokens`` (writes and lookups).

A token is shown once, at creation; only its SHA-256 is stored.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import ApiToken, Project

TOKEN_PREFIX = "gw_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenRecord:
    id: int
    project: str
    name: str
    created_at: float


def create_token(session: Session, *, project: str, name: str = "", now: Optional[float] = None) -> str:
    """Create the project if needed and a new token for it; returns the secret (shown once)."""
    from .ingest import get_or_create_project

    now = time.time() if now is None else now
    proj = get_or_create_project(session, name=project, now=now)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(project_id=proj.id, name=name, token_hash=hash_token(secret), created_at=now))
    session.flush()
    return secret


def project_for_token(session: Session, *, token: str) -> Optional[str]:
    """The project a token belongs to, or None for an unknown token."""
    return session.scalar(
        select(Project.name).join(ApiToken, ApiToken.project_id == Project.id)
        .where(ApiToken.token_hash == hash_token(token))
    )


def list_tokens(session: Session, *, project: Optional[str] = None) -> list[TokenRecord]:
    q = select(ApiToken.id, Project.name, ApiToken.name, ApiToken.created_at).join(
        Project, Project.id == ApiToken.project_id)
    if project:
        q = q.where(Project.name == project)
    return [TokenRecord(*row) for row in session.execute(q.order_by(ApiToken.id))]


def delete_token(session: Session, *, token_id: int) -> bool:
    tok = session.get(ApiToken, token_id)
    if tok is None:
        return False
    session.delete(tok)
    return True
