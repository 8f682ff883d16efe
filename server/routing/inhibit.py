"""Inhibition: an alert that explains others keeps them from being notified (they stay stored and shown).

Rules are data (``InhibitRule``: source matchers, target matchers, labels that must be equal, a step
window), so a rule family added later needs a line here, not code. Evaluated when a
group is about to notify, not only when the alert is raised: the NaN on rank 2 may arrive in a later
batch than the spike it caused on rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Alert
from gradwatch.server.routing.labels import alert_labels
from gradwatch.server.routing.matchers import Matcher, matches_all, parse_matchers


@dataclass(frozen=True)
class InhibitRule:
    """Alerts matching ``target`` are not notified when an alert matching ``source`` (and not ``target``)
    with the same ``equal`` labels started at most ``steps_after`` steps before the target or at most
    ``steps_before`` steps after it: the source's first step in [target − steps_after, target + steps_before]
    (the target came *after* its cause, or just before it: a grad explosion the step before the NaN)."""

    source: tuple[Matcher, ...]
    target: tuple[Matcher, ...]
    equal: tuple[str, ...] = ("project", "run")
    steps_before: int = 10
    steps_after: int = 200
    name: str = ""


# A non-finite loss (A1) causes the spike (C3), the grad explosion (A2), the overflow storm (A5), the
# loss-scale collapse (B3) and, on a multi-rank run, the divergent rank (F1) that follow it in the same
# run: only A1 says what to do. A straggler (F3) explains the rank divergence (F1) on its own rank: the
# slow rank's loss lags the others'. Both are alerts of several ranks led by the rank they name
# (one_alert_across_ranks), so "rank" is that rank on either side.
DEFAULT_INHIBITIONS: tuple[InhibitRule, ...] = (
    InhibitRule(name="nonfinite-loss", source=parse_matchers(['rule="A1"']),
                target=parse_matchers(['rule=~"C3|A2|A5|B3|F1"']), equal=("project", "run"),
                steps_before=10, steps_after=200),
    InhibitRule(name="straggler", source=parse_matchers(['rule="F3"']), target=parse_matchers(['rule="F1"']),
                equal=("project", "run", "rank"), steps_before=50, steps_after=50),
)


def find_inhibitor(session: Session, alert: Alert, *, project: str, run: str,
                   rules: Iterable[InhibitRule]) -> Optional[Alert]:
    """The earliest alert of the same run that inhibits ``alert`` under one of ``rules``, or None.

    Only alerts of the same run are candidates: what one training run does explains nothing in another."""
    labels = alert_labels(alert, project=project, run=run)
    rules = [r for r in rules if matches_all(r.target, labels)]
    if not rules:
        return None
    lo = alert.first_step - max(r.steps_after for r in rules)
    hi = alert.first_step + max(r.steps_before for r in rules)
    with session.no_autoflush:
        candidates = session.scalars(select(Alert).where(
            Alert.run_id == alert.run_id, Alert.id != alert.id, Alert.first_step >= lo, Alert.first_step <= hi)
            .order_by(Alert.first_step, Alert.id))
        for other in candidates:
            theirs = alert_labels(other, project=project, run=run)
            for r in rules:
                if not (alert.first_step - r.steps_after <= other.first_step <= alert.first_step + r.steps_before):
                    continue
                if matches_all(r.source, theirs) and not matches_all(r.target, theirs) \
                        and all(theirs.get(k) == labels.get(k) for k in r.equal):
                    return other
    return None
