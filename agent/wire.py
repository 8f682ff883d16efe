"""Turns sealed :class:`~agent.record.StepRecord` objects into wire-format step dicts and events.

Runs in the sender thread only. Also decides what is *critical* (sent without waiting for the tick)
and drives the NaN-origin hunt, both from the signal table's declarations (``critical``, ``nan_hunt``):
the training thread reads ``NanHunt.active`` (a plain attribute, no lock needed for a bool) and hooks
every module while it is set. See ``docs/wire-format.md`` for the shapes produced here.
"""
from __future__ import annotations

import base64
import math
import struct
import sys
from array import array
from typing import Any, Callable, Optional

from gradwatch.agent.derived import DERIVE
from gradwatch.agent.nonfinite import F32_PREFIX, NULL_F32_BITS, encode_float
from gradwatch.agent.record import StepRecord, StepValues, finite
from gradwatch.agent.signals import LAYER_PART_PREFIX, LAYER_STATS, PER_RANK, STEP_SIGNALS

# Compact per-layer arrays (docs/wire-format.md, "Compact layer arrays"): "f32:" + base64 of the
# little-endian float32 bytes; their prefix and "not measured" pattern are agent/nonfinite.py's, which
# the server reads too.
_NULL_F32 = struct.pack("<I", NULL_F32_BITS)
# The assembler reads the signal table, never a list of its own: a record part (or host value) named like
# a step signal goes on the wire as that signal, typed by its kind; a part "layers.<stat>" as that per-layer
# statistic; a derived signal is computed from its inputs by agent/derived.py's one function.
# overflow and overflow_count are this process's, counted here across steps (assemble).
_COUNTED = ("overflow", "overflow_count")
_STEP_SIGNALS = tuple((s.name, s.kind, (DERIVE[s.name], s.derived_from) if s.derived_from else None)
                      for s in STEP_SIGNALS if s.name not in _COUNTED)
_LAYER_PARTS = {LAYER_PART_PREFIX + s.name: (s.name, s.over) for s in LAYER_STATS if not s.derived_from}
_LAYER_DERIVED = tuple((s.name, DERIVE[s.name], s.derived_from) for s in LAYER_STATS if s.derived_from)


def _forms(part: str) -> tuple[str, ...]:
    """A record part's name and, where the table declares one, its per-rank form (a sharded run's)."""
    return (part, PER_RANK[part]) if part in PER_RANK else (part,)


# The critical check and the NaN-origin hunt read declarations too: the step signals whose non-finite value makes
# a step critical (``critical``: always, or without an active loss scaler), and the per-layer statistics the hunt
# reads (``nan_hunt``), each from its part or, on a sharded run, its per-rank form's.
_CRITICAL = tuple((_forms(s.name), s.critical == "nonfinite") for s in STEP_SIGNALS if s.critical)
_HUNT_ACTIVATION = next(LAYER_PART_PREFIX + s.name for s in LAYER_STATS if s.nan_hunt == "activation")
_HUNT_GRAD = _forms(next(LAYER_PART_PREFIX + s.name for s in LAYER_STATS if s.nan_hunt == "grad"))


def f32_b64(le_bytes: bytes) -> str:
    """Little-endian float32 bytes -> the compact wire string.

    >>> f32_b64(struct.pack("<2f", 1.0, 2.0))
    'f32:AACAPwAAAEA='
    """
    return F32_PREFIX + base64.b64encode(le_bytes).decode("ascii")


def pack_f32(values: list) -> bytes:
    """A list of floats with None for "not measured" -> little-endian float32 bytes.

    For the arrays a step builds one value at a time (activation statistics scattered to their
    modules, update ratios); arrays read straight off the device vector skip this.

    >>> pack_f32([1.0, None])[4:] == _NULL_F32
    True
    """
    a = array("f", [0.0 if v is None else v for v in values])
    if sys.byteorder != "little":
        a.byteswap()
    out = a.tobytes()
    if None in values:
        buf = bytearray(out)
        for i, v in enumerate(values):
            if v is None:
                buf[4 * i:4 * i + 4] = _NULL_F32
        out = bytes(buf)
    return out


