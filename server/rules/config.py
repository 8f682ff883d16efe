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

    # notification timing (server/routing/): any rule may take pending_steps / pending_seconds (it must keep
    # firing that long before it is notified; resolved earlier: never notified)
    [rules.C3]
    pending_steps = 20

    # a warm-up mute window: no notifications for alerts that start in a run's first N steps / seconds
    [warmup]
    steps = 200

    [projects.vision.warmup]
    steps = 500
    seconds = 120

API overrides (``set_rule_override``) are stored per project in the
``rule_overrides`` table, so every replica sees them. A bad key or value
raises ``RuleConfigError`` naming the rule and the key.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from gradwatch.server.storage.models import Project, RuleOverride
from gradwatch.server.operations.config_files import read_when_changed
from gradwatch.server.storage.projects import project_row
from gradwatch.server.rules.catalogue import RULES, SEVERITIES, find_rule
from gradwatch.server.rules.spec import RuleSpec


class RuleConfigError(ValueError):
    """A bad rule setting; ``rule`` and ``key`` say which."""

    def __init__(self, rule: str, key: Optional[str], message: str, source: str = ""):
        self.rule, self.key = rule, key
        where = f"{source}: " if source else ""
        what = f"rule {rule}" + (f", key {key!r}" if key else "")
        super().__init__(f"{where}{what}: {message}")


# Settings every rule takes, read by the notification routing rather than by the rule itself.
PENDING_KEYS = {"pending_steps": int, "pending_seconds": float}
# The warm-up mute window: a project's, not a rule's; stored as the pseudo-rule "warmup" in rule_overrides.
WARMUP = "warmup"
WARMUP_KEYS = {"steps": int, "seconds": float}


def _non_negative(kind: type, value: Any) -> tuple[Any, Optional[str]]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
            or (kind is int and value != int(value)):
        what = "a whole number ≥ 0" if kind is int else "a number of seconds ≥ 0"
        return value, f"must be {what}, got {value!r}"
    return kind(value), None


def validate_warmup(values: Any, *, source: str = "") -> dict[str, Any]:
    """Check a warm-up table (``steps``, ``seconds``); returns the cleaned values (None: remove)."""
    if not isinstance(values, dict):
        raise RuleConfigError(WARMUP, None, f"expected a table with steps and/or seconds, got {values!r}", source)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in WARMUP_KEYS:
            raise RuleConfigError(WARMUP, key, "not a warm-up setting; settings: seconds, steps", source)
        if value is None:
            out[key] = None
            continue
        value, problem = _non_negative(WARMUP_KEYS[key], value)
        if problem:
            raise RuleConfigError(WARMUP, key, problem, source)
        out[key] = value
    return out


def validate_values(rule_key: str, values: dict[str, Any], *, source: str = "") -> tuple[str, dict[str, Any]]:
    """Check ``values`` for one rule against its declared settings; returns (rule id, cleaned values)."""
    if rule_key == WARMUP:
        return WARMUP, validate_warmup(values, source=source)
    try:
        spec = find_rule(str(rule_key))
    except ValueError as e:
        raise RuleConfigError(str(rule_key), None, str(e), source) from None
    if not isinstance(values, dict):
        raise RuleConfigError(spec.id, None, f"expected a table of settings, got {values!r}", source)
    declared = spec.settings()
    label = f"{spec.id} ({spec.name})"
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in declared and key != "severity" and key not in PENDING_KEYS:
            raise RuleConfigError(label, key, f"not a setting of this rule; settings: "
                                  f"{', '.join(sorted([*declared, 'severity', *PENDING_KEYS]))}", source)
        if value is None:
            out[key] = None           # "remove this override"
            continue
        if key in PENDING_KEYS:
            value, problem = _non_negative(PENDING_KEYS[key], value)
            if problem:
                raise RuleConfigError(label, key, problem, source)
        elif key == "severity":
            if value not in SEVERITIES:
                raise RuleConfigError(label, key, f"must be one of {', '.join(SEVERITIES)}, got {value!r}", source)
        else:
            value, problem = declared[key].check(value)
            if problem:
                raise RuleConfigError(label, key, problem, source)
        out[key] = value
    return spec.id, out


@dataclass
class RulesFile:
    path: str
    every_project: dict[str, dict[str, Any]] = field(default_factory=dict)
    projects: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    warmup: dict[str, Any] = field(default_factory=dict)                 # [warmup]
    project_warmup: dict[str, dict[str, Any]] = field(default_factory=dict)   # [projects.<p>.warmup]


def parse_rules_toml(text: str, *, source: str = "rules file") -> RulesFile:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RuleConfigError("-", None, f"not valid TOML: {e}", source) from None
    unknown = set(doc) - {"rules", "projects", WARMUP}
    if unknown:
        raise RuleConfigError("-", sorted(unknown)[0], "unknown top-level table; use [rules.<id>], [warmup] or "
                              "[projects.<project>.rules.<id>]", source)
    rf = RulesFile(path=source)
    rf.warmup = validate_warmup(doc.get(WARMUP, {}), source=source)
    for rule_key, values in (doc.get("rules") or {}).items():
        rid, clean = validate_values(rule_key, values, source=source)
        rf.every_project.setdefault(rid, {}).update(clean)
    for project, table in (doc.get("projects") or {}).items():
        if not isinstance(table, dict) or set(table) - {"rules", WARMUP}:
            raise RuleConfigError("-", project, "a project's table holds only [projects.<project>.rules.<id>] "
                                  "and [projects.<project>.warmup]", source)
        if WARMUP in table:
            rf.project_warmup[project] = validate_warmup(table[WARMUP], source=f"{source} [projects.{project}]")
        for rule_key, values in (table.get("rules") or {}).items():
            rid, clean = validate_values(rule_key, values, source=f"{source} [projects.{project}]")
            rf.projects.setdefault(project, {}).setdefault(rid, {}).update(clean)
    return rf


