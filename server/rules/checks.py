"""One class per rule: what it reads, what it remembers, when its condition holds.

``observe(ctx, state, cfg, st)`` sees one wire-format step dict and returns a
``Hit``, ``False`` (clear) or ``None`` (nothing to say at this step). ``state``
is the rule's JSON-able memory for this (run, rank), kept in ``rule_states``.
Windows hold finite values only and leave out what the rule flagged.
"""
from __future__ import annotations

import base64
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from server.rules.alerts import Hit
from server.rules.catalogue import RULES_BY_ID
from server.rules.stats import MAD_TO_SIGMA, enc, finite, fmt, median, median_mad, num


@dataclass
class Context:
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
    # per-batch columns the fast paths share (_column, _steps_with): several rules read the same signals
    cache: dict = field(default_factory=dict, repr=False, compare=False)


def keys_present(steps: list[dict]) -> frozenset:
    """Every step key with a non-null value in ``steps``, and ``layers.<stat>`` for non-empty arrays."""
    keys: set[str] = set()
    for st in steps:
        for key, value in st.items():
            if value is not None and key != "layers":
                keys.add(key)
        for stat in st.get("layers") or ():
            if _layer_present(st, stat):
                keys.add("layers." + stat)
    return frozenset(keys)


def _layer(st: dict, stat: str) -> Optional[list]:
    layers = st.get("layers")
    if not layers:
        return None
    values = layers.get(stat)
    return values if values else None


def _pack_f8(arr) -> str:
    """float64 values -> base64 of their little-endian bytes: a compact, exact JSON string."""
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f8").tobytes()).decode("ascii")


def _unpack_f8(raw) -> np.ndarray:
    """The inverse of ``_pack_f8``; a plain JSON list (an earlier state) is read as it is."""
    if isinstance(raw, str):
        return np.frombuffer(base64.b64decode(raw), dtype="<f8").copy()
    return np.asarray(raw, dtype=np.float64)


def _layer_present(st: dict, stat: str) -> bool:
    """Whether the step carries a non-empty ``stat`` array (without decoding it)."""
    layers = st.get("layers")
    if not layers:
        return False
    present = getattr(layers, "present", None)
    return present(stat) if present is not None else bool(layers.get(stat))


def _layer_array(st: dict, stat: str) -> Optional[np.ndarray]:
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


_FLOAT_OR_NONE = frozenset((float, type(None)))


def _column(ctx: Context, steps: list[dict], key: str, as_float: bool = True) -> list:
    """``[num(st.get(key)) for st in steps]`` (``as_float=False``: the raw values), worked out once per
    batch for all the rules that read ``key``. Shared: callers must not change the list."""
    hit = ctx.cache.get((key, as_float))
    if hit is not None and hit[0] is steps and len(hit[1]) == len(steps):
        return hit[1]
    values = [st.get(key) for st in steps]
    # the wire schema already gives floats or None, which num() returns as they are: skip its calls then
    if as_float and not set(map(type, values)) <= _FLOAT_OR_NONE:
        values = [num(v) for v in values]
    ctx.cache[(key, as_float)] = (steps, values)
    return values


def _all_finite(xs: list[float]) -> bool:
    """Whether every value (no None) is finite. A NaN or an infinity makes the sum non-finite, so a finite
    sum (one C loop) settles the usual case; a sum that overflowed is checked value by value."""
    return math.isfinite(sum(xs)) or all(map(math.isfinite, xs))


# the per-layer statistics the agent sends on few steps, read by rules that observe only those steps
_SPARSE_STATS = frozenset(("bn_var_norm", "act_std", "weight_norm", "update_ratio"))


def _steps_with(ctx: Context, steps: list[dict], stat: str) -> list[dict]:
    """The batch's steps that carry a non-empty ``stat`` array (``_layer_present``), worked out for all of
    ``_SPARSE_STATS`` in one pass over the batch that the per-layer rules share. Other names (grad_norm,
    on every step) are passed over without a call into the layer view."""
    if stat not in _SPARSE_STATS:
        return [st for st in steps if _layer_present(st, stat)]
    hit = ctx.cache.get("layers")
    if hit is None or hit[0] is not steps:
        index: dict[str, list[dict]] = {}
        for st in steps:
            layers = st.get("layers")
            if layers is None:
                continue
            present = getattr(layers, "present", None)
            for name in layers:
                if name in _SPARSE_STATS and (present(name) if present is not None else bool(layers.get(name))):
                    index.setdefault(name, []).append(st)
        hit = ctx.cache["layers"] = (steps, index)
    return hit[1].get(stat, [])


def _medians(w: np.ndarray) -> np.ndarray:
    """``median`` of each row (bit-identical: the middle order statistics, the same float operations)."""
    n = w.shape[1]
    mid = n // 2
    if n % 2:
        return np.partition(w, mid, axis=1)[:, mid]
    p = np.partition(w, (mid - 1, mid), axis=1)
    return 0.5 * (p[:, mid - 1] + p[:, mid])


def _np_medians(w: np.ndarray) -> np.ndarray:
    """``np.median(w, axis=1)``, bit for bit (a NaN in a row gives NaN), without its per-call overhead."""
    med = _medians(w)
    if np.isnan(med).any() or np.isnan(w).any():
        med = np.where(np.isnan(w).any(axis=1), np.nan, med)
    return med


def _mads(w: np.ndarray, med: np.ndarray) -> np.ndarray:
    """The MAD half of ``median_mad`` for each row of ``w`` around its median ``med`` (bit-identical)."""
    return MAD_TO_SIGMA * _medians(np.abs(w - med[:, None]))


