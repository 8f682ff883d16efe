"""What A2's severity change costs a divergent run: when does it get its critical alert, if the run goes on?

A2 (server/rules/catalog/gradients.py) warns on one grad-norm spike and turns critical on a second spike
within 50 steps, on one lasting 3 steps, or when the loss is 3x its median at the spike and a step later. The
sweep stops a divergent run 5 steps after the divergence step, so a run whose explosion starts in those last
steps shows only A2's warning in a results file. This reruns each such
divergent run of a results file (the same case, LR, initialisation and batches) through the agent and a real
``gradwatch serve`` on 127.0.0.1 with SQLite, on to ``--after`` steps past its divergence (or its first
non-finite loss), and prints the first step of its first critical alert (any rule) against the step of its
first A2 alert. An analysis beside the protocol: it feeds no setting.

    .venv/bin/python -m bench.early_warning.a2_severity --results bench/early_warning/results-noattn-65cb243.jsonl
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

from .report import load
from .space import draw
from .sweep import Server, alerts_of, train


def _warned_only(run: dict) -> bool:
    """A2 warned and no rule was critical in the recorded run."""
    return (any(a["rule"] == "A2" for a in run["alerts"])
            and not any(a["severity"] == "critical" for a in run["alerts"]))


def rerun(args: tuple) -> dict:
    case_id, lr, d, after, server, tag = args
    name = f"{tag}case{case_id}-on"
    out = train(draw(case_id), lr, d + after + 1, server=server, run=name, stop_after_divergence=False)
    alerts = alerts_of(server, name)
    a2 = min((a["first_step"] for a in alerts if a["rule"] == "A2"), default=None)
    crit = min(((a["first_step"], a["rule"]) for a in alerts if a["severity"] == "critical"), default=None)
    # an escalated alert keeps the step it opened at: the step it turned critical is in its message
    crit_msg = next((a["message"] for a in alerts if crit and a["rule"] == crit[1] and a["severity"] == "critical"),
                    "")
    return {"id": case_id, "diverged_at": d, "steps": out["steps"], "a2": a2, "critical": crit,
            "critical_message": crit_msg}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", required=True)
    ap.add_argument("--after", type=int, default=20, help="steps past the divergence step to run on")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    cases = [c for c in load(Path(args.results)) if c.get("status") == "ok" and _warned_only(c["divergent"])]
    print(f"{len(cases)} divergent runs of {args.results} with an A2 warning and no critical alert, each run on to "
          f"{args.after} steps past its divergence", flush=True)
    with tempfile.TemporaryDirectory() as tmp, Server(Path(tmp)) as srv:
        tag = f"{int(time.time())}-"
        jobs = [(c["case"]["id"], c["lr"], c["divergent"]["diverged_at"], args.after, srv.url, tag) for c in cases]
        with mp.get_context("spawn").Pool(args.workers) as pool:
            rows = sorted(pool.imap_unordered(rerun, jobs), key=lambda r: r["id"])
    print("| case | divergence step | steps run | first A2 | first critical alert (rule) | its message |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        crit = f"{r['critical'][0]} ({r['critical'][1]})" if r["critical"] else "none"
        print(f"| {r['id']} | {r['diverged_at']} | {r['steps']} | {r['a2']} | {crit} | {r['critical_message'][:110]} |")


if __name__ == "__main__":
    main()
