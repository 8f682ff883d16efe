"""Runs: the runs list and one run's detail, with the derived status (stalled) and health (worst firing
alert); the project a run belongs to (the token checks)."""
from __future__ import annotations

import math
import time as _time
from typing import Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Project, Run
from gradwatch.server.wire.schemas import RunDetailOut, RunOut
from gradwatch.server.operations.settings import DEFAULT_STALL_SECONDS
from gradwatch.server.queries.alerts import alert_counts


def _status(run: Run, now: float, stall_seconds: float) -> str:
    if run.status == "running" and now - run.last_seen > stall_seconds:
        return "stalled"
    return run.status


def _summary(run: Run, project_name: str, counts, now: float, stall_seconds: float, cls=RunOut, **extra):
    n, health = counts.get(run.id, (0, "ok"))
    return cls(
        id=run.id, project=project_name, name=run.name, status=_status(run, now, stall_seconds),
        last_step=run.last_step, last_loss=math.nan if run.last_loss_nan else run.last_loss,
        started_at=run.started_at, last_seen=run.last_seen, open_alerts=n, health=health,
        world_size=run.world_size, **extra,
    )


def list_runs(session: Session, *, project: Optional[str] = None, status: Optional[str] = None,
              name: Optional[str] = None, stall_seconds: float = DEFAULT_STALL_SECONDS,
              now: Optional[float] = None) -> list[RunOut]:
    """Runs, most recently seen first. ``name`` matches a substring; ``status`` the derived status."""
    now = _time.time() if now is None else now
    q = select(Run, Project.name).join(Project, Project.id == Run.project_id).where(Run.deleted_at.is_(None))
    if project:
        q = q.where(Project.name == project)
    if name:
        q = q.where(Run.name.contains(name, autoescape=True))
    if status == "stalled":
        q = q.where(Run.status == "running", Run.last_seen < now - stall_seconds)
    elif status == "running":
        q = q.where(Run.status == "running", Run.last_seen >= now - stall_seconds)
    elif status:
        q = q.where(Run.status == status)
    rows = session.execute(q.order_by(Run.last_seen.desc(), Run.id.desc())).all()
    counts = alert_counts(session, [r.id for r, _ in rows])
    return [_summary(r, p, counts, now, stall_seconds) for r, p in rows]


def get_run(session: Session, *, run_id: int, stall_seconds: float = DEFAULT_STALL_SECONDS,
            now: Optional[float] = None) -> Optional[RunDetailOut]:
    """One run with its layer names and config, or None. ``signals`` and ``attention_modules`` are left at
    their defaults (the API's route fills them: two more reads the dashboard does not need)."""
    now = _time.time() if now is None else now
    row = session.execute(
        select(Run, Project.name).join(Project, Project.id == Run.project_id)
        .where(Run.id == run_id, Run.deleted_at.is_(None))
    ).first()
    if row is None:
        return None
    run, project_name = row
    counts = alert_counts(session, [run.id])
    return _summary(run, project_name, counts, now, stall_seconds, cls=RunDetailOut,
                    param_names=list(run.param_names or []), module_names=list(run.module_names or []),
                    bn_names=list(run.bn_names or []), config=dict(run.config or {}))


def run_project(session: Session, *, run_id: int) -> Optional[str]:
    """The project name of a run (for token checks), or None."""
    return session.scalar(select(Project.name).join(Run, Run.project_id == Project.id)
                          .where(Run.id == run_id, Run.deleted_at.is_(None)))    # being deleted: gone

