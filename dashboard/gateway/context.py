"""What every door of the gateway shares: what ``configure`` was given (``server``), the signed-in
project and what it may see, one short session, and the plain values pages get."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from gradwatch.server.access.scope import in_scope


class _Server:
    """What the server handed the dashboard at ``create_dash`` (``configure``); None until then."""

    sessionmaker = None
    settings = None
    deliveries_queued = None   # the server's "send due webhook deliveries now" (None: it polls every second)
    live_news = None           # the server's LiveNews: run pages wait for new steps (None: they poll)
    write_sessionmaker = None  # the server's write sessions and ingest gate: a delete's transactions take them
    write_gate = None


server = _Server()


def configure(sessionmaker, settings, *, deliveries_queued=None, live_news=None, write_sessionmaker=None,
              write_gate=None) -> None:
    """Called once by ``create_dash``: every later call reads through this sessionmaker."""
    server.sessionmaker = sessionmaker
    server.settings = settings
    server.deliveries_queued = deliveries_queued
    server.live_news = live_news
    server.write_sessionmaker = write_sessionmaker
    server.write_gate = write_gate


SCOPE_KEY = "gradwatch.project"  # server/access/auth.py puts the signed-in project in the ASGI scope


def signed_in_project() -> Optional[str]:
    """With auth on, the project of the session cookie (the dashboard shows only it); else None."""
    if not getattr(server.settings, "auth", False):
        return None
    try:
        from flask import has_request_context, request
    except ImportError:  # pragma: no cover - Dash runs on Flask here
        return None
    if not has_request_context():
        return None
    scope = request.environ.get("asgi.scope") or {}
    return scope.get(SCOPE_KEY)


# A project filter no stored project matches (names are at most 200 characters): what a signed-in user
# asking for another project's data reads. Plain text: PostgreSQL refuses a NUL even in a parameter.
_NO_PROJECT = "~" * 201


def scoped(project: Optional[str]) -> Optional[str]:
    """The project filter to apply: the signed-in one when auth is on (a request for another sees nothing)."""
    mine = signed_in_project()
    if mine is None:
        return project or None
    return mine if not project or in_scope(mine, project) else _NO_PROJECT


def writable(project: str) -> str:
    """The project a write goes to: with auth on, only the signed-in one (``ValueError`` otherwise, shown to
    the user; nothing is created)."""
    mine = signed_in_project()
    if project and not in_scope(mine, project):
        raise ValueError(f"you are signed in to project {mine!r}: sign in with its token to change another")
    return mine or project


def run_visible(session, run_id: int) -> bool:
    mine = signed_in_project()
    if mine is None:
        return True
    from gradwatch.server import queries
    return in_scope(mine, queries.run_project(session, run_id=run_id))


@contextmanager
def session(write: bool = False) -> Iterator[Any]:
    if server.sessionmaker is None:
        raise RuntimeError("dashboard.gateway.configure(sessionmaker, settings) was not called")
    with server.sessionmaker() as session:
        if write:
            # SQLite: take the write lock up front (BEGIN IMMEDIATE, see server/storage/db.py) so a write
            # that reads first cannot fail half way while ingest is writing.
            session.connection(execution_options={"sqlite_immediate": True})
        try:
            yield session
            if write:
                session.commit()
        except Exception:
            session.rollback()
            raise


def plain(obj: Any) -> Any:
    """ORM objects / pydantic models / dataclasses -> dicts (queries should already return dicts)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "__table__"):
        return {c.key: getattr(obj, c.key) for c in obj.__table__.columns}
    if hasattr(obj, "__dataclass_fields__"):
        return {k: plain(getattr(obj, k)) for k in obj.__dataclass_fields__}
    return obj


def unwrap(result: Any, key: str) -> list:
    result = plain(result)
    if isinstance(result, dict):
        return list(result.get(key) or [])
    return list(result or [])


def stall_seconds() -> float:
    """Seconds without data before a running run reads as stalled: the server's setting, else its default."""
    from gradwatch.server.operations.settings import DEFAULT_STALL_SECONDS
    return float(getattr(server.settings, "stall_seconds", None) or DEFAULT_STALL_SECONDS)
