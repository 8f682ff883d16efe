"""Project API tokens: the data access for ``api_tokens`` (writes and lookups).

A token is shown once, at creation; only its SHA-256 is stored.
"""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import ApiToken, Project
from gradwatch.server.storage.projects import get_or_create_project

TOKEN_PREFIX = "gw_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class TokenRecord:
    id: int
    project: str
    name: str
    created_at: float
    last_used_at: Optional[float] = None


def create_token(session: Session, *, project: str, name: str = "", now: Optional[float] = None) -> str:
    """Create the project if needed and a new token for it; returns the secret (shown once)."""
    now = time.time() if now is None else now
    proj = get_or_create_project(session, name=project, now=now)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    session.add(ApiToken(project_id=proj.id, name=name, token_hash=hash_token(secret), created_at=now))
    session.flush()
    return secret


# last_used_at is written at most this often per token: a lookup is not worth a write every time
TOUCH_SECONDS = 60.0


@dataclass(frozen=True)
class TokenUse:
    token_id: int
    project: str
    needs_touch: bool      # last_used_at is older than TOUCH_SECONDS (or never set)


def lookup_token(session: Session, *, token: str, now: Optional[float] = None) -> Optional[TokenUse]:
    """The token's id and project, or None for an unknown token (a read only)."""
    row = session.execute(
        select(ApiToken.id, ApiToken.last_used_at, Project.name).join(Project, ApiToken.project_id == Project.id)
        .where(ApiToken.token_hash == hash_token(token))
    ).first()
    if row is None:
        return None
    now = time.time() if now is None else now
    return TokenUse(row.id, row.name, row.last_used_at is None or now - row.last_used_at >= TOUCH_SECONDS)


def token_project(session: Session, *, token_id: int) -> Optional[str]:
    """The project of the token with this id, or None once it is deleted (a dashboard session made with
    it ends then)."""
    return session.scalar(select(Project.name).join(ApiToken, ApiToken.project_id == Project.id)
                          .where(ApiToken.id == token_id))


def touch_token(session: Session, *, token_id: int, now: Optional[float] = None) -> None:
    """Record a use of the token (``gradwatch token list`` shows it); the caller commits."""
    session.execute(update(ApiToken).where(ApiToken.id == token_id)
                    .values(last_used_at=time.time() if now is None else now))


def list_tokens(session: Session, *, project: Optional[str] = None) -> list[TokenRecord]:
    q = select(ApiToken.id, Project.name, ApiToken.name, ApiToken.created_at, ApiToken.last_used_at).join(
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
