"""The largest nn.Linear output RMS, read as H13 reads the attention logits (a doubling time from a level), tried for
the models with no attention and not adopted (docs/early-warning.md, "The other kinds"): an MLP has no attention
logit, but its activations grow before it diverges. Does their growth rate tell a twin from its control?

It reruns the valid tuning cases of the given results files in plain PyTorch (the held-out halves are never run),
twin and control, recording at every step the largest RMS of any nn.Linear output (H4's signal, every Linear), and
replays the rule on it every 25 steps: it fires at the k-th sample in a row whose value is >= ``level`` and whose
growth over the last 25 steps means a doubling in <= ``doubling`` steps.

    .venv/bin/python -m bench.early_warning.linear_rms --workers 2 \\
        --results bench/early_warning/results-dd92524.jsonl bench/early_warning/results-kinds.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing as mp
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from .report import lead, load, split_cases, summary
from .space import BUDGET, CONTROL_DIVISOR, NOATTN_ARCHS, draw

EVERY = 25


def run_pair(args: tuple) -> dict:
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from .sweep import train

    case_id, lr = args
    case = draw(case_id)
    out = {"id": case_id, "arch": case.arch, "optimizer": case.optimizer}
    for name, run_lr in (("divergent", lr), ("control", lr / CONTROL_DIVISOR)):
        step_max: list[float] = []
        seen: list[float] = []

        def linear_output(module, inputs, output):
            if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
                seen.append(float(output.detach().float().pow(2).mean().sqrt()))

        def step_ends(opt, args, kwargs):           # the step's forward is over: its largest Linear output RMS
            step_max.append(max(seen, default=math.nan))
            seen.clear()

        handles = [nn.modules.module.register_module_forward_hook(linear_output),
                   register_optimizer_step_pre_hook(step_ends)]
        try:
            r = train(case, run_lr, BUDGET, server=None, stop_after_divergence=True)
        finally:
            for h in handles:
                h.remove()
        out[name] = {"diverged_at": r["diverged_at"], "rms": step_max}
    return out


def first_growth(run: dict, level: float, doubling: float, k: int) -> Optional[int]:
    xs, streak = run["rms"], 0
    end = len(xs) if run["diverged_at"] is None else min(len(xs), run["diverged_at"] + 1)
    for t in range(EVERY, end, EVERY):
        a, b = xs[t], xs[t - EVERY]
        hit = math.isfinite(a) and math.isfinite(b) and b > 0 and a >= level and a / b >= 2 ** (EVERY / doubling)
        streak = streak + 1 if hit else 0
        if streak >= k:
            return t
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", nargs="+", required=True)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    jobs = [(c["case"]["id"], c["lr"]) for path in args.results for c in split_cases(load(Path(path)))[0]]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        rows = sorted(pool.imap_unordered(run_pair, jobs), key=lambda r: r["id"])
    rows = [r for r in rows if r["divergent"]["diverged_at"] is not None and r["control"]["diverged_at"] is None]
    mlp = [r for r in rows if r["arch"] in NOATTN_ARCHS]
    print(f"{len(rows)} valid tuning reruns, {len(mlp)} of them with no attention\n")
    print("| level | doubling in <= | k | no-attention twins warned >= 20 ahead | every twin: median lead / >= 20 "
          "ahead | controls warned | no-attention controls warned |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for level, doubling, k in itertools.product((2, 3, 5, 8, 12), (10, 15, 25, 40), (1, 2)):
        leads = {r["id"]: lead(r["divergent"]["diverged_at"], first_growth(r["divergent"], level, doubling, k))
                 for r in rows}
        s = summary(list(leads.values()))
        ctl = [r["id"] for r in rows if first_growth(r["control"], level, doubling, k) is not None]
        m = sum(1 for r in mlp if (leads[r["id"]] or 0) >= 20)
        quiet = [r["id"] for r in mlp if r["id"] in ctl]
        print(f"| {level} | {doubling} | {k} | {m} of {len(mlp)} | {s['median']} / {s['ge20']} of {s['n']} | "
              f"{len(ctl)} {ctl} | {len(quiet)} |")


if __name__ == "__main__":
    main()
