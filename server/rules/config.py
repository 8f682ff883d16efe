"""Rule configuration: defaults ← rules file (``gradwatch serve --rules FILE``) ← API overrides.

The rules file is TOML::

    # every project
    [rules.A2]
    factor = 20

    # one project (rule ids or names both work)
    [projects.vision.rules.loss_plateau]
    window = 100
    severity = "info"

    [projects.vision.rules.C2]
    enabled = false

API overrides (``set_rule_override``) are stored per project in the
``rule_overrides`` table, so every replica sees them. A bad key or value
raises ``RuleConfigError`` naming the rule and the key.
"""
from __future__ import annotations

import os
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from server.models import Project, RuleOverride
from server.rules.catalogue import RULES, SEVERITIES, find_rule

# integer-valued settings (a float there is a mistake worth reporting)
_INT_KEYS = {"window", "history", "steps", "consecutive", "halvings", "min_history", "clear_steps", "cooldown_steps",
             "critical_consecutive", "warmup_steps", "min_samples", "max_names"}
# settings that may be 0
_MAY_BE_ZERO = {"cooldown_steps", "warmup_steps", "min_improvement", "min_rise", "converged_drop", "converged_fraction", "low", "min_history", "fraction"}


class RuleConfigError(ValueError):
    """A bad rule setting; ``rule`` and ``key`` say which."""

    def __init__(self, rule: str, key: Optional[str], message: str, source: str = ""):
        self.rule, self.key = rule, key
        where = f"{source}: " if source else ""
        what = f"rule {rule}" + (f", key {key!r}" if key else "")
        super().__init__(f"{where}{what}: {message}")


def validate_values(rule_key: str, values: dict[str, Any], *, source: str = "") -> tuple[str, dict[str, Any]]:
    """Check ``values`` for one rule; returns (rule id, cleaned values)."""
    try:
        spec = find_rule(str(rule_key))
    except ValueError as e:
        raise RuleConfigError(str(rule_key), None, str(e), source) from None
    if not isinstance(values, dict):
        raise RuleConfigError(spec.id, None, f"expected a table of settings, got {values!r}", source)
    defaults = spec.defaults()
    label = f"{spec.id} ({spec.name})"
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in defaults:
            raise RuleConfigError(label, key, f"not a setting of this rule; settings: {', '.join(sorted(defaults))}",
                                  source)
        if value is None:
            out[key] = None           # "remove this override"
            continue
        if key == "enabled":
            if not isinstance(value, bool):
                raise RuleConfigError(label, key, f"must be true or false, got {value!r}", source)
        elif key == "severity":
            if value not in SEVERITIES:
                raise RuleConfigError(label, key, f"must be one of {', '.join(SEVERITIES)}, got {value!r}", source)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RuleConfigError(label, key, f"must be a number, got {value!r}", source)
            if value != value or value in (float("inf"), float("-inf")):
                raise RuleConfigError(label, key, f"must be finite, got {value!r}", source)
            if key in _INT_KEYS:
                if float(value) != int(value):
                    raise RuleConfigError(label, key, f"must be a whole number, got {value!r}", source)
                value = int(value)
            else:
                value = float(value)
            if value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
                raise RuleConfigError(label, key, f"must be {'>= 0' if key in _MAY_BE_ZERO else '> 0'}, got {value!r}",
                                      source)
            if key == "fraction" and value > 1:
                raise RuleConfigError(label, key, f"is a fraction between 0 and 1, got {value!r}", source)
        out[key] = value
    return spec.id, out


@dataclass
class RulesFile:
    path: str
    every_project: dict[str, dict[str, Any]] = field(default_factory=dict)
    projects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)


def parse_rules_toml(text: str, *, source: str = "rules file") -> RulesFile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleConfigError("-", None, f"not valid TOML: {e}", source) from None
    unknown = set(doc) - {"rules", "projects"}
    if unknown:
        raise RuleConfigError("-", sorted(unknown)[0], "unknown top-level table; use [rules.<id>] or "
                              "[projects.<project>.rules.<id>]", source)
    rf = RulesFile(path=source)
    for rule_key, values in (doc.get("rules") or {}).items():
        rid, clean = validate_values(rule_key, values, source=source)
        rf.every_project.setdefault(rid, {}).update(clean)
    for project, table in (doc.get("projects") or {}).items():
        if not isinstance(table, dict) or set(table) - {"rules"}:
            raise RuleConfigError("-", project, "a project's table holds only [projects.<project>.rules.<id>]", source)
        for rule_key, values in (table.get("rules") or {}).items():
            rid, clean = validate_values(rule_key, values, source=f"{source} [projects.{project}]")
            rf.projects.setdefault(project, {}).setdefault(rid, {}).update(clean)
    return rf


_file_cache: dict[str, tuple[float, RulesFile]] = {}


