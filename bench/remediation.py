"""The remediation scenarios table (docs/remediation.md): clean / broken / remediated, side by side.

For each scenario of tests/remediation/scenarios.py, three real runs against one real server (a fresh
SQLite file): the clean run, the broken run without remediation, the broken run with
``remediate=Rewind(...)`` (the scenario's policy). Prints a markdown table: the final loss of each
(the mean of the last 20 steps; "NaN" when any of them is non-finite), the rewinds and cools the
remediated run made, the batches its rewinds skipped, and the ratio of the remediated run's final
loss to the clean run's.

    python bench/remediation.py                       # every scenario (~2 min on 2 shared cores)
    python bench/remediation.py --only poisoned_batch lr_spike
    python bench/remediation.py --repeat 3            # each scenario three times (the alert's round trip varies)
    python bench/remediation.py --snapshot-cost       # one snapshot's time and bytes on agent_overhead's loop
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import checkout  # noqa: E402
sys.path.insert(0, str(checkout.shim(ROOT)))

from tests.conftest import start_sqlite_server  # noqa: E402
from tests.remediation.scenarios import BUILDERS, final_loss, policy, run_three  # noqa: E402


def _fmt(v: float) -> str:
    return "NaN" if not math.isfinite(v) else f"{v:.4f}"


def snapshot_cost(samples: int = 40) -> None:
    """One snapshot (SnapshotStore.take: the finiteness check and the fused copy into the reused buffers) of
    bench/agent_overhead.py's reference loop, timed against that loop's own step, side by side."""
    import statistics

    import torch

    from agent_overhead import make_data, make_loop, train_step
    from gradwatch.agent.collectors.base import Watched
    from gradwatch.agent.config import AgentConfig
    from gradwatch.agent.snapshots import SnapshotStore

    torch.set_num_threads(1)
    vocab = 256
    loop = make_loop(64, 32, vocab)
    model, opt, scaler, ema = loop
    data = make_data(4, 32, vocab)
    for i in range(5):
        train_step(loop, data[i % len(data)], vocab)
    store = SnapshotStore(Watched(model, scaler, opt, ema, AgentConfig(mode="disabled"), None), keep=2)
    step_ms, take_ms = [], []
    for i in range(samples):
        t0 = time.perf_counter()
        train_step(loop, data[i % len(data)], vocab)
        t1 = time.perf_counter()
        assert store.take(100 * (i + 1))
        t2 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        take_ms.append((t2 - t1) * 1e3)
    step, take = statistics.median(step_ms), statistics.median(take_ms)
    names, live = store.live_tensors()
    print(f"snapshot of the reference loop ({len(live)} tensors: params, buffers, AdamW state, scaler, EMA): "
          f"{store.slots[0].nbytes / 1024:.0f} KiB per slot, {store.nbytes / 1024:.0f} KiB for keep=2; "
          f"take() median {take:.2f} ms vs a step's {step:.2f} ms ({samples} samples): every 100 steps "
          f"{take / (100 * step) * 100:.3f} % of the steps' time")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(BUILDERS), help="these scenarios only")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each scenario")
    ap.add_argument("--snapshot-cost", action="store_true", help="time one snapshot, and nothing else")
    args = ap.parse_args()
    if args.snapshot_cost:
        snapshot_cost()
        return 0
    names = args.only or list(BUILDERS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        srv = start_sqlite_server(Path(tmp))
        try:
            for name in names:
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    runs = run_three(name, srv.url)
                    clean, broken, healed = (final_loss(runs[k]["losses"]) for k in ("clean", "broken", "remediated"))
                    acts = runs["remediated"]["rewinds"]
                    rewinds = [d for d in acts if d["action"] == "rewind"]
                    cools = [d for d in acts if d["action"] == "cool"]
                    rows.append((name, clean, broken, healed, len(rewinds), len(cools),
                                 sum(d["batches_skipped"] for d in rewinds),
                                 ", ".join(f"{d['trigger']['rule']}@{d['trigger']['step']}: "
                                           f"{d['from_step']}->{d['to_step']}" if d["action"] == "rewind" else
                                           f"{d['trigger']['rule']}@{d['trigger']['step']}: cool at {d['from_step']}"
                                           for d in acts),
                                 runs["remediated"]["snapshot_bytes"], time.perf_counter() - t0))
                    print(f"[{name}] done in {rows[-1][-1]:.0f} s", file=sys.stderr, flush=True)
        finally:
            srv.stop()
    print("| scenario | policy | clean | broken | remediated | remediated / clean | rewinds | cools | steps lost | "
          "actions (trigger@onset: from->to) | snapshot RAM |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, clean, broken, healed, nr, nc, lost, acts, nbytes, _ in rows:
        p = policy(name)
        on = "+".join(p.on) if isinstance(p.on, tuple) else str(p.on)
        cool_on = f", cool_on {'+'.join(p.cool_on)}" if p.cool_on else ""
        desc = f"every {p.every}, keep {p.keep}, on {on}{cool_on}, LR x{p.lr_factor:g} for {p.cool_steps}"
        ratio = f"{healed / clean:.2f}" if math.isfinite(healed) and math.isfinite(clean) and clean else "-"
        print(f"| {name} | {desc} | {_fmt(clean)} | {_fmt(broken)} | {_fmt(healed)} | {ratio} | {nr} | {nc} | "
              f"{lost} | {acts or '-'} | {nbytes / 1024:.0f} KiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
