"""Routes: which receivers an alert goes to, Alertmanager's way.

The routes are an ordered list under the root route: the first whose matchers all hold takes the
alert, and the search stops there unless that route says ``continue = true``. An alert no route takes
goes to the root route's receiver (without a routing file: every matching endpoint, today's behaviour).
"""
from __future__ import annotations

from typing import Mapping, Optional

from gradwatch.server.routing.config import Route, RoutingConfig
from gradwatch.server.routing.matchers import matches_all


def routes_for(cfg: RoutingConfig, labels: Mapping[str, str]) -> list[Route]:
    matched: list[Route] = []
    for route in cfg.routes:
        if matches_all(route.matchers, labels):
            matched.append(route)
            if not route.cont:
                break
    return matched or [cfg.root]


def route_named(cfg: RoutingConfig, name: str) -> Optional[Route]:
    """A group's route as configured now (None: the routing file no longer has it)."""
    if name == cfg.root.name:
        return cfg.root
    return next((r for r in cfg.routes if r.name == name), None)
