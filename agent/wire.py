"""Turns sealed :class:`~agent.record.StepRecord` objects into wire-format step dicts and events.

Runs in the sender thread only. Also decides what is *critical* (sent without waiting for the tick)
and drives the NaN-origin hunt: the training thread reads ``NanHunt.active``
(a plain attribute, no lock needed for a bool) and hooks every module while it
is set. See ``docs/wire-format.md`` for the shapes produced here.
"""
from __future__ import annotations

import base64
import math
import struct
import sys
from array import array
from typing import Any, Callable, Optional

from gradwatch.agent.nonfinite import F32_PREFIX, NULL_F32_BITS, encode_float
from gradwatch.agent.record import StepRecord, finite
from gradwatch.agent.signals import EXTRA_SIGNALS

# Compact per-layer arrays (docs/wire-format.md, "Compact layer arrays"): "f32:" + base64 of the
# little-endian float32 bytes; their prefix and "not measured" pattern are agent/nonfinite.py's, which
# the server reads too.
_NULL_F32 = struct.pack("<I", NULL_F32_BITS)
# Step signals declared after the built-in ones (agent/signals.py): a collector adds a record part, or
# a host value, of the signal's own name, and it goes on the wire as is (typed by its kind).
_GENERIC_SIGNALS = tuple((s.name, s.kind) for s in EXTRA_SIGNALS)
# Per-layer statistics of that kind: a record part named "layers.<stat>", one value per layer in the
# order of the statistic's name list, goes on the wire as layers[<stat>].
LAYER_PART_PREFIX = "layers."


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
    def __init__(self, param_names: list[str], module_names: list[str], bn_names: list[str], hunt: NanHunt,
                 sharded: bool = False):
        self.param_names = param_names
        # Sharded parameters (FSDP, DTensor): the norms measured here are of this rank's shards only, so
        # they go out under the *_local names and the server combines the ranks into the global ones.
        self.sharded = sharded
        self.module_names = module_names
        self.bn_names = bn_names
        self.hunt = hunt
        self.overflow_count = 0

    def assemble(self, record: StepRecord) -> tuple[dict, list[dict], bool]:
        """Returns (wire step, events, critical).

        Fields with nothing measured are left out (the spec makes every step field but ``step``
        and ``time`` optional), so an ordinary step is a dozen keys; per-layer arrays are the
        record's float32 bytes in base64, never walked value by value here.
        """
        vals = record.read()
        host = record.host
        get = host.get
        scalar = vals.scalar
        events: list[dict] = []

        loss = scalar("loss")
        loss_host = get("loss_host")
        if loss_host is not None:
            loss = loss_host if loss is None else loss + loss_host
        grad_norm = scalar("grad_norm")
        max_norm = get("clip_max_norm")
        found_inf = scalar("found_inf")
        overflow = bool(found_inf) if found_inf is not None else False
        if overflow:
            self.overflow_count += 1
        lr = scalar("lr")
        ema_diff, ema_ref = scalar("ema_diff"), scalar("ema_ref")
        inp = scalar("input_nonfinite")

        floats = {
            "loss": loss,
            "grad_norm": grad_norm,
            "clip_max_norm": max_norm,
            "loss_scale": scalar("loss_scale"),
            "lr": lr if lr is not None else get("lr"),
            "step_time": get("step_time"),
            "samples_per_s": get("samples_per_s"),
            "tokens_per_s": get("tokens_per_s"),
            "mem_peak": get("mem_peak"),
            "ema_divergence": (ema_diff / ema_ref if ema_diff is not None and ema_ref else
                               (float("nan") if ema_diff is not None and ema_ref == 0 else None)),
        }
        step: dict[str, Any] = {"step": record.step, "time": get("time")}
        if self.sharded:
            floats["grad_norm_local"] = floats.pop("grad_norm")
        for key, v in floats.items():
            if v is not None:
                step[key] = v if math.isfinite(v) else encode_float(v)
        if grad_norm is not None and max_norm is not None and not math.isnan(grad_norm) and not self.sharded:
            step["clipped"] = bool(grad_norm > max_norm)
        step["overflow"] = overflow if get("scaler_active") else False
        step["overflow_count"] = self.overflow_count
        if inp is not None and math.isfinite(inp):
            step["input_nonfinite"] = int(inp)
        for name, kind in _GENERIC_SIGNALS:
            v = scalar(name) if name in vals else get(name)
            if v is not None:
                step[name] = (bool(v) if kind == "bool" else int(v) if kind == "count" and math.isfinite(v)
                              else encode_float(float(v)))

        custom = dict(get("custom") or {})
        for key in vals.keys():
            if key.startswith("custom:"):
                custom[key[7:]] = scalar(key)
        if custom:
            step["custom"] = {k: encode_float(v) for k, v in custom.items()}

        layers: dict[str, str] = {}
        # Python lists of the same arrays, only for the few steps that look at single values
        # (a critical step's top grad norms, the NaN-origin hunt).
        lists: dict[str, list] = {}
        n_params = len(self.param_names)
        grad_index = get("grad_index")
        if "grad_norms" in vals and grad_index is not None:
            per = vals.f32("grad_norms")
            if len(grad_index) == n_params:    # every parameter had a grad: index is 0..n-1
                layers["grad_norm"] = f32_b64(per)
            else:
                buf = bytearray(_NULL_F32 * n_params)
                for k, i in enumerate(grad_index):
                    buf[4 * i:4 * i + 4] = per[4 * k:4 * k + 4]
                layers["grad_norm"] = f32_b64(bytes(buf))

        def grad_list() -> Optional[list]:
            if "grad_norm" not in lists and "grad_norms" in vals and grad_index is not None:
                arr: list = [None] * n_params
                for i, v in zip(grad_index, vals.floats("grad_norms")):
                    arr[i] = v
                lists["grad_norm"] = arr
            return lists.get("grad_norm")

        if self.sharded:
            if "grad_norm" in layers:
                layers["grad_norm_local"] = layers.pop("grad_norm")
            if "weight_norm" in vals:
                layers["weight_norm_local"] = f32_b64(vals.f32("weight_norm"))
                if "update_norm" in vals:
                    layers["update_norm_local"] = f32_b64(vals.f32("update_norm"))
        elif "weight_norm" in vals:
            layers["weight_norm"] = f32_b64(vals.f32("weight_norm"))
            if "update_norm" in vals:   # sampled steps only (weights_every)
                layers["update_ratio"] = f32_b64(pack_f32(
                    [u / x if x else (0.0 if u == 0 else float("inf"))
                     for u, x in zip(vals.floats("update_norm"), vals.floats("weight_norm"))]))
        act_index = get("act_index")
        if act_index is not None and "act" in vals:   # sampled steps and the NaN hunt only
            stats = vals.floats("act")
            cols = {name: [None] * len(self.module_names)
                    for name in ("act_mean", "act_std", "act_absmax", "act_nonfinite")}
            for k, mi in enumerate(act_index):
                mean, std, absmax, nonfinite = stats[4 * k:4 * k + 4]
                cols["act_mean"][mi], cols["act_std"][mi], cols["act_absmax"][mi] = mean, std, absmax
                cols["act_nonfinite"][mi] = int(nonfinite) if math.isfinite(nonfinite) else None
            lists.update(cols)
            for name, col in cols.items():
                layers[name] = f32_b64(pack_f32(col))
        if "bn_mean" in vals:
            layers["bn_mean_norm"] = f32_b64(vals.f32("bn_mean"))
            layers["bn_var_norm"] = f32_b64(vals.f32("bn_var"))
        for key in vals.keys():
            if key.startswith(LAYER_PART_PREFIX):
                layers[key[len(LAYER_PART_PREFIX):]] = f32_b64(vals.f32(key))
        if layers:
            step["layers"] = layers

        loss_bad = loss is not None and not finite(loss)
        grad_bad = grad_norm is not None and not finite(grad_norm)
        # A finite loss with overflowing fp16 grads is the scaler doing its job, not an incident.
        critical = loss_bad or (grad_bad and not get("scaler_active"))
        if critical:
            top = self._top_grad_norms(grad_list())
            if top:
                events.append({"step": record.step, "kind": "top_grad_norms", "data": {"params": top}})
        events.extend({"step": record.step, **e} for e in get("events", ()))   # a collector's events (kind, data)
        events.extend(self._hunt(record.step, critical, grad_bad, act_index, lists, grad_list, get("nan_replay")))
        return step, events, critical

    def _top_grad_norms(self, arr: Optional[list]) -> list:
        if not arr:
            return []
        pairs = [(self.param_names[i], v) for i, v in enumerate(arr) if v is not None]
        # Non-finite first (they are the story), then the largest.
        pairs.sort(key=lambda p: (math.isfinite(p[1]), -p[1] if math.isfinite(p[1]) else 0.0))
        return [[name, encode_float(v)] for name, v in pairs[:5]]

    def _hunt(self, step: int, critical: bool, grad_bad: bool, act_index, layers: dict,
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
            if not grad_bad:
                hunt.reported = False   # a healthy step ends the incident
            return []
        if hunt.reported:
            return []
        found = self._origin(act_index, layers, grad_list)
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

    def _origin(self, act_index, layers: dict, grad_list: Callable[[], Optional[list]]) -> Optional[tuple[str, str]]:
        if act_index is None:
            return None
        nonfinite = layers.get("act_nonfinite") or []
        for mi in act_index:                       # act_index is in forward (completion) order
            n = nonfinite[mi] if mi < len(nonfinite) else None
            if n is None or n > 0:
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
