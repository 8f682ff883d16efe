"""Precursors tried as early-warning signals beside the attention logits, on the tuning half only (issue 41, item 2):
attention entropy collapse ("if it buys lead"; Zhai et al. 2023), the update-to-weight ratio ||dW|| / ||W|| (the
checklist's healthy ~1e-3; rule E3 reads it every 100 steps) and the cosine between consecutive gradients (an
oscillation across a sharp valley, the edge of stability); and, tried next (2026-12-07), the whole model's
gradient norm and weight norm, the secant ratio along each step's update, and the acceleration of the max
attention logit's growth; last, up to three of the step signals at once (:func:`combined_table`), on the
no-attention space's tuning half as well (``--results results-noattn-65cb243.jsonl``). An analysis beside the
protocol: it reruns each valid tuning case of a results file (its divergent twin at the kept LR, its control at
LR / CONTROL_DIVISOR) in plain PyTorch, with :class:`Entropy` (a
subclass of this benchmark's oracle mode) and :class:`StepSignals` (optimizer step hooks) recording every step,
and asks whether a rule on either signal, or a gate on H12 by it, warns earlier or on fewer controls than H12
alone. Held-out cases are never run: a signal that wins here is put in the agent first and reported on the
held-out half through the real path (sweep.py + report.py), once.

    .venv/bin/python -m bench.early_warning.precursors --results bench/early_warning/results-733fc4b.jsonl \\
        --workers 2 --out /tmp/precursors.jsonl                 # runs (about 3 minutes), then the tables
    .venv/bin/python -m bench.early_warning.precursors --load /tmp/precursors.jsonl     # the tables again

Entropy, per attention call and step (the scores are the softmax's input, masked entries -inf, as oracle.py
sees them): the normalised entropy of each query row, H / ln(n) over the row's n unmasked keys (rows with
n >= 2), its mean over the call's rows, and the share of rows below 0.05, i.e. one-hot. A step's signal is
taken over the calls: the lowest mean (the most collapsed layer), the mean of the means, the largest one-hot
share. Update ratio, per step: ||dW|| / ||W|| of each weight matrix (parameters of 2 or more dimensions, as
E3 judges weights and not biases or gains), the median over the matrices (E3's statistic) and the largest;
and the cosine between the step's gradient and the last step's, over every parameter. Gradient and weight
norms, per step: the whole model's ||g|| (the pre-clip norm the agent streams) and ||W||, before the
optimizer's step. Secant ratio, per step: (g_t+1 . dW_t) / (g_t . dW_t) along the step's own update
dW_t, over every parameter: 1 on a flat stretch, below 0 when the step overshot the valley's floor, -1 at the
edge of stability, whatever the optimizer. Acceleration: at the agent's attention cadence (every 25 steps,
without its escalation) the max logit's growth over the last 25 steps against its growth over the 25 before, in
log terms; a healthy sharpening that levels off slows, a runaway was expected to speed up.

The divergence step is this rerun's own (divergence.py on its losses): AdamW and RMSprop runs are chaotic at
these LRs and do not repeat the recorded trajectory step for step (longer.py shows by how much).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .oracle import TrueLogits
from .report import lead, load, split_cases, summary, true_max
from .space import CONTROL_DIVISOR, draw

STEPS = 300                      # the protocol's run length
ONE_HOT = 0.05                   # a row whose normalised entropy is below this attends to one key
EVERY = 25                       # the agent's attention cadence (agent/config.py), without its escalation
WINDOW = 25                      # steps the update ratio's median is taken over
# StepSignals' tuple, one a step
STEP_COLUMNS = ("ratio_median", "ratio_max", "cosine", "grad_norm", "weight_norm", "rho")


class Entropy(TrueLogits):
    """The oracle's max logit per call, and beside it the call's entropy figures, one list per step."""

    def __init__(self):
        super().__init__()
        self.current: list[tuple[float, float]] = []
        self.steps: list[list[tuple[float, float]]] = []

    def note(self, scores: torch.Tensor) -> None:
        super().note(scores)
        with torch.no_grad():
            s = scores.float()
            valid = s > -1e30                     # finite and not a dtype-min mask (HF eager adds finfo.min)
            n = valid.sum(-1)
            p = torch.softmax(s.masked_fill(~valid, float("-inf")), dim=-1)
            h = torch.special.entr(p).nansum(-1)
            rows = n >= 2
            hn = h[rows] / torch.log(n[rows].float())
            if hn.numel() == 0 or not bool(torch.isfinite(hn).all()):
                self.current.append((math.nan, math.nan))
            else:
                self.current.append((round(float(hn.mean()), 5), round(float((hn < ONE_HOT).float().mean()), 5)))

    def take(self) -> list[float]:
        self.steps.append(self.current)
        self.current = []
        return super().take()


class StepSignals:
    """Through the global optimizer step hooks (the sweep's ``train`` builds its own optimizer), at every
    step: ||dW|| / ||W|| of every weight matrix, its median and its largest, the cosine between this
    step's gradient and the last one's over every parameter (near -1 when the run oscillates across a sharp
    valley, the edge of stability), the whole model's gradient norm and weight norm before the step, and the
    last step's secant ratio. One tuple a step: (ratio median, ratio max, cosine, grad norm, weight norm, rho)."""

    def __init__(self):
        self.steps: list[tuple[float, ...]] = []      # STEP_COLUMNS
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad: Optional[torch.Tensor] = None
        self._weights: Optional[torch.Tensor] = None

    def __enter__(self) -> "StepSignals":
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, opt, args, kwargs) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        self._before = [(p, p.detach().clone()) for p in params if p.dim() >= 2]
        grads = [p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params]
        grad = torch.cat(grads).float()
        prev, self._grad = self._grad, grad
        self._cos = float(F.cosine_similarity(grad, prev, dim=0)) if prev is not None else math.nan
        with torch.no_grad():
            weights = torch.cat([p.detach().reshape(-1).float() for p in params])
            self._norms = (float(grad.norm()), float(weights.norm()))
            # the last step's secant ratio along its own update dW: (g_now . dW) / (g_then . dW), 1 - (the
            # curvature along dW x the step's length); below 0 the step overshot the valley's floor, below -1 it
            # left it steeper than it came (the edge of stability at -1); any optimizer, the update as it was
            self._rho = math.nan
            if prev is not None and self._weights is not None and self._weights.numel() == weights.numel():
                dw = weights - self._weights
                a, b = float(prev @ dw), float(grad @ dw)
                self._rho = b / a if a < 0 else math.nan
            self._weights = weights

    def _post(self, opt, args, kwargs) -> None:
        with torch.no_grad():
            r = torch.tensor([float((p.detach() - q).norm() / q.norm().clamp_min(1e-12)) for p, q in self._before])
        ok = bool(torch.isfinite(r).all()) and r.numel() > 0
        med, top = (round(float(r.median()), 7), round(float(r.max()), 7)) if ok else (math.nan, math.nan)
        cos = round(self._cos, 5) if math.isfinite(self._cos) else math.nan
        rho = round(self._rho, 5) if math.isfinite(self._rho) else math.nan
        self.steps.append((med, top, cos, *(round(v, 6) for v in self._norms), rho))
        self._before = []


