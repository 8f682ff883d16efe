"""Notification groups: Alertmanager's group_wait / group_interval / repeat_interval, kept in the database.

An alert joins one group per route that takes it (``join_group``); the group's key is the route and
the values of its ``group_by`` labels (by default project, run and rule family: one incident). A
group is *flushed* when its ``next_flush_at`` comes (``flush_group``): each member is decided again —
inhibited (``suppressed_by``), silenced (``silenced_by``), in the warm-up window (``muted``) or still
pending — and the members left (firing, none of those) are the notification:

- the group's first notification once ``group_wait`` has passed since the group was created and, on a
  multi-rank run, every rank has sent the step of the group's latest alert (at most ``rank_wait`` after
  the group was created): the rank whose NaN explains the others' alerts may be the one reporting late;
- after that, when an alert (or a higher severity) not yet notified is there, at most once per
  ``group_interval``;
- the same alerts still firing: again after ``repeat_interval`` (0: never).

Both intervals count from when the last notification was *delivered* (``mark_delivered``), as
Alertmanager's notification log is written after a successful send: a notification flushed inside a
slow ingest transaction, or sent after a retry, does not make the next one come early.

One notification goes to the route's receiver, listing every alert (and rank) in it. Flushing takes
the group's row lock (PostgreSQL ``FOR UPDATE``; SQLite's writer lock), so ingest and the worker, or
two replicas, never send one notification twice; the rows survive a restart and the worker carries on.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Optional

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.db import dialect_insert
from gradwatch.server.storage.models import Alert, NotificationGroup, NotificationGroupAlert, Project, Run
from gradwatch.server.storage.ranks import rank_progress
from gradwatch.server.routing.config import Receiver, Route, RoutingConfig
from gradwatch.server.routing.inhibit import find_inhibitor
from gradwatch.server.routing.labels import alert_labels
from gradwatch.server.routing.notifications import enqueue_notification, group_payload
from gradwatch.server.routing.routes import route_named
from gradwatch.server.routing.silences import active_silences, silence_covering
from gradwatch.server.rules.config import effective_config, warmup_config

# How soon a group holding an alert that is pending by steps looks again (the steps arrive with ingest,
# which does not re-route an alert that merely goes on firing).
PENDING_POLL_S = 1.0
# How soon a group waiting for a multi-rank run's other ranks (rank_wait) looks again.
RANK_POLL_S = 0.1
FLUSH_LIMIT = 100


def group_key(route: Route, labels: dict[str, str]) -> tuple[str, dict[str, str]]:
    values = {k: labels.get(k, "") for k in route.group_by}
    text = json.dumps([route.name, sorted(values.items())], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), values


def join_group(session: Session, alert: Alert, route: Route, labels: dict[str, str], *, project_id: int,
               now: float) -> int:
    """Put ``alert`` in ``route``'s group for its labels (created if new); returns the group id.

    Written with INSERT … ON CONFLICT DO NOTHING: two ranks' batches opening the same incident at once
    on PostgreSQL both land in the one group instead of one of them failing on the unique key."""
    key, values = group_key(route, labels)
    run_id = alert.run_id if "run" in route.group_by or "alert" in route.group_by else None
    session.execute(dialect_insert(session, NotificationGroup).values(
        group_key=key, route=route.name, receiver=route.receiver, project_id=project_id, run_id=run_id,
        labels=values, created_at=now, next_flush_at=now + route.timing.group_wait, last_notified_at=None,
        notified=[], notifications=0).on_conflict_do_nothing(index_elements=["group_key"]))
    gid, created = session.execute(select(NotificationGroup.id, NotificationGroup.created_at)
                                   .where(NotificationGroup.group_key == key)).one()
    session.execute(dialect_insert(session, NotificationGroupAlert).values(group_id=gid, alert_id=alert.id)
                    .on_conflict_do_nothing(index_elements=["group_id", "alert_id"]))
    # something changed: decide again, though never before the group's wait is over. Compared in the
    # UPDATE itself, after the row lock: a flush committing meanwhile (another rank's batch, the worker)
    # may have just cleared next_flush_at, and this alert must not be left out of the next decision.
    due = max(now, created + route.timing.group_wait)
    col = NotificationGroup.next_flush_at
    session.execute(NotificationGroup.__table__.update().where(NotificationGroup.id == gid)
                    .values(next_flush_at=case((col.is_(None) | (col > due), due), else_=col)))
    return gid


class DecisionContext:
    """What deciding a project's alerts needs, read once per flush."""

    def __init__(self, session: Session, project: Project, cfg: RoutingConfig, settings: Any, now: float):
        self.project, self.cfg, self.now = project, cfg, now
        self.rules = effective_config(session, project_id=project.id, project_name=project.name, settings=settings)
        self.warmup = warmup_config(session, project_id=project.id, project_name=project.name, settings=settings)
        self.silences = active_silences(session, project_id=project.id, now=now)
        self.runs: dict[int, Run] = {}

    def run(self, session: Session, run_id: int) -> Run:
        if run_id not in self.runs:
            self.runs[run_id] = session.get(Run, run_id)
        return self.runs[run_id]


