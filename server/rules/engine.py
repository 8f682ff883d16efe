"""Rule engine: evaluates the catalogue on each ingested batch, and F2 on a timer.

``evaluate_batch`` is called by ingest inside the batch's transaction after
the steps are written. Per batch it reads the project's rule settings (one
query), the run's rule states for this rank (one query) and, for runs with
several ranks, the other ranks' losses for the same steps (one query); then
each enabled rule walks the batch's steps once. Everything a rule remembers
lives in ``rule_states`` — a restarted server or another replica continues
where this one left off.
"""
from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from server.db import json_dumps, json_loads
from server.models import STEP_SIGNALS, Alert, Project, Run, RuleOverride, RuleState, Step
from server.rules.alerts import Episode, Hit
from server.rules.catalogue import RULES_BY_ID
from server.rules.checks import RULE_CLASSES, Context, keys_present
from server.rules.config import effective_config, rules_file_of
from server.rules.stats import enc, fmt, median, num

log = logging.getLogger("gradwatch.rules")

_LOSS_NAN_BIT = 1 << STEP_SIGNALS.index("loss")

# rule_states key for run-level memory of the engine itself (NaN origin seen, …)
_ENGINE = "_"


class _StateRow:
    """One rule's state for the batch's own (run, rank), read and written with plain SQL.

    ``stored`` is the JSON text as read (None: no row yet). At the end of the batch a state is
    written only when its text differs from what was read, in one statement for all of them:
    through the ORM, ~18 JSON rows per batch cost several ms of unit-of-work bookkeeping, and
    rewriting unchanged ones costs PostgreSQL a TOAST rewrite each.
    """

    __slots__ = ("rule", "state", "stored")

    def __init__(self, rule: str, state: Any, stored: Optional[str]):
        self.rule, self.state, self.stored = rule, state, stored


def _load_states(session: Session, run_id: int, rank: int) -> dict[str, _StateRow]:
    conn = session.connection()
    if conn.dialect.name == "postgresql":   # json keeps its input text: ::text is what was written
        sql = "SELECT rule, state::text FROM rule_states WHERE run_id = %s AND rank = %s"
    else:
        sql = "SELECT rule, state FROM rule_states WHERE run_id = ? AND rank = ?"
    return {rule: _StateRow(rule, json_loads(text) if text else {}, text or "")
            for rule, text in conn.exec_driver_sql(sql, (run_id, rank))}


def _save_states(session: Session, run_id: int, rank: int, rows: dict[str, _StateRow]) -> None:
    updates, inserts = [], []
    for row in rows.values():
        text = json_dumps(row.state if isinstance(row.state, dict) else {})
        if row.stored is None:
            inserts.append((run_id, rank, row.rule, text))
        elif text != row.stored:
            updates.append((text, run_id, rank, row.rule))
        row.stored = text
    conn = session.connection()
    pg = conn.dialect.name == "postgresql"
    if updates:
        conn.exec_driver_sql("UPDATE rule_states SET state = %s::json WHERE run_id = %s AND rank = %s AND rule = %s"
                             if pg else "UPDATE rule_states SET state = ? WHERE run_id = ? AND rank = ? AND rule = ?",
                             updates)
    if inserts:
        conn.exec_driver_sql("INSERT INTO rule_states (run_id, rank, rule, state) VALUES (%s, %s, %s, %s::json)"
                             if pg else "INSERT INTO rule_states (run_id, rank, rule, state) VALUES (?, ?, ?, ?)",
                             inserts)


def _clone(state: Optional[dict]) -> dict:
    """A deep copy of a JSON state: SQLAlchemy only writes a JSON column whose new value differs from
    the loaded one, so nested windows must not be mutated in place."""
    return json.loads(json.dumps(state)) if state else {}


def _own(row) -> dict:
    """The row's state, to be changed in place by one rule.

    A state loaded for this batch belongs to this batch only, so it needs no copy; ``_discard``
    throws the changes away if the rule fails half-way."""
    if not isinstance(row.state, dict):
        row.state = {}
    return row.state


