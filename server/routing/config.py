"""The routing file (``GRADWATCH_ROUTING=routing.toml``): receivers, routes, group timers, inhibitions.

Without a file the routing is today's: every alert its own group, notified at once to every
webhook endpoint that matches it (the project's and the server-wide ones, by minimum severity),
with the built-in inhibitions (``inhibit.DEFAULT_INHIBITIONS``) on. A file looks like this::

    receiver = "everyone"                         # the root route's receiver (default: "default")
    group_by = ["project", "run", "family"]       # labels of one incident; "alert": one group per alert
    group_wait = 30                               # seconds before a new group's first notification
    group_interval = 300                          # at most this often for a group that changed
    repeat_interval = 14400                       # an unchanged firing group again after this (0: never)
    rank_wait = 5                                 # multi-rank runs: the first notification waits for every
                                                  # rank's batch of the incident's step, at most this long
    default_inhibitions = true

    [[receivers]]
    name = "everyone"
    webhooks = "all"                              # every matching endpoint, as without a file

    [[receivers]]
    name = "oncall"
    webhooks = ["https://hooks.slack.com/services/T000/B000/XXX"]   # those endpoints only (by URL)
    email = ["oncall@example.org"]

    [[receivers]]
    name = "mail-only"
    email = ["ml-team@example.org"]               # no webhooks key: email only (webhooks = [] says so too)

    [[routes]]                                    # first match wins unless continue = true
    matchers = ['severity="critical"']
    receiver = "oncall"
    continue = true
    group_wait = 5                                # a route may override group_by and the four timers

    [[inhibit]]
    source = ['rule="F3"']
    target = ['rule="F1"']
    equal = ["project", "run", "rank"]
    steps_before = 50
    steps_after = 50

A receiver named ``default`` (every endpoint) always exists unless the file defines its own.
A bad key or value raises ``RoutingConfigError`` naming where it is.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from gradwatch.server.operations.config_files import read_when_changed
from gradwatch.server.routing.inhibit import DEFAULT_INHIBITIONS, InhibitRule
from gradwatch.server.routing.labels import LABELS
from gradwatch.server.routing.matchers import Matcher, parse_matchers

GROUP_LABELS = (*LABELS, "alert")


class RoutingConfigError(ValueError):
    """A bad routing file; the message says where and what to write instead."""


@dataclass(frozen=True)
class Timing:
    group_wait: float = 0.0
    group_interval: float = 0.0
    repeat_interval: float = 0.0
    # a multi-rank run's group: its first notification also waits until every rank has sent the step of
    # the group's latest alert (the rank that went first may report late), at most this long after the
    # group was created (a dead rank must not hold the NaN back); 0: no rank wait (the default without a
    # routing file, where every alert is sent at once)
    rank_wait: float = 0.0


@dataclass(frozen=True)
class Receiver:
    name: str
    webhooks: Union[str, tuple[str, ...]] = "all"     # "all" or endpoint URLs
    email: tuple[str, ...] = ()


@dataclass(frozen=True)
class Route:
    name: str
    receiver: str
    matchers: tuple[Matcher, ...] = ()
    cont: bool = False
    group_by: tuple[str, ...] = ("alert",)
    timing: Timing = Timing()


@dataclass(frozen=True)
class RoutingConfig:
    root: Route
    routes: tuple[Route, ...] = ()
    receivers: dict[str, Receiver] = field(default_factory=dict)
    inhibit: tuple[InhibitRule, ...] = ()
    source: str = "(built-in)"


def default_config() -> RoutingConfig:
    return RoutingConfig(root=Route(name="root", receiver="default"),
                         receivers={"default": Receiver("default")}, inhibit=DEFAULT_INHIBITIONS)


# --------------------------------------------------------------------------- parsing

MAX_TIMER_S = 30 * 86400.0       # a timer longer than a month is a typo (1e308 made a group wait for ever)
# one address, no display name: anything that could end a header line or add a recipient is refused
_EMAIL = re.compile(r"[^\s@<>,;:\"()\[\]\\]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9.-]{0,253}[A-Za-z0-9])?")


def _seconds(where: str, key: str, value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 <= value <= MAX_TIMER_S):
        raise RoutingConfigError(f"{where}: {key} must be a number of seconds from 0 to {MAX_TIMER_S:.0f} "
                                 f"(30 days), got {value!r}")
    return float(value)


def _strings(where: str, key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RoutingConfigError(f"{where}: {key} must be a list of strings, got {value!r}")
    return tuple(value)


def _matchers(where: str, key: str, value: Any) -> tuple[Matcher, ...]:
    try:
        return parse_matchers(_strings(where, key, value))
    except ValueError as e:
        raise RoutingConfigError(f"{where}: {key}: {e}") from None


def _group_by(where: str, value: Any) -> tuple[str, ...]:
    labels = _strings(where, "group_by", value)
    bad = [v for v in labels if v not in GROUP_LABELS]
    if bad or not labels:
        raise RoutingConfigError(f"{where}: group_by: {bad or 'empty'}: labels are {', '.join(GROUP_LABELS)}")
    return labels


def _keys(where: str, table: Any, allowed: set[str]) -> dict:
    if not isinstance(table, dict):
        raise RoutingConfigError(f"{where}: expected a table, got {table!r}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise RoutingConfigError(f"{where}: unknown key {unknown[0]!r}; keys: {', '.join(sorted(allowed))}")
    return table


_TIMERS = ("group_wait", "group_interval", "repeat_interval", "rank_wait")


def _timing(where: str, table: dict, base: Timing) -> Timing:
    values = {k: _seconds(where, k, table[k]) for k in _TIMERS if k in table}
    return Timing(**{**vars(base), **values})


def parse_routing_toml(text: str, *, source: str = "routing file") -> RoutingConfig:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RoutingConfigError(f"{source}: not valid TOML: {e}") from None
    _keys(source, doc, {"receiver", "group_by", *_TIMERS, "default_inhibitions", "receivers", "routes", "inhibit"})
    receivers = {"default": Receiver("default")}
    for i, table in enumerate(doc.get("receivers") or []):
        where = f"{source} [[receivers]] #{i + 1}"
        _keys(where, table, {"name", "webhooks", "email"})
        name = table.get("name")
        if not isinstance(name, str) or not name or len(name) > 100:
            raise RoutingConfigError(f"{where}: name: expected 1 to 100 characters")
        email = _strings(where, "email", table.get("email", []))
        bad = [a for a in email if not _EMAIL.fullmatch(a)]
        if bad:
            raise RoutingConfigError(f"{where}: email: expected addresses like oncall@example.org (no spaces, "
                                     f"line breaks, names or commas), got {bad[0]!r}")
        # without a webhooks key: every endpoint, unless the receiver has email (an email receiver posts
        # to webhooks only when it says which, or "all": docs/webhooks.md, "Receivers")
        hooks = table.get("webhooks", [] if email else "all")
        hooks = hooks if hooks == "all" else _strings(where, "webhooks", hooks)
        receivers[name] = Receiver(name, hooks, email)

    def receiver_of(where: str, value: Any) -> str:
        if value not in receivers:
            raise RoutingConfigError(f"{where}: receiver {value!r} is not defined; receivers: "
                                     f"{', '.join(receivers)}")
        return value

    root_timing = Timing(group_wait=30.0, group_interval=300.0, repeat_interval=14400.0, rank_wait=5.0)
    root_timing = _timing(source, doc, root_timing)
    root = Route(name="root", receiver=receiver_of(source, doc.get("receiver", "default")),
                 group_by=_group_by(source, doc.get("group_by", ["project", "run", "family"])), timing=root_timing)
    routes = []
    for i, table in enumerate(doc.get("routes") or []):
        where = f"{source} [[routes]] #{i + 1}"
        _keys(where, table, {"name", "matchers", "receiver", "continue", "group_by", *_TIMERS})
        if "receiver" not in table:
            raise RoutingConfigError(f"{where}: receiver: required")
        cont = table.get("continue", False)
        if not isinstance(cont, bool):
            raise RoutingConfigError(f"{where}: continue: expected true or false, got {cont!r}")
        routes.append(Route(name=str(table.get("name") or f"routes[{i}]"),
                            receiver=receiver_of(where, table["receiver"]),
                            matchers=_matchers(where, "matchers", table.get("matchers", [])), cont=cont,
                            group_by=_group_by(where, table["group_by"]) if "group_by" in table else root.group_by,
                            timing=_timing(where, table, root.timing)))
    defaults = doc.get("default_inhibitions", True)
    if not isinstance(defaults, bool):
        raise RoutingConfigError(f"{source}: default_inhibitions: expected true or false, got {defaults!r}")
    inhibit = list(DEFAULT_INHIBITIONS if defaults else ())
    for i, table in enumerate(doc.get("inhibit") or []):
        where = f"{source} [[inhibit]] #{i + 1}"
        _keys(where, table, {"name", "source", "target", "equal", "steps_before", "steps_after"})
        if "source" not in table or "target" not in table:
            raise RoutingConfigError(f"{where}: source and target (lists of matchers) are required")
        equal = _strings(where, "equal", table.get("equal", ["project", "run"]))
        if set(equal) - set(LABELS):
            raise RoutingConfigError(f"{where}: equal: labels are {', '.join(LABELS)}, got {list(equal)}")
        steps = {}
        for k, default in (("steps_before", 10), ("steps_after", 200)):
            v = table.get(k, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise RoutingConfigError(f"{where}: {k}: expected a whole number of steps ≥ 0, got {v!r}")
            steps[k] = v
        inhibit.append(InhibitRule(source=_matchers(where, "source", table["source"]),
                                   target=_matchers(where, "target", table["target"]), equal=equal,
                                   name=str(table.get("name") or f"inhibit[{i}]"), **steps))
    return RoutingConfig(root=root, routes=tuple(routes), receivers=receivers, inhibit=tuple(inhibit), source=source)


_cache: dict[str, tuple[float, RoutingConfig]] = {}
_DEFAULT: list[RoutingConfig] = []


def load_routing(path: Optional[str]) -> RoutingConfig:
    """The routing in force: the file (re-read when it changes), or the default without one."""
    if not path:
        if not _DEFAULT:
            _DEFAULT.append(default_config())
        return _DEFAULT[0]
    return read_when_changed(path, _cache, lambda text, where: parse_routing_toml(text, source=where),
                             lambda e: RoutingConfigError(f"{os.fspath(path)}: cannot read the routing file: {e}"))


def routing_of(settings: Any) -> RoutingConfig:
    return load_routing(getattr(settings, "routing_file", None) if settings is not None else None)
