"""Rule engine: evaluates the registered rules on each ingested batch, and the timer rules on a clock.

``evaluate_batch`` is called by ingest inside the batch's transaction after the steps are written.
Per batch it reads the project's rule settings (one query) and the run's rule states for this rank
(one query); every enabled *batch* rule evaluates the whole batch at once; for runs with several
ranks every *cross-rank* rule gets the other ranks' values of the keys it needs at the same steps
(one query). ``scan_timer_rules`` runs the *timer* rules (called periodically by the webhook
worker). The engine dispatches on a rule's ``kind`` and knows no rule by its id: what a rule is
lives in its class (``server/rules/catalog/``). Everything a rule remembers lives in
``rule_states``: a restarted server or another replica continues where this one left off.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.db import json_dumps, json_loads
from gradwatch.agent.signals import EXTRA_BASE, is_step_signal, step_signal
from gradwatch.server.storage.models import STEP_COLUMNS, Alert, Project, Run, RuleState, Step
from gradwatch.server.wire.numbers import column_value, extra_value
from gradwatch.server.storage.ranks import all_ranks_sent, among_ranks, rank_hosts, steps_sent
from gradwatch.server.rules.alerts import Episode
from gradwatch.server.rules.batch import Batch, Context, keys_present
from gradwatch.server.rules.config import effective_config, smallest_setting
from gradwatch.server.rules.registry import rule_classes
from gradwatch.server.rules.rule import Outcome
from gradwatch.server.rules.stats import enc

log = logging.getLogger("gradwatch.rules")

# rule_states key for run-level memory of the engine itself (the events rules asked it to keep)
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


def _load_states(session: Session, run_id: int, rank: int,
                 rules: Optional[list[str]] = None) -> dict[str, _StateRow]:
    """The rank's rule state rows, every rule's or only ``rules``'."""
    conn = session.connection()
    if conn.dialect.name == "postgresql":   # json keeps its input text: ::text is what was written
        sql, mark = "SELECT rule, state::text FROM rule_states WHERE run_id = %s AND rank = %s", "%s"
    else:
        sql, mark = "SELECT rule, state FROM rule_states WHERE run_id = ? AND rank = ?", "?"
    if rules is not None:
        sql += f" AND rule IN ({', '.join([mark] * len(rules))})"
    return {rule: _StateRow(rule, json_loads(text) if text else {}, text or "")
            for rule, text in conn.exec_driver_sql(sql, (run_id, rank, *(rules or ())))}


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


def _own(row, cls) -> dict:
    """The row's state, to be changed in place by one rule (a state loaded for this batch belongs to
    this batch only; ``_discard`` throws the changes away if the rule fails half-way). A state written
    under another ``state_version`` of the rule is started afresh; the alert lifecycle is kept."""
    if not isinstance(row.state, dict):
        row.state = {}
    state = row.state
    version = state.get("v", 1)
    if version != cls.state_version:
        log.info("rule %s: state version %s, expected %s; starting its memory afresh", cls.id, version,
                 cls.state_version)
        state = row.state = {"lc": state.get("lc") or {}}
        if cls.state_version != 1:
            state["v"] = cls.state_version
    return state


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


def _feed(episode: Episode, batch: Batch, out: Outcome) -> None:
    """The verdicts into the alert lifecycle, in step order. Nothing firing and no hit: nothing to do."""
    for step, hit in out.before:
        episode.feed(step, hit)
    if not out.hits and not episode.firing:
        return
    marks = out.clear.copy()
    if out.hits:
        marks[list(out.hits)] = True
    steps = batch.step
    for i in np.flatnonzero(marks).tolist():
        hit = out.hits.get(i)
        if hit is None:
            if not episode.firing:
                if not any(k > i for k in out.hits):
                    return
                continue
            episode.feed(int(steps[i]), False)
        else:
            episode.feed(int(steps[i]), hit)