def decide(session: Session, alert: Alert, ctx: DecisionContext) -> None:
    """Set why ``alert`` is held back (or clear it): inhibited, silenced, muted for warm-up."""
    run = ctx.run(session, alert.run_id)
    labels = alert_labels(alert, project=ctx.project.name, run=run.name)
    inhibitor = find_inhibitor(session, alert, project=ctx.project.name, run=run.name, rules=ctx.cfg.inhibit)
    silence = silence_covering(ctx.silences, labels)
    steps, seconds = ctx.warmup.get("steps") or 0, ctx.warmup.get("seconds") or 0
    # each bound only when set: with no window, an alert must never count as early. Two ranks' first
    # batches of a new run race: the run row gets the started_at of the transaction that created it, and
    # the other rank's alert may carry a clock reading a millisecond older (it was taken before the
    # row lock). ``created_at < started_at + 0`` muted that rank's A1 for good (CI, PostgreSQL).
    in_warmup = (steps > 0 and alert.first_step < steps) or \
        (seconds > 0 and alert.created_at < run.started_at + seconds)
    values = {"suppressed_by": inhibitor.id if inhibitor is not None else None,
              "silenced_by": silence.id if silence is not None else None,
              "muted": "warm-up" if in_warmup else None}
    for k, v in values.items():
        if getattr(alert, k) != v:
            setattr(alert, k, v)


def _pending_until(alert: Alert, rcfg: dict[str, Any]) -> tuple[bool, Optional[float]]:
    """(still pending by steps, time when pending by seconds ends or None)."""
    by_steps = alert.last_step - alert.first_step < int(rcfg.get("pending_steps") or 0)
    seconds = float(rcfg.get("pending_seconds") or 0)
    return by_steps, (alert.created_at + seconds) if seconds else None


def flush_group(session: Session, group: NotificationGroup, *, cfg: RoutingConfig, settings: Any,
                now: float, ctx: Optional[DecisionContext] = None) -> int:
    """Decide the group's members and notify if its timers say so; returns the outbox rows written.

    The caller holds the group's row lock and commits."""
    route = route_named(cfg, group.route) or cfg.root
    timing = route.timing
    receiver = cfg.receivers.get(group.receiver) or cfg.receivers.get(route.receiver) or Receiver("default")
    project = session.get(Project, group.project_id)
    ctx = ctx or DecisionContext(session, project, cfg, settings, now)
    members = list(session.scalars(select(Alert).join(NotificationGroupAlert,
                                                      NotificationGroupAlert.alert_id == Alert.id)
                                   .where(NotificationGroupAlert.group_id == group.id).order_by(Alert.id)))
    wakes: list[float] = []
    poll = False
    eligible: list[Alert] = []
    notified = set(group.notified or [])
    notified_ids = {n.split(":", 1)[0] for n in notified}
    for alert in members:
        decide(session, alert, ctx)
        firing = alert.status == "firing"
        # an alert that fired and resolved before the group spoke is still news (a NaN that went away
        # inside group_wait happened); once notified, only a firing one is worth repeating
        if not firing and str(alert.id) in notified_ids and not _lead_news(alert, notified):
            continue
        if alert.silenced_by is not None:
            silence = next((s for s in ctx.silences if s.id == alert.silenced_by), None)
            if silence is not None and firing:
                wakes.append(silence.ends_at)      # the silence ends: notify what still fires
            continue
        if alert.suppressed_by is not None or alert.muted:
            continue
        by_steps, until = _pending_until(alert, ctx.rules.get(alert.rule, {}))
        if by_steps:
            poll = poll or firing          # resolved short of its pending steps: never notified
            continue
        if until is not None:
            if not firing:
                if (alert.resolved_at or 0) < until:
                    continue               # resolved inside its pending period: never notified
            elif now < until:
                wakes.append(until)
                continue
        eligible.append(alert)

    digest = {_news_key(a) for a in eligible}
    send = False
    if eligible and (digest - notified or any(a.status == "firing" for a in eligible)):
        if group.last_notified_at is None:
            ready = group.created_at + timing.group_wait
            if now >= ready and _ranks_behind(session, ctx, eligible) and \
                    now < group.created_at + timing.rank_wait:
                # look again soon: the steps arrive with ingest, which does not wake the worker for them
                ready = min(now + RANK_POLL_S, group.created_at + timing.rank_wait)
        elif digest - notified:
            ready = group.last_notified_at + timing.group_interval
        elif timing.repeat_interval > 0:
            ready = group.last_notified_at + timing.repeat_interval
        else:
            ready = math.inf
        if now >= ready:
            send = True
        elif ready < math.inf:
            wakes.append(ready)
    written = 0
    if send:
        run_names = {a.run_id: ctx.run(session, a.run_id).name for a in members}
        payload = group_payload(group, eligible, held_back=sum(1 for a in members if a not in eligible),
                                run_names=run_names, project_name=project.name, settings=settings)
        written = enqueue_notification(session, receiver, payload, project_id=project.id, settings=settings,
                                       now=now, alert_id=payload["alert_id"])
        group.notified = sorted(notified | digest)
        group.last_notified_at = now
        group.notifications = (group.notifications or 0) + 1
        if timing.repeat_interval > 0 and any(a.status == "firing" for a in eligible):
            wakes.append(now + timing.repeat_interval)
    if poll:
        wakes.append(now + PENDING_POLL_S)
    group.next_flush_at = min(wakes) if wakes else None
    session.flush()
    return written


