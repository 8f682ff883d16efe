"""The labels an alert is matched, grouped and inhibited by. Leaf module.

``family`` is the rule id's letter (A1 → ``A``): the catalogue's families (non-finite, vanishing, …)
are what one incident tends to set off together.
"""
from __future__ import annotations

from typing import Any

LABELS = ("project", "run", "rule", "name", "family", "severity", "rank")


def alert_labels(alert: Any, *, project: str, run: str) -> dict[str, str]:
    """Label name → value (all strings, as matchers compare strings); ``alert`` is the alert's id."""
    return {"project": project, "run": run, "rule": alert.rule, "name": alert.name, "family": alert.rule[:1],
            "severity": alert.severity, "rank": str(alert.rank), "alert": str(alert.id)}
