"""The router of a mixture of experts, tried as an early-warning signal (issue 41: early warning is judged on
every kind of model, dense or MoE; no rule read a router). An analysis beside the protocol, on the tuning half
of the mixture-of-experts space only (space.py, ids 300-359, ``results-moe.jsonl``): it reruns each valid tuning
case (its divergent twin at the kept LR, its control at LR / CONTROL_DIVISOR) in plain PyTorch, with
:class:`RouterLogits` (a subclass of this benchmark's oracle mode) recording every router call of every step,
and replays rules on what it recorded at the agent's cadence. Held-out cases are never run: a rule that wins
here goes into the agent first and is reported on the held-out half through the real path, once.

    .venv/bin/python -m bench.early_warning.router --results bench/early_warning/results-moe.jsonl \\
        --workers 2 --out /tmp/router.jsonl                     # runs (a few minutes), then the tables
    .venv/bin/python -m bench.early_warning.router --load /tmp/router.jsonl         # the tables again

A router call is a softmax over the last dimension of a 2-D ``[tokens, experts]`` tensor (Switch, Mixtral:
``softmax(router(x))``; the oracle's attention calls are 3-D or more), or one over more dimensions made by a module
whose class name ends in ``Router`` (Hugging Face's Switch Transformers: ``oracle.called_by_router``). Per call,
from its logits (the softmax's input): the largest spread of a token's logits (max - min: what the softmax sees,
shift-invariant), the largest logit's magnitude, the mean of logsumexp² (ST-MoE's router z-loss, Zoph et al.
2022), the mean top probability, and the largest share of tokens whose top expert is the same one (load
imbalance). A step's value is the largest over its calls (its worst layer).

The divergence step is this rerun's own (divergence.py on its losses), as in precursors.py.
"""
from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from gradwatch.server.rules.catalog.early_forecast import runaway_step

from .oracle import TrueLogits
from .precursors import outcome, rerun_tuning, valid_reruns
from .report import load
from .space import CONTROL_DIVISOR, draw

STEPS = 300
EVERY = 25                       # the agent's attention cadence (agent/config.py), without its escalation
COLUMNS = ("spread", "absmax", "z2", "top", "busiest")
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}


