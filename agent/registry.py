"""Attached monitors by model, the current pid after fork, and closing them all at exit.

Leaf module: standard library only (``agent.attach`` and the exit handlers use it).
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional


class _Process:
    """The current pid, refreshed after fork, so hooks compare an attribute instead of calling getpid()."""
    pid = os.getpid()


process = _Process()
_registry: dict[int, Any] = {}
_registry_lock = threading.Lock()


def remember(model: Any, monitor: Any) -> None:
    with _registry_lock:
        _registry[id(model)] = monitor


def forget(monitor: Any) -> None:
    with _registry_lock:
        for key, m in list(_registry.items()):
            if m is monitor:
                del _registry[key]


def existing(model: Any) -> Optional[Any]:
    """The open monitor attached to ``model``, if any."""
    with _registry_lock:
        m = _registry.get(id(model))
    if m is not None and (m.closed or m.model is not model):
        return None
    return m


def close_all(status: str = "finished") -> None:
    with _registry_lock:
        monitors = list(_registry.values())
    for m in monitors:
        try:
            m.close(status=status)
        except Exception:  # noqa: BLE001
            pass


def _after_fork_in_child() -> None:
    # DataLoader workers and other forks inherit the hooks but must do nothing:
    # every hook checks the pid; here we only drop the parent's monitors.
    global _registry_lock
    process.pid = os.getpid()
    _registry_lock = threading.Lock()
    _registry.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
