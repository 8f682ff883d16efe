"""A run's events and the checkpoints they record."""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, RunEvent
from gradwatch.server.queries.rewind_text import rewind_text
from gradwatch.server.wire.schemas import CheckpointOut, EventOut, RewindOut


def list_events(session: Session, *, run_id: int, kind: Optional[str] = None, limit: int = 1000) -> list[EventOut]:
    """A run's events in step order (events without a step last)."""
    q = select(RunEvent).where(RunEvent.run_id == run_id)
    if kind:
        q = q.where(RunEvent.kind == kind)
    q = q.order_by(RunEvent.step.is_(None), RunEvent.step, RunEvent.id).limit(limit)
    return [EventOut(id=e.id, run_id=e.run_id, rank=e.rank, step=e.step, kind=e.kind, data=dict(e.data or {}),
                     time=e.time) for e in session.scalars(q)]


def list_checkpoints(session: Session, *, run_id: int, limit: int = 10_000) -> list[CheckpointOut]:
    """A run's checkpoints (``checkpoint`` events) in step order; the same step and path recorded by
    several ranks (each DDP process runs the framework callback) is listed once."""
    q = (select(RunEvent.step, RunEvent.data, RunEvent.rank)
         .where(RunEvent.run_id == run_id, RunEvent.kind == "checkpoint", RunEvent.step.is_not(None))
         .order_by(RunEvent.step, RunEvent.rank, RunEvent.id).limit(limit))
    out: dict[tuple[int, Optional[str]], CheckpointOut] = {}
    for step, data, rank in session.execute(q):
        data = data or {}
        key = (int(step), data.get("path"))
        if key not in out:
            out[key] = CheckpointOut(step=int(step), path=data.get("path"), rank=rank,
                                     saved_at=data.get("saved_at"), source=data.get("source"))
    return list(out.values())




def rewind_key(data: dict[str, Any], step: Optional[int]) -> tuple:
    """What makes two reports one rewind: the same step, action, target and count (one per rank)."""
    return (step if step is not None else data.get("from_step"), data.get("action"), data.get("to_step"),
            data.get("rewind_number"))


def stored_trigger(session: Session, run_id: int, sent: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The trigger as the server knows it: the run's alert ``sent["alert_id"]`` (rule, name, first step,
    severity), else what the agent sent with ``alert_id`` null (no such alert on this run); None without one."""
    if not isinstance(sent, dict):
        return None
    alert_id = sent.get("alert_id")
    alert = session.get(Alert, alert_id) if isinstance(alert_id, int) and not isinstance(alert_id, bool) else None
    if alert is None or alert.run_id != run_id:
        return {k: sent.get(k) for k in ("rule", "name", "step", "alert_id")} | {"alert_id": None}
    return {"rule": alert.rule, "name": alert.name, "step": int(alert.first_step), "alert_id": alert.id,
            "severity": alert.severity}


def list_rewinds(session: Session, *, run_id: int, limit: int = 10_000) -> list[RewindOut]:
    """A run's rewinds (``rewind`` events) in step order, each reported by several ranks listed once."""
    q = (select(RunEvent.step, RunEvent.data, RunEvent.rank, RunEvent.time)
         .where(RunEvent.run_id == run_id, RunEvent.kind == "rewind")
         .order_by(RunEvent.step, RunEvent.id).limit(limit))
    out: dict[tuple, RewindOut] = {}
    for step, data, rank, time in session.execute(q):
        data = data or {}
        key = rewind_key(data, step)
        if key in out:
            if rank not in out[key].ranks:
                out[key].ranks.append(rank)
            continue
        trigger = stored_trigger(session, run_id, data.get("trigger"))
        out[key] = RewindOut(
            step=int(step if step is not None else data.get("from_step", 0)), action=str(data.get("action")),
            from_step=int(data.get("from_step", step or 0)), to_step=data.get("to_step"),
            batches_skipped=data.get("batches_skipped"), lr_factor=float(data.get("lr_factor", 1.0)),
            cool_steps=int(data.get("cool_steps") or 0), snapshot_age_steps=data.get("snapshot_age_steps"),
            rewind_number=data.get("rewind_number"), max_rewinds=data.get("max_rewinds"), then=data.get("then"),
            trigger=trigger, ranks=[rank], time=time, text=rewind_text(data, trigger=trigger or {}))
    return sorted(out.values(), key=lambda r: (r.step, r.time))
