"""The early-warning report of a sweep's results, tuning half and held-out half, labelled.

    .venv/bin/python -m bench.early_warning.report                       # bench/early_warning/results.jsonl
    .venv/bin/python -m bench.early_warning.report --results /tmp/ew.jsonl --cases   # + one row per case
    .venv/bin/python -m bench.early_warning.report --results NEW.jsonl --before OLD.jsonl   # + two sweeps side by side

Lead of a rule on a divergent run: the divergence step (divergence.py) minus the first step of the rule's
first alert above info; an alert after the divergence step, or none, is a miss. Warnings per 1,000 healthy
steps: the controls' alerts above info (every rule), per 1,000 control steps. Oracle lead: the divergence step
minus the first step whose true max attention logit (oracle.py) is above the highest value the case's
control reached in its whole run (its healthy range); none when it never leaves it before the divergence.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

from .space import HFMOE_FIRST, KINDS_FIRST, MOE_FIRST, NOATTN_ARCHS, NOATTN_FIRST
from .sweep import RESULTS
from .sweep import halves as sweep_halves

RULES = ("H1", "H2", "H3", "H4", "H12", "H13", "H14")
ANY = "any H"


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def first_warning(alerts: list[dict], rules) -> Optional[int]:
    steps = [a["first_step"] for a in alerts if a["rule"] in rules and a["severity"] != "info"]
    return min(steps) if steps else None


def lead(d: int, first: Optional[int]) -> Optional[int]:
    return d - first if first is not None and first <= d else None


def true_max(run: dict) -> list[float]:
    return [max((v for v in vs if v is not None), default=math.nan) for vs in run["logits"]]


def oracle_lead(case: dict) -> Optional[int]:
    ctl = [v for v in true_max(case["control"]) if math.isfinite(v)]
    if not ctl:
        return None
    hi = max(ctl)
    d = case["divergent"]["diverged_at"]
    for s, v in enumerate(true_max(case["divergent"])):
        if s > d:
            break
        if math.isfinite(v) and v > hi:
            return d - s
    return None


def summary(leads: list[Optional[int]]) -> dict:
    got = [x for x in leads if x is not None]
    n = len(leads)
    return {"n": n, "warned": len(got), "misses": n - len(got),
            # a miss counts as a lead below every warned one (-inf) in the median and p25
            "median": _pct([x if x is not None else -math.inf for x in leads], 50),
            "p25": _pct([x if x is not None else -math.inf for x in leads], 25),
            "ge20": sum(1 for x in got if x >= 20), "ge50": sum(1 for x in got if x >= 50)}


def _pct(xs: list[float], q: float):
    if not xs:
        return None
    v = float(np.percentile(np.array(xs, dtype=float), q, method="lower"))
    return "miss" if v == -math.inf else int(v)


def half_table(cases: list[dict], label: str, rules=RULES) -> str:
    lines = [f"**{label}**: {len(cases)} divergent runs with a valid control, "
             f"{sum(c['control']['steps'] for c in cases)} healthy control steps", "",
             "| signal | warned | misses | median lead | p25 lead | warned >= 20 ahead | >= 50 ahead |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in (*rules, ANY):
        rs = [x for x in rules] if r == ANY else [r]
        s = summary([lead(c["divergent"]["diverged_at"], first_warning(c["divergent"]["alerts"], rs)) for c in cases])
        lines.append(f"| {r} | {s['warned']}/{s['n']} | {s['misses']} | {s['median']} | {s['p25']} | "
                     f"{s['ge20']} ({100 * s['ge20'] / max(1, s['n']):.0f} %) | {s['ge50']} |")
    o = summary([oracle_lead(c) for c in cases])
    lines.append(f"| oracle (true max logit leaves the control's range) | {o['warned']}/{o['n']} | {o['misses']} | "
                 f"{o['median']} | {o['p25']} | {o['ge20']} ({100 * o['ge20'] / max(1, o['n']):.0f} %) | {o['ge50']} |")
    steps = sum(c["control"]["steps"] for c in cases)
    loud = [(c["case"]["id"], a["rule"], a["severity"]) for c in cases for a in c["control"]["alerts"]
            if a["severity"] != "info"]
    h_loud = [x for x in loud if x[1].startswith("H")]
    per_rule = {r: sorted({i for i, rule, _ in loud if rule == r}) for r in rules}
    lines += ["", f"Controls: {len(loud)} alerts above info ({1000 * len(loud) / max(1, steps):.2f} per 1,000 healthy "
              f"steps), {len(h_loud)} of them H ({1000 * len(h_loud) / max(1, steps):.2f} per 1,000)"
              + (f": {sorted(loud)}" if loud else ""), "",
              "Controls warned, per rule: " + "; ".join(f"{r} {len(ids)}" + (f" {ids}" if ids else "")
                                                         for r, ids in per_rule.items()), ""]
    return "\n".join(lines)


def case_rows(cases: list[dict], rules=RULES) -> str:
    lines = ["| case | half | arch | optimizer | lr | warm-up | depth x width / heads | batch | diverged at | "
             + " | ".join(rules) + " | oracle | control alerts |",
             "| " + " | ".join(["---"] * (11 + len(rules))) + " |"]
    for c in cases:
        k, d = c["case"], c["divergent"]["diverged_at"]
        leads = [lead(d, first_warning(c["divergent"]["alerts"], [r])) for r in rules]
        ctl = sorted({a["rule"] for a in c["control"]["alerts"] if a["severity"] != "info"})
        arch = k["arch"] + (f" ({k['precision']})" if k.get("precision", "fp32") != "fp32" else "")
        lines.append(f"| {k['id']} | {c['half']} | {arch} | {k['optimizer']} | {c['lr']:.3g} | {k['warmup']} | "
                     f"{k['depth']} x {k['width']} / {k['heads']} | {k['batch']} | {d} | "
                     + " | ".join("-" if x is None else str(x) for x in leads)
                     + f" | {oracle_lead(c) if oracle_lead(c) is not None else '-'} | {', '.join(ctl) or '-'} |")
    return "\n".join(lines)


def kind_of(case: dict) -> str:
    arch = case["arch"]
    if arch in NOATTN_ARCHS:
        return f"no attention ({arch})" if case["id"] >= NOATTN_FIRST else "no attention"
    if case["id"] >= HFMOE_FIRST:    # Hugging Face's MoEs: each arch its own row
        router = "3-D top-1 router" if arch == "hf_switch" else "top-2 router"
        return f"Hugging Face MoE, attention, {router} ({arch})"
    if case["id"] >= MOE_FIRST:      # the MoE space: each arch its own row
        return {"moe_lm": "mixture of experts, attention (moe_lm)",
                "moe_mlp_lm": "mixture of experts, no attention, top-1 (moe_mlp_lm)",
                "moe2_mlp_lm": "mixture of experts, no attention, top-2 (moe2_mlp_lm)"}[arch]
    return "mixture of experts" if arch == "moe_lm" else "dense attention"


def kinds_table(cases: list[dict], label: str) -> str:
    """One half's figures per kind of model and precision (the later spaces, space.py ids 100 on): the H rules'
    first warning, and beside it the first alert above info from any rule, with the controls each warns."""
    lines = [f"**{label}**, per kind", "",
             "| kind | precision | divergent runs | any H: median lead | p25 | warned >= 20 ahead | "
             "controls with an H warning | any rule: median lead | warned >= 20 ahead | controls with any alert "
             "above info |", "| " + " | ".join(["---"] * 10) + " |"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for c in cases:
        groups.setdefault((kind_of(c["case"]), c["case"].get("precision", "fp32")), []).append(c)
    for (kind, precision), cs in sorted(groups.items()):
        h = summary([lead(c["divergent"]["diverged_at"], first_warning(c["divergent"]["alerts"], RULES))
                     for c in cs])
        every = {a["rule"] for c in cs for run in ("divergent", "control") for a in c[run]["alerts"]}
        a = summary([lead(c["divergent"]["diverged_at"], first_warning(c["divergent"]["alerts"], every))
                     for c in cs])
        h_ctl = sum(1 for c in cs if h_warnings(c["control"]))
        any_ctl = sum(1 for c in cs if any(x["severity"] != "info" for x in c["control"]["alerts"]))
        lines.append(f"| {kind} | {precision} | {len(cs)} | {h['median']} | {h['p25']} | {h['ge20']} | {h_ctl} | "
                     f"{a['median']} | {a['ge20']} | {any_ctl} |")
    return "\n".join(lines + [""])


def h_warnings(run: dict) -> list[dict]:
    """A run's alerts above info from the H rules."""
    return [a for a in run["alerts"] if a["severity"] != "info" and a["rule"].startswith("H")]


