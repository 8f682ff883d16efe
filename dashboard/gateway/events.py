"""A run's events, checkpoints and rewinds."""
from __future__ import annotations

from typing import Optional

from gradwatch.dashboard.gateway.context import run_visible, session, unwrap


def list_events(run_id: int, *, kind: Optional[str] = None) -> list[dict]:
    from gradwatch.server import queries
    with session() as s:
        if not run_visible(s, run_id):
            return []
        return unwrap(queries.list_events(s, run_id=run_id, kind=kind), "events")


def list_checkpoints(run_id: int) -> list[dict]:
    """The run's checkpoints in step order (``queries.list_checkpoints``)."""
    from gradwatch.server import queries
    with session() as s:
        if not run_visible(s, run_id):
            return []
        return unwrap(queries.list_checkpoints(s, run_id=run_id), "checkpoints")


def list_rewinds(run_id: int) -> list[dict]:
    """The run's rewinds in step order (``queries.list_rewinds``: the agent's Rewind policy)."""
    from gradwatch.server import queries
    with session() as s:
        if not run_visible(s, run_id):
            return []
        return unwrap(queries.list_rewinds(s, run_id=run_id), "rewinds")
