"""Retention policy: how long a run keeps its raw rows before only its rollups remain.

Leaf module (standard library and ``server/operations/config_files.py`` only): the policy file, the environment,
and the record a compacted run carries, which the query layer reads (``server/queries/``).

The policy file (TOML, ``GRADWATCH_RETENTION=/etc/gradwatch/retention.toml``), like the rules file a
table for every project and one per project, re-read when it changes::

    [retention]                 # every project
    raw_days = 30               # raw steps whose step time is older than 30 days are compacted
    raw_steps = 200000          # ... and that are not among the run's last 200,000 steps
    layer_level = 4096          # finest per-layer rollup level kept once the raw rows are gone

    [projects.sweeps.retention]
    raw_days = 7
    rank_layer_steps = 20000    # sharded runs: the ranks' own per-layer rows, once combined

    [projects.paper.retention]
    raw_days = "forever"        # never compact this project's runs

Without a file, ``GRADWATCH_RETENTION_RAW_DAYS`` / ``GRADWATCH_RETENTION_RAW_STEPS`` /
``GRADWATCH_RETENTION_LAYER_LEVEL`` / ``GRADWATCH_RETENTION_RANK_LAYER_STEPS`` give the every-project
policy (a file's ``[retention]`` table wins over them). Nothing set: no retention, every row is kept.

When both ``raw_days`` and ``raw_steps`` are set, a step is compacted only when both let it go (the
policy keeps raw what either keeps). docs/deployment.md, "Retention".
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional

from gradwatch.server.operations.config_files import read_when_changed

from gradwatch.server.storage.compaction import LEVELS
_KEYS = ("raw_days", "raw_steps", "layer_level", "step_level", "rank_layer_steps")


class RetentionConfigError(ValueError):
    """A retention file or variable that cannot be used; the message says where and what to write."""


@dataclass(frozen=True)
class RetentionPolicy:
    """One project's retention. ``None`` in ``raw_days`` and ``raw_steps``: raw rows are kept forever.

    >>> RetentionPolicy(raw_steps=1000).active
    True
    >>> RetentionPolicy().active
    False
    """

    raw_days: Optional[float] = None
    raw_steps: Optional[int] = None
    # the finest rollup levels kept once raw rows are gone. A 150-layer full per-layer partial is 3.6 KB
    # whatever its span: level 16 costs ~37 % of the raw rows' bytes, level 256 ~9-12 % (the statistics
    # sampled every 100 steps make as many partials as grad norms), level 4096 < 1 %. The default keeps
    # 4096 only, so a retained run is ~5 % of its raw size (the target: <= 10 %; measured,
    # docs/performance.md): a heatmap of a compacted range has columns of 4,096 steps, what a
    # 1,000,000-step run's whole-run heatmap reads anyway. ``layer_level = 256``: finer old heatmaps at
    # ~17 %. Step rollups are small and keep every level (a chart of a compacted range: >= 16 steps a point).
    layer_level: int = 4096
    step_level: int = 16
    # sharded runs: the ranks' own per-layer rows (their *_local norms) of steps that have their
    # combined row are dropped beyond the run's last N steps (their rollups stay); None: with the rest
    rank_layer_steps: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.raw_days is not None or self.raw_steps is not None or self.rank_layer_steps is not None


@dataclass
class RetentionConfig:
    every_project: RetentionPolicy = field(default_factory=RetentionPolicy)
    projects: dict[str, dict[str, Any]] = field(default_factory=dict)   # overrides, validated
    source: str = "environment"

    def policy_for(self, project: str) -> RetentionPolicy:
        over = self.projects.get(project)
        return replace(self.every_project, **over) if over else self.every_project


def _check(key: str, value: Any, where: str) -> Any:
    """A validated value for ``key`` (``None`` for "forever" / "off")."""
    if isinstance(value, str) and value.strip().lower() in ("forever", "off", "none", ""):
        if key in ("layer_level", "step_level"):
            raise RetentionConfigError(f"{where}: {key} must be one of {', '.join(map(str, LEVELS))}")
        return None
    if key in ("layer_level", "step_level"):
        try:
            level = int(value)
        except (TypeError, ValueError, OverflowError):
            level = None
        if isinstance(value, float) and not value == level:      # 16.5 is not level 16
            level = None
        if level not in LEVELS or isinstance(value, bool):
            raise RetentionConfigError(f"{where}: {key} must be one of {', '.join(map(str, LEVELS))}, got {value!r}")
        return level
    if key == "raw_days":
        try:
            days = float(value)
        except (TypeError, ValueError):
            days = math.nan
        if isinstance(value, bool) or not math.isfinite(days) or days < 0:
            raise RetentionConfigError(f'{where}: raw_days must be a number of days >= 0 or "forever", got {value!r}')
        return days
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if isinstance(value, bool) or n < 0 or (isinstance(value, float) and not value.is_integer()):
        raise RetentionConfigError(f'{where}: {key} must be a whole number of steps >= 0 or "forever", got {value!r}')
    return n


def _table(values: Any, where: str) -> dict[str, Any]:
    if not isinstance(values, dict):
        raise RetentionConfigError(f"{where}: expected a table of settings, got {values!r}")
    unknown = sorted(set(values) - set(_KEYS))
    if unknown:
        raise RetentionConfigError(f"{where}: unknown setting {unknown[0]!r}; settings: {', '.join(_KEYS)}")
    return {k: _check(k, v, f"{where} {k}") for k, v in values.items()}


def parse_retention_toml(text: str, *, source: str = "retention file",
                         base: Optional[RetentionPolicy] = None) -> RetentionConfig:
    """The file's policies over ``base`` (the environment's).

    >>> c = parse_retention_toml('[retention]\\nraw_steps = 10\\n[projects.p.retention]\\nraw_days = 1')
    >>> c.policy_for("p").raw_days, c.policy_for("p").raw_steps, c.policy_for("q").raw_days
    (1.0, 10, None)
    """
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RetentionConfigError(f"{source}: not valid TOML: {e}") from None
    unknown = sorted(set(doc) - {"retention", "projects"})
    if unknown:
        raise RetentionConfigError(f"{source}: unknown top-level table {unknown[0]!r}; use [retention] or "
                                   f"[projects.<project>.retention]")
    every = replace(base or RetentionPolicy(), **_table(doc.get("retention", {}), f"{source} [retention]"))
    projects = {}
    for project, table in (doc.get("projects") or {}).items():
        bad = next((c for c in project if ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"), None)
        if bad is not None or not project or len(project) > 200:
            raise RetentionConfigError(f"{source} [projects.{project!r}]: a project name is 1 to 200 characters "
                                       f"without control characters (ingest refuses them), got {project!r}")
        if not isinstance(table, dict) or set(table) - {"retention"}:
            raise RetentionConfigError(f"{source} [projects.{project}]: holds only [projects.{project}.retention]")
        projects[project] = _table(table.get("retention", {}), f"{source} [projects.{project}.retention]")
    return RetentionConfig(every_project=every, projects=projects, source=source)


def policy_from_env(env: Mapping[str, str]) -> RetentionPolicy:
    """The every-project policy the ``GRADWATCH_RETENTION_*`` variables give."""
    values = {}
    for key in _KEYS:
        raw = env.get(f"GRADWATCH_RETENTION_{key.upper()}")
        if raw is not None and raw.strip():
            values[key] = _check(key, raw.strip(), f"GRADWATCH_RETENTION_{key.upper()}")
    return RetentionPolicy(**values)


_file_cache: dict[str, tuple[float, str]] = {}


def load_retention(env: Mapping[str, str]) -> RetentionConfig:
    """The retention in force: the file ``GRADWATCH_RETENTION`` names (re-read when it changes) over the
    ``GRADWATCH_RETENTION_*`` variables (a key the file's ``[retention]`` sets wins)."""
    base = policy_from_env(env)
    path = env.get("GRADWATCH_RETENTION")
    if not path:
        return RetentionConfig(every_project=base)
    text = read_when_changed(path, _file_cache, lambda text, where: text,
                             lambda e: RetentionConfigError(f"cannot read retention file {path}: {e}"))
    return parse_retention_toml(text, source=os.fspath(path), base=base)


@dataclass(frozen=True)
class JobSettings:
    """How the background job paces itself (``GRADWATCH_RETENTION_INTERVAL`` seconds between passes,
    ``GRADWATCH_RETENTION_BATCH_ROWS`` rows per delete transaction, ``GRADWATCH_RETENTION_PAUSE`` seconds
    between two of them)."""

    interval_s: float = 600.0
    batch_rows: int = 2000
    pause_s: float = 0.05

    # name: (default, lowest, highest, whole number): 0, a negative number or nan as the interval made the
    # thread spin (851 passes in 16 s); each is refused at start, naming the setting, value and range
    RANGES = {"GRADWATCH_RETENTION_INTERVAL": (600.0, 0.1, 7 * 86400.0, False),
              "GRADWATCH_RETENTION_BATCH_ROWS": (2000, 1, 1_000_000, True),
              "GRADWATCH_RETENTION_PAUSE": (0.05, 0.0, 60.0, False)}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "JobSettings":
        """
        >>> JobSettings.from_env({"GRADWATCH_RETENTION_INTERVAL": "0"})
        Traceback (most recent call last):
        ...
        gradwatch.server.lifecycle.retention_config.RetentionConfigError: GRADWATCH_RETENTION_INTERVAL='0': expected a number from 0.1 to 604800
        """
        values = []
        for name, (default, lo, hi, whole) in cls.RANGES.items():
            text = str(env.get(name, "")).strip()
            if not text:
                values.append(default)
                continue
            try:
                value = int(text) if whole else float(text)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and lo <= value <= hi):
                raise RetentionConfigError(f"{name}={text!r}: expected {'a whole number' if whole else 'a number'} "
                                           f"from {lo:g} to {hi:.0f}")
            values.append(value)
        return cls(*values)