def h_controls(cases: list[dict]) -> tuple[int, float]:
    """Controls with an H alert above info, and H alerts above info per 1,000 healthy steps."""
    steps = sum(c["control"]["steps"] for c in cases)
    loud = [a for c in cases for a in h_warnings(c["control"])]
    warned = sum(1 for c in cases if h_warnings(c["control"]))
    return warned, 1000 * len(loud) / max(1, steps)


def side_by_side(before: list[dict], after: list[dict], label: str, rules=("H2", "H12", "H13", ANY)) -> str:
    """One half's figures from two sweeps of the same cases (an earlier results file, this one)."""
    ids = lambda cs: sorted(c["case"]["id"] for c in cs)   # noqa: E731
    same = ids(before) == ids(after)
    lines = [f"**{label}**" + ("" if same else f" (the sweeps' ok cases differ: {ids(before)} / {ids(after)})"), "",
             "| signal | median lead before / after | p25 before / after | warned >= 20 ahead before / after | "
             ">= 50 ahead before / after |", "| --- | --- | --- | --- | --- |"]
    for r in rules:
        rs = list(RULES) if r == ANY else [r]
        b, a = (summary([lead(c["divergent"]["diverged_at"], first_warning(c["divergent"]["alerts"], rs))
                         for c in cs]) for cs in (before, after))
        pct = lambda s: f"{s['ge20']} ({100 * s['ge20'] / max(1, s['n']):.0f} %)"   # noqa: E731
        lines.append(f"| {r} | {b['median']} / {a['median']} | {b['p25']} / {a['p25']} | {pct(b)} / {pct(a)} | "
                     f"{b['ge50']} / {a['ge50']} |")
    (wb, rb), (wa, ra) = h_controls(before), h_controls(after)
    lines += ["", f"Controls with an H warning: {wb} / {wa} of {len(after)}; H warnings per 1,000 healthy steps: "
              f"{rb:.2f} / {ra:.2f}", ""]
    return "\n".join(lines)