def run_pair(args: tuple) -> dict:
    from .sweep import train             # the models (transformers among them): imported in the worker

    case_id, lr = args
    case = draw(case_id)
    out = {"id": case_id, "arch": case.arch, "optimizer": case.optimizer, "warmup": case.warmup}
    for name, run_lr in (("divergent", lr), ("control", lr / CONTROL_DIVISOR)):
        mode = Entropy()
        with StepSignals() as step_signals:
            r = train(case, run_lr, STEPS, server=None, stop_after_divergence=True, oracle=mode)
        out[name] = {"diverged_at": r["diverged_at"], "losses": r["losses"], "logits": r["logits"],
                     "entropy": mode.steps, "step_signals": step_signals.steps}
    return out


# ---------------------------------------------------------------------------------------------- signals


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def min_mean(calls) -> float:
    return min(_finite([c[0] for c in calls]), default=math.nan)


def mean_mean(calls) -> float:
    xs = _finite([c[0] for c in calls])
    return sum(xs) / len(xs) if xs else math.nan


def max_onehot(calls) -> float:
    return max(_finite([c[1] for c in calls]), default=math.nan)


def first_low(run: dict, signal: Callable, below: Optional[float], above: Optional[float], k: int,
              every: int, series: str = "entropy") -> Optional[int]:
    """The first sampled step (every ``every`` steps) of ``k`` in a row whose signal is below ``below``
    (an entropy) or above ``above`` (a one-hot share, an update ratio)."""
    streak = 0
    for step, calls in enumerate(run[series]):
        if step % every:
            continue
        v = signal(calls)
        hit = math.isfinite(v) and ((below is not None and v < below) or (above is not None and v > above))
        streak = streak + 1 if hit else 0
        if streak >= k:
            return step
    return None