def _scatter(raw: bytes, index: list, n: int) -> bytes:
    """float32 bytes of the layers ``index`` -> float32 bytes of all ``n`` layers, the rest "not measured".

    >>> _scatter(struct.pack("<2f", 1.0, 2.0), [2, 0], 3) == struct.pack("<f", 2.0) + _NULL_F32 + struct.pack("<f", 1.0)
    True
    """
    buf = bytearray(_NULL_F32 * n)
    for k, i in enumerate(index):
        buf[4 * i:4 * i + 4] = raw[4 * k:4 * k + 4]
    return bytes(buf)


class NanHunt:
    """Shared between threads: the sender arms it, the training thread reads ``active``."""

    def __init__(self, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.max_steps = max_steps
        self.active = False
        self.started_at: Optional[int] = None
        self.reported = False   # one nan_origin per incident; re-armed after a finite step
        self.replay_note: Optional[str] = None   # why the failing step's replay found no origin (if it ran)


class StepAssembler:
    def __init__(self, param_names: list[str], module_names: list[str], bn_names: list[str], hunt: NanHunt):
        self.param_names = param_names
        self.module_names = module_names
        self.bn_names = bn_names
        self.layer_counts = {"params": len(param_names), "modules": len(module_names), "bn": len(bn_names)}
        self.hunt = hunt
        self.overflow_count = 0

    def assemble(self, record: StepRecord) -> tuple[dict, list[dict], bool]:
        """Returns (wire step, events, critical).

        Fields with nothing measured are left out (the spec makes every step field but ``step``
        and ``time`` optional), so an ordinary step is a dozen keys; per-layer arrays are the
        record's float32 bytes in base64, never walked value by value here.
        """
        vals = record.read()
        get = record.host.get
        scalar = vals.scalar
        events: list[dict] = []

        step: dict[str, Any] = {"step": record.step, "time": get("time")}
        for name, kind, derived in _STEP_SIGNALS:
            if derived is None:
                v = scalar(name) if name in vals else get(name)
            else:
                derive, inputs = derived
                v = derive(*[scalar(n) if n in vals else get(n) for n in inputs])
            if v is None:
                continue
            if kind == "float":
                step[name] = encode_float(float(v))
            elif kind == "bool":
                step[name] = bool(v)
            elif math.isfinite(v):   # a count: an int >= 0 on the wire, nothing for a non-finite one
                step[name] = int(v)
        found_inf = scalar("overflow")   # the GradScaler's found_inf: the step was skipped
        overflow = bool(found_inf) if found_inf is not None else False
        if overflow:
            self.overflow_count += 1
        step["overflow"] = overflow if record.scaler_active else False
        step["overflow_count"] = self.overflow_count

        custom = dict(record.custom or {})
        for key in vals.keys():
            if key.startswith("custom:"):
                custom[key[7:]] = scalar(key)
        if custom:
            step["custom"] = {k: encode_float(v) for k, v in custom.items()}

        layers: dict[str, str] = {}
        index = record.index
        for key in vals.keys():
            sent = _LAYER_PARTS.get(key)
            if sent is not None:
                stat, over = sent
                raw = vals.f32(key)
                at = index.get(key)
                layers[stat] = f32_b64(raw if at is None else _scatter(raw, at, self.layer_counts[over]))
        for stat, derive, inputs in _LAYER_DERIVED:   # sampled steps only (update_ratio: weights_every)
            if all(n in vals for n in inputs):
                layers[stat] = f32_b64(pack_f32(derive(*[vals.floats(n) for n in inputs])))
        if layers:
            step["layers"] = layers

        # Python lists of single values, only for the few steps that look at them (a critical step's top
        # grad norms, the NaN-origin hunt). Sharded: this rank's norms of its pieces.
        grad_key = next((k for k in _HUNT_GRAD if k in vals), _HUNT_GRAD[0])
        grad_list = lambda: self._per_layer(vals, index, grad_key)   # noqa: E731
        always = unscaled = False   # a non-finite value of a critical signal: one that is always critical / not
        for forms, always_critical in _CRITICAL:
            for name in forms:
                v = scalar(name) if name in vals else get(name)
                if v is not None:
                    if not finite(v):
                        if always_critical:
                            always = True
                        else:
                            unscaled = True
                    break
        # A finite loss with overflowing fp16 grads is the scaler doing its job, not an incident.
        critical = always or (unscaled and not record.scaler_active)
        if critical:
            top = self._top_grad_norms(grad_list())
            if top:
                events.append({"step": record.step, "kind": "top_grad_norms", "data": {"params": top}})
        events.extend({"step": record.step, **e} for e in get("events", ()))   # a collector's events (kind, data)
        act_index = index.get(_HUNT_ACTIVATION)
        act_nonfinite = vals.floats(_HUNT_ACTIVATION) if act_index is not None else None
        events.extend(self._hunt(record.step, critical, always or unscaled, act_index, act_nonfinite, grad_list,
                                 record.nan_replay))
        return step, events, critical

    def _per_layer(self, vals: StepValues, index: dict, key: str) -> Optional[list]:
        """A per-parameter part as one value per parameter, None where not measured."""
        values = vals.floats(key)
        if values is None:
            return None
        at = index.get(key)
        if at is None:
            return values
        out: list = [None] * len(self.param_names)
        for i, v in zip(at, values):
            out[i] = v
        return out

    def _top_grad_norms(self, arr: Optional[list]) -> list:
        if not arr:
            return []
        pairs = [(self.param_names[i], v) for i, v in enumerate(arr) if v is not None]
        # Non-finite first (they are the story), then the largest.
        pairs.sort(key=lambda p: (math.isfinite(p[1]), -p[1] if math.isfinite(p[1]) else 0.0))
        return [[name, encode_float(v)] for name, v in pairs[:5]]

    def _hunt(self, step: int, critical: bool, nonfinite: bool, act_index: Optional[list],
              act_nonfinite: Optional[list],
              grad_list: Callable[[], Optional[list]], replayed: Optional[dict] = None) -> list[dict]:
        hunt = self.hunt
        if replayed is not None and not hunt.reported:
            # The failing step itself, replayed with every module hooked (agent/capture/replay.py): its
            # answer names the step it broke at, so no later step needs hooking.
            if replayed.get("found"):
                hunt.active = False
                hunt.reported = True
                hunt.replay_note = None
                data = {k: v for k, v in replayed.items() if k != "found"}
                return [{"step": step, "kind": "nan_origin", "data": data}]
            hunt.replay_note = replayed.get("note")   # the hunt below carries on, as the fallback
        if not hunt.enabled:
            return []
        if not critical and not hunt.active:
            if not nonfinite:
                hunt.reported = False   # a healthy step ends the incident
            return []
        if hunt.reported:
            return []
        found = self._origin(act_index, act_nonfinite, grad_list)
        if found is not None:
            hunt.active = False
            hunt.reported = True
            module, where = found
            return [{"step": step, "kind": "nan_origin", "data": {"module": module, "where": where}}]
        if not hunt.active:
            hunt.active = True
            hunt.started_at = step
        elif hunt.started_at is not None and step - hunt.started_at > hunt.max_steps:
            hunt.active = False
            hunt.reported = True
            data: dict = {"hunted_steps": hunt.max_steps}
            if hunt.replay_note:
                data["replay"] = hunt.replay_note
            return [{"step": step, "kind": "nan_origin_not_found", "data": data}]
        return []

    def _origin(self, act_index: Optional[list], act_nonfinite: Optional[list],
                grad_list: Callable[[], Optional[list]]) -> Optional[tuple[str, str]]:
        if act_index is None or act_nonfinite is None:
            return None
        for mi, n in zip(act_index, act_nonfinite):   # act_index is in forward (completion) order
            if not math.isfinite(n) or n > 0:
                return self.module_names[mi], "activation"
        grads = grad_list()
        if grads and any(v is not None and not math.isfinite(v) for v in grads):
            # Activations were all finite: the NaN was born in backward, which runs in reverse
            # forward order, so the culprit is the bad parameter whose module ran last.
            position = {self.module_names[mi]: k for k, mi in enumerate(act_index)}
            bad = [self.param_names[i] for i, v in enumerate(grads) if v is not None and not math.isfinite(v)]
            owner = lambda name: name.rsplit(".", 1)[0] if "." in name else ""
            bad.sort(key=lambda name: position.get(owner(name), -1))
            return owner(bad[-1]) or bad[-1], "grad"
        return None