class RouterLogits(TrueLogits):
    """The oracle's attention logits, and beside them each router call's figures (:data:`COLUMNS`), one list of
    tuples per step."""

    def __init__(self):
        super().__init__()
        self.current: list[tuple] = []
        self.steps: list[list[tuple]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SOFTMAX and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 2:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim in (-1, 1):
                self.router(args[0].detach())
        return super().__torch_function__(func, types, args, kwargs)

    def router_call(self, logits: torch.Tensor) -> None:
        self.router(logits)

    def router(self, x: torch.Tensor) -> None:
        with torch.no_grad():
            s = x.float()
            if not bool(torch.isfinite(s).all()):
                self.current.append((math.nan,) * len(COLUMNS))
                return
            lse = torch.logsumexp(s, dim=-1)
            top = torch.softmax(s, dim=-1).amax(dim=-1)
            share = torch.bincount(s.argmax(dim=-1), minlength=s.shape[-1]).max() / s.shape[0]
            spread = (s.amax(dim=-1) - s.amin(dim=-1)).max()
            self.current.append(tuple(round(float(v), 5) for v in
                                      (spread, s.abs().max(), (lse ** 2).mean(), top.mean(), share)))

    def take(self) -> list[float]:
        self.steps.append(self.current)
        self.current = []
        return super().take()


def run_pair(args: tuple) -> dict:
    from .sweep import train             # the models (transformers among them): imported in the worker

    case_id, lr = args
    case = draw(case_id)
    out = {"id": case_id, "arch": case.arch, "optimizer": case.optimizer, "warmup": case.warmup,
           "precision": case.precision}
    for name, run_lr in (("divergent", lr), ("control", lr / CONTROL_DIVISOR)):
        mode = RouterLogits()
        r = train(case, run_lr, STEPS, server=None, stop_after_divergence=True, oracle=mode)
        out[name] = {"diverged_at": r["diverged_at"], "losses": r["losses"], "logits": r["logits"],
                     "router": mode.steps}
    return out


# ---------------------------------------------------------------------------------------------- rules


def series(run: dict, column: str) -> list[float]:
    """The step's worst router call's figure (NaN: no router call, or a non-finite one)."""
    k = COLUMNS.index(column)
    out = []
    for calls in run["router"]:
        xs = [c[k] for c in calls if c[k] is not None and math.isfinite(c[k])]
        out.append(max(xs) if xs else math.nan)
    return out


def first_level(run: dict, column: str, level: float, k: int, every: int) -> Optional[int]:
    """The first sampled step of ``k`` in a row whose figure is at least ``level``."""
    streak = 0
    for step, v in enumerate(series(run, column)):
        if step % every:
            continue
        streak = streak + 1 if math.isfinite(v) and v >= level else 0
        if streak >= k:
            return step
    return None


def first_doubling(run: dict, column: str, floor: float, doubling: float, k: int, every: int) -> Optional[int]:
    """H14's condition (the rule's own :func:`runaway_step`, H13's) on a router figure sampled every ``every``
    steps: the first sampled step of ``k`` in a row whose figure is at least ``floor`` and has doubled within
    ``doubling`` steps since a sample ``every`` to 2 x ``every`` steps earlier."""
    cfg, mem = {"min_logit": floor, "span": every, "consecutive": k}, {}
    for step, x in enumerate(series(run, column)):
        if step % every == 0 and runaway_step(mem, step, x, cfg, doubling) is not None:
            return step
    return None


def grid(rows: list[dict], every: int) -> list[tuple]:
    """Every rule of the grid: (name, lead summary, controls warned)."""
    out = []
    levels = {"spread": (4, 6, 8, 10, 15, 20, 30), "absmax": (4, 6, 8, 10, 15, 20, 30),
              "z2": (4, 9, 16, 25, 50, 100), "top": (0.8, 0.9, 0.95, 0.99), "busiest": (0.6, 0.75, 0.9, 0.99)}
    for column, ls in levels.items():
        for level, k in itertools.product(ls, (1, 2)):
            s, ctl = outcome(rows, lambda c, run: first_level(run, column, level, k, every))
            out.append((f"{column} >= {level:g}, {k} in a row", s, ctl))
    for column in ("spread", "absmax", "z2"):
        for floor, doubling, k in itertools.product((1, 2, 4, 8), (10, 15, 25, 40, 60), (1, 2)):
            s, ctl = outcome(rows, lambda c, run: first_doubling(run, column, floor, doubling, k, every))
            out.append((f"{column} >= {floor:g} doubling in <= {doubling} steps, {k} in a row", s, ctl))
    return out


def print_grid(rows: list[dict], every: int) -> None:
    results = grid(rows, every)
    print(f"\n{len(results)} rules on {len(rows)} tuning cases, sampled every {every} steps; for each number of "
          "controls warned, the rule with the most twins warned >= 20 ahead (then the highest median)")
    print("| rule | controls warned | median lead | p25 | warned >= 20 ahead | >= 50 ahead |")
    print("| --- | --- | --- | --- | --- | --- |")
    best: dict[int, tuple] = {}
    for name, s, ctl in results:
        key = (s["ge20"], s["median"] if s["median"] != "miss" else -1)
        if len(ctl) not in best or key > best[len(ctl)][0]:
            best[len(ctl)] = (key, name, s, ctl)
    for n in sorted(best):
        _, name, s, ctl = best[n]
        print(f"| {name} | {n} ({', '.join(map(str, ctl))}) | {s['median']} | {s['p25']} | {s['ge20']} | "
              f"{s['ge50']} |")


def trajectories(rows: list[dict]) -> None:
    """Each case's router spread at steps 0, 50, 100, ... for the twin and the control, and the twin's
    divergence: what a rule would have to part."""
    print("\n| case | arch | precision | optimizer | twin diverged at | twin spread every 50 steps | "
          "control spread every 50 steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        def every50(run):
            return " ".join(f"{v:.1f}" if math.isfinite(v) else "-" for v in series(run, "spread")[::50])
        print(f"| {r['id']} | {r['arch']} | {r['precision']} | {r['optimizer']} | {r['divergent']['diverged_at']} "
              f"| {every50(r['divergent'])} | {every50(r['control'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", help="the MoE sweep's results: its valid tuning cases are rerun")
    ap.add_argument("--load", help="a file this script wrote: the tables only")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", help="one JSON line per case")
    ap.add_argument("--every", type=int, default=EVERY)
    args = ap.parse_args()
    rows = load(Path(args.load)) if args.load else rerun_tuning(Path(args.results), run_pair, args.workers, args.out)
    valid = valid_reruns(rows)
    for arch in sorted({r["arch"] for r in valid}):
        print(f"  {arch}: {sum(r['arch'] == arch for r in valid)}")
    trajectories(valid)
    print_grid(valid, args.every)
    print_grid([r for r in valid if r["arch"] != "moe_lm"], args.every)


if __name__ == "__main__":
    main()
