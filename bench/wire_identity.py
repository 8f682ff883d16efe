"""Wire identity: the spooled steps of one seeded loop, from two checkouts of the agent, compared.

Runs the same seeded tiny loops (GradScaler + clipping + EMA + BatchNorm + logged scalars + a NaN
step; optimizer-only; log-only) with ``mode="offline"`` in a child process per checkout and
compares the spooled batches' steps and events, ignoring what differs from run to run (times,
step times and throughputs, ids, host/pid in meta).

    python bench/wire_identity.py --base /tmp/agent-base          # this checkout vs the base one
    python bench/wire_identity.py --dump out.json                  # only write this checkout's steps

Every collector runs every step (``*_every=1``), so each field of the wire step is exercised.
Exit status 0 when the two agree.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import checkout  # bench/, this script's folder: runs a checkout's code as gradwatch.*

HERE = Path(__file__).resolve().parent.parent
# host clocks: they differ from run to run (data_time: the time before each step's first forward)
VOLATILE_STEP = {"time", "step_time", "data_time", "samples_per_s", "tokens_per_s"}


def _loops(spool: str) -> None:
    import torch

    from gradwatch import agent
    sys.path.insert(0, str(HERE / "tests" / "agent"))   # this checkout's helpers, whichever agent is imported
    from agent_helpers import ShadowEMA, TinyNet, batches, checklist_step

    Net = lambda: TinyNet(bn=True)   # noqa: E731
    data = batches(12)
    every = dict(weights_every=1, activations_every=1, inputs_every=1, ema_every=1, bn_every=1,
                 seal_grace=30.0, flush_interval=60.0)

    # 1. The checklist's loop: scaler, clipping, EMA, BatchNorm, logged scalars, one NaN input.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    ema = ShadowEMA(model)
    m = agent.attach(model, scaler, ema=ema, mode="offline", spool_dir=spool, project="wire", run="scaler",
                     **every)
    for i, (x, y) in enumerate(data):
        if i == 7:
            x = x.clone()
            x[0, 0] = float("nan")
        checklist_step(model, opt, scaler, x, y, ema=ema)
        m.log(acc=float(i), seen=torch.tensor(2.0 * i))
    m.close()

    # 2. Optimizer only (bf16/fp32 style), two param groups, logged loss.
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW([{"params": model.fc1.parameters(), "lr": 1e-3},
                             {"params": list(model.bn.parameters()) + list(model.fc2.parameters()), "lr": 2e-3}])
    m = agent.attach(model, optimizer=opt, mode="offline", spool_dir=spool, project="wire", run="optimizer",
                     **every)
    for x, y in data[:6]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        m.log(loss=loss)
    m.close()

    # 3. Neither scaler nor optimizer: each logged loss is a step.
    torch.manual_seed(2)
    model = Net()
    m = agent.attach(model, mode="offline", spool_dir=spool, project="wire", run="log-only", **every)
    for x, y in data[:4]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        m.log(loss=loss, tokens=3)
    m.close()


def _spooled(spool: str) -> dict:
    out: dict = {}
    for d in sorted({p.parent for p in Path(spool).rglob("*.json")}):
        key = str(d.relative_to(spool))
        for p in sorted(d.glob("*.json")):
            body = json.loads(p.read_bytes())
            entry = out.setdefault(key, {"steps": [], "events": [], "status": []})
            entry["steps"].extend({k: v for k, v in s.items() if k not in VOLATILE_STEP} for s in body["steps"])
            entry["events"].extend(body.get("events", []))
            entry["status"].append(body.get("status"))
            if body.get("meta"):
                meta = dict(body["meta"])
                for k in ("host", "pid", "started_at"):
                    meta.pop(k, None)
                meta["config"] = {k: v for k, v in meta.get("config", {}).items() if k != "spool_dir"}
                entry["meta"] = meta
    return out


def _child_dump(path: str) -> None:
    with tempfile.TemporaryDirectory() as spool:
        _loops(spool)
        Path(path).write_text(json.dumps(_spooled(spool), sort_keys=True, indent=1))


def _run_in(root: Path, out: Path) -> dict:
    env = {**os.environ, **checkout.pythonpath(root)}
    subprocess.run([sys.executable, str(HERE / "bench" / "wire_identity.py"), "--child-dump", str(out)],
                   cwd=str(root), env=env, check=True)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the other checkout's root (e.g. a `git worktree add /tmp/agent-base <commit>`)")
    p.add_argument("--dump", help="write this checkout's steps here and stop")
    p.add_argument("--child-dump", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child_dump:
        _child_dump(a.child_dump)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mine = _run_in(HERE, Path(tmp) / "mine.json")
        if a.dump:
            Path(a.dump).write_text(json.dumps(mine, sort_keys=True, indent=1))
            return 0
        if not a.base:
            p.error("--base or --dump")
        theirs = _run_in(Path(a.base).resolve(), Path(tmp) / "base.json")
    same = mine == theirs
    steps = sum(len(v["steps"]) for v in mine.values())
    print(f"{'identical' if same else 'DIFFERENT'}: {steps} steps in {len(mine)} runs "
          f"({', '.join(sorted(mine))}) vs {a.base}")
    if not same:
        for run in sorted(set(mine) | set(theirs)):
            x, y = mine.get(run), theirs.get(run)
            if x == y:
                continue
            for key in ("meta", "status", "events"):
                if (x or {}).get(key) != (y or {}).get(key):
                    print(f"  {run} {key}: {(x or {}).get(key)!r}\n   base: {(y or {}).get(key)!r}")
            for i, (s, t) in enumerate(zip((x or {}).get("steps", []), (y or {}).get("steps", []))):
                if s != t:
                    diff = {k: (s.get(k), t.get(k)) for k in set(s) | set(t) if s.get(k) != t.get(k)}
                    print(f"  {run} step {i}: {diff}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
