"""Run the cases: the blind LR search (plain PyTorch), then the divergent run and its control through the
real agent (default settings) to a real server (``gradwatch serve`` on 127.0.0.1, a SQLite file).

    .venv/bin/python -m bench.early_warning.sweep                 # every case of the split, 2 workers
    .venv/bin/python -m bench.early_warning.sweep --cases 0-5 --out /tmp/ew.jsonl --workers 1
    .venv/bin/python -m bench.early_warning.sweep --cases kinds --out bench/early_warning/results-kinds.jsonl
    .venv/bin/python -m bench.early_warning.sweep --cases noattn --out bench/early_warning/results-noattn.jsonl
    .venv/bin/python -m bench.early_warning.sweep --cases moe --out bench/early_warning/results-moe.jsonl

Writes one JSON line per case (bench/early_warning/results.jsonl by default): the case, the LR search's
tries, and for each of the two runs its losses, the divergence step, the true max attention logit of every
step (:mod:`.oracle`, per attention call) and the server's alerts (rule, severity, first step).
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import torch

from . import models
from .divergence import diverged_at, learned
from .oracle import TrueLogits
from .space import BUDGET, CONTROL_DIVISOR, DOWN, EARLIEST, LEARNED, TRIES, UP, Case, draw

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPLIT = HERE / "split.json"
KINDS_SPLIT = HERE / "split-kinds.json"     # the other kinds (space.py, ids 100-159), frozen on 2026-12-07
NOATTN_SPLIT = HERE / "split-noattn.json"   # no attention (space.py, ids 200-279), frozen on 2026-12-07
MOE_SPLIT = HERE / "split-moe.json"         # mixture of experts (space.py, ids 300-359), frozen on 2026-12-07
HFMOE_SPLIT = HERE / "split-hfmoe.json"     # Hugging Face's MoEs (space.py, ids 400-439), all held out, 2026-12-07
SPLITS = {"kinds": KINDS_SPLIT, "noattn": NOATTN_SPLIT, "moe": MOE_SPLIT, "hfmoe": HFMOE_SPLIT}
RESULTS = HERE / "results.jsonl"
PROJECT = "early-warning"
N_CASES = 100           # the sweep runs case ids 0 .. N_CASES - 1 (each in its half of split.json)


def halves() -> dict[int, str]:
    """Each case id's half, 'tuning' or 'held-out', from every frozen split."""
    out: dict[int, str] = {}
    for path in (SPLIT, *SPLITS.values()):
        split = json.loads(path.read_text())
        out |= {i: "tuning" for i in split["tuning"]} | {i: "held-out" for i in split["held_out"]}
    return out


def train(case: Case, lr: float, steps: int, *, server: Optional[str] = None, run: str = "",
          stop_after_divergence: bool = True, agent_config: Optional[dict] = None,
          oracle: Optional[TrueLogits] = None) -> dict:
    """One run: plain PyTorch (``server`` None) or through the agent. Stops 5 steps after the loss
    diverges (the rule needs them) or at the first non-finite loss. The true max logits are recorded
    through the agent, or in plain PyTorch when an ``oracle`` is given (precursors.py passes its own)."""
    torch.set_num_threads(1)
    model, batch, loss_fn = models.build(case)
    opt = models.optimizer(case, model, lr)
    monitor = None
    if server is not None:
        from gradwatch import agent
        monitor = agent.attach(model, optimizer=opt, project=PROJECT, run=run, server=server,
                               **(agent_config or {}))
    if oracle is None and server is not None:
        oracle = TrueLogits()
    losses: list[float] = []
    logits: list[list[float]] = []
    try:
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = models.lr_at(step, lr, case.warmup)
            b = batch(step)
            opt.zero_grad(set_to_none=True)
            if oracle is not None:
                with oracle:
                    out = models.forward(model, case, b)
                logits.append([round(v, 4) if math.isfinite(v) else None for v in oracle.take()])
            else:
                out = models.forward(model, case, b)
            loss = loss_fn(out, b)
            loss.backward()
            opt.step()
            if monitor is not None:
                monitor.log(loss=loss)
            x = float(loss.detach())
            losses.append(round(x, 5) if math.isfinite(x) else None)
            if not math.isfinite(x):
                break
            d = diverged_at([v if v is not None else math.nan for v in losses])
            if stop_after_divergence and d is not None and step >= d + 4:
                break
    finally:
        if monitor is not None:
            monitor.close()
    d = diverged_at([v if v is not None else math.nan for v in losses])
    return {"lr": lr, "steps": len(losses), "diverged_at": d, "losses": losses, "logits": logits}


def _floats(xs: list) -> list[float]:
    return [math.nan if x is None else x for x in xs]


def lr_search(case: Case) -> tuple[Optional[float], list[dict]]:
    """The declared rule (space.py), applied blindly: the kept LR, or None (rejected), and the tries."""
    lr, tries = case.lr0, []
    low = high = None                      # the highest LR that did not diverge, the lowest that did too early
    for _ in range(TRIES):
        r = train(case, lr, BUDGET)
        tries.append({"lr": lr, "diverged_at": r["diverged_at"]})
        d = r["diverged_at"]
        if d is not None and not learned(_floats(r["losses"]), d, LEARNED):
            d = 0                          # diverged without having learned: an LR too high
        tries[-1]["learned"] = d != 0
        if d is not None and EARLIEST <= d < BUDGET:
            return lr, tries
        if d is None:
            low = lr if low is None else max(low, lr)
        else:
            high = lr if high is None else min(high, lr)
        lr = math.sqrt(low * high) if low is not None and high is not None else lr / DOWN if d is not None \
            else lr * UP
    return None, tries


