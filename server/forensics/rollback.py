"""Rollback advice: the checkpoint a critical incident's run should restart from, and the batches to skip.

Follows the recipe PaLM published for loss spikes (Chowdhery et al. 2022, section 5.1):
restart from a checkpoint about 100 steps before the spike started and skip about 200–500
data batches, the ones seen before and during the spike. gradwatch knows the checkpoints
(``checkpoint`` events: ``monitor.checkpoint(path)``, the HF and Lightning callbacks) and the
incident's steps, so it names both:

* **first anomalous step**: the alert's ``first_step``, or an earlier step that the alert's
  evidence names as a precursor (``evidence.precursors[*].step`` or ``evidence.precursor.step``,
  the precursor timeline's keys) — the trouble began there, so the restart must be before it;
* **checkpoint**: the last one whose step is at or before that step. A checkpoint's step is
  the optimizer steps taken when it was saved (agent/checkpoints.py), so its weights never saw
  the anomalous step. A later checkpoint may hold damaged weights (a NaN the scaler did not
  skip, a spike already absorbed) and is never named;
* **skip_batches** ``[a, b]`` (inclusive, in batch indices = step numbers: one batch per
  optimizer step; with k micro-batches per step multiply by k): ``a`` = the later of the
  checkpoint's step and 100 steps before the first anomalous step (PaLM's restart point: the
  steps from the checkpoint up to ``a`` are replayed on their own data), ``b`` so that the
  window covers the incident's steps seen so far plus 100 more, at least 200 and at most 500
  batches.

The advice is written into the alert in the ingest transaction that raises (or escalates) it,
before routing, so webhooks and Slack / Discord messages carry it: ``evidence.rollback`` =
``{"checkpoint": path, "step": s, "skip_batches": [a, b], "anomaly_step": n, "action": text}``
and ``text`` ("Roll back to <path> (step s) and skip batches a–b …") is the alert's second action,
right after the rule's first one (the fix for the cause: the run must not restart into the same
failure), so the two read in the order a user acts on them.
A checkpoint event can arrive after its alert (another rank saves, a batch is delayed, an HF
``on_save`` fires after the step's batch went out): every batch that carries checkpoint events
recomputes the advice of the run's rollback alerts at or after them, so the stored alert (API,
dashboard) names the right checkpoint; a notification already sent is not sent again. Without
any checkpoint at or before the anomalous step the advice says so (``checkpoint`` null) and
tells how to record them.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert, RunEvent
from gradwatch.server.rules import registry

CHECKPOINT_KIND = "checkpoint"
RESTART_BEFORE = 100             # PaLM: restart about 100 steps before the spike
SKIP_MIN, SKIP_MAX = 200, 500    # PaLM: skip about 200-500 batches
AFTER_INCIDENT = 100             # the window reaches this far past the incident's last step seen

__all__ = ["advise_rollback", "refresh_advice", "rollback_plan", "anomaly_step"]


def _wants_advice(alert: Alert) -> bool:
    if alert.severity != "critical":
        return False
    try:
        return bool(registry.get(alert.rule).spec.rollback_advice)
    except KeyError:   # an alert of a rule that is no longer declared
        return False


def anomaly_step(alert: Alert) -> int:
    """The alert's first anomalous step: its first step, or an earlier precursor named in its evidence."""
    first = int(alert.first_step)
    ev = alert.evidence or {}
    found: list[Any] = []
    pre = ev.get("precursor")
    if isinstance(pre, dict):
        found.append(pre.get("step", pre.get("first_step")))
    pres = ev.get("precursors")
    if isinstance(pres, list):
        # a signal that left its band (precursors.py: "from_step"); a loss-scale halving listed beside
        # them ("event") is context, not where the run went wrong
        found += [p.get("from_step", p.get("step", p.get("first_step"))) for p in pres
                  if isinstance(p, dict) and not p.get("event")]
    steps = [int(s) for s in found if isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s <= first]
    return min([first, *steps])


