"""Silences: matchers plus a time window; a matching alert is stored, marked "silenced by", not notified.

Data-access functions for the API, the CLI and the dashboard: a Session and keyword arguments, no
commit (the caller owns the transaction), ``ValueError`` saying what is wrong. A silence belongs to a
project (it only ever covers that project's alerts) or, made by an operator with no project, to all.
Expiring one (``ends_at`` = now) makes the groups it covered look again: an alert still firing is then
notified.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import NotificationGroup, Silence
from gradwatch.server.storage.projects import project_row
from gradwatch.server.routing.matchers import matches_all, parse_matchers

MAX_DURATION_S = 366 * 24 * 3600.0




def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d`` or plain seconds → seconds."""
    text = str(text).strip()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise ValueError(f"duration: expected e.g. 90s, 30m, 2h or 1d, got {text!r}") from None


def create_silence(session: Session, *, project: Optional[str], matchers: Iterable[str], created_by: str = "",
                   comment: str = "", starts_at: Optional[float] = None, ends_at: Optional[float] = None,
                   duration_s: Optional[float] = None, now: Optional[float] = None) -> Silence:
    """Add a silence. ``project`` None: every project (an operator's). Give ``ends_at`` or ``duration_s``.

    Example: ``create_silence(s, project="nlp", matchers=["run=exp-42", 'rule=~"C.*"'], duration_s=7200,
    created_by="ana", comment="known data issue")``.
    """
    now = time.time() if now is None else now
    texts = [matchers] if isinstance(matchers, str) else list(matchers)
    parsed = parse_matchers(texts)
    if not parsed:
        raise ValueError("matchers: at least one, e.g. run=exp-42 (a silence of everything is not a silence)")
    starts = now if starts_at is None else float(starts_at)
    if ends_at is None:
        if duration_s is None:
            raise ValueError("ends_at or duration: say when the silence ends")
        ends_at = starts + float(duration_s)
    ends = float(ends_at)
    if not ends > starts:
        raise ValueError("ends_at: must be after starts_at")
    if ends - starts > MAX_DURATION_S:
        raise ValueError("duration: at most a year")
    if len(created_by) > 200:
        raise ValueError("created_by: at most 200 characters")
    if len(comment) > 2000:
        raise ValueError("comment: at most 2000 characters")
    proj = project_row(session, project, create=True) if project is not None else None
    row = Silence(project_id=proj.id if proj else None, matchers=[str(m) for m in parsed], starts_at=starts,
                  ends_at=ends, created_by=created_by, comment=comment, created_at=now)
    session.add(row)
    session.flush()
    _look_again(session, row.project_id, max(starts, now))
    return row


def list_silences(session: Session, *, project: Optional[str] = None, active_only: bool = False,
                  now: Optional[float] = None) -> list[Silence]:
    """Newest first. ``project``: its own silences and the operator's over every project."""
    now = time.time() if now is None else now
    q = select(Silence).order_by(Silence.id.desc())
    if project is not None:
        proj = project_row(session, project, create=False)
        q = q.where((Silence.project_id == (proj.id if proj else -1)) | Silence.project_id.is_(None))
    if active_only:
        q = q.where(Silence.ends_at > now)
    return list(session.scalars(q))


def expire_silence(session: Session, *, silence_id: int, project: Optional[str] = None,
                   now: Optional[float] = None) -> Optional[Silence]:
    """End a silence now. ``project``: the caller's scope (another project's silence reads as missing)."""
    now = time.time() if now is None else now
    row = session.get(Silence, silence_id)
    if row is None:
        return None
    if project is not None:
        proj = project_row(session, project, create=False)
        if proj is None or row.project_id != proj.id:
            return None
    if row.ends_at > now:
        row.ends_at = now
        session.flush()
        _look_again(session, row.project_id, now)
    return row


def _look_again(session: Session, project_id: Optional[int], at: float) -> None:
    """The groups a silence may cover decide again at ``at`` (when it starts or ends)."""
    q = update(NotificationGroup).where((NotificationGroup.next_flush_at.is_(None))
                                        | (NotificationGroup.next_flush_at > at))
    if project_id is not None:
        q = q.where(NotificationGroup.project_id == project_id)
    session.execute(q.values(next_flush_at=at).execution_options(synchronize_session=False))


def active_silences(session: Session, *, project_id: int, now: float) -> list[Silence]:
    return list(session.scalars(select(Silence).where(
        (Silence.project_id == project_id) | Silence.project_id.is_(None),
        Silence.starts_at <= now, Silence.ends_at > now).order_by(Silence.id)))


def silence_covering(silences: Iterable[Silence], labels: dict[str, str]) -> Optional[Silence]:
    for s in silences:
        try:
            matchers = parse_matchers(s.matchers or [])
        except ValueError:
            # stored before matchers were RE2's (a lookaround, a backreference): it covers nothing rather
            # than failing the ingest that raised the alert; `gradwatch silence list` still shows it
            continue
        if matches_all(matchers, labels):
            return s
    return None


def silence_to_dict(s: Silence, project_name: Optional[str] = None, now: Optional[float] = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    state = "expired" if s.ends_at <= now else ("active" if s.starts_at <= now else "pending")
    return {"id": s.id, "project": project_name, "matchers": list(s.matchers or []), "starts_at": s.starts_at,
            "ends_at": s.ends_at, "created_by": s.created_by, "comment": s.comment, "created_at": s.created_at,
            "state": state}
