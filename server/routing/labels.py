"""The labels an alert is matched, grouped and inhibited by.

``family`` is the family its rule declares (A1's is ``A``; ``server.rules.spec.FAMILIES``): the catalogue's
families (non-finite, vanishing, …) are what one incident tends to set off together. An alert of a rule no
longer in the catalogue has an empty family.
"""
from __future__ import annotations

from typing import Any

from gradwatch.server.rules.registry import family_of

LABELS = ("project", "run", "rule", "name", "family", "severity", "rank")


def alert_labels(alert: Any, *, project: str, run: str) -> dict[str, str]:
    """Label name → value (all strings, as matchers compare strings); ``alert`` is the alert's id."""
    return {"project": project, "run": run, "rule": alert.rule, "name": alert.name, "family": family_of(alert.rule),
            "severity": alert.severity, "rank": str(alert.rank), "alert": str(alert.id)}
