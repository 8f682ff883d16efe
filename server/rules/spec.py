"""What a rule declares about itself: its thresholds (typed, bounded), its texts, its verdicts.

Leaf module (standard library only). A rule class (``server.rules.rule``) states its ``id``,
``name``, ``severity``, ``checklist``, ``fires_when``, ``diagnosis``, named ``actions`` and its
``params`` as ``Param`` declarations; ``RuleSpec`` is that declaration in one frozen object, which
the catalogue, the settings validation, the CLI, the docs and the settings page read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}
# Rule families (a rule declares its ``family``; its id starts with it): what one incident tends to set off
# together, grouped by the routing's ``family`` label (docs/webhooks.md).
FAMILIES = {
    "A": "non-finite values, overflow",          # checklist 8.A
    "B": "vanishing updates, stalled learning",  # 8.B
    "C": "oscillation, clipping, spikes",        # 8.C
    "D": "late divergence, drift",               # 8.D
    "E": "activations, weights",
    "F": "ranks and liveness",                   # several ranks of a run, a run or rank gone silent
    "G": "resume sanity",                        # 7.3
    "H": "early warning and setup advice",       # fires before the failure (docs/early-warning.md)
}
EARLY_WARNING = "H"   # the runs list's early-warning badge (queries.early_warnings)
CROSS_RANK = "F"      # an alert of this family names the rank that stands out (the run page's rank charts)


@dataclass(frozen=True)
class Param:
    """One setting of a rule: its default, its type and the values it accepts.

    ``zero_ok``: 0 is allowed (otherwise a number must be > 0). ``at_most``: an upper bound
    (a fraction: 1). ``setting``: a server setting (``Settings`` attribute) that, when set, replaces
    the default for every project (F2's ``timeout_s`` ← ``GRADWATCH_STALL_SECONDS``).
    """

    default: Any
    type: type = float
    zero_ok: bool = False
    at_most: Optional[float] = None
    setting: Optional[str] = None

    def check(self, value: Any) -> tuple[Any, Optional[str]]:
        """(the value as stored, None) or (None, what is wrong with it)."""
        if self.type is bool:
            return (value, None) if isinstance(value, bool) else (None, f"must be true or false, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None, f"must be a number, got {value!r}"
        if value != value or value in (float("inf"), float("-inf")):
            return None, f"must be finite, got {value!r}"
        if self.type is int:
            if float(value) != int(value):
                return None, f"must be a whole number, got {value!r}"
            value = int(value)
        else:
            value = float(value)
        if value < 0 or (value == 0 and not self.zero_ok):
            return None, f"must be {'>= 0' if self.zero_ok else '> 0'}, got {value!r}"
        if self.at_most is not None and value > self.at_most:
            if self.at_most == 1:
                return None, f"is a fraction between 0 and 1, got {value!r}"
            return None, f"must be <= {self.at_most:g}, got {value!r}"
        return value, None


def Int(default: int, **kw: Any) -> Param:
    return Param(int(default), int, **kw)


def Float(default: float, **kw: Any) -> Param:
    return Param(float(default), float, **kw)


# Settings every rule understands besides its own thresholds.
COMMON: Mapping[str, Param] = MappingProxyType({
    "enabled": Param(True, bool),
    # steps the condition must stay clear before a firing alert resolves
    "clear_steps": Int(20),
    # a new episode within this many steps of the last one reopens that alert
    # instead of creating (and notifying) a new one
    "cooldown_steps": Int(50, zero_ok=True),
})
COMMON_PARAMS: Mapping[str, Any] = MappingProxyType({k: p.default for k, p in COMMON.items()})


@dataclass(frozen=True)
class RuleSpec:
    """A rule's declaration, read by everything that lists or configures rules."""

    id: str
    name: str
    family: str                         # one of FAMILIES
    severity: str
    checklist: str
    fires_when: str                     # the condition, in words, with {placeholders} for thresholds
    diagnosis: str
    named_actions: Mapping[str, str]    # name -> text, in the order an alert lists them
    param_specs: Mapping[str, Param]    # the rule's own thresholds and any common key it changes
    kind: str = "batch"
    needs: tuple[str, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)   # the defaults of the rule's own settings
    # one incident seen on several ranks of a run is one alert listing the ranks (server/rules/alerts.py)
    one_alert_across_ranks: bool = False
    # a critical alert of this rule means the weights may be damaged: its evidence names the
    # checkpoint to roll back to and the batches to skip (server/forensics/rollback.py)
    rollback_advice: bool = False

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(self.named_actions.values())

    def action(self, *names: str) -> list[str]:
        """The texts of the named actions, in the order given."""
        return [self.named_actions[n] for n in names]

    def settings(self) -> dict[str, Param]:
        """Every setting this rule accepts: the common ones (with the rule's defaults), severity aside."""
        out = dict(COMMON)
        out.update(self.param_specs)
        return out

    def defaults(self) -> dict[str, Any]:
        out = dict(COMMON_PARAMS)
        out["severity"] = self.severity
        out.update({k: p.default for k, p in self.param_specs.items()})
        return out


@dataclass
class Hit:
    """The rule's condition holds at this step."""

    evidence: dict[str, Any]
    message: str
    severity: Optional[str] = None          # None: the rule's configured severity
    diagnosis: Optional[str] = None         # None: the catalogue's diagnosis
    actions: Optional[list[str]] = None     # None: the catalogue's actions