def outcome(rows: list[dict], first: Callable[[dict, dict], Optional[int]]) -> tuple[dict, list[int]]:
    """A rule over the cases: ``first(case, run)`` is the step it first fires on a run (None: never). Its
    lead summary on the twins (report.summary) and the ids of the controls it warns on."""
    leads = [lead(r["divergent"]["diverged_at"], first(r, r["divergent"])) for r in rows]
    return summary(leads), [r["id"] for r in rows if first(r, r["control"]) is not None]


def median_at(run: dict, column: str, step: int, window: int) -> float:
    """The median of one of StepSignals' columns over the ``window`` steps up to ``step``, its non-finite values
    left out (NaN where none is left)."""
    c = STEP_COLUMNS.index(column)
    xs = [s[c] for s in run["step_signals"][max(0, step - window + 1):step + 1] if math.isfinite(s[c])]
    return float(np.median(xs)) if xs else math.nan


def ratio_at(run: dict, step: int, window: int = WINDOW) -> float:
    """The median of the per-step median update ratios over the ``window`` steps up to ``step`` (E3's
    statistic over a shorter window: a single step's ratio is noisy)."""
    return median_at(run, "ratio_median", step, window)


def cosine_at(run: dict, step: int, window: int = 10) -> float:
    """The mean cosine between consecutive gradients over the ``window`` steps up to ``step``."""
    c = STEP_COLUMNS.index("cosine")
    xs = [s[c] for s in run["step_signals"][max(0, step - window + 1):step + 1] if math.isfinite(s[c])]
    return float(np.mean(xs)) if xs else math.nan


def first_cosine_below(run: dict, below: float) -> Optional[int]:
    """The first step whose mean gradient cosine over 10 steps (:func:`cosine_at`) is below ``below``."""
    return next((s for s in range(10, len(run["step_signals"])) if cosine_at(run, s) < below), None)