def _discard(row: _StateRow) -> None:
    """Undo a failed rule's in-place changes: back to the state as read (a new row starts empty)."""
    row.state = json_loads(row.stored) if row.stored else {}


def _events_by_kind(events: list[dict]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for ev in events or ():
        kind, step = ev.get("kind"), ev.get("step")
        if kind is None or step is None:
            continue
        out.setdefault(kind, {})[int(step)] = dict(ev.get("data") or {})
    return out


def evaluate_batch(session: Session, *, run: Run, rank: int, steps: list[dict], events: list[dict],
                   settings: Any, now: float, present: Optional[frozenset] = None) -> list[Alert]:
    """Evaluate every enabled rule on this batch; returns the alerts to notify (new or escalated).

    ``present``: ``keys_present(steps)`` when the caller knows it more cheaply (ingest does).
    """
    steps = [st for st in (steps or ()) if st.get("step") is not None]
    if not steps and not events:
        return []
    project = session.get(Project, run.project_id)
    cfg = effective_config(session, project_id=run.project_id, project_name=project.name if project else None,
                           settings=settings)
    rows = _load_states(session, run.id, rank)

    def state_row(rule: str, for_rank: int = rank):
        """This rank's rows: a ``_StateRow``; another rank's (F1): the ORM row."""
        if for_rank == rank:
            row = rows.get(rule)
            if row is None:
                row = rows[rule] = _StateRow(rule, {}, None)
            return row
        row = session.get(RuleState, (run.id, for_rank, rule))
        if row is None:
            row = RuleState(run_id=run.id, rank=for_rank, rule=rule, state={})
            session.add(row)
        return row

    ctx = Context(run_id=run.id, rank=rank, world_size=run.world_size or 1,
                  param_names=list(run.param_names or []), module_names=list(run.module_names or []),
                  bn_names=list(run.bn_names or []), events=_events_by_kind(events),
                  present=keys_present(steps) if present is None else present)
    notify: list[Alert] = []
    episodes: dict[str, Episode] = {}

    # run-level memory: the latest NaN origin, attached to A1 / A2 alerts as evidence
    origins = ctx.events.get("nan_origin", {})
    tops = ctx.events.get("top_grad_norms", {})
    engine_row = None
    if origins:
        engine_row = state_row(_ENGINE)
        first = min(origins)
        engine_state = _clone(engine_row.state)
        engine_state["nan_origin"] = enc({"step": first, **origins[first]})
        engine_row.state = engine_state
    nan_origin = (engine_row.state if engine_row is not None else
                  (rows[_ENGINE].state if _ENGINE in rows else {})).get("nan_origin")

    # data arrived: a stalled run is alive again (F2 lives on rank 0's state)
    if steps:
        if run.status == "stalled":
            run.status = "running"
        if rank == 0:
            _resolve_stall(session, rows.get("F2"), now)
        elif run.status == "stalled":
            _resolve_stall(session, session.get(RuleState, (run.id, 0, "F2")), now)

    for cls in RULE_CLASSES:
        rule = cls()
        rcfg = cfg[rule.id]
        if not rcfg.get("enabled", True) or not rule.applies(steps, ctx):
            continue
        row = state_row(rule.id)
        state = _own(row)
        lc = state.setdefault("lc", {})
        if nan_origin and rule.id in ("A1", "A2"):
            state["nan_origin"] = nan_origin
        episode = Episode(session, run.id, rank, rule.spec, rcfg, lc, now)
        try:
            rule.begin(ctx, state, rcfg)
            for ev_step, hit in rule.event_hits(ctx, state, rcfg):
                episode.feed(ev_step, hit)
            if episode.firing or not rule.fast(ctx, state, rcfg, steps):
                # feed() ignores None, and False while nothing is firing: skip the call for those
                observe, feed, firing = rule.observe, episode.feed, episode.firing
                for st in steps:
                    verdict = observe(ctx, state, rcfg, st)
                    if verdict is None or (verdict is False and not firing):
                        continue
                    feed(int(st["step"]), verdict)
                    firing = episode.firing
            rule.end(ctx, state, rcfg)
        except Exception:   # noqa: BLE001 - one broken rule must not lose the batch
            log.exception("rule %s failed on run %s rank %s; skipped for this batch", rule.id, run.id, rank)
            _discard(row)
            continue
        if rule.id in ("A1", "A2") and (origins or tops):
            extra = {}
            if origins:
                extra["nan_origin"] = nan_origin
            if tops:
                s = max(tops)
                extra["top_grad_norms"] = [[str(p[0]), enc(num(p[1]))] for p in (tops[s].get("params") or [])[:5]]
            episode.add_evidence(**extra)
        state.pop("nan_origin", None)
        notify.extend(episode.notify)
        episodes[rule.id] = episode

    if ctx.world_size > 1 and steps and cfg["F1"].get("enabled", True):
        try:
            with session.begin_nested():      # a failure here must not take the batch with it
                notify.extend(_rank_divergence(session, run, rank, steps, cfg["F1"], state_row, now))
        except Exception:  # noqa: BLE001
            log.exception("rule F1 failed on run %s rank %s; skipped for this batch", run.id, rank)
    _save_states(session, run.id, rank, rows)
    return notify


# --------------------------------------------------------------------------- F1

def _rank_divergence(session: Session, run: Run, rank: int, steps: list[dict], cfg: dict, state_row,
                     now: float) -> list[Alert]:
    """Compare this rank's losses with the other ranks' at the same steps (whichever arrives second)."""
    mine = {int(st["step"]): num(st.get("loss")) for st in steps if num(st.get("loss")) is not None}
    if not mine:
        return []
    lo, hi = min(mine), max(mine)
    others: dict[int, dict[int, float]] = {}
    for r, s, loss, nan_mask in session.execute(
            select(Step.rank, Step.step, Step.loss, Step.nan_mask).where(
                Step.run_id == run.id, Step.rank != rank, Step.step >= lo, Step.step <= hi)):
        if loss is None and (nan_mask or 0) & _LOSS_NAN_BIT:
            loss = math.nan          # SQLite keeps NaN as NULL + a bit in nan_mask
        if loss is not None:
            others.setdefault(s, {})[r] = loss
    if not others:
        return []
    spec = RULES_BY_ID["F1"]
    notify: list[Alert] = []
    episodes: dict[int, tuple[Episode, RuleState, dict]] = {}

    def episode_for(r: int) -> Episode:
        if r not in episodes:
            row = state_row("F1", r)
            state = _clone(row.state)
            episodes[r] = (Episode(session, run.id, r, spec, cfg, state.setdefault("lc", {}), now), row, state)
        return episodes[r][0]

    for step in sorted(mine):
        if step not in others:
            continue
        losses = {**others[step], rank: mine[step]}
        if len(losses) < 2:
            continue
        for r, x in losses.items():
            rest = [v for q, v in losses.items() if q != r]
            finite_rest = [v for v in rest if math.isfinite(v)]
            ep = episode_for(r)
            st = episodes[r][2]
            if not math.isfinite(x) and finite_rest:
                st["streak"] = st.get("streak", 0) + 1
                ep.feed(step, Hit({"rank": r, "loss": enc(x), "others_median": median(finite_rest)},
                                  f"Rank {r} has loss {fmt(x)} at step {step} while the other ranks' median is "
                                  f"{fmt(median(finite_rest))}"))
                continue
            if math.isfinite(x) and len(finite_rest) == len(rest):
                med = median(finite_rest)
                if med > 0 and x > cfg["factor"] * med:
                    st["streak"] = st.get("streak", 0) + 1
                    if st["streak"] >= cfg["consecutive"]:
                        ep.feed(step, Hit({"rank": r, "loss": x, "others_median": med, "ratio": x / med,
                                           "steps": st["streak"]},
                                          f"Rank {r}'s loss {fmt(x)} is {x / med:.1f}x the other ranks' median "
                                          f"{fmt(med)} for {st['streak']} steps"))
                    continue
                st["streak"] = 0
                ep.feed(step, False)
    for r, (ep, row, state) in episodes.items():
        row.state = dict(state)
        notify.extend(ep.notify)
    return notify


# --------------------------------------------------------------------------- F2

def _resolve_stall(session: Session, row: Optional[RuleState], now: float) -> None:
    if row is None:
        return
    state = _clone(row.state)
    lc = dict(state.get("lc") or {})
    if not lc.get("firing"):
        return
    alert = session.get(Alert, lc.get("alert_id")) if lc.get("alert_id") else None
    if alert is not None and alert.status == "firing":
        alert.status, alert.resolved_at, alert.updated_at = "resolved", now, now
    lc["firing"] = False
    state["lc"] = lc
    row.state = state


def check_stalled_runs(session: Session, *, settings: Any, now: Optional[float] = None) -> list[Alert]:
    """F2: runs still marked running that sent nothing for ``timeout_s``. Called periodically.

    The alert goes on rank 0's state; the run is marked ``stalled``. Data arriving
    again resolves it (see ``evaluate_batch``) and ingest marks the run running.
    """
    now = time.time() if now is None else now
    default_timeout = RULES_BY_ID["F2"].params["timeout_s"]
    # the smallest timeout any project may have bounds the query; each project's own setting decides
    timeouts = [float(getattr(settings, "stall_seconds", None) or default_timeout)]
    rf = rules_file_of(settings)
    if rf is not None:
        for table in [rf.every_project, *rf.projects.values()]:
            if table.get("F2", {}).get("timeout_s"):
                timeouts.append(float(table["F2"]["timeout_s"]))
    for cfg_row in session.scalars(select(RuleOverride.config).where(RuleOverride.rule == "F2")):
        if (cfg_row or {}).get("timeout_s"):
            timeouts.append(float(cfg_row["timeout_s"]))
    q = (select(Run, Project.name).join(Project, Project.id == Run.project_id)
         .where(Run.status == "running", Run.last_seen < now - min(timeouts)))
    if session.bind.dialect.name == "postgresql":
        # two replicas checking at once: the second skips the runs the first is handling
        q = q.with_for_update(skip_locked=True, of=Run)
    candidates = session.execute(q).all()
    if not candidates:
        return []
    notify: list[Alert] = []
    cfg_cache: dict[int, dict] = {}
    for run, project_name in candidates:
        if run.project_id not in cfg_cache:
            cfg_cache[run.project_id] = effective_config(session, project_id=run.project_id,
                                                         project_name=project_name, settings=settings)["F2"]
        cfg = cfg_cache[run.project_id]
        timeout = cfg.get("timeout_s", default_timeout)
        if not cfg.get("enabled", True) or run.last_seen is None or now - run.last_seen < timeout:
            continue
        row = session.get(RuleState, (run.id, 0, "F2"))
        if row is None:
            row = RuleState(run_id=run.id, rank=0, rule="F2", state={})
            session.add(row)
        state = _clone(row.state)
        lc = state.setdefault("lc", {})
        if lc.get("firing"):
            continue
        step = int(run.last_step) if run.last_step is not None else 0
        silent = now - run.last_seen
        ep = Episode(session, run.id, 0, RULES_BY_ID["F2"], {**cfg, "cooldown_steps": 0}, lc, now)
        ep.hit(step, Hit({"last_seen": run.last_seen, "silent_s": round(silent, 1), "timeout_s": timeout,
                          "last_step": run.last_step},
                         f"No data from run {run.name!r} for {silent:.0f} s (last step {run.last_step})"))
        row.state = state
        run.status = "stalled"
        notify.extend(ep.notify)
    return notify