def evaluate_batch(session: Session, *, run: Run, rank: int, steps: list[dict], events: list[dict],
                   settings: Any, now: float, present: Optional[frozenset] = None,
                   sent: Optional[dict[int, int]] = None) -> list[Alert]:
    """Evaluate every enabled rule on this batch; returns the alerts to notify (new or escalated).

    ``present``: ``keys_present(steps)`` when the caller knows it more cheaply (ingest does). ``sent``:
    {step: ranks that have stored it} for the batch's steps, when the caller has it (ingest does, from
    ``ranks.count_sent``); otherwise ``ranks.steps_sent`` reads it.
    """
    steps = [st for st in (steps or ()) if st.get("step") is not None]
    if not steps and not events:
        return []
    project = session.get(Project, run.project_id)
    cfg = effective_config(session, project_id=run.project_id, project_name=project.name if project else None,
                           settings=settings)
    rows = _load_states(session, run.id, rank)

    def state_row(rule: str) -> _StateRow:
        row = rows.get(rule)
        if row is None:
            row = rows[rule] = _StateRow(rule, {}, None)
        return row

    ctx = Context(run_id=run.id, rank=rank, world_size=run.world_size or 1,
                  param_names=list(run.param_names or []), module_names=list(run.module_names or []),
                  bn_names=list(run.bn_names or []), events=_events_by_kind(events),
                  # the run's meta (the last rank's word) and every rank's host (F3, F4 name it)
                  run_meta={**((run.config or {}).get("_meta") or {}), "rank_hosts": rank_hosts(run.config)},
                  present=keys_present(steps) if present is None else present)
    ctx.remembered = _remember_events(ctx, rows, state_row)
    notify: list[Alert] = []

    if steps:
        timers = [cls for cls in rule_classes("timer") if cfg[cls.id].get("enabled", True)]
        # their lifecycles are on rank 0's state: another rank's batch reads them in one Core query
        # (an ORM load a rule and batch was 5 % of a 256-rank batch), the ORM row only to resolve one
        zero = rows if rank == 0 or not timers else _load_states(session, run.id, 0, [c.id for c in timers])
        for cls in timers:
            _revive(session, cls, run, rank, rows, zero, cfg[cls.id], now)

    batch = Batch(steps, ctx)
    for cls in rule_classes("batch"):
        rcfg = cfg[cls.id]
        rule = cls()
        if not rcfg.get("enabled", True) or not rule.applies(ctx):
            continue
        row = state_row(cls.id)
        state = _own(row, cls)
        lc = state.setdefault("lc", {})
        episode = Episode(session, run.id, rank, cls.spec, rcfg, lc, now)
        try:
            try:
                out = rule.evaluate(batch, state, rcfg)
            except Exception:   # noqa: BLE001 - perhaps a state it cannot read: once more from a fresh one
                if set(state) <= {"lc", "v"}:
                    raise
                log.warning("rule %s could not read its state on run %s rank %s; starting its memory afresh",
                            cls.id, run.id, rank, exc_info=True)
                state = row.state = {"lc": lc, **({"v": cls.state_version} if cls.state_version != 1 else {})}
                out = rule.evaluate(batch, state, rcfg)
            _feed(episode, batch, out)
        except Exception:   # noqa: BLE001 - one broken rule must not lose the batch
            log.exception("rule %s failed on run %s rank %s; skipped for this batch", cls.id, run.id, rank)
            _discard(row)
            continue
        if cls.evidence_events and any(ctx.events.get(k) for k in cls.evidence_events):
            extra = rule.late_evidence(ctx)
            if extra:
                episode.add_evidence(**extra)
        notify.extend(episode.notify)

    if ctx.world_size > 1 and steps and rank >= 0:   # the combined row (rank -1) is no rank to compare
        # {step: ranks that sent it}; the cross-rank rules judge only the steps this batch completed, and
        # most batches complete none (only a step's last rank does): then no rule, no savepoint, is run
        if sent is None:
            sent = steps_sent(session, run_id=run.id, world_size=ctx.world_size, lo=int(batch.step.min()),
                              hi=int(batch.step.max()))
        completes = any(all_ranks_sent(sent, batch.step.tolist(), ctx.world_size))
        for cls in rule_classes("cross_rank") if completes else ():
            if not cfg[cls.id].get("enabled", True) or not cls().applies(ctx):
                continue
            try:
                with session.begin_nested():      # a failure here must not take the batch with it
                    notify.extend(_cross_rank(session, cls, run, rank, batch, cfg[cls.id], state_row, now, sent))
            except Exception:  # noqa: BLE001
                log.exception("rule %s failed on run %s rank %s; skipped for this batch", cls.id, run.id, rank)
    _save_states(session, run.id, rank, rows)
    return notify


