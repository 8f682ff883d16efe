"""Offline iteration on the tuning half only: H12's forecast (server/rules/catalog/early_forecast.py,
:func:`forecast_step`, the rule's own code) replayed on the recorded true max logits at the agent's default
cadence (every 50 steps, every step for 2 intervals once the run's max is >= 10 and 1.5x its value one
interval earlier: agent/collectors/early_logits.py), for a grid of settings. The figures reported come
from the real path (sweep.py + report.py), never from here; held-out cases are never read.

    .venv/bin/python -m bench.early_warning.replay --results bench/early_warning/results.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from gradwatch.server.rules.catalog.early_forecast import AttentionLogitForecast, forecast_step

from .report import lead, load, split_cases, summary

EVERY, FLOOR, GROWTH, INTERVALS = 50, 10.0, 1.5, 2


def sampled(run: dict) -> list[tuple[int, list[float]]]:
    """(step, per-call max logits) of the steps the agent would sample."""
    out, history, boost = [], [], -1
    for step, vs in enumerate(run["logits"]):
        if not (step % EVERY == 0 or step <= boost):
            continue
        vals = [v if v is not None else math.nan for v in vs]
        out.append((step, vals))
        top = max((v for v in vals if math.isfinite(v)), default=math.nan)
        before = [v for s, v in history if s <= step - EVERY]
        history = [(s, v) for s, v in history if s > step - 2 * EVERY] + [(step, top)]
        if before and math.isfinite(top) and top >= FLOOR and top >= GROWTH * before[-1]:
            boost = step + INTERVALS * EVERY
    return out


def first_hit(run: dict, cfg: dict):
    mems: dict[int, dict] = {}
    for step, vals in sampled(run):
        hit = False
        for j, v in enumerate(vals):
            if math.isfinite(v) and forecast_step(mems.setdefault(j, {}), step, v, cfg) is not None:
                hit = True
        if hit:
            return step
    return None


def evaluate(cases: list[dict], cfg: dict) -> tuple[dict, int]:
    leads = [lead(c["divergent"]["diverged_at"], first_hit(c["divergent"], cfg)) for c in cases]
    fp = sum(1 for c in cases if first_hit(c["control"], cfg) is not None)
    return summary(leads), fp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    args = ap.parse_args()
    tuning, _, _ = split_cases(load(Path(args.results)))        # the held-out half is dropped here
    base = {k: p.default for k, p in AttentionLogitForecast.params.items()}
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