def mark_delivered(session: Session, group_ids: list[int], *, now: float) -> None:
    """The delivery worker's word that notifications of these groups reached their receivers: the groups'
    last notification time becomes ``now`` (the time the intervals count from). A group flushed again
    meanwhile (a later ``last_notified_at``) keeps its own time. The caller commits."""
    ids = sorted({g for g in group_ids if g is not None})
    if not ids:
        return
    col = NotificationGroup.last_notified_at
    session.execute(NotificationGroup.__table__.update()
                    .where(NotificationGroup.id.in_(ids), col.is_not(None), col < now)
                    .values(last_notified_at=now))


def _ranks_behind(session: Session, ctx: "DecisionContext", alerts: list[Alert]) -> bool:
    """Whether a running multi-rank run of ``alerts`` has a rank that has not yet sent the step of its
    latest alert there (its batch of the incident is still to come). One index lookup per rank."""
    latest: dict[int, int] = {}
    for a in alerts:
        latest[a.run_id] = max(latest.get(a.run_id, a.first_step), a.first_step)
    for run_id, step in latest.items():
        run = ctx.run(session, run_id)
        if (run.world_size or 1) < 2 or run.status != "running":
            continue
        progress = rank_progress(session, run)
        if any(progress.get(r, (-1, 0.0))[0] < step for r in range(run.world_size)):
            return True
    return False


def _news_key(alert: Alert) -> str:
    """What of an alert a notification reports: its id and severity (an escalation is news), and for an
    alert of several ranks whose lead changed (a rank that went first, its batch arriving late:
    server/rules/alerts.py) the leading rank and step, so the right rank is told once more."""
    key = f"{alert.id}:{alert.severity}"
    ev = alert.evidence if isinstance(alert.evidence, dict) else {}
    if "first" in ev:
        key += f":rank{alert.rank}@{alert.first_step}"
    return key


def _lead_news(alert: Alert, notified: set) -> bool:
    """A notified alert whose leading rank changed since (told again, even if it resolved meanwhile)."""
    ev = alert.evidence if isinstance(alert.evidence, dict) else {}
    return "first" in ev and _news_key(alert) not in notified


def _locked(session: Session, q):
    if session.get_bind().dialect.name == "postgresql":
        return q.with_for_update(skip_locked=True)
    return q


def flush_groups(session: Session, *, cfg: RoutingConfig, settings: Any, now: float,
                 ids: Optional[list[int]] = None) -> int:
    """Flush the due groups (``ids``: only those); returns the outbox rows written. The caller commits."""
    q = (select(NotificationGroup).where(NotificationGroup.next_flush_at <= now)
         .order_by(NotificationGroup.next_flush_at).limit(FLUSH_LIMIT))
    if ids is not None:
        if not ids:
            return 0
        q = q.where(NotificationGroup.id.in_(ids))
    groups = list(session.scalars(_locked(session, q)))
    contexts: dict[int, DecisionContext] = {}
    written = 0
    for group in groups:
        ctx = contexts.get(group.project_id)
        if ctx is None:
            project = session.get(Project, group.project_id)
            ctx = contexts[group.project_id] = DecisionContext(session, project, cfg, settings, now)
        written += flush_group(session, group, cfg=cfg, settings=settings, now=now, ctx=ctx)
    return written


def next_flush_at(session: Session) -> Optional[float]:
    return session.scalar(select(func.min(NotificationGroup.next_flush_at)))

