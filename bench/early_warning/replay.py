"""Offline iteration on the tuning half only: H12's forecast (server/rules/catalog/early_forecast.py,
:func:`forecast_step`, the rule's own code) replayed on the recorded true max logits at the agent's default
cadence (every 25 steps, every step for 2 intervals once the run's max is >= 10 and 1.5x its value one
interval earlier: agent/collectors/early_logits.py), for a grid of settings. The figures reported come
from the real path (sweep.py + report.py), never from here; held-out cases are never read.

    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results.jsonl
    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results.jsonl --cadence
    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results.jsonl --gates
    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results-733fc4b.jsonl --rate
    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results-65cb243.jsonl --gated

``--cadence`` replays H12's default settings at other sampling cadences instead of the grid (issue 41: lead
through cadence, within the overhead budget): the interval, how long an escalation samples every step, and
the growth test that escalates. Beside the lead figures it prints the share of the controls' steps that
would be sampled (each costs one measured forward: the overhead that cadence adds on a healthy run).
``--gates`` tries gates on H12's hits (a faster doubling time, the loss off its best, a higher danger level
without the level prior) against the five AdamW controls that every setting of the grid warns on, then a
doubling-time limit per optimizer family (``by_optimizer``).
``--rate`` replays a growth-rate rule alone, without H12's floor of 60 (``first_fast``: H13's own code): does
the rate, read from a lower level, warn the divergent runs sooner than H12 with a per-family limit, and the
controls never? H13's defaults come from this grid.
``--gated`` replays H12 gated by a doubling-time limit per optimizer family (``fast_enough``: the rule's own
gate, off by default), alone and or H13: the balanced profile (docs/early-warning.md) comes from it.
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Optional

from gradwatch.server.rules.catalog.early_forecast import (AttentionLogitForecast, AttentionLogitRunaway, fast_enough,
                                                           forecast_step, optimizer_family, runaway_step)

from .report import lead, load, split_cases, summary

EVERY, FLOOR, GROWTH, INTERVALS = 25, 10.0, 1.5, 2      # agent/config.py, agent/collectors/early_logits.py


# the agent's cadence (agent/collectors/early_logits.py): the interval, the escalation's length in steps
# (BOOST_INTERVALS intervals), the interval the growth test looks back over (one interval)
CADENCE = {"every": EVERY, "boost": INTERVALS * EVERY, "lookback": EVERY, "floor": FLOOR, "growth": GROWTH}


def sampled(run: dict, cadence: dict = CADENCE) -> list[tuple[int, list[float]]]:
    """(step, per-call max logits) of the steps the agent would sample at ``cadence``."""
    every, look = cadence["every"], cadence["lookback"]
    out, history, boost = [], [], -1
    for step, vs in enumerate(run["logits"]):
        if not (step % every == 0 or step <= boost):
            continue
        vals = [v if v is not None else math.nan for v in vs]
        out.append((step, vals))
        top = max((v for v in vals if math.isfinite(v)), default=math.nan)
        before = [v for s, v in history if s <= step - look]
        history = [(s, v) for s, v in history if s > step - 2 * max(look, every)] + [(step, top)]
        if before and math.isfinite(top) and top >= cadence["floor"] and top >= cadence["growth"] * before[-1]:
            boost = step + cadence["boost"]
    return out


def first_hit(run: dict, cfg: dict, cadence: dict = CADENCE, gate=None):
    """The first sampled step at which H12 holds for some module (and ``gate(hit, step, losses)``, if given)."""
    mems: dict[int, dict] = {}
    for step, vals in sampled(run, cadence):
        hit = False
        for j, v in enumerate(vals):
            if math.isfinite(v):
                h = forecast_step(mems.setdefault(j, {}), step, v, cfg)
                if h is not None and (gate is None or gate(h, step, run["losses"])):
                    hit = True
        if hit:
            return step
    return None


def evaluate(cases: list[dict], cfg: dict, cadence: dict = CADENCE, gate=None) -> tuple[dict, int]:
    leads = [lead(c["divergent"]["diverged_at"], first_hit(c["divergent"], cfg, cadence, gate)) for c in cases]
    fp = sum(1 for c in cases if first_hit(c["control"], cfg, cadence, gate) is not None)
    return summary(leads), fp


def control_cost(cases: list[dict], cadence: dict) -> float:
    """Sampled steps per step of the controls (healthy runs) at ``cadence``."""
    n = sum(len(c["control"]["logits"]) for c in cases)
    return sum(len(sampled(c["control"], cadence)) for c in cases) / max(1, n)


# the cadences --cadence compares (H12 at its defaults): interval, escalation length, growth look-back. The
# first is the bound (every step sampled); (50, 100, 50) was the default before issue 41, (25, 50, 25) is now.
CADENCES = [dict(CADENCE, every=e, boost=b, lookback=lb) for e, b, lb in
            ((1, 100, 10), (50, 100, 50), (40, 80, 40), (30, 60, 30), (25, 50, 25), (25, 100, 25), (25, 100, 50),
             (20, 40, 20), (10, 100, 10))]


def cadences(tuning: list[dict], cfg: dict) -> None:
    print("every boost lookback | controls warned | sampled share of control steps | lead summary")
    for cad in CADENCES:
        s, fp = evaluate(tuning, cfg, cad)
        print(f"{cad['every']:5d} {cad['boost']:5d} {cad['lookback']:8d} | {fp:2d} of {len(tuning)} | "
              f"{control_cost(tuning, cad):.4f} | {s}", flush=True)


# The AdamW controls every H12 setting warns on (docs/early-warning.md, "Met and not met"): their max attention
# logit reaches 4.4e3-5.6e4 while their loss stays under the divergence rule.
ADAMW_FIVE = {1, 36, 55, 72, 94}


def fast(max_doubling: float):
    """Gate: the hit's growth doubles the logit within ``max_doubling`` steps (the divergent runs grow faster?)."""
    return lambda hit, step, losses: hit["doubling_steps"] is not None and hit["doubling_steps"] <= max_doubling


