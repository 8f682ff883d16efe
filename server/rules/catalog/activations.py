"""Per-module statistics the agent samples: activation jumps (E1), BatchNorm running-stat drift (D3).

The agent sends these every few steps; each carrying step's array is judged with numpy over the
modules (a batch at the agent's defaults carries one or two such steps).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from gradwatch.server.rules.batch import layer_array
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, medians, name_of, pack_f8, unpack_f8
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt


def _np_medians(w: np.ndarray) -> np.ndarray:
    """``np.median(w, axis=1)`` (a NaN in a row gives NaN), without its per-call overhead."""
    med = medians(w)
    if np.isnan(med).any() or np.isnan(w).any():
        med = np.where(np.isnan(w).any(axis=1), np.nan, med)
    return med


@register
class BnDrift(BatchRule):
    id, name, severity, checklist = "D3", "bn_drift", "warning", "8.D"
    family = "D"
    fires_when = ("a BatchNorm layer's running_var changes > {factor:g}x within {window} steps (after the first "
                  "{warmup_steps} steps)")
    diagnosis = "BatchNorm running statistics drift: the data the model sees changed."
    actions = {"recompute_bn": "When fine-tuning on new data, recompute the BatchNorm statistics on it (a pass in "
                               "train mode without updates), or freeze BN layers."}
    params = {"factor": Float(10.0), "window": Int(100), "warmup_steps": Int(100, zero_ok=True)}
    needs = ("layers.bn_var_norm",)
    # Per-layer history of (step, running_var norm) over the last `window` steps, thinned to <= 64 points.
    # Layers whose histories hold the same steps (the normal case: every layer reported at every sample)
    # share one group, so a step costs a few numpy operations instead of a Python loop per layer:
    # state["g"] = [{"l": [layer indices], "s": [steps], "v": packed [[value per layer of "l"] per step]}].

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        groups: Optional[list[dict]] = None
        for i in batch.carriers("bn_var_norm"):
            step = int(batch.step[i])
            if step < cfg["warmup_steps"]:
                continue
            if groups is None:
                groups = [{"l": np.asarray(g["l"], dtype=np.int64), "s": np.asarray(g["s"], dtype=np.int64),
                           "v": unpack_f8(g["v"]).reshape(len(g["s"]), len(g["l"]))} for g in state.get("g") or []]
            groups, hit = self._step(groups, layer_array(batch.steps[i], "bn_var_norm"), step, cfg, batch.ctx)
            if hit is None:
                out.clear[i] = True
            else:
                out.hits[i] = hit
        if groups is not None:
            state["g"] = self._merge(groups)
        return out

    def _step(self, groups: list[dict], x: np.ndarray, step: int, cfg: dict, ctx) -> tuple[list[dict], Optional[Hit]]:
        window = int(cfg["window"])
        with np.errstate(invalid="ignore"):
            valid = np.isfinite(x) & (x > 0)
        n = len(x)
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
                i = int(g["l"][ratio == r].min())
                k = int(np.flatnonzero(g["l"] == i)[0])
                if best is None or r > best[0] or (r == best[0] and i < best[1]):
                    best = (r, i, float(lo[k]), float(hi[k]))
        groups = out if len(out) == 1 else self._merge(out, as_lists=False)
        if not best:
            return groups, None
        ratio, i, lo, hi = best
        name = name_of(ctx.bn_names, i)
        return groups, Hit({"layer": name, "ratio": ratio, "var_norm_min": lo, "var_norm_max": hi, "window": window},
                           f"BatchNorm {name}: running_var norm changed {ratio:.0f}x within {window} steps "
                           f"({fmt(lo)} -> {fmt(hi)})")

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
            merged.append({"l": g["l"].tolist(), "s": g["s"].tolist(), "v": pack_f8(g["v"])} if as_lists else g)
        return merged


@register
class ActivationJump(BatchRule):
    id, name, severity, checklist = "E1", "activation_jump", "warning", "7.1"
    family = "E"
    fires_when = "a module's activation std >= {factor:g}x the median of its last {history} samples"
    diagnosis = "A layer amplifies its signal: its activation variance jumped."
    actions = {
        "inspect_layer": "Inspect that layer (weights, normalisation, residual scaling); pre-norm or a normalisation "
                         "after it controls the variance.",
        "lower_lr": "Lower the learning rate if its weights grew quickly (see E2).",
    }
    params = {"factor": Float(10.0), "history": Int(20), "min_history": Int(5, zero_ok=True)}
    needs = ("layers.act_std",)
    REFRESH = 4         # a module's baseline median is recomputed every 4 samples
    # State: "n" = samples per module, "hb" = the modules' last `history` accepted samples as one packed
    # matrix (row i, first n[i] columns), "mb" = the cached baseline medians (NaN: to be recomputed).

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("act_std")
        if not carriers:
            return out
        history = int(cfg["history"])
        n = np.asarray(state.get("n") or [], dtype=np.int64)
        H = unpack_f8(state.get("hb")).reshape(len(n), -1) if len(n) else np.full((0, history), np.nan)
        if H.shape[1] < history:
            H = np.hstack([H, np.full((len(n), history - H.shape[1]), np.nan)])
        M = unpack_f8(state.get("mb"))
        if len(M) != len(n):
            M = np.full(len(n), np.nan)
        for i in carriers:
            x = layer_array(batch.steps[i], "act_std")
            extra = len(x) - len(n)
            if extra > 0:
                H = np.vstack([H, np.full((extra, H.shape[1]), np.nan)])
                n = np.concatenate([n, np.zeros(extra, dtype=np.int64)])
                M = np.concatenate([M, np.full(extra, np.nan)])
            worst = self._step(H, n, M, x, cfg, history)
            if worst is None:
                out.clear[i] = True
                continue
            k, ratio, med, v = worst
            name = name_of(batch.ctx.module_names, k)
            out.hits[i] = Hit({"module": name, "act_std": v, "median": med, "ratio": ratio},
                              f"Activation std of {name} jumped to {fmt(v)}, {ratio:.0f}x its median {fmt(med)}")
        width = int(n.max()) if len(n) else 0
        state["n"] = n.tolist()
        state["hb"] = pack_f8(H[:, :width])
        state["mb"] = pack_f8(M)
        return out

    def _uniform(self, H: np.ndarray, n: np.ndarray, M: np.ndarray, x: np.ndarray, cfg: dict, history: int) -> bool:
        """The common sample: every module finite, all with the same number of samples, none jumping. What
        ``_step`` does with it, in fewer array operations; False: leave it to ``_step``."""
        if not len(n) or len(x) != len(n):
            return False
        k = int(n[0])
        if (n != k).any() or not np.isfinite(x).all():
            return False
        if k >= cfg["min_history"]:
            need = np.isnan(M)
            if need.any():
                M[need] = _np_medians(H[need, :k])
            if ((M > 0) & (x >= cfg["factor"] * M)).any():
                return False          # a jump: _step finds and reports it
        if k >= history:
            H[:, :k - 1] = H[:, 1:k]
            H[:, k - 1] = x
        else:
            H[:, k] = x
            n += 1
            k += 1
        if k % self.REFRESH == 0:
            M[:] = np.nan
        return True

    def _step(self, H: np.ndarray, n: np.ndarray, M: np.ndarray, x: np.ndarray, cfg: dict, history: int):
        """One sample of every module, judged and pushed in place; the worst jump or None."""
        if self._uniform(H, n, M, x, cfg, history):
            return None
        idx = np.flatnonzero(np.isfinite(x))
        if not len(idx):
            return None
        xs = x[idx]
        judged = n[idx] >= cfg["min_history"]
        need = idx[judged & np.isnan(M[idx])]
        for k in np.unique(n[need]).tolist():         # baseline medians not cached: one per length
            rows = need[n[need] == k]
            M[rows] = _np_medians(H[rows, :k])
        med = M[idx]
        with np.errstate(invalid="ignore"):
            flagged = judged & (med > 0) & (xs >= cfg["factor"] * med)
        worst = None
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
        M[take[n[take] % self.REFRESH == 0]] = np.nan
        return worst