def _slices(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> list[tuple[Any, np.ndarray]]:
    """The slices arr[lo[i]:hi[i]] as matrices, one per length: [(which slices, one slice a row)]. There is
    one length but at a run's start (a window still filling), so the rules' numpy work is one call."""
    lengths = hi - lo
    if lengths.min() == lengths.max():
        return [(slice(None), arr[lo[:, None] + np.arange(int(lengths[0]))])]
    return [(rows, arr[lo[rows][:, None] + np.arange(n)])
            for n in np.unique(lengths).tolist() for rows in [np.flatnonzero(lengths == n)]]


def _per_slice(groups: list, count: int, fn) -> np.ndarray:
    """``fn`` (matrix -> one value per row) over the slices of ``_slices``, in slice order."""
    if len(groups) == 1 and isinstance(groups[0][0], slice):
        return fn(groups[0][1])
    out = np.empty(count)
    for rows, w in groups:
        out[rows] = fn(w)
    return out


class _Refreshes:
    """The windows on which ``Window.stats()`` would recompute its statistics while a rule pushes ``xs``
    one by one, asking for them before each push once the window holds ``min_len`` values (A1, A2, C3
    and D2 do). The walk judges a value by the statistics of the last refresh, not the batch start's, so a
    fast path must too: values ``xs[first:]`` are judged in blocks of ``refresh``, each by its refresh.
    ``ok`` is False where the walk would take the median of an empty window: leave that to the walk.
    The arrays are made on first use: a fast path that settles the batch by a bound needs none."""

    def __init__(self, win: "Window", xs: list[float], min_len: int):
        self.n0, self.size, self.m = n0, size, m = len(win.values), win.size, len(xs)
        self.ok = win._stats is None and n0 <= size
        self.first = m if size < min_len else min(m, max(0, min_len - n0))
        self.count = 0
        if not self.ok or self.first >= m:
            return
        if n0 + self.first == 0:
            self.ok = False
            return
        self.win, self.xs, self.refresh = win, xs, win.refresh
        self.count = len(range(self.first, m, self.refresh))

    @functools.cached_property
    def arr(self) -> np.ndarray:
        return np.concatenate((self.win.array(), np.asarray(self.xs, dtype=np.float64)))

    @functools.cached_property
    def groups(self) -> list:
        hi = self.n0 + np.arange(self.first, self.m, self.refresh)
        return _slices(self.arr, np.maximum(hi - self.size, 0), hi)

    @functools.cached_property
    def med(self) -> np.ndarray:
        return _per_slice(self.groups, self.count, _medians)

    def per_value(self, per_refresh: np.ndarray) -> np.ndarray:
        """Per judged value (the tests hold this against a Window fed one value at a time)."""
        return np.repeat(per_refresh, np.minimum(self.refresh, self.m - np.arange(self.first, self.m, self.refresh)))

    def block_max(self) -> np.ndarray:
        """The largest value judged by each refresh."""
        return np.maximum.reduceat(self.arr[self.n0 + self.first:], np.arange(0, self.m - self.first, self.refresh))

    def mad(self, rows: np.ndarray) -> np.ndarray:
        """The MAD of the refreshes ``rows`` (a boolean mask), NaN for the others."""
        out = np.full(self.count, np.nan)
        for which, w in self.groups:
            sel = rows[which]
            if sel.any():
                idx = np.arange(self.count)[which][sel]
                out[idx] = _mads(w[sel], self.med[idx])
        return out


def _observe_carriers(rule: "Rule", ctx: Context, state: dict, cfg: dict, steps: list[dict], stat: str,
                      lists: tuple[str, ...] = ()) -> bool:
    """The fast path of a rule that reads one per-layer statistic, sent on few steps (every 100 by the
    agent's defaults): on a step without it observe returns None and changes nothing, so only the steps
    that carry it are observed. A hit among them: the state goes back as it was (``lists``: its lists that
    observe changes in place; the rule's own arrays are reset by ``begin``) and the engine walks the batch."""
    carriers = _steps_with(ctx, steps, stat)
    if not carriers:
        return True
    saved = dict(state)
    for key in lists:
        if isinstance(saved.get(key), list):
            saved[key] = list(saved[key])
    for st in carriers:
        verdict = rule.observe(ctx, state, cfg, st)
        if verdict is not None and verdict is not False:
            state.clear()
            state.update(saved)
            rule.begin(ctx, state, cfg)
            return False
    return True


def _name(names: list[str], i: int) -> str:
    return names[i] if 0 <= i < len(names) else f"#{i}"


def top_grad_norms(ctx: Context, st: dict, k: int = 5) -> Optional[list[list]]:
    """Top-k parameters by grad norm at this step: the agent's event, else the per-layer stats."""
    ev = ctx.events.get("top_grad_norms", {}).get(st["step"])
    if ev and ev.get("params"):
        return [[str(p[0]), enc(num(p[1]))] for p in ev["params"][:k]]
    values = _layer(st, "grad_norm")
    if not values:
        return None
    pairs = []
    for i, v in enumerate(values):
        x = num(v)
        if x is None:
            continue
        pairs.append((math.inf if not math.isfinite(x) else x, i, x))
    pairs.sort(reverse=True)
    return [[_name(ctx.param_names, i), enc(x)] for _, i, x in pairs[:k]]


class Window:
    """A rolling window of finite values in ``state[key]`` with a cached median (and MAD)."""

    def __init__(self, state: dict, key: str, size: int, refresh: int = 8):
        self.state, self.key, self.size, self.refresh = state, key, size, refresh
        raw = state.get(key)
        self._arr: Optional[np.ndarray] = None     # the values as an array while none is pushed (fast paths)
        if isinstance(raw, str):      # stored packed: base64 of little-endian float64
            self._arr = _unpack_f8(raw)
            self.values: list[float] = self._arr.tolist()
        else:
            self.values = list(raw or [])
        self._stats: Optional[tuple[float, float]] = None
        self._since = 0

    def array(self) -> np.ndarray:
        if self._arr is None or len(self._arr) != len(self.values):
            self._arr = np.array(self.values, dtype=np.float64)
        return self._arr

    def save(self) -> None:
        """Write the window back into the state, packed (a JSON string, not a list of numbers)."""
        self.state[self.key] = _pack_f8(self.values)

    def push(self, x: float) -> None:
        self._arr = None
        self.values.append(float(x))
        if len(self.values) > self.size:
            del self.values[: len(self.values) - self.size]
        self._since += 1

    def extend(self, xs: list[float]) -> None:
        self._arr = None
        self.values.extend(xs)
        if len(self.values) > self.size:
            del self.values[: len(self.values) - self.size]
        self._since += len(xs)

    def __len__(self) -> int:
        return len(self.values)

    def stats(self) -> tuple[float, float]:
        # recomputed every `refresh` pushes: one sort per few steps, not per step
        if self._stats is None or self._since >= self.refresh:
            self._stats = median_mad(self.values)
            self._since = 0
        return self._stats


class Rule:
    id = ""
    needs: tuple[str, ...] = ()        # step keys; "layers.<stat>" for per-layer arrays

    @property
    def spec(self):
        return RULES_BY_ID[self.id]

    def applies(self, steps: list[dict], ctx: Context) -> bool:
        return any(key in ctx.present for key in self.needs)

    def begin(self, ctx: Context, state: dict, cfg: dict) -> None:
        """Called once per batch before the steps."""

    def end(self, ctx: Context, state: dict, cfg: dict) -> None:
        """Called once per batch after the steps: windows (and a rule's own arrays) go back into the state."""
        for value in vars(self).values():
            if isinstance(value, Window):
                value.save()

    def fast(self, ctx: Context, state: dict, cfg: dict, steps: list[dict]) -> bool:
        """Batch fast path for a rule that is not firing: if the whole batch provably holds no hit,
        update the state in bulk and return True; otherwise leave the state alone and return False
        (the engine then walks the steps one by one)."""
        return False

    def event_hits(self, ctx: Context, state: dict, cfg: dict) -> list:
        """Hits that come from the batch's events rather than its steps: [(step, Hit)]."""
        return []

    def observe(self, ctx: Context, state: dict, cfg: dict, st: dict):
        raise NotImplementedError


# --------------------------------------------------------------------------- A: NaN / Inf

class LossNonfinite(Rule):
    id = "A1"
    needs = ("loss",)

    def begin(self, ctx, state, cfg):
        self.gn = Window(state, "gn", 50, refresh=4)

    def fast(self, ctx, state, cfg, steps):
        losses = _column(ctx, steps, "loss")
        present = [x for x in losses if x is not None]
        if not _all_finite(present):
            return False
        gns = _column(ctx, steps, "grad_norm")
        if len(present) == len(losses):
            seen = [g for g in gns if g is not None]
        else:
            seen = [g for x, g in zip(losses, gns) if x is not None and g is not None]
        if not seen:
            return True
        push = seen if _all_finite(seen) else [g for g in seen if math.isfinite(g)]
        if push and not self._pushes_all(push, cfg["explode_factor"]):
            return False
        last = seen[-1]
        state["prev_gn"] = last if math.isfinite(last) else "NaN"
        self.gn.extend(push)
        return True

    def _pushes_all(self, push: list[float], factor: float) -> bool:
        """Whether the walk would push every one of ``push``: none above ``factor`` x the median in force.

        Every median the walk takes is one of a window made of the stored values and these, so it is at
        least their minimum: below factor x that, nothing is a spike. Otherwise the medians themselves."""
        stored = self.gn.values
        lowest = min(min(push), min(stored)) if stored else min(push)
        if max(push) <= factor * lowest:
            return True
        r = _Refreshes(self.gn, push, 5)
        return r.ok and not (r.count and (r.block_max() > factor * r.med).any())

    def observe(self, ctx, state, cfg, st):
        loss = num(st.get("loss"))
        gn = num(st.get("grad_norm"))
        if loss is None:
            return None
        if math.isfinite(loss):
            if finite(gn):
                state["prev_gn"] = gn
                med = self.gn.stats()[0] if len(self.gn) >= 5 else None
                # leave spikes out of the baseline, as A2 does
                if med is None or gn <= cfg["explode_factor"] * med:
                    self.gn.push(gn)
            elif gn is not None:
                state["prev_gn"] = "NaN"
            return False
        before = state.get("prev_gn")
        med = self.gn.stats()[0] if len(self.gn) >= 5 else None
        ev: dict[str, Any] = {"loss": enc(loss), "grad_norm": enc(gn), "grad_norm_before": before,
                              "grad_norm_median": med, "overflow": st.get("overflow"),
                              "loss_scale": enc(num(st.get("loss_scale")))}
        inputs_bad = (num(st.get("input_nonfinite")) or 0) > 0
        actions = list(self.spec.actions)
        if inputs_bad:
            ev["input_nonfinite"] = st.get("input_nonfinite")
            cause = "inputs"
            diagnosis = ("The loss became NaN/Inf at a step whose input batch held non-finite values: "
                         "the data pipeline, not the model, produced it.")
            actions = [actions[3], actions[0], actions[2]]
        elif before == "NaN" or (finite(before) and med is not None and before > cfg["explode_factor"] * med):
            cause = "grad_explosion_first"
            diagnosis = (f"The gradient norm exploded first (last grad norm {fmt(num(before))}, "
                         f"{fmt(num(before) / med) if finite(num(before)) and med else 'non-finite'}x its median "
                         f"{fmt(med)}), then the loss became NaN/Inf.")
            actions = [actions[1], actions[2], actions[0], actions[3]]
        elif med is not None:
            cause = "loss_computation"
            diagnosis = (f"The loss became NaN/Inf while the grad norm was normal (last {fmt(num(before))}, "
                         f"median {fmt(med)}): the loss computation itself produced it.")
        else:
            cause = "unknown"
            diagnosis = "The loss became NaN/Inf before a grad-norm history was available."
        ev["cause"] = cause
        origin = state.get("nan_origin")
        if origin:
            ev["nan_origin"] = origin
        top = top_grad_norms(ctx, st)
        if top:
            ev["top_grad_norms"] = top
        skipped = " (the scaler skipped the step)" if st.get("overflow") else ""
        return Hit(ev, f"Loss is {fmt(loss)} at step {st['step']}{skipped}; cause: {cause.replace('_', ' ')}",
                   diagnosis=diagnosis, actions=actions)


class GradExplosion(Rule):
    id = "A2"
    needs = ("grad_norm",)

    def begin(self, ctx, state, cfg):
        self.win = Window(state, "gn", int(cfg["window"]))

    def fast(self, ctx, state, cfg, steps):
        gns = _column(ctx, steps, "grad_norm")
        push = [g for g in gns if g is not None]
        if not _all_finite(push):
            push = []
            for st, g in zip(steps, gns):
                if g is None:
                    continue
                if math.isfinite(g):
                    push.append(g)
                elif not (st.get("overflow") or st.get("loss_scale") is not None):
                    return False         # non-finite with no scaler to skip the step: a hit
        if not push:
            return True
        factor, stored = cfg["factor"], self.win.values
        # every median the walk takes is one of a window of stored and new values: at least their minimum
        lowest = min(min(push), min(stored)) if stored else min(push)
        if max(push) > factor * lowest:
            r = _Refreshes(self.win, push, cfg["min_history"])
            if not r.ok or (r.count and ((r.med > 0) & (r.block_max() > factor * r.med)).any()):
                return False
        self.win.extend(push)
        return True

    def observe(self, ctx, state, cfg, st):
        gn = num(st.get("grad_norm"))
        if gn is None:
            return None
        if not math.isfinite(gn):
            if st.get("overflow") or st.get("loss_scale") is not None:
                return None          # a scaler is there and skips the step: A5 / A1 territory
            ev = {"grad_norm": enc(gn), "no_scaler": True, "top_grad_norms": top_grad_norms(ctx, st)}
            if state.get("nan_origin"):
                ev["nan_origin"] = state["nan_origin"]
            return Hit(ev, f"Grad norm is {fmt(gn)} at step {st['step']} and no GradScaler skipped the step")
        if len(self.win) >= cfg["min_history"]:
            med = self.win.stats()[0]
            if med > 0 and gn > cfg["factor"] * med:
                ev = {"grad_norm": gn, "median": med, "ratio": gn / med,
                      "clip_max_norm": st.get("clip_max_norm"), "top_grad_norms": top_grad_norms(ctx, st)}
                names = ", ".join(p[0] for p in (ev["top_grad_norms"] or [])[:3])
                return Hit(ev, f"Grad norm {fmt(gn)} at step {st['step']} is {gn / med:.0f}x its median {fmt(med)}"
                               + (f"; largest: {names}" if names else ""))
        self.win.push(gn)
        return False


class NanOrigin(Rule):
    id = "A3"
    needs = ("loss",)

    def applies(self, steps, ctx):
        return bool(ctx.events.get("nan_origin"))

    def event_hits(self, ctx, state, cfg) -> list[tuple[int, Hit]]:
        hits = []
        for step, origin in sorted(ctx.events.get("nan_origin", {}).items()):
            module = origin.get("module", "?")
            where = origin.get("where", "activation")
            hits.append((step, Hit({"module": module, "where": where,
                                    **{k: enc(v) for k, v in origin.items() if k not in ("module", "where")}},
                                   f"First non-finite {where} at step {step} in module {module}",
                                   diagnosis=f"The NaN/Inf started in `{module}` ({where}): that layer's "
                                             f"activations or gradients overflowed.")))
        return hits

    def observe(self, ctx, state, cfg, st):
        loss = num(st.get("loss"))
        if loss is None:
            return None
        return False if math.isfinite(loss) else None


class InputNonfinite(Rule):
    id = "A4"
    needs = ("input_nonfinite",)

    def fast(self, ctx, state, cfg, steps):
        values = _column(ctx, steps, "input_nonfinite", as_float=False)
        if values.count(None) + values.count(0) == len(values):
            return True
        return not any((num(v) or 0) > 0 for v in values)

    def observe(self, ctx, state, cfg, st):
        n = num(st.get("input_nonfinite"))
        if n is None:
            return None
        if n > 0:
            return Hit({"input_nonfinite": int(n)}, f"{int(n)} non-finite values in the input batch at step {st['step']}")
        return False


class OverflowStorm(Rule):
    id = "A5"
    needs = ("overflow",)

    def fast(self, ctx, state, cfg, steps):
        overflows = _column(ctx, steps, "overflow", as_float=False)
        if any(overflows):
            return False
        if overflows.count(None) == len(overflows):
            return True
        skipped = list(state.get("skipped") or ())
        if skipped:
            # the skips of a storm that just ended can still fill the window past the fraction: a hit
            window = int(cfg["window"])
            limit = cfg["fraction"] * window
            for st, ov in zip(steps, overflows):
                if ov is None:
                    continue
                cutoff = st["step"] - window
                while skipped and skipped[0] <= cutoff:
                    skipped.pop(0)
                if len(skipped) > limit:
                    return False
        state["skipped"] = skipped
        state["consecutive"] = 0
        return True

    def observe(self, ctx, state, cfg, st):
        ov = st.get("overflow")
        if ov is None:
            return None
        window = int(cfg["window"])
        skipped: list[int] = state.setdefault("skipped", [])
        if ov:
            state["consecutive"] = state.get("consecutive", 0) + 1
            skipped.append(st["step"])
        else:
            state["consecutive"] = 0
        cutoff = st["step"] - window
        while skipped and skipped[0] <= cutoff:
            skipped.pop(0)
        consecutive = state["consecutive"]
        if consecutive >= cfg["consecutive"] or len(skipped) > cfg["fraction"] * window:
            ev = {"consecutive_skipped": consecutive, "skipped_in_window": len(skipped), "window": window,
                  "loss_scale": enc(num(st.get("loss_scale"))), "overflow_count": st.get("overflow_count")}
            return Hit(ev, f"{consecutive} consecutive skipped steps, {len(skipped)} of the last {window} "
                           f"(loss scale {fmt(num(st.get('loss_scale')))})")
        return False


# --------------------------------------------------------------------------- B: training stalls

class VanishingGrad(Rule):
    id = "B1"
    needs = ("grad_norm",)

    def fast(self, ctx, state, cfg, steps):
        gns = _column(ctx, steps, "grad_norm")
        overflows = _column(ctx, steps, "overflow", as_float=False)
        judged = [g for g in gns if g is not None]
        if any(overflows) or not _all_finite(judged):
            judged = [g for g, ov in zip(gns, overflows) if g is not None and not ov and math.isfinite(g)]
        if judged and min(judged) < cfg["threshold"]:
            return False
        if judged:
            state["streak"] = 0
            state.pop("since", None)
        return True

    def observe(self, ctx, state, cfg, st):
        gn = num(st.get("grad_norm"))
        if gn is None or not math.isfinite(gn) or st.get("overflow"):
            return None
        if gn < cfg["threshold"]:
            state["streak"] = state.get("streak", 0) + 1
            state.setdefault("since", st["step"])
            if state["streak"] >= cfg["steps"]:
                return Hit({"grad_norm": gn, "steps_below": state["streak"], "since_step": state["since"],
                            "threshold": cfg["threshold"]},
                           f"Grad norm {fmt(gn)} < {cfg['threshold']:g} for {state['streak']} steps")
            return None
        state["streak"] = 0
        state.pop("since", None)
        return False


class LossPlateau(Rule):
    id = "B2"
    needs = ("loss",)
    CHUNKS = 20

    def fast(self, ctx, state, cfg, steps):
        # the walk in bulk: a chunk's worth of losses at a time, judged where a chunk completes
        losses = _column(ctx, steps, "loss")
        gns = _column(ctx, steps, "grad_norm")
        if None in losses or not _all_finite(losses):
            keep = [x is not None and math.isfinite(x) for x in losses]
            losses = [x for x, k in zip(losses, keep) if k]
            gns = [g for g, k in zip(gns, keep) if k]
        if not losses:
            return True
        threshold = RULES_BY_ID["B1"].params["threshold"]
        measured = [g for g in gns if g is not None]
        # the usual batch: every grad norm finite and above B1's threshold, no chunk gets flagged
        any_bad = bool(measured) and (not _all_finite(measured) or min(measured) < threshold)
        chunk_len = max(1, int(cfg["window"]) // self.CHUNKS)
        buf = list(state.get("buf") or ())
        chunks = state.get("chunks")
        # "gn_bad" as the walk keeps it: set by a bad grad norm, taken into the chunk that completes
        has_bad, gn_bad = "gn_bad" in state, state.get("gn_bad")
        first = state.get("first")
        has_first = "first" in state
        pos, n = 0, len(losses)
        while pos < n:
            end = min(n, pos + chunk_len - len(buf))
            buf.extend(losses[pos:end])
            if any_bad and any(g is not None and (not math.isfinite(g) or g < threshold) for g in gns[pos:end]):
                has_bad, gn_bad = True, True
            pos = end
            if len(buf) < chunk_len:
                break
            chunks = list(chunks or ())
            chunks.append([median(buf), bool(gn_bad) if has_bad else False])
            buf, has_bad, gn_bad = [], False, None
            if not has_first:
                first, has_first = chunks[0][0], True
            if len(chunks) > self.CHUNKS:
                del chunks[: len(chunks) - self.CHUNKS]
            if len(chunks) >= self.CHUNKS and self._plateau(chunks, first, cfg) is not None:
                return False
        state["buf"] = buf
        if chunks is not None:
            state["chunks"] = chunks
        if has_first:
            state["first"] = first
        if has_bad:
            state["gn_bad"] = gn_bad
        else:
            state.pop("gn_bad", None)
        return True

    def _plateau(self, chunks: list, first: float, cfg: dict) -> Optional[Hit]:
        # the first and the last quarter of the window, each as the median of its chunk medians
        quarter = self.CHUNKS // 4
        start, end = median(c[0] for c in chunks[:quarter]), median(c[0] for c in chunks[-quarter:])
        improvement = (start - end) / abs(start) if start else 0.0
        gn_normal = not any(bad for _, bad in chunks)
        converged = abs(end) < (1.0 - cfg["converged_drop"]) * abs(first)
        if improvement < cfg["min_improvement"] and gn_normal and not converged:
            ev = {"loss_median_start": start, "loss_median_end": end, "improvement": improvement,
                  "window": int(cfg["window"]), "first_loss_median": first}
            return Hit(ev, f"Loss median {fmt(end)} improved {improvement:.1%} over the last {int(cfg['window'])} "
                           f"steps (needs {cfg['min_improvement']:.0%}); grad norm is normal")
        return None

    def observe(self, ctx, state, cfg, st):
        # walked on every step while the rule fires (a plateau lasts): num() only where the value is no float
        loss = st.get("loss")
        if loss.__class__ is not float:
            loss = num(loss)
            if loss is None:
                return None
        if not math.isfinite(loss):
            return None
        chunk_len = max(1, int(cfg["window"]) // self.CHUNKS)
        buf = state.setdefault("buf", [])
        buf.append(loss)
        gn = st.get("grad_norm")
        if gn.__class__ is not float:
            gn = num(gn)
        # grad norm "normal": finite and not vanishing (B1's threshold)
        if gn is not None and (not math.isfinite(gn) or gn < RULES_BY_ID["B1"].params["threshold"]):
            state["gn_bad"] = True
        if len(buf) < chunk_len:
            return None
        chunks = state.setdefault("chunks", [])
        chunks.append([median(buf), bool(state.pop("gn_bad", False))])
        buf.clear()
        if "first" not in state:
            state["first"] = chunks[0][0]
        if len(chunks) > self.CHUNKS:
            del chunks[: len(chunks) - self.CHUNKS]
        if len(chunks) < self.CHUNKS:
            return None
        hit = self._plateau(chunks, state["first"], cfg)
        return False if hit is None else hit


class LossScaleCollapse(Rule):
    id = "B3"
    needs = ("loss_scale",)

    def fast(self, ctx, state, cfg, steps):
        scales = _column(ctx, steps, "loss_scale")
        overflows = _column(ctx, steps, "overflow", as_float=False)
        prev, settled, min_scale, need = state.get("prev"), state.get("settled"), cfg["min_scale"], cfg["halvings"]
        if (prev is not None and not state.get("halvings") and need > 0 and not prev < min_scale
                and scales.count(prev) == len(scales)):
            # the usual batch: the scale stays where it was, so nothing halves, grows or falls below the floor
            state["prev"] = scales[-1]
            state["halvings"] = []
            if not settled and any(ov is False for ov in overflows):
                state["settled"] = True
            return True
        # the walk in bulk, on local copies
        window = int(cfg["window"])
        halvings = list(state.get("halvings") or ())
        seen = False
        for st, scale, ov in zip(steps, scales, overflows):
            if scale is None or not math.isfinite(scale):
                continue
            seen = True
            step = st["step"]
            if prev is not None:
                if scale < prev and settled:
                    halvings.append(step)
                elif scale > prev:
                    halvings.clear()
            prev = scale
            if ov is False:
                settled = True
            cutoff = step - window
            while halvings and halvings[0] <= cutoff:
                halvings.pop(0)
            if scale < min_scale or len(halvings) >= need:
                return False
        if seen:
            state["prev"] = prev
            state["halvings"] = halvings
            if settled and not state.get("settled"):
                state["settled"] = True
        return True

    def observe(self, ctx, state, cfg, st):
        scale = num(st.get("loss_scale"))
        if scale is None or not math.isfinite(scale):
            return None
        prev = state.get("prev")
        halvings: list[int] = state.setdefault("halvings", [])
        if prev is not None:
            if scale < prev and state.get("settled"):
                halvings.append(st["step"])
            elif scale > prev:
                halvings.clear()
        state["prev"] = scale
        if st.get("overflow") is False:
            # the scaler's start-up calibration (halving from too high an init_scale) is not a collapse
            state["settled"] = True
        cutoff = st["step"] - int(cfg["window"])
        while halvings and halvings[0] <= cutoff:
            halvings.pop(0)
        if scale < cfg["min_scale"]:
            return Hit({"loss_scale": scale, "min_scale": cfg["min_scale"], "halvings": len(halvings)},
                       f"Loss scale fell to {fmt(scale)} (< {cfg['min_scale']:g}) at step {st['step']}")
        if len(halvings) >= cfg["halvings"]:
            return Hit({"loss_scale": scale, "halvings": len(halvings), "halved_at": halvings[-10:],
                        "window": int(cfg["window"])},
                       f"Loss scale halved {len(halvings)} times with no growth (now {fmt(scale)})")
        return False


class LrZero(Rule):
    id = "B4"
    needs = ("lr",)

    def fast(self, ctx, state, cfg, steps):
        lrs = _column(ctx, steps, "lr")
        if 0 in _column(ctx, steps, "step", as_float=False):
            lrs = [x for st, x in zip(steps, lrs) if st["step"] != 0]
        lrs = [x for x in lrs if x is not None]
        if 0.0 in lrs:
            return False
        if lrs:
            # max() folds left as the walk's max(peak, lr) does, a NaN included
            state["peak"] = max([state.get("peak", 0.0), *lrs])
            state["streak"] = 0
            state.pop("since", None)
        return True

    def observe(self, ctx, state, cfg, st):
        lr = num(st.get("lr"))
        if lr is None or st["step"] == 0:
            return None
        if lr == 0:
            state["streak"] = state.get("streak", 0) + 1
            state.setdefault("since", st["step"])
            if state["streak"] >= cfg["steps"]:
                return Hit({"lr": lr, "steps_at_zero": state["streak"], "since_step": state["since"],
                            "peak_lr": state.get("peak")},
                           f"Learning rate is 0 for {state['streak']} steps (since step {state['since']})")
            return None
        state["peak"] = max(state.get("peak", 0.0), lr)
        state["streak"] = 0
        state.pop("since", None)
        return False


class DeadParams(Rule):
    id = "B5"
    needs = ("layers.grad_norm",)

    def fast(self, ctx, state, cfg, steps):
        # the walk in bulk on a copy of zero_since: only every steps/10-th step is looked at, and the cheap
        # test (the step number) comes first
        every = max(1, int(cfg["steps"]) // 10)
        last = state.get("last", -10**12)
        zero_since: Optional[dict] = None
        for st in steps:
            step = st["step"]
            if step - last < every or not _layer_present(st, "grad_norm") or st.get("overflow"):
                continue
            last = step
            if zero_since is None:
                zero_since = dict(state.get("zero_since") or {})
            # every value positive (a NaN fails this, and a null is a NaN in the array): no 0.0 nor None,
            # every parameter has a gradient; told without making the Python list
            if _layer_array(st, "grad_norm").min() > 0:
                zero_since.clear()
                continue
            values = _layer(st, "grad_norm")
            zero = {str(i) for i, v in enumerate(values) if not v}
            for key in [k for k in zero_since if k not in zero]:
                del zero_since[key]
            for key in zero:
                if key not in zero_since:
                    zero_since[key] = step
            if any(step - s0 >= cfg["steps"] for s0 in zero_since.values()):
                return False
        if zero_since is not None:
            state["last"] = last
            state["zero_since"] = zero_since
        return True

    def observe(self, ctx, state, cfg, st):
        if not _layer_present(st, "grad_norm") or st.get("overflow"):
            return None
        step = st["step"]
        if step - state.get("last", -10**12) < max(1, int(cfg["steps"]) // 10):
            return None               # looked at every steps/10 steps: enough to time a 50-step silence
        values = _layer(st, "grad_norm")
        state["last"] = step
        zero_since: dict[str, int] = state.setdefault("zero_since", {})
        # None (no .grad) and 0.0 are falsy, NaN is not: one pass in C, then set arithmetic
        zero = {str(i) for i, v in enumerate(values) if not v} if not all(values) else set()
        for key in [k for k in zero_since if k not in zero]:
            del zero_since[key]
        for key in zero:
            if key not in zero_since:
                zero_since[key] = step
        if not zero_since:
            return False
        dead = sorted(int(k) for k, s0 in zero_since.items() if step - s0 >= cfg["steps"])
        if dead:
            names = [_name(ctx.param_names, i) for i in dead]
            shown = ", ".join(names[: int(cfg["max_names"])]) + (" …" if len(names) > cfg["max_names"] else "")
            return Hit({"params": names[:50], "count": len(dead), "steps": int(cfg["steps"])},
                       f"{len(dead)} trainable parameter(s) without gradient for >= {int(cfg['steps'])} steps: {shown}")
        return False


# --------------------------------------------------------------------------- C: oscillation

class LossOscillation(Rule):
    id = "C1"
    needs = ("loss",)
    EVERY = 10

    def begin(self, ctx, state, cfg):
        self.win = Window(state, "loss", int(cfg["window"]), refresh=1)

    def fast(self, ctx, state, cfg, steps):
        xs = [x for x in _column(ctx, steps, "loss") if x is not None]
        if not _all_finite(xs):
            xs = [x for x in xs if math.isfinite(x)]
        if not xs:
            return True
        n0 = state.get("n", 0)
        new_start = xs[: max(0, 20 - n0)]
        if self._judged_somewhere(state, cfg, xs, n0):
            return False
        self.win.extend(xs)
        state["n"] = n0 + len(xs)
        if new_start:
            state["start"] = list(state.get("start") or ()) + new_start
        return True

    def _judged_somewhere(self, state: dict, cfg: dict, xs: list[float], n0: int) -> bool:
        """Whether the walk would find the condition at one of the batch's checks (every EVERY-th value,
        on the window as it is then, with the starting level as it is then). True, too, where that is not
        worked out here: the walk then decides."""
        size, stored, m = int(cfg["window"]), self.win.values, len(xs)
        nv = len(stored)
        # value j is judged where n0 + j + 1 is a multiple of EVERY and the window then holds min_history
        j0 = max((-(n0 + 1)) % self.EVERY, cfg["min_history"] - nv - 1)
        j0 += (-(n0 + 1 + j0)) % self.EVERY
        if size < cfg["min_history"] or j0 >= m:
            return False
        # the values the checked windows cover: from the first one's start to the last checked value
        start = max(nv + j0 + 1 - size, 0)
        seen = stored[start:] + xs[max(0, start - nv): m - (m - 1 - j0) % self.EVERY]
        low = min(seen)
        # spread = MAD / |median| <= 1.4826 (max - min) / min for positive values: no oscillation below that
        if low > 0 and MAD_TO_SIGMA * (max(seen) - low) / low <= cfg["spread_ratio"]:
            return False
        js = np.arange(j0, m, self.EVERY)
        hi = nv + js + 1
        lo = np.maximum(hi - size, 0)
        arr = np.concatenate((self.win.array(), np.asarray(xs, dtype=np.float64)))
        if (hi - lo).min() < 3:
            return True               # thirds of fewer than 3 values: the walk's own slicing decides
        start0 = list(state.get("start") or ())
        starts = []
        for j in js.tolist():
            start = start0 + xs[: max(0, min(j + 1, 20 - n0))]
            if not start:
                return True
            starts.append(median(start))
        med, mad, first, last = (np.empty(len(js)) for _ in range(4))
        for rows, w in _slices(arr, lo, hi):
            n = w.shape[1]
            third = n // 3
            med[rows] = m_ = _medians(w)
            mad[rows] = _mads(w, m_)
            first[rows] = _medians(w[:, :third])
            last[rows] = _medians(w[:, n - third:])
        with np.errstate(divide="ignore", invalid="ignore"):
            spread = np.where(med != 0, mad / np.abs(med), np.inf)
        falling = last < first - 0.5 * mad
        converged = np.abs(med) < cfg["converged_fraction"] * np.abs(np.array(starts))
        return bool(((spread > cfg["spread_ratio"]) & ~falling & ~converged).any())

    @staticmethod
    def _condition(vals, start_vals, cfg):
        med, mad = median_mad(vals)
        third = len(vals) // 3
        first, last = median(vals[:third]), median(vals[-third:])
        spread = mad / abs(med) if med else math.inf
        falling = last < first - 0.5 * mad
        start = median(start_vals)
        # a run whose loss already fell far below its start has converged: noise there is not oscillation
        converged = abs(med) < cfg["converged_fraction"] * abs(start)
        if spread > cfg["spread_ratio"] and not falling and not converged:
            return {"loss_median": med, "loss_mad": mad, "spread_ratio": spread, "first_third_median": first,
                    "last_third_median": last, "window": len(vals), "start_loss_median": start}
        return None

    def observe(self, ctx, state, cfg, st):
        loss = num(st.get("loss"))
        if loss is None or not math.isfinite(loss):
            return None
        self.win.push(loss)
        state["n"] = state.get("n", 0) + 1
        if state["n"] <= 20:
            state.setdefault("start", []).append(loss)      # the run's starting level
        if len(self.win) < cfg["min_history"] or state["n"] % self.EVERY:
            return None
        ev = self._condition(self.win.values, state["start"], cfg)
        if ev is not None:
            return Hit(ev, f"Loss oscillates: robust spread {ev['spread_ratio']:.2f}x its median "
                           f"{fmt(ev['loss_median'])}, no downward trend ({fmt(ev['first_third_median'])} -> "
                           f"{fmt(ev['last_third_median'])}), still at "
                           f"{abs(ev['loss_median']) / abs(ev['start_loss_median']):.0%} of its start")
        return False


class ClipSaturation(Rule):
    id = "C2"
    needs = ("clipped",)

    def fast(self, ctx, state, cfg, steps):
        window = int(cfg["window"])
        clipped = _column(ctx, steps, "clipped", as_float=False)
        overflows = _column(ctx, steps, "overflow", as_float=False)
        if any(overflows):
            clipped = [c for c, ov in zip(clipped, overflows) if not ov]
        new = "".join(["1" if c else "0" for c in clipped if c is not None])
        if not new:
            return True               # the walk judges no step and keeps no bits
        bits = state.get("bits", "") + new
        # no window inside bits can hold more ones than bits as a whole
        if len(bits) >= window and bits[-(window + len(new)):].count("1") > cfg["fraction"] * window:
            return False
        state["bits"] = bits[-window:]
        return True

    def observe(self, ctx, state, cfg, st):
        clipped = st.get("clipped")
        if clipped is None or st.get("overflow"):
            return None
        window = int(cfg["window"])
        bits = state.get("bits", "") + ("1" if clipped else "0")
        bits = bits[-window:]
        state["bits"] = bits
        if len(bits) < window:
            return None
        n = bits.count("1")
        if n > cfg["fraction"] * window:
            return Hit({"clipped_steps": n, "window": window, "fraction": n / window,
                        "grad_norm": enc(num(st.get("grad_norm"))), "clip_max_norm": st.get("clip_max_norm")},
                       f"Clipping active on {n} of the last {window} steps ({n / window:.0%}); "
                       f"max_norm {st.get('clip_max_norm')}")
        return False


class LossSpike(Rule):
    id = "C3"
    needs = ("loss",)

    def begin(self, ctx, state, cfg):
        self.win = Window(state, "loss", int(cfg["window"]))

    def fast(self, ctx, state, cfg, steps):
        if state.get("consecutive"):
            return False
        xs = [x for x in _column(ctx, steps, "loss") if x is not None]
        if not _all_finite(xs):
            xs = [x for x in xs if math.isfinite(x)]
        if not xs:
            return True
        stored, factor = self.win.values, cfg["mad_factor"]
        # every median the walk takes is one of a window of stored and new values, so at least their
        # minimum, and for positive values the limit grows with the median: the lowest limit bounds them all
        lowest = min(min(xs), min(stored)) if stored else min(xs)
        if not (lowest > 0 and max(xs) <= lowest + factor * max(0.01 * lowest, 1e-12)):
            r = _Refreshes(self.win, xs, cfg["min_history"])
            if not r.ok:
                return False
            if r.count:
                med, top = r.med, r.block_max()
                # the limit is at least this without the MAD: the MAD only where a value gets above it
                floor = np.maximum(0.01 * np.abs(med), 1e-12)
                need = top > med + factor * floor
                if need.any():
                    limit = med + factor * np.maximum(r.mad(need), floor)
                    if (top[need] > limit[need]).any():
                        return False
        state["consecutive"] = 0
        self.win.extend(xs)
        return True

    def observe(self, ctx, state, cfg, st):
        loss = num(st.get("loss"))
        if loss is None or not math.isfinite(loss):
            return None
        if len(self.win) >= cfg["min_history"]:
            med, mad = self.win.stats()
            mad = max(mad, 0.01 * abs(med), 1e-12)
            limit = med + cfg["mad_factor"] * mad
            if loss > limit:
                state["consecutive"] = state.get("consecutive", 0) + 1
                n = state["consecutive"]
                severity = "critical" if n >= cfg["critical_consecutive"] else None
                ev = {"loss": loss, "median": med, "mad": mad, "limit": limit, "consecutive": n,
                      "z": (loss - med) / mad}
                return Hit(ev, f"Loss spike {fmt(loss)} at step {st['step']} (median {fmt(med)}, "
                               f"{(loss - med) / mad:.0f} MADs above)" + (f"; {n} in a row" if n > 1 else ""),
                           severity=severity)
        state["consecutive"] = 0
        self.win.push(loss)
        return False


# --------------------------------------------------------------------------- D: late divergence

class LateDivergence(Rule):
    id = "D1"
    needs = ("lr",)
    CHUNKS = 10

    def fast(self, ctx, state, cfg, steps):
        lrs = _column(ctx, steps, "lr")
        finite_lrs = [x for x in lrs if x is not None]
        if not _all_finite(finite_lrs):
            finite_lrs = [x for x in finite_lrs if math.isfinite(x)]
        if not finite_lrs:
            return True
        peak0 = state.get("peak", 0.0)
        top = max(peak0, max(finite_lrs))
        if top <= 0 or min(finite_lrs) >= cfg["lr_fraction"] * top:
            # the LR never falls below its fraction of the peak (which only grows): no step is judged
            state["peak"] = top
            if state.get("chunks") or state.get("buf"):
                state["chunks"], state["buf"] = [], []
            return True
        # the LR is low somewhere in the batch: the walk in bulk, on local copies
        losses = _column(ctx, steps, "loss")
        fraction, chunk_len = cfg["lr_fraction"], max(1, int(cfg["window"]) // self.CHUNKS)
        peak = peak0
        buf, chunks = state.get("buf"), state.get("chunks")
        buf = None if buf is None else list(buf)
        chunks = None if chunks is None else list(chunks)
        for lr, loss in zip(lrs, losses):
            if lr is None or not math.isfinite(lr):
                continue
            peak = max(peak, lr)
            if peak <= 0 or lr >= fraction * peak:
                if chunks or buf:
                    chunks, buf = [], []
                continue
            if loss is None or not math.isfinite(loss):
                continue
            if buf is None:
                buf = []
            buf.append(loss)
            if len(buf) < chunk_len:
                continue
            if chunks is None:
                chunks = []
            chunks.append(median(buf))
            buf = []
            if len(chunks) > self.CHUNKS:
                del chunks[: len(chunks) - self.CHUNKS]
            if len(chunks) >= self.CHUNKS and self._rising(chunks, cfg) is not None:
                return False
        state["peak"] = peak
        if buf is not None:
            state["buf"] = buf
        if chunks is not None:
            state["chunks"] = chunks
        return True

    def _rising(self, chunks: list, cfg: dict) -> Optional[tuple[int, float]]:
        ups = sum(1 for a, b in zip(chunks, chunks[1:]) if b > a)
        rise = (chunks[-1] - chunks[0]) / abs(chunks[0]) if chunks[0] else 0.0
        if rise > cfg["min_rise"] and ups >= 0.7 * (self.CHUNKS - 1):
            return ups, rise
        return None

    def observe(self, ctx, state, cfg, st):
        lr = num(st.get("lr"))
        loss = num(st.get("loss"))
        if lr is None or not math.isfinite(lr):
            return None
        peak = max(state.get("peak", 0.0), lr)
        state["peak"] = peak
        if peak <= 0 or lr >= cfg["lr_fraction"] * peak:
            if state.get("chunks") or state.get("buf"):
                state["chunks"], state["buf"] = [], []
            return False
        if loss is None or not math.isfinite(loss):
            return None
        buf = state.setdefault("buf", [])
        buf.append(loss)
        chunk_len = max(1, int(cfg["window"]) // self.CHUNKS)
        if len(buf) < chunk_len:
            return None
        chunks = state.setdefault("chunks", [])
        chunks.append(median(buf))
        buf.clear()
        if len(chunks) > self.CHUNKS:
            del chunks[: len(chunks) - self.CHUNKS]
        if len(chunks) < self.CHUNKS:
            return None
        rising = self._rising(chunks, cfg)
        if rising is not None:
            rise = rising[1]
            return Hit({"lr": lr, "peak_lr": peak, "loss_median_start": chunks[0], "loss_median_end": chunks[-1],
                        "rise": rise, "window": int(cfg["window"])},
                       f"Loss rose {rise:.0%} over {int(cfg['window'])} steps after the LR fell to "
                       f"{fmt(lr)} ({lr / peak:.1%} of its peak {fmt(peak)})")
        return False


class EmaDivergence(Rule):
    id = "D2"
    needs = ("ema_divergence",)
    EVERY = 10

    def begin(self, ctx, state, cfg):
        self.win = Window(state, "div", int(cfg["window"]))

    def fast(self, ctx, state, cfg, steps):
        xs = [x for x in _column(ctx, steps, "ema_divergence") if x is not None]
        if not _all_finite(xs):
            xs = [x for x in xs if math.isfinite(x)]
        if not xs:
            return True
        nv, size, stored, m = len(self.win), self.win.size, self.win.values, len(xs)
        r = _Refreshes(self.win, xs, cfg["min_history"])
        if not r.ok:
            return False
        first = r.first
        if first < m:
            factor = cfg["factor"]
            # each median the walk takes is at least the lowest value of the window it is taken of
            lowest = min(min(xs), min(stored)) if stored else min(xs)
            if max(xs) > factor * lowest and ((r.med > 0) & (r.block_max() > factor * r.med)).any():
                return False
            # the oscillation check of every EVERY-th judged value: the last 50 values up to it
            n0 = state.get("n", 0)
            j0 = first + (-(n0 + 1)) % self.EVERY
            if j0 < m:
                # the values those windows cover: from the first window's start to the last judged value
                start = max(nv + j0 - size, 0, nv + j0 - 49)
                seen = stored[start:] + xs[max(0, start - nv): m - (m - 1 - j0) % self.EVERY]
                low = min(seen)
                # MAD / median <= 1.4826 (max - min) / min for positive values: no oscillation below that
                if not (low > 0 and MAD_TO_SIGMA * (max(seen) - low) / low <= 1.0):
                    hi = nv + np.arange(j0, m, self.EVERY)
                    lo = np.maximum(np.maximum(hi - size, 0), hi - 49)
                    if (hi + 1 - lo).min() < 3:
                        return False
                    for _, w in _slices(r.arr, lo, hi + 1):
                        wmed = _medians(w)
                        d = np.diff(w, axis=1)
                        turns = ((d[:, :-1] * d[:, 1:]) < 0).sum(axis=1)
                        with np.errstate(divide="ignore", invalid="ignore"):
                            if ((wmed > 0) & (_mads(w, wmed) / wmed > 1.0) & (turns > 0.5 * w.shape[1])).any():
                                return False
            state["n"] = n0 + (m - first)
        self.win.extend(xs)
        return True

    @staticmethod
    def _oscillating(recent: list[float]):
        if len(recent) < 3:
            return None
        med, mad = median_mad(recent)
        turns = sum(1 for a, b, c in zip(recent, recent[1:], recent[2:]) if (b - a) * (c - b) < 0)
        if med > 0 and mad / med > 1.0 and turns > 0.5 * len(recent):
            return {"median": med, "mad": mad, "turns": turns}
        return None

    def observe(self, ctx, state, cfg, st):
        d = num(st.get("ema_divergence"))
        if d is None or not math.isfinite(d):
            return None
        if len(self.win) >= cfg["min_history"]:
            med, mad = self.win.stats()
            if med > 0 and d > cfg["factor"] * med:
                return Hit({"ema_divergence": d, "median": med, "ratio": d / med},
                           f"EMA divergence {fmt(d)} is {d / med:.1f}x its median {fmt(med)}")
            state["n"] = state.get("n", 0) + 1
            if state["n"] % self.EVERY == 0:
                # oscillating: over the last 50 values the EMA distance swings by more than its own
                # level, back and forth
                osc = self._oscillating(self.win.values[-49:] + [d])
                if osc:
                    self.win.push(d)
                    return Hit({"ema_divergence": d, **osc, "oscillating": True},
                               f"EMA divergence oscillates: spread {osc['mad'] / osc['median']:.1f}x its median "
                               f"{fmt(osc['median'])}")
        self.win.push(d)
        return False


class BnDrift(Rule):
    id = "D3"
    needs = ("layers.bn_var_norm",)
    # Per-layer history of (step, running_var norm) over the last `window` steps, thinned to <= 64 points.
    # Layers whose histories hold the same steps (the normal case: every layer reported at every sample)
    # share one group, so a step costs a few numpy operations instead of a Python loop per layer:
    # state["g"] = [{"l": [layer indices], "s": [steps], "v": [[value per layer of "l"] per step]}].

    def begin(self, ctx, state, cfg):
        self._live: Optional[list[dict]] = None       # the groups as arrays while the batch lasts

    def fast(self, ctx, state, cfg, steps):
        return _observe_carriers(self, ctx, state, cfg, steps, "bn_var_norm")

    def end(self, ctx, state, cfg):
        if self._live is not None:
            state["g"] = self._merge(self._live)

    def _groups(self, state: dict) -> list[dict]:
        if self._live is not None:
            return self._live
        groups = state.get("g")
        if groups is None:
            groups = []
            old = state.pop("hist", None) or {}      # the earlier layout: {layer: [[step, x], ...]}
            by_steps: dict[tuple, list[int]] = {}
            for key, h in old.items():
                by_steps.setdefault(tuple(p[0] for p in h), []).append(int(key))
            for steps, layers in by_steps.items():
                layers.sort()
                cols = {i: [p[1] for p in old[str(i)]] for i in layers}
                groups.append({"l": layers, "s": list(steps),
                               "v": [[cols[i][k] for i in layers] for k in range(len(steps))]})
        return [{"l": np.asarray(g["l"], dtype=np.int64), "s": np.asarray(g["s"], dtype=np.int64),
                 "v": _unpack_f8(g["v"]).reshape(len(g["s"]), len(g["l"]))} for g in groups]

    def observe(self, ctx, state, cfg, st):
        x = _layer_array(st, "bn_var_norm")
        if x is None:
            return None
        step = st["step"]
        if step < cfg["warmup_steps"]:
            return None
        window = int(cfg["window"])
        with np.errstate(invalid="ignore"):
            valid = np.isfinite(x) & (x > 0)
        n = len(x)
        groups = self._groups(state)
        seen = np.zeros(n, dtype=bool)
        out: list[dict] = []
        best = None                    # (ratio, layer, lo, hi)
        pushed: list[dict] = []
        for g in groups:
            layers = g["l"]
            inside = layers < n
            seen[layers[inside]] = True
            ok = np.zeros(len(layers), dtype=bool)
            ok[inside] = valid[layers[inside]]
            if not ok.any():
                out.append(g)
                continue
            if not ok.all():           # layers without a value at this step keep their history as it is
                out.append({"l": layers[~ok], "s": g["s"], "v": g["v"][:, ~ok]})
                layers = layers[ok]
                v = g["v"][:, ok]
            else:
                v = g["v"]
            pushed.append(self._push(layers, g["s"], v, step, x[layers], window))
        new = np.flatnonzero(valid & ~seen)
        if len(new):
            pushed.append({"l": new, "s": np.array([step], dtype=np.int64), "v": x[new].reshape(1, -1)})
        out.extend(pushed)
        for g in pushed:
            lo, hi = g["v"].min(axis=0), g["v"].max(axis=0)
            ratio = hi / lo
            j = int(np.argmax(ratio))
            r = float(ratio[j])
            if r > cfg["factor"]:
                # equal ratios: the lowest layer index, as a walk over the layers in order finds it
                ties = g["l"][ratio == r]
                i = int(ties.min())
                k = int(np.flatnonzero(g["l"] == i)[0])
                if best is None or r > best[0] or (r == best[0] and i < best[1]):
                    best = (r, i, float(lo[k]), float(hi[k]))
        self._live = out if len(out) == 1 else self._merge(out, as_lists=False)
        if best:
            ratio, i, lo, hi = best
            name = _name(ctx.bn_names, i)
            return Hit({"layer": name, "ratio": ratio, "var_norm_min": lo, "var_norm_max": hi, "window": window},
                       f"BatchNorm {name}: running_var norm changed {ratio:.0f}x within {window} steps "
                       f"({fmt(lo)} -> {fmt(hi)})")
        return False

    @staticmethod
    def _push(layers, steps, v, step, xs, window) -> dict:
        steps = np.append(steps, step)
        v = np.vstack([v, xs.reshape(1, -1)])
        keep = int(np.argmin(steps < step - window))   # leading steps older than the window go
        if keep:
            steps, v = steps[keep:], v[keep:]
        if len(steps) > 64:            # keep the state small: thin out the middle of the window
            drop = np.arange(1, len(steps) - 32, 2)
            mask = np.ones(len(steps), dtype=bool)
            mask[drop] = False
            steps, v = steps[mask], v[mask]
        return {"l": layers, "s": steps, "v": v}

    @staticmethod
    def _merge(groups: list[dict], as_lists: bool = True) -> list[dict]:
        by_steps: dict[bytes, list[dict]] = {}
        for g in groups:
            by_steps.setdefault(g["s"].tobytes(), []).append(g)
        merged = []
        for gs in by_steps.values():
            if len(gs) == 1:
                g = gs[0]
            else:
                layers = np.concatenate([g["l"] for g in gs])
                order = np.argsort(layers, kind="stable")
                g = {"l": layers[order], "s": gs[0]["s"], "v": np.hstack([g["v"] for g in gs])[:, order]}
            merged.append({"l": g["l"].tolist(), "s": g["s"].tolist(), "v": _pack_f8(g["v"])} if as_lists else g)
        return merged


# --------------------------------------------------------------------------- E: layer statistics

class ActivationJump(Rule):
    id = "E1"
    needs = ("layers.act_std",)
    # Per-module baselines kept as arrays for the batch (state on disk: "h" = the last `history`
    # accepted samples per module, "m" = the cached baseline median per module or None), so a step
    # is a few numpy operations over all modules rather than a Python loop.

    def begin(self, ctx, state, cfg):
        self._loaded = False

    def fast(self, ctx, state, cfg, steps):
        return _observe_carriers(self, ctx, state, cfg, steps, "act_std")

    def _load(self, state: dict, cfg: dict) -> None:
        history = int(cfg["history"])
        if isinstance(state.get("vals"), dict):        # the earlier layout: {"0": [...], ...}
            old, meds = state.pop("vals"), state.pop("med", None) or {}
            n = 1 + max((int(k) for k in old), default=-1)
            state["h"] = [old.get(str(i), []) for i in range(n)]
            state["m"] = [meds.get(str(i)) for i in range(n)]
        if "hb" in state:                               # packed: see end()
            self.n = np.asarray(state["n"], dtype=np.int64)
            self.H = _unpack_f8(state["hb"]).reshape(len(self.n), -1) if len(self.n) else np.full((0, history), np.nan)
            if self.H.shape[1] < history:
                self.H = np.hstack([self.H, np.full((len(self.n), history - self.H.shape[1]), np.nan)])
            self.M = _unpack_f8(state["mb"])
            self._loaded = True
            return
        rows, meds = state.pop("h", None) or [], state.pop("m", None) or []
        width = max([history, *(len(r) for r in rows)])
        self.H = np.full((len(rows), width), np.nan)
        self.n = np.zeros(len(rows), dtype=np.int64)
        for i, r in enumerate(rows):
            self.H[i, :len(r)] = r
            self.n[i] = len(r)
        self.M = np.array([np.nan if m is None else m for m in meds] + [np.nan] * (len(rows) - len(meds)),
                          dtype=np.float64)
        self._loaded = True

    def _grow(self, size: int) -> None:
        extra = size - len(self.n)
        if extra > 0:
            self.H = np.vstack([self.H, np.full((extra, self.H.shape[1]), np.nan)])
            self.n = np.concatenate([self.n, np.zeros(extra, dtype=np.int64)])
            self.M = np.concatenate([self.M, np.full(extra, np.nan)])

    def _uniform_step(self, x: np.ndarray, cfg: dict, history: int) -> bool:
        """The common step: every module finite, all with the same number of samples, none jumping.
        Same result as the general path below, in fewer array operations; False: take that path."""
        H, n, M = self.H, self.n, self.M
        if not len(n):
            return False
        k = int(n[0])
        if (n != k).any() or not np.isfinite(x).all():
            return False
        if k >= cfg["min_history"]:
            need = np.isnan(M)
            if need.any():
                M[need] = _np_medians(H[need, :k])
            if ((M > 0) & (x >= cfg["factor"] * M)).any():
                return False          # a jump: the general path finds and reports it
        if k >= history:
            H[:, :k - 1] = H[:, 1:k]
            H[:, k - 1] = x
        else:
            H[:, k] = x
            n += 1
            k += 1
        if k % 4 == 0:
            M[:] = np.nan
        return True

    def end(self, ctx, state, cfg):
        if not self._loaded:
            return
        # "n": samples per module, "hb": the modules' samples as one packed matrix (row i, first n[i]
        # columns), "mb": the cached baseline medians (NaN: to be recomputed)
        width = int(self.n.max()) if len(self.n) else 0
        state["n"] = self.n.tolist()
        state["hb"] = _pack_f8(self.H[:, :width])
        state["mb"] = _pack_f8(self.M)

    def observe(self, ctx, state, cfg, st):
        x = _layer_array(st, "act_std")
        if x is None:
            return None
        if not self._loaded:
            self._load(state, cfg)
        history = int(cfg["history"])
        self._grow(len(x))
        H, n, M = self.H, self.n, self.M
        worst = None
        if len(x) == len(n) and self._uniform_step(x, cfg, history):
            return False
        idx = np.flatnonzero(np.isfinite(x))
        if len(idx):
            xs = x[idx]
            judged = n[idx] >= cfg["min_history"]
            need = idx[judged & np.isnan(M[idx])]
            for k in np.unique(n[need]).tolist():         # baseline medians not cached: one per length
                rows = need[n[need] == k]
                M[rows] = _np_medians(H[rows, :k])
            med = M[idx]
            with np.errstate(invalid="ignore"):
                flagged = judged & (med > 0) & (xs >= cfg["factor"] * med)
            if flagged.any():
                ratios = np.where(flagged, xs / np.where(flagged, med, 1.0), -np.inf)
                j = int(np.argmax(ratios))           # the first module with the largest ratio
                worst = (int(idx[j]), float(ratios[j]), float(med[j]), float(xs[j]))
            # a flagged jump stays out of the baseline; the others are appended (oldest out when full)
            take, xt = idx[~flagged], xs[~flagged]
            full = n[take] >= history
            for k in np.unique(n[take[full]]).tolist():  # k == history, or more after a config change
                sel = full & (n[take] == k)
                rows = take[sel]
                H[rows, :k - 1] = H[rows, 1:k]
                H[rows, k - 1] = xt[sel]
            rows = take[~full]
            if len(rows):
                H[rows, n[rows]] = xt[~full]
                n[rows] += 1
            refresh = take[n[take] % 4 == 0]          # the baseline median is refreshed every 4 samples
            M[refresh] = np.nan
        if worst:
            i, ratio, med, x = worst
            name = _name(ctx.module_names, i)
            return Hit({"module": name, "act_std": x, "median": med, "ratio": ratio},
                       f"Activation std of {name} jumped to {fmt(x)}, {ratio:.0f}x its median {fmt(med)}")
        return False


class WeightNormGrowth(Rule):
    id = "E2"
    needs = ("layers.weight_norm",)
    SAMPLES = 10                      # samples kept per window (all parameters share the sample steps)
    # State: "steps" = the sample steps; "vb" = the samples' weight norms packed one after another (NaN:
    # no usable value), "vn" = their lengths. The earlier layout ("vals": a JSON list per sample, null for
    # no value) is read too; it cost far more to parse and print on every batch than the rule itself.

    def begin(self, ctx, state, cfg):
        self._samples: Optional[list[np.ndarray]] = None

    def _load(self, state: dict) -> list[np.ndarray]:
        if self._samples is None:
            old = state.pop("vals", None)
            if old is not None:
                samples = [np.array([math.nan if v is None else v for v in row], dtype=np.float64) for row in old]
                state.pop("vb", None)
                state.pop("vn", None)
            else:
                lengths = state.get("vn") or []
                flat = _unpack_f8(state.get("vb") or "")
                samples = np.split(flat, np.cumsum(lengths)[:-1].tolist()) if lengths else []
            steps = state.get("steps") or []
            if len(samples) != len(steps):       # one of them cut short: keep the samples both still hold
                keep = min(len(samples), len(steps))
                samples, state["steps"] = samples[len(samples) - keep:], steps[len(steps) - keep:]
            self._samples = samples
        return self._samples

    def end(self, ctx, state, cfg):
        if self._samples is not None:
            state["vn"] = [len(v) for v in self._samples]
            state["vb"] = _pack_f8(np.concatenate(self._samples) if self._samples else np.empty(0))

    def fast(self, ctx, state, cfg, steps):
        return _observe_carriers(self, ctx, state, cfg, steps, "weight_norm", lists=("steps", "vals"))

    def observe(self, ctx, state, cfg, st):
        if not _layer_present(st, "weight_norm"):
            return None
        step = st["step"]
        window = int(cfg["window"])
        if step - state.get("last", -10**12) < max(1, window // self.SAMPLES):
            return None
        x = _layer_array(st, "weight_norm")
        state["last"] = step
        samples = self._load(state)
        steps: list[int] = state.setdefault("steps", [])
        steps.append(step)
        with np.errstate(invalid="ignore"):
            samples.append(np.where(np.isfinite(x) & (x > 0), x, np.nan))   # null, non-finite, <= 0: no value
        while len(steps) > 1 and steps[1] <= step - window:  # keep one sample at or before the window start
            steps.pop(0)
            samples.pop(0)
        if len(steps) < cfg["min_samples"] or step - steps[0] < window:
            return False
        first, last = samples[0], samples[-1]
        n = min(len(first), len(last))
        a, b = first[:n], last[:n]
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            grew = b / a - 1.0
            idx = np.flatnonzero(~np.isnan(a) & ~np.isnan(b) & (grew > cfg["growth"]))
            if len(idx):
                # and monotonically: each sample at least 0.999 x the one before (a missing value breaks it)
                series = np.full((len(samples), len(idx)), np.nan)
                for k, v in enumerate(samples):
                    inside = idx < len(v)
                    series[k, inside] = v[idx[inside]]
                idx = idx[(series[1:] >= series[:-1] * 0.999).all(axis=0)]
        if len(idx):
            growing = sorted(zip(grew[idx].tolist(), idx.tolist(), a[idx].tolist(), b[idx].tolist()), reverse=True)
            g, i, a0, b0 = growing[0]
            names = [_name(ctx.param_names, j) for _, j, _, _ in growing]
            return Hit({"params": names[:10], "count": len(names), "growth": g, "weight_norm_start": a0,
                        "weight_norm_end": b0, "window": window},
                       f"Weight norm of {names[0]} grew {g:.0%} monotonically over {window} steps"
                       + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""))
        return False


_weights_only_cache: dict[tuple, np.ndarray] = {}   # (param names, bn names) -> indices E3 judges


class UpdateRatio(Rule):
    id = "E3"
    needs = ("layers.update_ratio",)

    def begin(self, ctx, state, cfg):
        # weights only: a bias or a norm layer's gain starting at 0 / 1 has a meaningless ratio early on
        key = (tuple(ctx.param_names), tuple(ctx.bn_names))
        keep = _weights_only_cache.get(key)
        if keep is None:   # names x prefixes string tests: worth remembering across a run's batches
            bn_prefixes = tuple(b + "." for b in ctx.bn_names)
            keep = np.asarray([i for i, n in enumerate(ctx.param_names)
                               if not n.endswith("bias") and not (bn_prefixes and n.startswith(bn_prefixes))],
                              dtype=np.int64)
            if len(_weights_only_cache) > 256:
                _weights_only_cache.clear()
            _weights_only_cache[key] = keep
        self.keep_arr = keep

    def fast(self, ctx, state, cfg, steps):
        return _observe_carriers(self, ctx, state, cfg, steps, "update_ratio", lists=("hist",))

    def observe(self, ctx, state, cfg, st):
        if st.get("overflow"):
            return None
        values = _layer_array(st, "update_ratio")
        if values is None or not len(values):
            return None
        keep = self.keep_arr[self.keep_arr < len(values)]
        if not len(keep):
            keep = np.arange(len(values))
        xs = values[keep]
        fin = np.isfinite(xs)
        if not fin.any():
            return None
        keep, xs = keep[fin], xs[fin]
        step = st["step"]
        window = int(cfg["window"])
        hist = state.setdefault("hist", [])
        hist.append([step, median(xs.tolist())])      # = float(np.median(xs)), bit for bit: no NaN here
        while hist and hist[0][0] <= step - window:
            hist.pop(0)
        state.setdefault("first", step)
        # judged over a whole window: the first steps of any run move the weights fastest
        if len(hist) < cfg["min_samples"] or step - state["first"] < window - 1:
            return None
        med = median(p[1] for p in hist)
        if med > cfg["high"] or med < cfg["low"]:
            direction = "high" if med > cfg["high"] else "low"
            pairs = list(zip(xs.tolist(), keep.tolist()))
            per_layer = sorted(pairs, reverse=(direction == "high"))[:5]
            return Hit({"median_update_ratio": med, "direction": direction, "samples": len(hist),
                        "layers": [[_name(ctx.param_names, i), x] for x, i in per_layer]},
                       f"Median update ratio {fmt(med)} over {window} steps is too {direction} "
                       f"(healthy ~1e-3)",
                       actions=[self.spec.actions[0 if direction == "high" else 1]])
        return False


# Classes, not instances: the engine makes fresh ones per batch (ingest runs batches concurrently).
RULE_CLASSES: tuple[type[Rule], ...] = (
    LossNonfinite, GradExplosion, NanOrigin, InputNonfinite, OverflowStorm,
    VanishingGrad, LossPlateau, LossScaleCollapse, LrZero, DeadParams,
    LossOscillation, ClipSaturation, LossSpike,
    LateDivergence, EmaDivergence, BnDrift,
    ActivationJump, WeightNormGrowth, UpdateRatio,
)
