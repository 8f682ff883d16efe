"""A batch of one rank's steps as the rules read it: columns as numpy arrays, made once per batch.

``Batch.values(key)`` is a step key's column as float64 (absent values NaN) with
``Batch.measured(key)`` telling absent from NaN; ``Batch.layers(stat)`` the steps that carry a
per-layer array and the arrays. Several rules read the same signals: each column is built once.
Leaf module but for ``stats``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from gradwatch.server.rules.stats import num

_PLAIN = frozenset((float, int, bool, type(None)))


def keys_present(steps: list[dict]) -> frozenset:
    """Every step key with a non-null value in ``steps``, and ``layers.<stat>`` for non-empty arrays."""
    keys: set[str] = set()
    for st in steps:
        for key, value in st.items():
            if value is not None and key != "layers":
                keys.add(key)
        for stat in st.get("layers") or ():
            if layer_present(st, stat):
                keys.add("layers." + stat)
    return frozenset(keys)


def layer_present(st: dict, stat: str) -> bool:
    """Whether the step carries a non-empty ``stat`` array (without decoding it)."""
    layers = st.get("layers")
    if not layers:
        return False
    present = getattr(layers, "present", None)
    return present(stat) if present is not None else bool(layers.get(stat))


def layer_list(st: dict, stat: str) -> Optional[list]:
    layers = st.get("layers")
    if not layers:
        return None
    values = layers.get(stat)
    return values if values else None


def layer_array(st: dict, stat: str) -> Optional[np.ndarray]:
    """A per-layer array as float64, absent (null) layers as NaN; None when the step has none."""
    layers = st.get("layers")
    if not layers:
        return None
    arr = getattr(layers, "array", None)
    if arr is not None:
        return arr(stat)
    values = layers.get(stat)
    if not values:
        return None
    return np.array([math.nan if v is None else num(v) for v in values], dtype=np.float64)


@dataclass
class Context:
    """What a rule may know about the run besides the batch's steps."""

    run_id: int
    rank: int
    world_size: int
    param_names: list[str]
    module_names: list[str]
    bn_names: list[str]
    # kind → {step: data} for this batch's events
    events: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    # step keys with a value somewhere in the batch ("layers.<stat>" for non-empty arrays): keys_present()
    present: frozenset = frozenset()
    # event kind -> the run's latest such event ({"step": ..., **data}), for the kinds rules ask to keep
    remembered: dict[str, Any] = field(default_factory=dict)
    # what the agent said about the run's parallelism (meta, kept in runs.config["_meta"]): e.g.
    # "grad_replicas": "ddp" when every rank holds the same all-reduced gradients
    run_meta: dict[str, Any] = field(default_factory=dict)


class Batch:
    """The batch's steps (sorted by step, as ingest sends them) and their columns."""

    def __init__(self, steps: list[dict], ctx: Context):
        self.steps = steps
        self.ctx = ctx
        self.n = len(steps)
        self._cols: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._raw: dict[str, list] = {}
        self._carriers: Optional[dict[str, list[int]]] = None
        self.step = np.fromiter((st["step"] for st in steps), dtype=np.int64, count=self.n)

    def raw(self, key: str) -> list:
        """The values as sent (None when absent). Shared: do not change the list."""
        col = self._raw.get(key)
        if col is None:
            col = self._raw[key] = [st.get(key) for st in self.steps]
        return col

    def _column(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        col = self._cols.get(key)
        if col is None:
            raw = self.raw(key)
            if not set(map(type, raw)) <= _PLAIN:
                raw = [num(v) for v in raw]
            if None in raw:
                measured = np.fromiter((v is not None for v in raw), dtype=bool, count=self.n)
                values = np.fromiter((math.nan if v is None else v for v in raw), dtype=np.float64, count=self.n)
            else:                   # the usual column: sent on every step
                measured = np.ones(self.n, dtype=bool)
                values = np.array(raw, dtype=np.float64)
            col = self._cols[key] = (values, measured)
        return col

    def values(self, key: str) -> np.ndarray:
        """float64 per step; absent values are NaN (``measured`` tells them from a NaN sent)."""
        return self._column(key)[0]

    def measured(self, key: str) -> np.ndarray:
        return self._column(key)[1]

    def true(self, key: str) -> np.ndarray:
        """A flag column (overflow, clipped) as booleans: sent and true."""
        return self._column(key)[0] == 1.0

    def false(self, key: str) -> np.ndarray:
        """Sent and false (None is neither)."""
        return self._column(key)[0] == 0.0

    def carriers(self, stat: str) -> list[int]:
        """Indices of the steps that carry a non-empty ``stat`` array."""
        if self._carriers is None:           # one pass over the batch for every statistic
            index: dict[str, list[int]] = {}
            for i, st in enumerate(self.steps):
                layers = st.get("layers")
                if not layers:
                    continue
                present = getattr(layers, "present", None)
                for name in layers:
                    if present(name) if present is not None else bool(layers.get(name)):
                        index.setdefault(name, []).append(i)
            self._carriers = index
        return self._carriers.get(stat, [])