def load_rules_file(path: Optional[str]) -> Optional[RulesFile]:
    """Parse (and cache by modification time) the rules file; None when no file is configured."""
    if not path:
        return None
    path = os.fspath(path)
    try:
        mtime = os.stat(path).st_mtime
    except OSError as e:
        raise RuleConfigError("-", None, f"cannot read rules file: {e}", path) from None
    cached = _file_cache.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    with open(path, encoding="utf-8") as f:
        rf = parse_rules_toml(f.read(), source=path)
    _file_cache[path] = (mtime, rf)
    return rf


def rules_file_of(settings: Any) -> Optional[RulesFile]:
    return load_rules_file(getattr(settings, "rules_file", None) if settings is not None else None)


def _project_row(session: Session, project: Any, *, create: bool) -> Optional[Project]:
    if isinstance(project, Project):
        return project
    row = session.scalar(select(Project).where(Project.name == str(project)))
    if row is None and create:
        row = Project(name=str(project), created_at=time.time())
        session.add(row)
        session.flush()
    return row


def effective_config(session: Session, *, project_id: Optional[int], project_name: Optional[str],
                     settings: Any = None) -> dict[str, dict[str, Any]]:
    """rule id → settings in force for that project (one small query)."""
    return _merged_config(project_name, settings, _override_rows(session, project_id))


def _override_rows(session: Session, project_id: Optional[int]) -> tuple:
    """The project's stored overrides as ((rule, config), ...) ordered by rule."""
    if project_id is None:
        return ()
    return tuple(session.execute(_OVERRIDES_OF_PROJECT, {"project_id": project_id}))


def _merged_config(project_name: Optional[str], settings: Any, overrides: tuple) -> dict[str, dict[str, Any]]:
    """Defaults, then the stall setting, the rules file and the override rows, merged.

    The merge is cached on everything it depends on (the override rows as read now, the rules
    file as loaded, the stall setting), so a changed override or rules file applies to the very
    next batch; the caller gets its own copy.
    """
    stall = getattr(settings, "stall_seconds", None) if settings is not None else None
    rf = rules_file_of(settings)
    key = (project_name, stall, id(rf), repr(overrides))
    cached = _config_cache.get(key)
    if cached is None or cached[0] is not rf:
        cfg = {spec.id: spec.defaults() for spec in RULES}
        if stall:
            cfg["F2"]["timeout_s"] = float(stall)      # GRADWATCH_STALL_SECONDS sets F2's default
        if rf is not None:
            for rid, values in rf.every_project.items():
                cfg[rid].update(values)
            for rid, values in rf.projects.get(project_name or "", {}).items():
                cfg[rid].update(values)
        for rule, config in overrides:
            if rule in cfg:
                cfg[rule].update({k: v for k, v in (config or {}).items() if k in cfg[rule]})
        if len(_config_cache) > 1000:
            _config_cache.clear()
        cached = _config_cache[key] = (rf, cfg)
    return {rid: dict(values) for rid, values in cached[1].items()}


_OVERRIDES_OF_PROJECT = (select(RuleOverride.rule, RuleOverride.config)
                         .where(RuleOverride.project_id == bindparam("project_id")).order_by(RuleOverride.rule))
# (project, stall, rules file, overrides) -> (rules file object, merged config); the file object is kept
# so its id() cannot be reused by another one while the entry lives
_config_cache: dict[tuple, tuple[Any, dict[str, dict[str, Any]]]] = {}


def get_rule_config(session: Session, *, project: Any, settings: Any = None) -> dict[str, dict[str, Any]]:
    """The catalogue with the settings in force for ``project`` (a name or a Project).

    Returns ``{rule_id: {"id", "name", "severity", "enabled", <thresholds>..., "overridden": [keys]}}``.
    """
    row = _project_row(session, project, create=False)
    name = row.name if row is not None else str(project)
    rows = _override_rows(session, row.id if row is not None else None)   # read once, for both uses
    cfg = _merged_config(name, settings, rows)
    overrides = {rule: dict(config or {}) for rule, config in rows}
    out = {}
    for spec in RULES:
        values = cfg[spec.id]
        out[spec.id] = {"id": spec.id, "name": spec.name, **values,
                        "overridden": sorted(overrides.get(spec.id, {}))}
    return out


def set_rule_override(session: Session, *, project: Any, rule: str, settings: Any = None,
                      **values: Any) -> dict[str, Any]:
    """Store per-project settings for one rule (``None`` removes a key's override).

    Example: ``set_rule_override(s, project="vision", rule="A2", factor=20.0, severity="warning")``.
    Raises ``RuleConfigError`` (a ``ValueError``) naming the rule and the key. Returns the
    rule's settings now in force.
    """
    rid, clean = validate_values(rule, values)
    row = _project_row(session, project, create=True)
    override = session.get(RuleOverride, (row.id, rid))
    current = dict(override.config or {}) if override is not None else {}
    for key, value in clean.items():
        if value is None:
            current.pop(key, None)
        else:
            current[key] = value
    if override is None:
        override = RuleOverride(project_id=row.id, rule=rid, config=current)
        session.add(override)
    else:
        override.config = current
    session.flush()
    return get_rule_config(session, project=row, settings=settings)[rid]