def cosine_table(rows: list[dict]) -> None:
    print("\nGradient cosine, tuning half, every step: fires when the mean cosine between consecutive gradients "
          "over 10 steps is below the threshold")
    print("| threshold | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in (0.0, -0.1, -0.2, -0.3, -0.5):
        s, fp = outcome(rows, lambda r, run, t=t: first_cosine_below(run, t))
        print(f"| < {t} | {len(fp)} of {len(rows)} | {s['median']} | {s['p25']} | {s['ge20']} | {s['ge50']} |")


def first_high_ratio(run: dict, above: float, every: int) -> Optional[int]:
    for step in range(0, len(run["step_signals"]), every):
        if step >= WINDOW - 1 and ratio_at(run, step) > above:
            return step
    return None


def ratio_table(rows: list[dict], every: int) -> None:
    print(f"\nUpdate ratio, tuning half, sampled every {every} steps: fires when the median over {WINDOW} steps of "
          f"the per-step median ||dW|| / ||W|| is above the threshold")
    print("| threshold | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- |")
    for t in (0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.12):
        s, fp = outcome(rows, lambda r, run, t=t: first_high_ratio(run, t, every))
        print(f"| > {t} | {len(fp)} of {len(rows)} | {s['median']} | {s['p25']} | {s['ge20']} | {s['ge50']} |")


def table(rows: list[dict], every: int) -> None:
    print(f"Tuning half: {len(rows)} cases, entropy sampled every {every} steps (no escalation). "
          f"A rule fires at the k-th sampled step in a row past its threshold.")
    print("| signal | threshold | k | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    specs = [("lowest call mean", min_mean, t, None) for t in (0.02, 0.05, 0.1, 0.2, 0.3, 0.4)]
    specs += [("mean of call means", mean_mean, t, None) for t in (0.05, 0.1, 0.2, 0.3, 0.4)]
    specs += [("largest one-hot share", max_onehot, None, t) for t in (0.5, 0.8, 0.9, 0.95, 0.99)]
    for name, fn, below, above in specs:
        for k in (1, 3):
            s, fp = outcome(rows, lambda r, run, fn=fn, below=below, above=above, k=k:
                            first_low(run, fn, below, above, k, every))
            print(f"| {name} | {'< ' + str(below) if below is not None else '> ' + str(above)} | {k} | "
                  f"{len(fp)} of {len(rows)} | {s['median']} | {s['p25']} | {s['ge20']} | {s['ge50']} |")


def h12_rows(rows: list[dict]) -> None:
    """H12 (its own forecast, replay.py, at the agent's cadence with its escalation) on the same reruns'
    true max logits, alone and gated by the entropy at its hit: does the entropy tell the controls apart
    where the logit does not?"""
    from gradwatch.server.rules.catalog.early_forecast import AttentionLogitForecast

    from .replay import CADENCE, by_optimizer, first_hit

    base = {k: p.default for k, p in AttentionLogitForecast.params.items()}

    def gated(fn, below):
        return lambda run: (lambda hit, step, losses: math.isfinite(v := fn(run["entropy"][step])) and v < below)

    specs = [("H12 as it is", lambda run: None)]
    specs += [(f"H12 and lowest call mean < {t}", gated(min_mean, t)) for t in (0.01, 0.05, 0.2)]
    specs += [(f"H12 and mean of call means < {t}", gated(mean_mean, t)) for t in (0.05, 0.1, 0.2, 0.3)]
    specs += [(f"H12 and update ratio > {t}", lambda run, t=t: (lambda hit, step, losses: ratio_at(run, step) > t))
              for t in (0.015, 0.02, 0.03, 0.05)]
    print("\n| rule | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- |")

    def row(name, first):
        s, fp = outcome(rows, first)
        print(f"| {name} | {len(fp)} of {len(rows)} {fp} | {s['median']} | {s['p25']} | {s['ge20']} | {s['ge50']} |")

    for name, gate_of in specs:
        row(name, lambda r, run, gate_of=gate_of: first_hit(run, base, CADENCE, gate_of(run)))

    # the doubling-time limit per optimizer family of replay.py --gates (5 steps AdamW / RMSprop, 10 SGD: no
    # tuning control warned), alone and with AdamW's gradient cosine beside it (its twins turn negative first)
    def family(r, run):
        return first_hit(run, base, CADENCE, by_optimizer(5, 10)({"case": {"optimizer": r["optimizer"]}}))

    def family_or_cosine(r, run):
        hits = [family(r, run)]
        if r["optimizer"] == "adamw":
            hits.append(first_cosine_below(run, -0.05))
        hits = [h for h in hits if h is not None]
        return min(hits) if hits else None

    row("H12 with a doubling-time limit per optimizer family (replay.by_optimizer(5, 10))", family)
    row("the same, or AdamW's gradient cosine < -0.05", family_or_cosine)


def first_weight_growth(run: dict, rate: Optional[float], total: Optional[float], every: int = EVERY) -> Optional[int]:
    """The first step (every ``every`` steps) whose weight norm is ``rate``x its value ``every`` steps earlier,
    or ``total``x its value at step 0."""
    w = [s[STEP_COLUMNS.index("weight_norm")] for s in run["step_signals"]]
    for t in range(every, len(w), every):
        if (rate is not None and w[t] >= rate * w[t - every]) or (total is not None and w[t] >= total * w[0]):
            return t
    return None


def first_grad_rise(run: dict, factor: float, window: int = 10) -> Optional[int]:
    """The first step whose gradient norm, a median over ``window`` steps, is ``factor``x the lowest such median
    so far (every step: the agent streams the pre-clip norm at every step)."""
    low = math.inf
    for t in range(window - 1, len(run["step_signals"])):
        m = median_at(run, "grad_norm", t, window)
        if not math.isfinite(m):
            continue
        low = min(low, m)
        if m >= factor * low:
            return t
    return None


def first_secant_below(run: dict, below: float, window: int = 10) -> Optional[int]:
    """The first step whose secant ratio, a median over ``window`` steps, is below ``below``."""
    return next((t for t in range(window, len(run["step_signals"])) if median_at(run, "rho", t, window) < below),
                None)


def first_acceleration(run: dict, level: float, growth: float, faster: float, k: int,
                       every: int = EVERY) -> Optional[int]:
    """The k-th sample in a row (every ``every`` steps) whose true max logit is >= ``level``, has grown by at least
    ``growth`` (log) over the last ``every`` steps, and by at least ``faster``x the growth of the ``every`` before."""
    m = true_max(run)
    streak = 0
    for t in range(2 * every, len(m), every):
        x, y, z = m[t], m[t - every], m[t - 2 * every]
        if not all(math.isfinite(v) and v > 0 for v in (x, y, z)):
            streak = 0
            continue
        g1, g0 = math.log(x / y), math.log(y / z)
        streak = streak + 1 if x >= level and g1 >= growth and g1 >= faster * g0 else 0
        if streak >= k:
            return t
    return None


def more_signals_table(rows: list[dict]) -> None:
    """The signals tried on 2026-12-07: the whole model's weight norm and gradient norm, the secant ratio and the
    max logit's acceleration. Each row: a rule on the signal alone."""
    specs = [(f"weight norm >= {r}x its value 25 steps earlier (every 25)",
              lambda r_, run, r=r: first_weight_growth(run, r, None)) for r in (1.02, 1.05, 1.1, 1.2, 1.5)]
    specs += [(f"weight norm >= {t}x its first value (every 25)",
               lambda r_, run, t=t: first_weight_growth(run, None, t)) for t in (1.1, 1.2, 1.5, 2.0, 3.0)]
    specs += [(f"gradient norm, median over 10 steps, >= {k}x its lowest so far (every step)",
               lambda r_, run, k=k: first_grad_rise(run, k)) for k in (1.5, 2.0, 2.5, 3.0, 4.0)]
    specs += [(f"secant ratio along the update, median over 10 steps, < {b} (every step)",
               lambda r_, run, b=b: first_secant_below(run, b)) for b in (-0.2, -0.3, -0.4, -0.5, -0.7)]
    specs += [(f"max logit >= {lv}, log growth over 25 steps >= {g} and >= {f}x the 25 before, {k} in a row",
               lambda r_, run, lv=lv, g=g, f=f, k=k: first_acceleration(run, lv, g, f, k))
              for lv, g, f, k in ((10, 0.3, 1.2, 1), (10, 0.7, 1.0, 1), (10, 1.0, 1.2, 1), (20, 0.5, 1.2, 1),
                                  (10, 0.7, 1.2, 2), (20, 0.3, 1.2, 2))]
    print("\nWeight norm, gradient norm, secant ratio, the logit's acceleration: tuning half, a rule on each alone")
    print("| rule | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, first in specs:
        s, fp = outcome(rows, first)
        print(f"| {name} | {len(fp)} of {len(rows)} | {s['median']} | {s['p25']} | {s['ge20']} | {s['ge50']} |")


def step_conditions(run: dict) -> dict[str, np.ndarray]:
    """Per step, whether each signal of :func:`combined_table` holds (a NaN never does)."""
    n = len(run["step_signals"])
    if not n:
        return {}
    steps = range(n)

    def over_lowest(x):
        x = np.array(x, dtype=float)
        return x / np.fmin.accumulate(np.where(np.isfinite(x), x, np.inf))

    losses = [math.nan if v is None else v for v in run["losses"][:n]]
    loss_mean = [np.mean(xs) if (xs := [v for v in losses[max(0, t - 9):t + 1] if math.isfinite(v)]) else math.nan
                 for t in steps]
    grad, lossr = over_lowest([median_at(run, "grad_norm", t, 10) for t in steps]), over_lowest(loss_mean)
    w = [s[STEP_COLUMNS.index("weight_norm")] for s in run["step_signals"]]
    wgrow = np.array([w[t] / w[t - EVERY] if t >= EVERY else math.nan for t in steps])
    rho = np.array([median_at(run, "rho", t, 10) for t in steps])
    cos = np.array([cosine_at(run, t) for t in steps])
    ratio = np.array([ratio_at(run, t) for t in steps])
    with np.errstate(invalid="ignore"):
        return {"grad 1.5x": grad >= 1.5, "grad 2x": grad >= 2, "weights 1.05x/25": wgrow >= 1.05,
                "weights 1.1x/25": wgrow >= 1.1, "weights 1.2x/25": wgrow >= 1.2, "secant < -0.3": rho < -0.3,
                "secant < -0.5": rho < -0.5, "cosine < 0": cos < 0, "cosine < -0.1": cos < -0.1,
                "update ratio > 0.03": ratio > 0.03, "update ratio > 0.05": ratio > 0.05,
                "loss 1.05x": lossr >= 1.05, "loss 1.1x": lossr >= 1.1}


def combined_table(rows: list[dict], start: int = 50) -> None:
    """Up to three of the step signals at once (every one holding at the same step, ``k`` steps in a row, from
    ``start`` on: before it a run is leaving its initialisation), each signal over 10 steps as above, the loss's
    10-step mean against its lowest so far beside them. The search is over every such combination on the tuning
    half, so its best row per count of controls warned is an optimistic bound, not a rule's held-out figure."""
    import itertools

    conds = {(r["id"], name): step_conditions(r[name]) for r in rows for name in ("divergent", "control")}
    names = list(next(iter(conds.values())).keys()) if conds else []

    def first(case, name, combo, k):
        c = conds[(case["id"], name)]
        if not c:
            return None
        held = np.logical_and.reduce([c[x] for x in combo])
        streak = 0
        for t in range(start, len(held)):
            streak = streak + 1 if held[t] else 0
            if streak >= k:
                return t
        return None

    best: dict[int, tuple] = {}
    tried = 0
    for size in (1, 2, 3):
        for combo in itertools.combinations(names, size):
            for k in (1, 5):
                tried += 1
                leads = [lead(r["divergent"]["diverged_at"], first(r, "divergent", combo, k)) for r in rows]
                s = summary(leads)
                fp = sum(first(r, "control", combo, k) is not None for r in rows)
                if fp not in best or s["ge20"] > best[fp][0]["ge20"]:
                    best[fp] = (s, combo, k)
    print(f"\nUp to three step signals at once, from step {start}: the best of {tried} combinations for each count "
          "of controls warned (most runs warned >= 20 ahead; tuning half, an optimistic bound)")
    print("| controls warned | signals, all at once | in a row | median lead | p25 | warned >= 20 ahead "
          "| >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for fp in sorted(best)[:6]:
        s, combo, k = best[fp]
        print(f"| {fp} of {len(rows)} | {', '.join(combo)} | {k} | {s['median']} | {s['p25']} | {s['ge20']} | "
              f"{s['ge50']} |")


def trajectories(rows: list[dict]) -> None:
    """The signals side by side at a few steps: do the twins and the controls part, and when?"""
    print("\ncase opt | run | diverged | lowest call mean / mean of means / one-hot share / update ratio at steps "
          "0 25 50 100 150 200 250 (. past the divergence)")
    for r in rows:
        for name in ("divergent", "control"):
            run = r[name]
            d = run["diverged_at"]
            cells = []
            for s in (0, 25, 50, 100, 150, 200, 250):
                if s >= len(run["entropy"]) or (d is not None and s > d):
                    cells.append("        .")
                    continue
                c = run["entropy"][s]
                cells.append(f"{min_mean(c):.2f}/{mean_mean(c):.2f}/{max_onehot(c):.2f}/{ratio_at(run, s):.3f}")
            print(f"{r['id']:3d} {r['optimizer'][:5]:5s} | {name[:4]} | {str(d):>4s} | {' '.join(cells)}")


def rerun_tuning(results: Path, run_pair: Callable[[tuple], dict], workers: int, out: Optional[str]) -> list[dict]:
    """Rerun each valid tuning case of a sweep's ``results`` with ``run_pair((case id, kept LR))`` in ``workers``
    processes (the held-out half is never run), printing each as it lands; the rows, by case id, also written to
    ``out`` (one JSON line each) when given. Shared by this script and router.py."""
    tuning, _, _ = split_cases(load(results))
    jobs = [(c["case"]["id"], c["lr"]) for c in tuning]
    print(f"{len(jobs)} tuning cases, twin and control each run {STEPS} steps in plain PyTorch", flush=True)
    rows = []
    with mp.get_context("spawn").Pool(workers) as pool:
        for r in pool.imap_unordered(run_pair, jobs):
            rows.append(r)
            print(f"case {r['id']:3d} {r['arch']:13s} {r.get('precision', '')} {r['optimizer']:12s} twin diverged at "
                  f"{r['divergent']['diverged_at']}, control {r['control']['diverged_at']}", flush=True)
    rows.sort(key=lambda r: r["id"])
    if out:
        with open(out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


def valid_reruns(rows: list[dict]) -> list[dict]:
    """The reruns whose twin diverged again and whose control did not (printed: how many)."""
    valid = [r for r in rows if r["divergent"]["diverged_at"] is not None and r["control"]["diverged_at"] is None]
    print(f"{len(valid)} of {len(rows)} reruns have a diverging twin and a control that does not diverge")
    return valid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="the sweep's results: its valid tuning cases are rerun")
    ap.add_argument("--load", help="a file this script wrote: the tables only")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", help="one JSON line per case")
    ap.add_argument("--every", type=int, default=EVERY, help="the sampling interval of the first entropy and "
                    "update-ratio tables (the second of each: every step)")
    args = ap.parse_args()
    rows = load(Path(args.load)) if args.load else rerun_tuning(Path(args.results), run_pair, args.workers, args.out)
    valid = valid_reruns(rows)
    table(valid, args.every)
    table(valid, 1)
    ratio_table(valid, args.every)
    ratio_table(valid, 1)
    cosine_table(valid)
    h12_rows(valid)
    more_signals_table(valid)
    combined_table(valid)
    trajectories(valid)


if __name__ == "__main__":
    main()
