"""A run's events and the checkpoints they record."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..models import RunEvent


@dataclass
class EventRecord:
    id: int
    run_id: int
    rank: int
    step: Optional[int]
    kind: str
    data: dict[str, Any]
    time: float


def list_events(session: Session, *, run_id: int, kind: Optional[str] = None, limit: int = 1000) -> list[EventRecord]:
    """A run's events in step order (events without a step last)."""
    q = select(RunEvent).where(RunEvent.run_id == run_id)
    if kind:
        q = q.where(RunEvent.kind == kind)
    q = q.order_by(RunEvent.step.is_(None), RunEvent.step, RunEvent.id).limit(limit)
    return [EventRecord(id=e.id, run_id=e.run_id, rank=e.rank, step=e.step, kind=e.kind, data=dict(e.data or {}),
                        time=e.time) for e in session.scalars(q)]


@dataclass
class CheckpointRecord:
    step: int                     # optimizer steps taken when it was saved: the step a resume continues with
    path: Optional[str]           # None: saved where gradwatch was not told (Lightning's trainer.save_checkpoint)
    rank: int                     # the lowest rank that recorded it
    saved_at: Optional[float]     # the agent's wall clock when it was recorded
    source: Optional[str]         # "transformers", "lightning", or None (monitor.checkpoint)


def list_checkpoints(session: Session, *, run_id: int, limit: int = 10_000) -> list[CheckpointRecord]:
    """A run's checkpoints (``checkpoint`` events) in step order; the same step and path recorded by
    several ranks (each DDP process runs the framework callback) is listed once."""
    q = (select(RunEvent.step, RunEvent.data, RunEvent.rank)
         .where(RunEvent.run_id == run_id, RunEvent.kind == "checkpoint", RunEvent.step.is_not(None))
         .order_by(RunEvent.step, RunEvent.rank, RunEvent.id).limit(limit))
    out: dict[tuple[int, Optional[str]], CheckpointRecord] = {}
    for step, data, rank in session.execute(q):
        data = data or {}
        key = (int(step), data.get("path"))
        if key not in out:
            out[key] = CheckpointRecord(step=int(step), path=data.get("path"), rank=rank,
                                        saved_at=data.get("saved_at"), source=data.get("source"))
    return list(out.values())


