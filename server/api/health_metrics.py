"""Per-run health in Prometheus text format, appended to ``GET /metrics``.

For teams that alert through Alertmanager rather than gradwatch's webhooks.
Every series carries ``project`` and ``run`` labels::

    gradwatch_run_open_alerts{project,run,rule,name,severity}  firing alerts (one series per rule and severity)
    gradwatch_run_health{project,run}                          0 ok, 1 warning, 2 critical (worst firing alert)
    gradwatch_run_last_step{project,run}                       last optimizer step received
    gradwatch_run_last_loss{project,run}                       loss at that step (NaN when it was NaN)
    gradwatch_run_last_seen_timestamp_seconds{project,run}     when data last arrived
    gradwatch_run_status{project,run,status}                   1 for the run's status (running|stalled|finished|crashed)

Which runs: every run still running (or stalled) plus every run seen within
``recent_seconds`` (default one day), newest first, at most ``max_runs`` —
the number of series stays bounded however many runs the database holds.

The numbers come from the shared database through ``server.queries``, so
every replica answers the same; in Prometheus aggregate replicas with
``max by (project, run, …)``. Example Alertmanager rule::

    - alert: GradwatchCriticalRun
      expr: max by (project, run) (gradwatch_run_health) == 2
      for: 1m

Leaf-ish module: imports ``server.queries`` (and the settings' stall default) only.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Optional

from sqlalchemy.orm import Session

from gradwatch.server import queries
from gradwatch.server.operations.settings import DEFAULT_STALL_SECONDS

HEALTH_VALUE = {"ok": 0, "warning": 1, "critical": 2}
STATUSES = ("running", "stalled", "finished", "crashed")


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}"


def _number(v: Optional[float]) -> str:
    if v is None:
        return "NaN"
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def render_run_health(session: Session, *, stall_seconds: float = DEFAULT_STALL_SECONDS,
                      recent_seconds: float = 86_400.0, max_runs: int = 500,
                      now: Optional[float] = None, project: Optional[str] = None) -> str:
    """The per-run health families in Prometheus text exposition format (ends with a newline); only
    ``project``'s runs when given."""
    now = time.time() if now is None else now
    runs = [r for r in queries.list_runs(session, project=project, stall_seconds=stall_seconds, now=now)
            if r.status in ("running", "stalled") or now - r.last_seen <= recent_seconds][:max_runs]
    by_id = {r.id: r for r in runs}
    open_counts: dict[tuple[int, str, str, str], int] = defaultdict(int)
    if by_id:
        for a in queries.list_alerts(session, status="firing", limit=100_000):
            if a.run_id in by_id:
                open_counts[(a.run_id, a.rule, a.name, a.severity)] += 1

    out: list[str] = []

    def family(name: str, help_text: str) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")

    family("gradwatch_run_open_alerts", "Firing gradwatch alerts of a run, by rule and severity.")
    for (run_id, rule, name, severity), n in sorted(open_counts.items()):
        r = by_id[run_id]
        out.append(f"gradwatch_run_open_alerts{_labels(project=r.project, run=r.name, rule=rule, name=name, severity=severity)} {n}")
    family("gradwatch_run_health", "Worst firing alert of a run: 0 ok, 1 warning, 2 critical.")
    for r in runs:
        out.append(f"gradwatch_run_health{_labels(project=r.project, run=r.name)} {HEALTH_VALUE.get(r.health, 0)}")
    family("gradwatch_run_last_step", "Last optimizer step received for a run.")
    for r in runs:
        if r.last_step is not None:
            out.append(f"gradwatch_run_last_step{_labels(project=r.project, run=r.name)} {r.last_step}")
    family("gradwatch_run_last_loss", "Loss at a run's last step (NaN when the loss was NaN).")
    for r in runs:
        if r.last_loss is not None:  # None: no loss measured; NaN: the loss was NaN
            out.append(f"gradwatch_run_last_loss{_labels(project=r.project, run=r.name)} {_number(r.last_loss)}")
    family("gradwatch_run_last_seen_timestamp_seconds", "When data for a run last arrived (Unix time).")
    for r in runs:
        out.append(f"gradwatch_run_last_seen_timestamp_seconds{_labels(project=r.project, run=r.name)} {_number(r.last_seen)}")
    family("gradwatch_run_status", "1 for a run's current status (running, stalled, finished, crashed).")
    for r in runs:
        for status in STATUSES:
            out.append(f"gradwatch_run_status{_labels(project=r.project, run=r.name, status=status)} "
                       f"{1 if r.status == status else 0}")
    return "\n".join(out) + "\n"
