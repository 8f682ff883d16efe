"""The rule catalogue's texts and families, and a project's rule overrides."""
from __future__ import annotations

from typing import Any

from gradwatch.dashboard.gateway.context import plain, scoped, server, session, writable


def rule_text(rule_id: str, values: dict) -> str:
    """What rule ``rule_id`` fires on with ``values`` (the static catalogue: text only, no database);
    its default text where the values cannot be described, "" for a rule the catalogue lacks."""
    from gradwatch.server.rules.catalogue import RULES_BY_ID, describe
    spec = RULES_BY_ID.get(rule_id)
    try:
        return describe(spec, values) if spec else ""
    except Exception:  # noqa: BLE001 - a description is a nicety; the thresholds are what matter
        return spec.fires_when if spec else ""


def setup_rule_ids() -> frozenset:
    """The configuration-advice rules (H5-H9: every rule of ``setup_advice.py``'s ``SetupRule`` family)."""
    from gradwatch.server.rules.catalog.setup_advice import SetupRule
    from gradwatch.server.rules.registry import rule_classes
    return frozenset(c.id for c in rule_classes() if issubclass(c, SetupRule))


def cross_rank_rule_ids() -> frozenset:
    """The rules whose alert names the rank that stands out (family ``spec.CROSS_RANK``: F1, F3, F5, …)."""
    from gradwatch.server.rules.registry import ids_of_family
    from gradwatch.server.rules.spec import CROSS_RANK
    return frozenset(ids_of_family(CROSS_RANK))


def get_rule_config(project: str) -> Any:
    from gradwatch.server.rules import config
    with session() as s:
        return plain(config.get_rule_config(s, project=scoped(project), settings=server.settings))


def set_rule_override(project: str, rule: str, values: dict) -> None:
    from gradwatch.server.rules import config
    with session(write=True) as s:
        config.set_rule_override(s, project=writable(project), rule=rule, **values)
