"""A loss-regression rule, tried for the models with no attention and not adopted (docs/early-warning.md, "The other
kinds"): does the loss's own slow climb back from its best warn early enough, and does it stay quiet on healthy
runs?

The candidate fires at the first step where the median of the last ``window`` losses is ``rise`` above the lowest
such median so far, has given back ``give_back`` of its fall from the first one, and (``z`` > 0) lies ``z`` noise
units above the best, the noise being the scaled MAD of consecutive differences over the last 50 losses. It is
evaluated, on recorded losses only, on the tuning halves of the two spaces (the held-out halves are never read)
and on the healthy runs of tests/rules/test_lr_jump_and_coverage_rules.py: a tiny regression under ten standard
LR schedules, whose batches differ in difficulty in a fixed order each epoch, as real data does.

    .venv/bin/python -m bench.early_warning.loss_regression \\
        --results bench/early_warning/results-dd92524.jsonl bench/early_warning/results-kinds.jsonl
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from gradwatch.server.rules.stats import MAD_TO_SIGMA

from .report import lead, load, split_cases, summary
from .space import NOATTN_ARCHS

SETTINGS = [(10, 0.15, 0.1, 0.0), (10, 0.2, 0.1, 0.0), (20, 0.15, 0.1, 0.0), (10, 0.15, 0.1, 2.0),
            (10, 0.15, 0.1, 3.0), (10, 0.15, 0.1, 4.0)]


def first_regression(losses: list, until: Optional[int], window: int, rise: float, give_back: float,
                     z: float, span: int = 50) -> Optional[int]:
    xs = np.array([math.nan if x is None else x for x in losses], dtype=float)
    best, first = math.inf, None
    end = len(xs) if until is None else min(len(xs), until + 1)
    for t in range(window - 1, end):
        m = float(np.median(xs[t - window + 1:t + 1]))
        if not math.isfinite(m):
            return t
        best = min(best, m)
        first = m if first is None else first
        noise = 0.0
        if z > 0:
            d = np.diff(xs[max(0, t - span + 1):t + 1])
            noise = MAD_TO_SIGMA * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2) if len(d) > 2 else math.inf
        if best > 0 and m >= (1 + rise) * best and m - best >= give_back * (first - best) and m - best >= z * noise:
            return t
    return None


def schedule_runs() -> dict[str, list[float]]:
    """The healthy runs of the H10 schedule test (its own loop, ``schedule_loop``), in plain PyTorch."""
    import warnings

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.rules.test_lr_jump_and_coverage_rules import _schedules, schedule_loop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # scheduler.step(epoch) is deprecated; the test uses it
        return {name: schedule_loop(name)[0] for name in _schedules() if name != "x50-bug"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", nargs="+", required=True, help="results files; their tuning halves are read")
    args = ap.parse_args()
    tuning = [c for path in args.results for c in split_cases(load(Path(path)))[0]]
    groups = {"attention": [c for c in tuning if c["case"]["arch"] not in NOATTN_ARCHS],
              "no attention": [c for c in tuning if c["case"]["arch"] in NOATTN_ARCHS]}
    healthy = schedule_runs()
    print(f"tuning halves: {', '.join(f'{k} {len(v)}' for k, v in groups.items())}; {len(healthy)} healthy "
          f"schedule runs\n")
    print("| window | rise | give back | z | " + " | ".join(f"{k}: median lead / >= 20 ahead / controls warned"
                                                          for k in groups) + " | schedule runs warned |")
    print("| --- | --- | --- | --- | " + " | ".join("---" for _ in groups) + " | --- |")
    for w, r, g, z in SETTINGS:
        cells = []
        for cases in groups.values():
            s = summary([lead(c["divergent"]["diverged_at"],
                              first_regression(c["divergent"]["losses"], c["divergent"]["diverged_at"], w, r, g, z))
                         for c in cases])
            ctl = [c["case"]["id"] for c in cases if first_regression(c["control"]["losses"], None, w, r, g, z)
                   is not None]
            cells.append(f"{s['median']} / {s['ge20']} of {s['n']} / {len(ctl)} {ctl}")
        loud = [n for n, losses in healthy.items() if first_regression(losses, None, w, r, g, z) is not None]
        print(f"| {w} | {r:.0%} | {g:.0%} | {z:g} | " + " | ".join(cells) + f" | {len(loud)} of {len(healthy)} "
              f"{loud} |")


if __name__ == "__main__":
    main()