def loss_off_best(fraction: float, window: int = 20):
    """Gate: the mean of the last ``window`` losses is ``fraction`` above the best loss so far."""
    def gate(hit, step, losses):
        xs = [x for x in losses[:step + 1] if x is not None]
        return len(xs) >= window and sum(xs[-window:]) / window >= (1 + fraction) * min(xs)
    return gate


def gates(tuning: list[dict], base: dict) -> None:
    """Issue 41, item 4: a signal or gate that stops the warnings on ADAMW_FIVE without losing lead (tuning
    half, the agent's cadence). Each row: the controls warned (how many of the five), H12's lead figures."""
    rows = [("H12 as it is", base, None)]
    rows += [(f"doubling <= {d} steps, span {sp}, {c} in a row", dict(base, span=sp, consecutive=c), fast(d))
             for sp, c, d in itertools.product((10, 25, 50), (2, 5), (5, 8, 10, 15, 30))]
    rows += [(f"the last 20 losses' mean >= {1 + f:g}x the best", base, loss_off_best(f)) for f in (0.02, 0.05, 0.1)]
    rows += [(f"danger {dg:g}, horizon {hz}, no level prior, doubling <= {d}",
              dict(base, danger=dg, horizon=hz, level=1e9), fast(d))
             for dg, hz, d in itertools.product((3000, 10000, 100000), (50, 100), (10, 20))]
    for name, cfg, gate in rows:
        leads = [lead(c["divergent"]["diverged_at"], first_hit(c["divergent"], cfg, CADENCE, gate)) for c in tuning]
        warned = {c["case"]["id"] for c in tuning if first_hit(c["control"], cfg, CADENCE, gate) is not None}
        s = summary(leads)
        print(f"{name:55s} controls {len(warned):2d} (of the five {len(warned & ADAMW_FIVE)}) | median {s['median']} "
              f"p25 {s['p25']} >=20 {s['ge20']} >=50 {s['ge50']}", flush=True)


def by_optimizer(adaptive: float, sgd: Optional[float]):
    """A gate per case: the hit's doubling time at most ``adaptive`` steps for AdamW and RMSprop, at most
    ``sgd`` for SGD with momentum (None: SGD ungated). On the tuning half, at H12's first hit, the true max
    logit had grown over the last 25 steps ×46–881 in AdamW's divergent runs against ×2.4–7.8 in their
    controls; RMSprop ×2.8–122 against ×3.2–3.7; SGD ×2.1–83 against ×1.1–3.2."""
    def per_case(case: dict):
        limit = sgd if case["case"]["optimizer"] == "sgd_momentum" else adaptive
        return None if limit is None else fast(limit)
    return per_case


