"""The weights: EMA drifting from them (D2), weight norms growing (E2), the update-to-weight ratio (E3)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from gradwatch.server.rules.batch import layer_array
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, mads, medians, name_of, pack_f8, unpack_f8, window_slices
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import MAD_TO_SIGMA, fmt, median
from gradwatch.server.rules.windows import RobustWindow


@register
class EmaDivergence(BatchRule):
    id, name, severity, checklist = "D2", "ema_divergence", "warning", "8.D"
    family = "D"
    fires_when = ("EMA divergence ||theta_ema - theta|| / ||theta|| > {factor:g}x its rolling median over {window} "
                  "steps, or oscillating")
    diagnosis = "The EMA weights drift away from the model's weights."
    actions = {"decay": "The EMA decay is too large for this task: try 0.999 or 0.99."}
    params = {"factor": Float(3.0), "window": Int(200), "min_history": Int(50, zero_ok=True)}
    needs = ("ema_divergence",)
    REFRESH = 8
    EVERY = 10          # the oscillation test: every 10th judged value, over the last 50 values
    RECENT = 50

    def evaluate(self, batch, state, cfg):
        d = batch.values("ema_divergence")
        arrivals = np.flatnonzero(np.isfinite(d))
        factor = cfg["factor"]
        win = RobustWindow(state, "div", int(cfg["window"]), refresh=self.REFRESH, min_len=cfg["min_history"])
        n0_win = len(win)
        stored = win.values
        xs = d[arrivals]
        s = win.screen(xs, np.ones(len(xs), dtype=bool), lambda x, med, mad: (med > 0) & (x > factor * med),
                       monotone=True)
        win.save()
        clear = np.zeros(batch.n, dtype=bool)
        clear[arrivals[~s.flagged]] = True
        out = Outcome(clear)
        for k in np.flatnonzero(s.flagged).tolist():
            i, x, med = int(arrivals[k]), float(xs[k]), float(s.med[k])
            out.hits[i] = Hit({"ema_divergence": x, "median": med, "ratio": x / med},
                              f"EMA divergence {fmt(x)} is {x / med:.1f}x its median {fmt(med)}")
        # the judged values not flagged count; every EVERY-th is tested for oscillation: over the last 50
        # values the EMA distance swings by more than its own level, back and forth
        counted = s.judged & ~s.flagged
        n0 = int(state.get("n", 0))
        ns = n0 + np.cumsum(counted)
        tests = np.flatnonzero(counted & (ns % self.EVERY == 0))
        state["n"] = int(ns[-1]) if len(ns) else n0
        if not len(tests):
            return out
        arr = np.concatenate((stored, xs[s.pushed]))
        at = n0_win + np.cumsum(s.pushed) - 1             # where each pushed value sits in arr
        hi = at[tests] + 1
        size = int(cfg["window"])
        lens = np.minimum(size, hi - 1)                   # the window before the value
        lo = hi - 1 - np.minimum(lens, self.RECENT - 1)
        seen = arr[min(lo):max(hi)]
        low = float(seen.min())
        if low > 0 and MAD_TO_SIGMA * (float(seen.max()) - low) / low <= 1.0:
            return out                                    # MAD / median <= 1.4826 (max - min) / min: no swing
        for rows, w in window_slices(arr, lo, hi):
            if w.shape[1] < 3:
                continue
            wmed = medians(w)
            wmad = mads(w, wmed)
            dd = np.diff(w, axis=1)
            turns = ((dd[:, :-1] * dd[:, 1:]) < 0).sum(axis=1)
            with np.errstate(divide="ignore", invalid="ignore"):
                osc = (wmed > 0) & (wmad / wmed > 1.0) & (turns > 0.5 * w.shape[1])
            for r in np.flatnonzero(osc).tolist():
                k = int(tests[np.arange(len(tests))[rows][r]])
                i = int(arrivals[k])
                med, mad = float(wmed[r]), float(wmad[r])
                out.clear[i] = False
                out.hits[i] = Hit({"ema_divergence": float(xs[k]), "median": med, "mad": mad, "turns": int(turns[r]),
                                   "oscillating": True},
                                  f"EMA divergence oscillates: spread {mad / med:.1f}x its median {fmt(med)}")
        return out


@register
class WeightNormGrowth(BatchRule):
    id, name, severity, checklist = "E2", "weight_norm_growth", "warning", "7.1"
    family = "E"
    fires_when = "a weight norm grows monotonically by > {growth:.0%} over {window} steps"
    diagnosis = "A weight norm keeps growing fast: the learning rate is too large."
    actions = {"lower_lr": "Lower the learning rate; add or raise weight decay."}
    params = {"growth": Float(0.5), "window": Int(1000), "min_samples": Int(5)}
    needs = ("layers.weight_norm",)
    SAMPLES = 10        # samples kept per window (all parameters share the sample steps)
    # State: "steps" = the sample steps; "vb" = the samples' weight norms packed one after another (NaN:
    # no usable value), "vn" = their lengths.

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        window = int(cfg["window"])
        every = max(1, window // self.SAMPLES)
        samples: Optional[list[np.ndarray]] = None
        steps: list[int] = list(state.get("steps") or [])
        last = state.get("last", -10**12)
        for i in batch.carriers("weight_norm"):
            step = int(batch.step[i])
            if step - last < every:
                continue
            if samples is None:
                samples = self._load(state, steps)
            x = layer_array(batch.steps[i], "weight_norm")
            last = step
            steps.append(step)
            with np.errstate(invalid="ignore"):
                samples.append(np.where(np.isfinite(x) & (x > 0), x, np.nan))   # null, non-finite, <= 0: no value
            while len(steps) > 1 and steps[1] <= step - window:  # keep one sample at or before the window start
                steps.pop(0)
                samples.pop(0)
            if len(steps) < cfg["min_samples"] or step - steps[0] < window:
                out.clear[i] = True
                continue
            hit = self._growing(samples, cfg, window, batch.ctx.param_names)
            if hit is None:
                out.clear[i] = True
            else:
                out.hits[i] = hit
        if samples is not None:
            state["last"] = last
            state["steps"] = steps
            state["vn"] = [len(v) for v in samples]
            state["vb"] = pack_f8(np.concatenate(samples) if samples else np.empty(0))
        return out

    @staticmethod
    def _load(state: dict, steps: list[int]) -> list[np.ndarray]:
        lengths = state.get("vn") or []
        flat = unpack_f8(state.get("vb") or "")
        samples = np.split(flat, np.cumsum(lengths)[:-1].tolist()) if lengths else []
        if len(samples) != len(steps):       # one of them cut short: keep the samples both still hold
            keep = min(len(samples), len(steps))
            samples = samples[len(samples) - keep:]
            del steps[: len(steps) - keep]
        return samples

    def _growing(self, samples: list[np.ndarray], cfg: dict, window: int, param_names: list[str]) -> Optional[Hit]:
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
        if not len(idx):
            return None
        growing = sorted(zip(grew[idx].tolist(), idx.tolist(), a[idx].tolist(), b[idx].tolist()), reverse=True)
        g, i, a0, b0 = growing[0]
        names = [name_of(param_names, j) for _, j, _, _ in growing]
        return Hit({"params": names[:10], "count": len(names), "growth": g, "weight_norm_start": a0,
                    "weight_norm_end": b0, "window": window},
                   f"Weight norm of {names[0]} grew {g:.0%} monotonically over {window} steps"
                   + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""))


_weights_only_cache: dict[tuple, np.ndarray] = {}   # (param names, bn names) -> indices E3 judges


@register
class UpdateRatio(BatchRule):
    id, name, severity, checklist = "E3", "update_ratio", "warning", "—"
    family = "E"
    fires_when = ("median per-layer update ratio ||dtheta|| / ||theta|| of the weights (not biases / norm gains) "
                  "over {window} steps > {high:g} or < {low:g} (healthy ~1e-3)")
    diagnosis = "The size of the updates relative to the weights is far from the healthy ~1e-3."
    actions = {
        "too_high": "Above 1e-2: the learning rate is far too high; lower it.",
        "too_low": "Below 1e-6: the learning rate is far too low (or zero, or steps are skipped); raise it.",
    }
    params = {"high": Float(1e-2), "low": Float(1e-6, zero_ok=True), "window": Int(100), "min_samples": Int(5)}
    needs = ("layers.update_ratio",)

    @staticmethod
    def _weights_only(ctx) -> np.ndarray:
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
        return keep

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("update_ratio")
        if not carriers:
            return out
        weights = self._weights_only(batch.ctx)
        overflow = batch.true("overflow")
        window = int(cfg["window"])
        hist = state.get("hist")
        for i in carriers:
            if overflow[i]:
                continue
            values = layer_array(batch.steps[i], "update_ratio")
            keep = weights[weights < len(values)]
            if not len(keep):
                keep = np.arange(len(values))
            xs = values[keep]
            fin = np.isfinite(xs)
            if not fin.any():
                continue
            keep, xs = keep[fin], xs[fin]
            step = int(batch.step[i])
            hist = list(hist or ()) if not isinstance(hist, list) else hist
            hist.append([step, median(xs.tolist())])
            while hist and hist[0][0] <= step - window:
                hist.pop(0)
            state.setdefault("first", step)
            # judged over a whole window: the first steps of any run move the weights fastest
            if len(hist) < cfg["min_samples"] or step - state["first"] < window - 1:
                continue
            med = median(p[1] for p in hist)
            if not (med > cfg["high"] or med < cfg["low"]):
                out.clear[i] = True
                continue
            direction = "high" if med > cfg["high"] else "low"
            per_layer = sorted(zip(xs.tolist(), keep.tolist()), reverse=(direction == "high"))[:5]
            out.hits[i] = Hit({"median_update_ratio": med, "direction": direction, "samples": len(hist),
                               "layers": [[name_of(batch.ctx.param_names, j), x] for x, j in per_layer]},
                              f"Median update ratio {fmt(med)} over {window} steps is too {direction} "
                              f"(healthy ~1e-3)",
                              actions=self.spec.action("too_high" if direction == "high" else "too_low"))
        if hist is not None:
            state["hist"] = hist
        return out
