"""Turns sealed :class:`~agent.record.StepRecord` objects into wire-format step dicts and events.

Runs in the sender thread only. Also decides what is *critical* (sent at once)
and drives the NaN-origin hunt: the training thread reads ``NanHunt.active``
(a plain attribute, no lock needed for a bool) and hooks every module while it
is set. See ``docs/wire-format.md`` for the shapes produced here.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from agent.record import StepRecord, finite


class NanHunt:
    """Shared between threads: the sender arms it, the training thread reads ``active``."""

    def __init__(self, enabled: bool, max_steps: int):
        self.enabled = enabled
        self.max_steps = max_steps
        self.active = False
        self.started_at: Optional[int] = None
        self.reported = False   # one nan_origin per incident; re-armed after a finite step


def _num(values: dict, key: str) -> Optional[float]:
    v = values.get(key)
    return v[0] if v else None


class StepAssembler:
    def __init__(self, param_names: list[str], module_names: list[str], bn_names: list[str], hunt: NanHunt):
        self.param_names = param_names
        self.module_names = module_names
        self.bn_names = bn_names
        self.hunt = hunt
        self.overflow_count = 0

    def assemble(self, record: StepRecord) -> tuple[dict, list[dict], bool]:
        """Returns (wire step, events, critical)."""
        values = record.values()
        host = record.host
        events: list[dict] = []
        step: dict[str, Any] = {"step": record.step, "time": host.get("time")}

        loss = _num(values, "loss")
        if host.get("loss_host") is not None:
            loss = host["loss_host"] if loss is None else loss + host["loss_host"]
        step["loss"] = loss

        grad_norm = _num(values, "grad_norm")
        step["grad_norm"] = grad_norm
        max_norm = host.get("clip_max_norm")
        step["clip_max_norm"] = max_norm
        step["clipped"] = (bool(grad_norm > max_norm) if grad_norm is not None and max_norm is not None
                           and not math.isnan(grad_norm) else None)

        step["loss_scale"] = _num(values, "loss_scale")
        found_inf = _num(values, "found_inf")
        overflow = bool(found_inf) if found_inf is not None else False
        if overflow:
            self.overflow_count += 1
        step["overflow"] = overflow if host.get("scaler_active") else False
        step["overflow_count"] = self.overflow_count

        lr = _num(values, "lr")
        step["lr"] = lr if lr is not None else host.get("lr")
        step["step_time"] = host.get("step_time")
        step["samples_per_s"] = host.get("samples_per_s")
        step["tokens_per_s"] = host.get("tokens_per_s")
        step["mem_peak"] = host.get("mem_peak")

        ema_diff, ema_ref = _num(values, "ema_diff"), _num(values, "ema_ref")
        step["ema_divergence"] = (ema_diff / ema_ref if ema_diff is not None and ema_ref else
                                  (float("nan") if ema_diff is not None and ema_ref == 0 else None))
        inp = _num(values, "input_nonfinite")
        step["input_nonfinite"] = int(inp) if inp is not None and math.isfinite(inp) else None

        custom = dict(host.get("custom") or {})
        for key, v in values.items():
            if key.startswith("custom:"):
                custom[key[7:]] = v[0]
        if custom:
            step["custom"] = custom

        layers: dict[str, list] = {}
        grad_index = host.get("grad_index")
        per_param = values.get("grad_norms")
        if per_param is not None and grad_index is not None:
            arr: list = [None] * len(self.param_names)
            for i, v in zip(grad_index, per_param):
                arr[i] = v
            layers["grad_norm"] = arr
        if "weight_norm" in values:
            w = values["weight_norm"]
            layers["weight_norm"] = w
            if "update_norm" in values:
                layers["update_ratio"] = [u / x if x else (0.0 if u == 0 else float("inf"))
                                          for u, x in zip(values["update_norm"], w)]
        act_index = host.get("act_index")
        if act_index is not None and "act" in values:
            stats = values["act"]
            cols = {name: [None] * len(self.module_names)
                    for name in ("act_mean", "act_std", "act_absmax", "act_nonfinite")}
            for k, mi in enumerate(act_index):
                mean, std, absmax, nonfinite = stats[4 * k:4 * k + 4]
                cols["act_mean"][mi], cols["act_std"][mi], cols["act_absmax"][mi] = mean, std, absmax
                cols["act_nonfinite"][mi] = int(nonfinite) if math.isfinite(nonfinite) else None
            layers.update(cols)
        if "bn_mean" in values:
            layers["bn_mean_norm"] = values["bn_mean"]
            layers["bn_var_norm"] = values["bn_var"]
        if layers:
            step["layers"] = layers

        loss_bad = loss is not None and not finite(loss)
        grad_bad = grad_norm is not None and not finite(grad_norm)
        # A finite loss with overflowing fp16 grads is the scaler doing its job, not an incident.
        critical = loss_bad or (grad_bad and not host.get("scaler_active"))
        if critical:
            top = self._top_grad_norms(step.get("layers", {}).get("grad_norm"))
            if top:
                events.append({"step": record.step, "kind": "top_grad_norms", "data": {"params": top}})
        events.extend(self._hunt(record.step, critical, grad_bad, act_index, step.get("layers", {})))
        return step, events, critical

    def _top_grad_norms(self, arr: Optional[list]) -> list:
        if not arr:
            return []
        pairs = [(self.param_names[i], v) for i, v in enumerate(arr) if v is not None]
        # Non-finite first (they are the story), then the largest.
        pairs.sort(key=lambda p: (math.isfinite(p[1]), -p[1] if math.isfinite(p[1]) else 0.0))
        return [[name, v] for name, v in pairs[:5]]

    def _hunt(self, step: int, critical: bool, grad_bad: bool, act_index, layers: dict) -> list[dict]:
        hunt = self.hunt
        if not hunt.enabled:
            return []
        if not critical and not hunt.active:
            if not grad_bad:
                hunt.reported = False   # a healthy step ends the incident
            return []
        if hunt.reported:
            return []
        found = self._origin(act_index, layers, grad_bad)
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
            return [{"step": step, "kind": "nan_origin_not_found", "data": {"hunted_steps": hunt.max_steps}}]
        return []

    def _origin(self, act_index, layers: dict, grad_bad: bool) -> Optional[tuple[str, str]]:
        if act_index is None:
            return None
        nonfinite = layers.get("act_nonfinite") or []
        for mi in act_index:                       # act_index is in forward (completion) order
            n = nonfinite[mi] if mi < len(nonfinite) else None
            if n is None or n > 0:
                return self.module_names[mi], "activation"
        grads = layers.get("grad_norm")
        if grads and any(v is not None and not math.isfinite(v) for v in grads):
            # Activations were all finite: the NaN was born in backward, which runs in reverse
            # forward order, so the culprit is the bad parameter whose module ran last.
            position = {self.module_names[mi]: k for k, mi in enumerate(act_index)}
            bad = [self.param_names[i] for i, v in enumerate(grads) if v is not None and not math.isfinite(v)]
            owner = lambda name: name.rsplit(".", 1)[0] if "." in name else ""
            bad.sort(key=lambda name: position.get(owner(name), -1))
            return owner(bad[-1]) or bad[-1], "grad"
        return None