def as_info(results: list[dict], rules: set[str]) -> None:
    """Count ``rules``' alerts as info (what the sweep would have shown with those rules' severity at info: the
    severity changes nothing else a run records)."""
    for c in results:
        for run in (c.get("divergent"), c.get("control")):
            for a in (run or {}).get("alerts", []):
                if a["rule"] in rules:
                    a["severity"] = "info"


def split_cases(results: list[dict]) -> tuple[list[dict], list[dict], dict]:
    halves = sweep_halves()
    counts: dict[str, int] = {}
    tuning, held = [], []
    for c in results:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
        if c["status"] != "ok":
            continue
        c["half"] = halves[c["case"]["id"]]
        (tuning if c["half"] == "tuning" else held).append(c)
    return tuning, held, counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--cases", action="store_true", help="also one row per case")
    ap.add_argument("--before", default=None, help="an earlier sweep's results file: H2 / H12 / any H side by side")
    ap.add_argument("--as-info", default="", help="rules whose alerts count as info, e.g. H2,H12 (both files)")
    args = ap.parse_args()
    results = load(Path(args.results))
    demoted = {r for r in args.as_info.split(",") if r}
    as_info(results, demoted)
    if demoted:
        print(f"counted as info: {', '.join(sorted(demoted))}\n")
    tuning, held, counts = split_cases(results)
    print(f"cases: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}\n")
    if args.before:
        before = load(Path(args.before))
        as_info(before, demoted)
        tuning0, held0, _ = split_cases(before)
        print(side_by_side(tuning0, tuning, "Tuning half, before / after"))
        print(side_by_side(held0, held, "Held-out half, before / after"))
    print(half_table(tuning, "Tuning half"))
    print(half_table(held, "Held-out half"))
    if any(c["case"]["id"] >= KINDS_FIRST for c in tuning + held):
        print(kinds_table(tuning, "Tuning half"))
        print(kinds_table(held, "Held-out half"))
    if args.cases:
        print(case_rows(sorted(tuning + held, key=lambda c: c["case"]["id"])))


if __name__ == "__main__":
    main()
