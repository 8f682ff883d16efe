"""Per-collector switches: an exception in a collector is logged once, turns it off, and training goes on.

Imports :mod:`agent.registry` only (the pid after fork).
"""
from __future__ import annotations

from typing import Any

from gradwatch.agent.registry import process


class Guards:
    """The monitor's collector switches (STYLE point 1: never hurt the host process).

    ``with guards.guard("bn"): ...`` runs the block; an exception in it switches
    ``"bn"`` off for good and logs one warning. ``guards.on("bn")`` says whether a
    collector may run: not switched off, monitor not closed, and not in a forked child.
    """

    def __init__(self, warn: Any, pid: int):
        self.warn = warn
        self.pid = pid
        self.closed = False
        self.disabled: set[str] = set()
        self._guards: dict[str, _Guard] = {}

    def on(self, collector: str) -> bool:
        return collector not in self.disabled and not self.closed and process.pid == self.pid

    def guard(self, collector: str) -> "_Guard":
        """One reusable context manager per collector (hooks use it several times a step; a
        generator-based one would be created and torn down at each use)."""
        g = self._guards.get(collector)
        if g is None:
            g = self._guards[collector] = _Guard(self, collector)
        return g

    def failed(self, collector: str, e: BaseException) -> None:
        self.disabled.add(collector)
        self.warn.warning("guard:" + collector,
                          "gradwatch: the %s collector failed and is now off (training continues): %r",
                          collector, e)


class _Guard:
    """Guards.guard's context manager: an exception in the block turns the collector off."""

    __slots__ = ("guards", "collector")

    def __init__(self, guards: Guards, collector: str):
        self.guards, self.collector = guards, collector

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        self.guards.failed(self.collector, exc)
        return True
