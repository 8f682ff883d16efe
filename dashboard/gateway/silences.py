"""Silences: list, create, expire (each change wakes the delivery worker)."""
from __future__ import annotations

from typing import Optional, Sequence

from gradwatch.dashboard.gateway.context import server, session, signed_in_project, writable


def list_silences() -> list[dict]:
    """Not yet ended silences, newest first (with auth on: the signed-in project's)."""
    from gradwatch.server.storage.models import Project
    from gradwatch.server.routing import silences
    mine = signed_in_project()
    with session() as s:
        rows = silences.list_silences(s, project=mine, active_only=True)
        if mine is not None:
            rows = [r for r in rows if r.project_id is not None]
        names = {p.id: p.name for p in s.query(Project).filter(Project.id.in_({r.project_id for r in rows}))}
        return [silences.silence_to_dict(r, names.get(r.project_id)) for r in rows]


def create_silence(*, project: Optional[str], matchers: Sequence[str], duration: str, comment: str = "",
                   created_by: str = "") -> dict:
    """Raises ``ValueError`` saying what is wrong with a matcher or the duration."""
    from gradwatch.server.routing import silences
    mine = signed_in_project()
    project = writable(project) if (project or mine) else None
    with session(write=True) as s:
        row = silences.create_silence(s, project=project, matchers=list(matchers),
                                      duration_s=silences.parse_duration(duration), comment=comment,
                                      created_by=created_by or ("dashboard" if mine is None else f"dashboard:{mine}"))
        out = silences.silence_to_dict(row, project)
    if server.deliveries_queued is not None:
        server.deliveries_queued()
    return out


def expire_silence(silence_id: int) -> bool:
    from gradwatch.server.routing import silences
    with session(write=True) as s:
        row = silences.expire_silence(s, silence_id=silence_id, project=signed_in_project())
    if server.deliveries_queued is not None:
        server.deliveries_queued()
    return row is not None
