"""A configuration file read once and again only when it changes (its modification time): the rules
file and the routing file are consulted on every batch that raises an alert, and an operator edits
them while the server runs."""
from __future__ import annotations

import os
from typing import Callable, TypeVar

T = TypeVar("T")


def read_when_changed(path: str, cache: dict[str, tuple[float, T]], parse: Callable[[str, str], T],
                      unreadable: Callable[[OSError], Exception]) -> T:
    """``parse(text, path)`` of the file at ``path``, cached in ``cache`` until its mtime changes;
    ``unreadable(error)`` is raised when it cannot be read."""
    path = os.fspath(path)
    try:
        mtime = os.stat(path).st_mtime
    except OSError as e:
        raise unreadable(e) from None
    cached = cache.get(path)
    if cached and cached[0] == mtime:
        return cached[1]
    with open(path, encoding="utf-8") as f:
        value = parse(f.read(), path)
    cache[path] = (mtime, value)
    return value