def _remember_events(ctx: Context, rows: dict, state_row) -> dict[str, Any]:
    """The run's latest event of each kind a rule asked to keep (the NaN origin, …): updated from this
    batch's events (its first of each kind) and kept in the engine's own state row."""
    kinds = {k for cls in rule_classes() for k in cls.evidence_events}
    stored = rows[_ENGINE].state if _ENGINE in rows and isinstance(rows[_ENGINE].state, dict) else {}
    remembered = dict(stored.get("events") or {})
    if "nan_origin" in stored and "events" not in stored:      # the layout before rules were plug-ins
        remembered["nan_origin"] = stored["nan_origin"]
    fresh = {k: ctx.events[k] for k in kinds if ctx.events.get(k)}
    if fresh:
        for kind, by_step in fresh.items():
            first = min(by_step)
            remembered[kind] = enc({"step": first, **by_step[first]})
        row = state_row(_ENGINE)
        row.state = {"events": remembered}
    return remembered


def _cross_rank(session: Session, cls, run: Run, rank: int, batch: Batch, cfg: dict, state_row,
                now: float, sent: dict[int, int]) -> list[Alert]:
    """Hand a cross-rank rule this rank's and the other ranks' values of its keys at the batch's steps
    that this batch completed (``sent``: how many of the run's ranks have a row for each step)."""
    # step signals: those with a column of their own (F1 reads loss and grad_norm), and later ones from the
    # `steps.extra` blob by slot (F3 reads data_time)
    keys = [k for k in cls.needs if is_step_signal(k)]
    col_keys = [k for k in keys if k in STEP_COLUMNS]
    extra_slots = {k: step_signal(k).id - EXTRA_BASE for k in keys if k not in STEP_COLUMNS}
    have = np.zeros(batch.n, dtype=bool)
    for k in keys:
        have |= batch.measured(k)
    idx = np.flatnonzero(have)
    if not len(idx):
        return []
    # A step is judged once, by the batch that completes it: every other rank of the run has a row for it
    # (batches of a run are serialised by its lock, so exactly one batch sees that). Judged on every batch,
    # a step of an N-rank run was seen up to N - 1 times, each rank's streak advancing as often, and each
    # batch read and wrote the state of every rank: O(N) per batch, O(N^2) per step.
    # The other ranks are named (ranks.among_ranks), not a range, which would walk the whole run.
    world = run.world_size or 1
    steps = batch.step[idx]
    complete = np.array(all_ranks_sent(sent, steps.tolist(), world), dtype=bool)
    if not complete.any():
        return []
    idx, steps = idx[complete], steps[complete]
    lo, hi = int(steps.min()), int(steps.max())
    position = {int(s): j for j, s in enumerate(steps.tolist())}
    others: dict[int, dict[str, np.ndarray]] = {}
    columns = [getattr(Step, k) for k in col_keys] + ([Step.extra] if extra_slots else [])
    # Core rows, not the ORM's loading: a row per other rank and step (2,550 for 10 steps of 256 ranks)
    for r, s, nan_mask, *values in session.connection().execute(
            select(Step.rank, Step.step, Step.nan_mask, *columns).where(
                Step.run_id == run.id, among_ranks(Step.rank, world), Step.rank != rank, Step.step >= lo,
                Step.step <= hi)).all():
        j = position.get(s)
        if j is None:
            continue
        cols = others.get(r)
        if cols is None:
            cols = others[r] = {}
            for k in keys:
                cols[k] = np.full(len(steps), np.nan)
                cols[k + ".measured"] = np.zeros(len(steps), dtype=bool)
        for k, v in zip(col_keys, values):
            v = column_value(v, bool((nan_mask or 0) & (1 << step_signal(k).id)))
            if v is not None:
                cols[k][j] = v
                cols[k + ".measured"][j] = True
        for k, slot in extra_slots.items():
            v = extra_value(values[-1], slot)
            if v is not None:
                cols[k][j] = v
                cols[k + ".measured"][j] = True
    if not others:
        return []
    mine: dict[str, Any] = {"rank": rank, "world_size": run.world_size or 1, "run_meta": batch.ctx.run_meta}
    for k in keys:
        mine[k] = batch.values(k)[idx]
        mine[k + ".measured"] = batch.measured(k)[idx]

    held: dict[int, tuple[Any, dict, Episode]] = {}
    loaded: Optional[dict[int, RuleState]] = None   # the other ranks' state rows, read in one query when first needed

    def holder(r: int):
        nonlocal loaded
        if r not in held:
            if r == rank:
                row = state_row(cls.id)
                state = _clone(row.state)
            else:
                if loaded is None:
                    loaded = {row.rank: row for row in session.scalars(select(RuleState).where(
                        RuleState.run_id == run.id, among_ranks(RuleState.rank, world), RuleState.rule == cls.id))}
                row = loaded.get(r)
                if row is None:
                    row = RuleState(run_id=run.id, rank=r, rule=cls.id, state={})
                    session.add(row)
                state = _clone(row.state)
            held[r] = (row, state, Episode(session, run.id, r, cls.spec, cfg, state.setdefault("lc", {}), now))
        return held[r]

    verdicts = cls().evaluate(steps, mine, others, lambda r: holder(r)[1], cfg)
    for r, step, verdict in verdicts:
        holder(r)[2].feed(step, verdict)
    notify: list[Alert] = []
    for r, (row, state, episode) in held.items():
        row.state = dict(state)   # an unchanged state is no UPDATE: SQLAlchemy compares (see _clone)
        notify.extend(episode.notify)
    return notify