def rollback_plan(checkpoints: Iterable[tuple[int, Optional[str]]], *, anomaly: int, last_step: int) -> dict:
    """The advice for an incident whose first anomalous step is ``anomaly`` and whose latest step seen
    is ``last_step``, given the run's checkpoints as (step, path). Pure; the module docstring has the rules.

    >>> rollback_plan([(100, "c100"), (200, "c200"), (300, "c300")], anomaly=350, last_step=350)["skip_batches"]
    [300, 499]
    """
    usable = [(s, p) for s, p in checkpoints if s is not None and s <= anomaly]
    if not usable:
        return {"checkpoint": None, "step": None, "skip_batches": None, "anomaly_step": anomaly,
                "action": f"No checkpoint recorded at or before step {anomaly:,}: record each one with "
                          f"monitor.checkpoint(path) (the HF and Lightning callbacks do it) and gradwatch names "
                          f"the one to roll back to."}
    step, path = max(usable, key=lambda c: c[0])
    first = max(step, anomaly - RESTART_BEFORE)
    length = min(max(max(last_step, anomaly) - first + 1 + AFTER_INCIDENT, SKIP_MIN), SKIP_MAX)
    skip = [first, first + length - 1]
    where = f"{path} (step {step:,})" if path else f"the checkpoint saved at step {step:,}"
    return {"checkpoint": path, "step": step, "skip_batches": skip, "anomaly_step": anomaly,
            "action": f"Roll back to {where} and skip batches {skip[0]:,}–{skip[1]:,} (restart before step "
                      f"{anomaly:,}, where it began, and leave out the data seen before and during it; "
                      f"PaLM's recipe for loss spikes)."}


def _checkpoints(session: Session, run_id: int, upto: int) -> list[tuple[int, Optional[str]]]:
    with session.no_autoflush:
        rows = session.execute(select(RunEvent.step, RunEvent.data).where(
            RunEvent.run_id == run_id, RunEvent.kind == CHECKPOINT_KIND, RunEvent.step <= upto)).all()
    return [(int(s), (d or {}).get("path")) for s, d in rows]


def refresh_advice(session: Session, alert: Alert) -> None:
    """Recompute one alert's advice now, e.g. after evidence naming an earlier precursor was attached
    (``evidence.precursors``): the restart point moves before it. No-op for alerts without advice."""
    if _wants_advice(alert):
        _advise(session, alert)


def _advise(session: Session, alert: Alert) -> None:
    anomaly = anomaly_step(alert)
    plan = rollback_plan(_checkpoints(session, alert.run_id, anomaly), anomaly=anomaly,
                         last_step=int(alert.last_step))
    ev = dict(alert.evidence or {})
    old = ev.get("rollback") or {}
    actions = [a for a in (alert.actions or []) if a != old.get("action")]
    actions.insert(min(1, len(actions)), plan["action"])
    if old == plan and list(alert.actions or []) == actions:
        return
    alert.actions = actions
    ev["rollback"] = plan
    alert.evidence = ev


def advise_rollback(session: Session, *, run_id: int, alerts: list[Alert], events: list[dict]) -> None:
    """Called by ingest after the rules, before routing, in the batch's transaction: write the advice
    into the critical alerts raised or escalated now, and recompute it for the run's alerts that a
    checkpoint in this batch (``events``: wire event dicts) may change."""
    for alert in alerts:
        if _wants_advice(alert):
            _advise(session, alert)
    steps = [e.get("step") for e in events if e.get("kind") == CHECKPOINT_KIND and e.get("step") is not None]
    if not steps:
        return
    seen = {a.id for a in alerts}
    with session.no_autoflush:
        later = session.scalars(select(Alert).where(Alert.run_id == run_id, Alert.severity == "critical",
                                                    Alert.last_step >= min(steps))).all()
    for alert in later:
        if alert.id not in seen and _wants_advice(alert):
            _advise(session, alert)