def alerts_of(server: str, run: str) -> list[dict]:
    def get(path):
        with urllib.request.urlopen(server + path, timeout=30) as r:
            return json.loads(r.read())
    for _ in range(200):
        rid = next((r["id"] for r in get(f"/api/v1/runs?project={PROJECT}")["runs"] if r["name"] == run), None)
        if rid is not None:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"run {run} never reached the server")
    time.sleep(0.3)
    return [{"rule": a["rule"], "severity": a["severity"], "first_step": a["first_step"],
             "message": a.get("message", "")[:300]} for a in get(f"/api/v1/alerts?run={rid}")["alerts"]]


def one_case(args: tuple) -> dict:
    case_id, server, tag, previous = args
    case = draw(case_id)
    t0 = time.perf_counter()
    if previous is not None:            # the search's outcome from an earlier sweep (the search is deterministic)
        lr, tries = previous["lr"], previous["tries"]
    else:
        lr, tries = lr_search(case)
    out: dict = {"case": case.as_dict(), "tries": tries, "lr": lr}
    if lr is None:
        out["status"] = "rejected"
        return out
    div = train(case, lr, BUDGET, server=server, run=f"{tag}case{case_id}-div")
    ctl = train(case, lr / CONTROL_DIVISOR, BUDGET, server=server, run=f"{tag}case{case_id}-ctl",
                stop_after_divergence=False)
    div["alerts"] = alerts_of(server, f"{tag}case{case_id}-div")
    ctl["alerts"] = alerts_of(server, f"{tag}case{case_id}-ctl")
    out.update(divergent=div, control=ctl, seconds=round(time.perf_counter() - t0, 1))
    # the agent's run must diverge too (the same numerics as the search's run; checked, not assumed)
    out["status"] = ("invalid_control" if ctl["diverged_at"] is not None or not learned(
        _floats(ctl["losses"]), None, LEARNED) else
                     "ok" if div["diverged_at"] is not None else "agent_run_not_diverged")
    print(f"case {case_id:3d} {case.arch:13s} {case.optimizer:12s} lr {lr:.3g} tries {len(tries)} "
          f"div@{div['diverged_at']} {out['status']} "
          f"H:{sorted({(a['rule'], a['first_step']) for a in div['alerts'] if a['severity'] != 'info'})} "
          f"ctl:{sorted({a['rule'] for a in ctl['alerts'] if a['severity'] != 'info'})} {out['seconds']}s",
          flush=True)
    return out


class Server:
    """``gradwatch serve`` on 127.0.0.1 with a SQLite file (migrated first)."""

    def __init__(self, data_dir: Path, rules: Optional[Path] = None):
        self.data_dir, self.rules = data_dir, rules
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Server":
        env = dict(os.environ, GRADWATCH_DATA_DIR=str(self.data_dir), PYTHONUNBUFFERED="1")
        db = f"sqlite:///{self.data_dir / 'gradwatch.db'}"
        subprocess.run([sys.executable, "-m", "gradwatch.server", "db", "upgrade", "--db", db], check=True,
                       env=env, cwd=ROOT, capture_output=True, timeout=120)
        extra = ["--rules", str(self.rules)] if self.rules else []
        self.log = open(self.data_dir / "server.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--db", db, "--host",
                                      "127.0.0.1", "--port", str(self.port), *extra], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        for _ in range(300):
            try:
                urllib.request.urlopen(self.url + "/api/health", timeout=1)
                return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError((self.data_dir / "server.log").read_text())
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def case_ids(spec: Optional[str]) -> list[int]:
    if spec is None or spec in SPLITS:
        split = json.loads((SPLIT if spec is None else SPLITS[spec]).read_text())
        return sorted(i for i in split["tuning"] + split["held_out"] if spec or i < N_CASES)
    ids: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ids += list(range(int(lo), int(hi or lo) + 1))
    return ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="ids, e.g. 0-9,12; 'kinds': the other kinds' ids 100-159; "
                    "'noattn': the no-attention ids 200-279; 'moe': the mixture-of-experts ids 300-359; "
                    "'hfmoe': Hugging Face's mixtures of experts, ids 400-439 "
                    "(default: ids below N_CASES)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rules", default=None, help="a rules file for the server")
    ap.add_argument("--reuse", default=None, help="take each case's LR search from this earlier results file")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))      # stop the server and the workers on a kill
    ids = case_ids(args.cases)
    prev = {}
    if args.reuse:
        for line in Path(args.reuse).read_text().splitlines():
            o = json.loads(line)
            prev[o["case"]["id"]] = {"lr": o["lr"], "tries": o["tries"]}
    with tempfile.TemporaryDirectory() as tmp, Server(Path(tmp), Path(args.rules) if args.rules else None) as srv:
        tag = f"{int(time.time())}-"
        with mp.get_context("spawn").Pool(args.workers) as pool, open(args.out, "w") as f:
            for out in pool.imap(one_case, [(i, srv.url, tag, prev.get(i)) for i in ids]):
                f.write(json.dumps(out) + "\n")
                f.flush()


if __name__ == "__main__":
    main()