# --------------------------------------------------------------------------- timer rules

def _revive(session: Session, cls, run: Run, rank: int, rows: dict, zero: dict, cfg: dict, now: float) -> None:
    """Data arrived from ``rank``: whether a timer rule's open alert (its lifecycle kept on rank 0's
    state, ``zero``: rank 0's rows, read-only, ``rows`` itself for rank 0) resolves is the rule's to say
    (``TimerRule.revive``); the row to change is loaded only to resolve."""

    def row():
        return rows.get(cls.id) if rank == 0 else session.get(RuleState, (run.id, 0, cls.id))

    def lifecycle() -> dict:
        r = zero.get(cls.id)
        state = r.state if r is not None and isinstance(r.state, dict) else {}
        return dict(state.get("lc") or {})

    if cls().revive(session, run, rank, lifecycle, cfg, now):
        _resolve(session, row(), now)


def _resolve(session: Session, row, now: float) -> None:
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


def timer_scan_interval(settings: Any) -> float:
    """How often ``scan_timer_rules`` should run: the shortest period any timer rule asks for, given
    the smallest timeout the settings and the rules file give it (API overrides are read per scan)."""
    periods = [cls().period([smallest_setting(cls.spec, cls.timeout_param, settings)])
               for cls in rule_classes("timer")]
    return min(periods) if periods else 5.0


def scan_timer_rules(session: Session, *, settings: Any, now: Optional[float] = None) -> list[Alert]:
    """Evaluate every timer rule: the runs each one names as candidates, checked against their project's
    settings. The alert's lifecycle goes on rank 0's state; data arriving again resolves it when the rule
    says so (``TimerRule.revive``, called by ``evaluate_batch``)."""
    now = time.time() if now is None else now
    notify: list[Alert] = []
    for cls in rule_classes("timer"):
        rule = cls()
        smallest = smallest_setting(cls.spec, cls.timeout_param, settings, session=session)
        candidates = rule.candidates(session, now=now, smallest_timeout=smallest)
        cfg_cache: dict[int, dict] = {}
        for run, project_name in candidates:
            if run.project_id not in cfg_cache:
                cfg_cache[run.project_id] = effective_config(session, project_id=run.project_id,
                                                             project_name=project_name, settings=settings)[cls.id]
            cfg = cfg_cache[run.project_id]
            if not cfg.get("enabled", True):
                continue
            found = rule.check(session, run, cfg, now)
            if found is None:
                continue
            row = session.get(RuleState, (run.id, 0, cls.id))
            if row is None:
                row = RuleState(run_id=run.id, rank=0, rule=cls.id, state={})
                session.add(row)
            state = _clone(row.state)
            lc = state.setdefault("lc", {})
            if lc.get("firing"):
                continue
            step, hit = found
            # the alert names the rank the rule names (F4: the silent one); its lifecycle stays on rank 0
            ep = Episode(session, run.id, rule.alert_rank(hit), cls.spec, {**cfg, "cooldown_steps": 0}, lc, now)
            ep.hit(step, hit)
            row.state = state
            rule.fired(run)
            notify.extend(ep.notify)
    return notify