def family_gates(tuning: list[dict], base: dict) -> None:
    """The doubling-time gate with a limit per optimizer family (``by_optimizer``), with the rate measured
    over ``span`` 10 (H12's default) or 25 steps."""
    for (adaptive, sgd), span in itertools.product(((4, 10), (5, 10), (5, None), (6, 10), (6, 15), (8, 10),
                                                    (10, 10), (10, None)), (10, 25)):
        cfg, per_case = dict(base, span=span), by_optimizer(adaptive, sgd)
        leads = [lead(c["divergent"]["diverged_at"], first_hit(c["divergent"], cfg, CADENCE, per_case(c)))
                 for c in tuning]
        warned = sorted(c["case"]["id"] for c in tuning if first_hit(c["control"], cfg, CADENCE, per_case(c)) is not None)
        s = summary(leads)
        print(f"doubling <= {adaptive} (AdamW, RMSprop), <= {sgd} (SGD), span {span}: controls {len(warned):2d} {warned} | "
              f"median {s['median']} p25 {s['p25']} >=20 {s['ge20']} >=50 {s['ge50']}", flush=True)


def first_fast(run: dict, floor: float, window: int, limit: float, consecutive: int,
               cadence: dict = CADENCE) -> Optional[int]:
    """The first sampled step at which H13's condition (server/rules/catalog/early_forecast.py,
    :func:`runaway_step`, the rule's own code) holds for some module: its max logit is >= ``floor`` and has
    doubled in at most ``limit`` steps since the latest sample ``window``-``2*window`` steps earlier,
    ``consecutive`` samples in a row."""
    cfg = {"min_logit": floor, "span": window, "consecutive": consecutive}
    mems: dict[int, dict] = {}
    for step, vals in sampled(run, cadence):
        hit = False
        for j, v in enumerate(vals):
            if math.isfinite(v) and runaway_step(mems.setdefault(j, {}), step, v, cfg, limit) is not None:
                hit = True
        if hit:
            return step
    return None


CLASS_OF = {"adamw": "AdamW", "rmsprop": "RMSprop", "sgd_momentum": "SGD"}    # space.py's optimizers


def rates(tuning: list[dict]) -> None:
    """H13 at its defaults (the rule's params), then ``first_fast`` over a grid (floor, window, samples in a
    row, a doubling limit per optimizer family): for each window, the 10 settings that warn the fewest controls,
    then the most runs >= 20 ahead, then the longest median. H13's defaults were chosen from this grid."""
    d = {k: p.default for k, p in AttentionLogitRunaway.params.items()}
    grid = [(d["min_logit"], d["span"], d["consecutive"], d["doubling_adaptive"], d["doubling_rmsprop"],
             d["doubling_sgd"])]
    grid += list(itertools.product((5, 10, 20, 40), (10, 25), (1, 2, 3), (3, 4, 5, 6, 8, 10, 15),
                                   (4, 5, 6, 8, 10, 15), (6, 8, 10, 15, 20, 30)))
    rows = []
    for floor, window, cons, *limits in grid:
        by_family = dict(zip(("adaptive", "rmsprop", "sgd"), limits))

        def first(run, case):
            family = optimizer_family(CLASS_OF[case["optimizer"]])
            return first_fast(run, floor, window, by_family[family], cons)
        leads = [lead(c["divergent"]["diverged_at"], first(c["divergent"], c["case"])) for c in tuning]
        warned = sorted(c["case"]["id"] for c in tuning if first(c["control"], c["case"]) is not None)
        s = summary(leads)
        rows.append((len(warned), -s["ge20"], -(s["median"] if isinstance(s["median"], int) else -999), window,
                     f"floor {floor:g}, window {window}, {cons} in a row, doubling <= {limits} (AdamW, RMSprop, SGD)",
                     warned, s))

    def show(row):
        n, _, _, _, name, warned, s = row
        print(f"{name}: controls {n} {warned} | median {s['median']} p25 {s['p25']} >=20 {s['ge20']} "
              f">=50 {s['ge50']}", flush=True)
    print("H13 at its defaults:")
    show(rows[0])
    print(f"{len(rows) - 1} settings of the grid")
    for window in (10, 25):
        print(f"window {window}:")
        for row in sorted((r for r in rows[1:] if r[3] == window), key=lambda r: r[:3])[:10]:
            show(row)