_file_cache: dict[str, tuple[float, RulesFile]] = {}


def load_rules_file(path: Optional[str]) -> Optional[RulesFile]:
    """Parse (and cache by modification time) the rules file; None when no file is configured."""
    if not path:
        return None
    return read_when_changed(path, _file_cache, lambda text, where: parse_rules_toml(text, source=where),
                             lambda e: RuleConfigError("-", None, f"cannot read rules file: {e}", os.fspath(path)))


def rules_file_of(settings: Any) -> Optional[RulesFile]:
    return load_rules_file(getattr(settings, "rules_file", None) if settings is not None else None)


def _project_row(session: Session, project: Any, *, create: bool) -> Optional[Project]:
    if isinstance(project, Project):
        return project
    return project_row(session, str(project), create=create)


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
    """Defaults, then the server settings a rule's parameters name, the rules file and the override rows, merged.

    The merge is cached on everything it depends on (the override rows as read now, the rules
    file as loaded, those server settings), so a changed override or rules file applies to the very
    next batch; the caller gets its own copy.
    """
    from_settings = _settings_defaults(settings)
    rf = rules_file_of(settings)
    key = (project_name, repr(from_settings), id(rf), repr(overrides))
    cached = _config_cache.get(key)
    if cached is None or cached[0] is not rf:
        cfg = {spec.id: spec.defaults() for spec in RULES}
        for rid, values in from_settings.items():
            cfg[rid].update(values)
        if rf is not None:
            for rid, values in rf.every_project.items():
                cfg[rid].update(values)
            for rid, values in rf.projects.get(project_name or "", {}).items():
                cfg[rid].update(values)
        for rule, config in overrides:
            if rule in cfg:
                cfg[rule].update({k: v for k, v in (config or {}).items() if k in cfg[rule] or k in PENDING_KEYS})
        if len(_config_cache) > 1000:
            _config_cache.clear()
        cached = _config_cache[key] = (rf, cfg)
    return {rid: dict(values) for rid, values in cached[1].items()}


def _settings_defaults(settings: Any) -> dict[str, dict[str, Any]]:
    """rule id -> {key: value} for the parameters whose declared server setting is set
    (``Param(setting="stall_seconds")``: GRADWATCH_STALL_SECONDS sets F2's timeout)."""
    out: dict[str, dict[str, Any]] = {}
    if settings is None:
        return out
    for spec in RULES:
        for key, param in spec.param_specs.items():
            value = getattr(settings, param.setting, None) if param.setting else None
            if value:
                out.setdefault(spec.id, {})[key] = param.type(value)
    return out


def smallest_setting(spec: RuleSpec, key: str, settings: Any, session: Optional[Session] = None) -> float:
    """The smallest value of one rule's setting that any project may have: the default (or the server
    setting that replaces it), every table of the rules file, and (given a session) every stored API
    override. The timer scan bounds its query by it, and the webhook worker times its scan by it."""
    values = [float(_settings_defaults(settings).get(spec.id, {}).get(key, spec.param_specs[key].default))]
    try:
        rf = rules_file_of(settings)
    except RuleConfigError:      # reported where the rules file is loaded for real
        rf = None
    if rf is not None:
        for table in [rf.every_project, *rf.projects.values()]:
            if table.get(spec.id, {}).get(key):
                values.append(float(table[spec.id][key]))
    if session is not None:
        for config in session.scalars(select(RuleOverride.config).where(RuleOverride.rule == spec.id)):
            if (config or {}).get(key):
                values.append(float(config[key]))
    return min(values)


_OVERRIDES_OF_PROJECT = (select(RuleOverride.rule, RuleOverride.config)
                         .where(RuleOverride.project_id == bindparam("project_id")).order_by(RuleOverride.rule))
# (project, settings-backed defaults, rules file, overrides) -> (rules file object, merged config); the file object is kept
# so its id() cannot be reused by another one while the entry lives
_config_cache: dict[tuple, tuple[Any, dict[str, dict[str, Any]]]] = {}


def warmup_config(session: Session, *, project_id: Optional[int], project_name: Optional[str],
                  settings: Any = None) -> dict[str, Any]:
    """The warm-up mute window in force for a project: ``{"steps": int, "seconds": float}`` (0: none);
    the rules file's [warmup], then its [projects.<p>.warmup], then the API override."""
    out: dict[str, Any] = {"steps": 0, "seconds": 0.0}
    rf = rules_file_of(settings)
    if rf is not None:
        out.update(rf.warmup)
        out.update(rf.project_warmup.get(project_name or "", {}))
    if project_id is not None:
        row = session.get(RuleOverride, (project_id, WARMUP))
        if row is not None:
            out.update({k: v for k, v in (row.config or {}).items() if k in WARMUP_KEYS})
    return out


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
    if rid == WARMUP and not clean:
        raise RuleConfigError(WARMUP, None, "give steps and/or seconds")
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
    if rid == WARMUP:
        return {"id": WARMUP, **warmup_config(session, project_id=row.id, project_name=row.name, settings=settings),
                "overridden": sorted(current)}
    return get_rule_config(session, project=row, settings=settings)[rid]
