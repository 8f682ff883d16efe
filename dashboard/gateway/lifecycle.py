"""Deleting a run (its preview first) and the database's size."""
from __future__ import annotations

from typing import Optional

from gradwatch.dashboard.gateway.context import plain, run_visible, server, session, stall_seconds


def delete_preview(run_id: int) -> Optional[dict]:
    """What deleting a run would take: its name, project, status and estimated bytes (None: not visible)."""
    from gradwatch.server.lifecycle import delete, sizes
    with session() as s:
        if not run_visible(s, run_id):
            return None
        refs = delete.select_runs(s, run_ids=[run_id], stall_seconds=stall_seconds())
        if not refs:
            return None
        r = refs[0]
        return {"id": r.id, "name": r.name, "project": r.project, "status": r.status,
                "bytes": sizes.run_bytes(s, [r.id]).get(r.id, 0)}


def delete_run(run_id: int, *, force: bool) -> dict:
    """Delete a run (server/lifecycle/delete.py): ``{"deleted": bool, "rows", "bytes", "message"}``.
    A run still sending is refused unless ``force`` (the message says so)."""
    from types import SimpleNamespace

    from gradwatch.server.lifecycle import delete
    with session() as s:
        if not run_visible(s, run_id):
            return {"deleted": False, "rows": 0, "bytes": 0, "message": f"run {run_id} not found"}
        refs = delete.select_runs(s, run_ids=[run_id], stall_seconds=stall_seconds())
    if not refs:
        return {"deleted": False, "rows": 0, "bytes": 0, "message": f"run {run_id} not found"}
    database = SimpleNamespace(sessionmaker=server.sessionmaker, write_sessionmaker=server.write_sessionmaker or server.sessionmaker)
    try:
        report = delete.delete_runs(database, runs=refs, force=force, stall_seconds=stall_seconds(),
                                    gate=server.write_gate)
    except delete.RunStillSending as e:
        return {"deleted": False, "rows": 0, "bytes": 0, "message": str(e)}
    done = bool(report.runs)
    return {"deleted": done, "rows": report.rows, "bytes": sum(report.bytes.values()),
            "message": f"deleted run {refs[0].name!r}" if done else f"run {run_id} was already being deleted"}


def format_bytes(n: Optional[float]) -> str:
    """``1.38 GB``: decimal units, as the CLI prints them."""
    from gradwatch.server.lifecycle.cli import human_bytes
    return human_bytes(n)


def database_size() -> dict:
    """``{"dialect", "bytes", "free_bytes"}`` (server/lifecycle/sizes.py)."""
    from gradwatch.server.lifecycle import sizes
    with session() as s:
        return plain(sizes.database_size(s))