def gated(tuning: list[dict]) -> None:
    """H12 gated by a doubling-time limit per optimizer family (the rule's own ``fast_enough``), alone and with
    H13 beside it: the first sampled step at which either warns. The balanced profile's limits first (H13's:
    bench/early_warning/profiles/balanced.toml), then a grid of limits and spans, the 10 settings warning the
    fewest controls, then the most runs >= 20 ahead, then the longest median and p25."""
    h13 = {k: p.default for k, p in AttentionLogitRunaway.params.items()}
    ungated = {k: p.default for k, p in AttentionLogitForecast.params.items()}     # the gate is off by default
    h12 = dict(ungated, doubling_adaptive=h13["doubling_adaptive"], doubling_rmsprop=h13["doubling_rmsprop"],
               doubling_sgd=h13["doubling_sgd"])

    def limit_of(case, cfg):
        return cfg[f"doubling_{optimizer_family(CLASS_OF[case['optimizer']])}"]

    def first_h12(run, case, cfg):
        return first_hit(run, cfg, CADENCE, lambda h, step, losses: fast_enough(dict(h), limit_of(case, cfg)))

    h13_first: dict = {}

    def first_h13(run, case):       # H13's settings do not move in the grid: each run is replayed once
        key = (case["id"], id(run))
        if key not in h13_first:
            h13_first[key] = first_fast(run, h13["min_logit"], h13["span"], limit_of(case, h13), h13["consecutive"])
        return h13_first[key]

    def either(run, case, cfg):
        steps = [x for x in (first_h12(run, case, cfg), first_h13(run, case)) if x is not None]
        return min(steps) if steps else None

    def row(first):
        leads = [lead(c["divergent"]["diverged_at"], first(c["divergent"], c["case"])) for c in tuning]
        return sorted(c["case"]["id"] for c in tuning if first(c["control"], c["case"]) is not None), summary(leads)

    def show(name, warned, s):
        print(f"{name}: controls {len(warned)} {warned} | median {s['median']} p25 {s['p25']} >=20 {s['ge20']} "
              f">=50 {s['ge50']}", flush=True)
    show("H12 at its defaults (no gate)", *row(lambda r, c: first_hit(r, ungated)))
    show("H13 at its defaults", *row(first_h13))
    show("H12 gated at H13's limits (the balanced profile)", *row(lambda r, c: first_h12(r, c, h12)))
    show("the same, or H13", *row(lambda r, c: either(r, c, h12)))
    rows = []
    for a, rms, sgd, span in itertools.product((4, 5, 6, 8), (5, 8, 10, 15), (8, 10, 15, 20), (10, 25)):
        cfg = dict(h12, doubling_adaptive=a, doubling_rmsprop=rms, doubling_sgd=sgd, span=span)
        warned, s = row(lambda r, c, cfg=cfg: either(r, c, cfg))
        key = [x if isinstance(x, int) else -1 for x in (s["median"], s["p25"])]
        rows.append((len(warned), -s["ge20"], -key[0], -key[1], f"limits {a}/{rms}/{sgd} (AdamW/RMSprop/SGD), "
                     f"span {span}, or H13", warned, s))
    print(f"{len(rows)} settings of the gate, each or H13:")
    for r in sorted(rows, key=lambda r: r[:4])[:10]:
        show(*r[4:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--cadence", action="store_true", help="H12's defaults at other sampling cadences, not the grid")
    ap.add_argument("--gates", action="store_true", help="gates tried against the five AdamW controls, not the grid")
    ap.add_argument("--rate", action="store_true", help="a growth-rate rule alone, from a lower level, not the grid")
    ap.add_argument("--gated", action="store_true", help="H12 gated by the doubling time per optimizer family, "
                    "alone and or H13, not the grid")
    args = ap.parse_args()
    tuning, _, _ = split_cases(load(Path(args.results)))        # the held-out half is dropped here
    base = {k: p.default for k, p in AttentionLogitForecast.params.items()}
    if args.cadence:
        cadences(tuning, base)
        return
    if args.rate:
        rates(tuning)
        return
    if args.gated:
        gated(tuning)
        return
    if args.gates:
        gates(tuning, base)
        family_gates(tuning, base)
        return
    print("default", base, *evaluate(tuning, base))
    rows = []
    # docs/early-warning.md quotes this grid (2,160 settings): its least number of controls warned
    for ml, dg, hz, lv, cons, span in itertools.product((40, 60, 100, 150), (1000, 3000, 10000), (100, 200, 300, 600),
                                                        (250, 500, 1000, 3000, 1e9), (2, 3, 5), (10, 25, 50)):
        cfg = dict(base, min_logit=ml, danger=dg, horizon=hz, level=lv, consecutive=cons, span=span)
        s, fp = evaluate(tuning, cfg)
        rows.append((fp, -(s["ge20"]), -(s["median"] if isinstance(s["median"], int) else -999), cfg, s))
    rows.sort(key=lambda r: r[:3])
    print(f"{len(rows)} settings; the fewest controls warned: {rows[0][0]} of {len(tuning)}")
    for fp, _, _, cfg, s in rows[:25]:
        print(fp, s, {k: cfg[k] for k in ("min_logit", "danger", "horizon", "level", "consecutive", "span")})


if __name__ == "__main__":
    main()
