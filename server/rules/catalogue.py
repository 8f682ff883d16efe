"""The rule catalogue: every registered rule's id, name, default thresholds and texts.

A view over the registry (``server.rules.registry``): the rules declare themselves in
``server/rules/catalog/``; this module lists them for the settings validation, the CLI, the
dashboard's settings page, the webhook filters and the docs. The diagnosis and action texts are
the troubleshooting checklist's (``shared/seed/stability-checklist.zh.txt`` section 8, with
6.2 / 7.1 / 9 where they say more), in English; every threshold can be overridden per project
(see ``server.rules.config``).
"""
from __future__ import annotations

from typing import Any

from gradwatch.server.rules.registry import specs
from gradwatch.server.rules.spec import COMMON_PARAMS, SEVERITIES, SEVERITY_RANK, RuleSpec

__all__ = ["COMMON_PARAMS", "RULES", "RULES_BY_ID", "RULES_BY_NAME", "SEVERITIES", "SEVERITY_RANK", "RuleSpec",
           "describe", "find_rule"]

RULES: tuple[RuleSpec, ...] = specs()
RULES_BY_ID: dict[str, RuleSpec] = {r.id: r for r in RULES}
RULES_BY_NAME: dict[str, RuleSpec] = {r.name: r for r in RULES}


def find_rule(key: str) -> RuleSpec:
    """A rule by id ("A2", case-insensitive) or name ("grad_explosion")."""
    spec = RULES_BY_ID.get(key.upper()) or RULES_BY_NAME.get(key.lower())
    if spec is None:
        known = ", ".join(f"{r.id} {r.name}" for r in RULES)
        raise ValueError(f"unknown rule {key!r}; known rules: {known}")
    return spec


def describe(spec: RuleSpec, cfg: dict[str, Any]) -> str:
    """The rule's condition with the thresholds in ``cfg`` filled in."""
    try:
        return spec.fires_when.format(**cfg)
    except (KeyError, ValueError, IndexError):
        return spec.fires_when
