"""What the controls do after the protocol stops watching them: each valid control of a results file run on,
in plain PyTorch (no agent), to ``--steps`` steps, and whether it then diverges (``divergence.py``'s rule).

An analysis beside the protocol, not a change to it. The protocol (docs/early-warning.md) runs a control for
300 steps at the kept LR ÷ 5 and counts any warning above info on it as a false alarm; the split, the control's
definition and the figures it reports stay as they were frozen. What this adds is the answer to the question
those warnings raise: are the controls an H rule warns on healthier or less healthy, later on, than the
controls it leaves quiet? Nothing here feeds a rule's settings.

    .venv/bin/python -m bench.early_warning.longer --results bench/early_warning/results-733fc4b.jsonl
    .venv/bin/python -m bench.early_warning.longer --results ... --steps 1000 --workers 2 --out /tmp/longer.jsonl

Each control's first 300 losses are compared with the ones the sweep recorded through the agent (same
initialisation, same batches, same LR): the largest difference is printed, so a run that is not the
recorded one shows.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
from pathlib import Path

from .divergence import diverged_at
from .report import h_warnings, load, split_cases
from .space import CONTROL_DIVISOR, draw


def _warned(control: dict) -> list[str]:
    """The H rules that warned (above info) on the recorded control."""
    return sorted({a["rule"] for a in h_warnings(control)})


def run_on(args: tuple) -> dict:
    from .sweep import train           # imports torch: in the worker

    case_id, lr, steps, recorded = args
    case = draw(case_id)                # a case is drawn from its id, as the sweep drew it
    out = train(case, lr / CONTROL_DIVISOR, steps, server=None, stop_after_divergence=True)
    losses = [v if v is not None else math.nan for v in out["losses"]]
    n = min(len(recorded), len(losses))
    # both sides hold NaN where a loss was not finite (None in the files): compared where both are finite
    diffs = [abs(a - b) for a, b in zip(losses[:n], recorded[:n]) if math.isfinite(a) and math.isfinite(b)]
    return {"id": case_id, "diverged_at": diverged_at(losses), "steps": len(losses),
            "max_diff_first": max(diffs, default=math.nan), "compared": n,
            "last_min_ratio": (sum(losses[-20:]) / 20) / min(losses) if len(losses) >= 20 else math.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--steps", type=int, default=1000, help="how far each control runs on (the protocol: 300)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", help="one JSON line per control (default: none)")
    args = ap.parse_args()
    tuning, held, _ = split_cases(load(Path(args.results)))
    cases = {c["case"]["id"]: c for c in tuning + held}
    jobs = [(c["case"]["id"], c["lr"], args.steps, [v if v is not None else math.nan for v in c["control"]["losses"]])
            for c in tuning + held]
    print(f"{len(jobs)} valid controls ({len(tuning)} tuning, {len(held)} held-out), each run on to {args.steps} "
          f"steps in plain PyTorch", flush=True)
    rows = []
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers) as pool:
        for r in pool.imap_unordered(run_on, jobs):
            c = cases[r["id"]]
            r.update(half=c["half"], arch=c["case"]["arch"], optimizer=c["case"]["optimizer"],
                     warned=_warned(c["control"]))
            rows.append(r)
            print(f"case {r['id']:3d} {r['half']:8s} {r['arch']:13s} {r['optimizer']:12s} warned {r['warned'] or '-'} "
                  f"diverged at {r['diverged_at']} of {r['steps']} steps; last 20 / best {r['last_min_ratio']:.3f}; "
                  f"first {r['compared']} losses off the recorded by at most {r['max_diff_first']:.2g}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for r in sorted(rows, key=lambda r: r["id"]):
                f.write(json.dumps(r) + "\n")
    print()
    print(f"| half | controls | H-warned: diverged by step {args.steps} | not warned: diverged by step {args.steps} |")
    print("| --- | --- | --- | --- |")
    for half in ("tuning", "held-out"):
        mine = [r for r in rows if r["half"] == half]
        warned = [r for r in mine if r["warned"]]
        quiet = [r for r in mine if not r["warned"]]
        dw = sorted(r["diverged_at"] for r in warned if r["diverged_at"] is not None)
        dq = sorted(r["diverged_at"] for r in quiet if r["diverged_at"] is not None)
        print(f"| {half} | {len(mine)} | {len(dw)} of {len(warned)} (at {dw}) | {len(dq)} of {len(quiet)} (at {dq}) |")


if __name__ == "__main__":
    main()
