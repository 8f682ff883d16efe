"""Precursor search cost (server/forensics/precursors.py) on a large run, and what it adds to an ingest batch.

    .venv/bin/python bench/precursors.py                                  # SQLite file under ./bench-data
    .venv/bin/python bench/precursors.py --db postgresql://postgres@127.0.0.1:5432/gw_bench
    .venv/bin/python bench/precursors.py --steps 100000 --layers 500

Writes a run of ``--steps`` steps × ``--layers`` per-parameter grad norms every step (weight norms and
activation statistics every 100 steps) through the server's own write path (rules off), with one
layer's grad norm growing 8 % a step over the last 96 steps, then times ``find_precursors`` at the
run's last step (the failure) ``--repeat`` times and, side by side, one 1,000-step ingest batch of the
same run: the search runs once per critical alert, the batch on every flush.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import checkout  # noqa: E402  (bench/, this script's folder)
sys.path.insert(0, str(checkout.shim(ROOT)))   # gradwatch.* is this checkout's code


def batch_of(lo: int, n: int, layers: int, names, rng, grow_from: int, run: str):
    from gradwatch.server.wire.schemas import IngestBatchIn, MetaIn, StepIn
    idx = np.arange(lo, lo + n)
    gn = np.abs(1.0 + 0.2 * rng.standard_normal((n, layers))).astype("<f4")
    grow = idx >= grow_from
    gn[grow, 7] *= (1.08 ** (idx[grow] - grow_from + 1)).astype("<f4")
    steps = []
    for j, i in enumerate(idx.tolist()):
        lay = {"grad_norm": gn[j].tobytes()}
        if i % 100 == 0:
            for st in ("weight_norm", "act_absmax", "act_std"):
                lay[st] = np.abs(1.0 + 0.01 * rng.standard_normal(layers)).astype("<f4").tobytes()
        steps.append(StepIn.model_construct(
            step=i, time=1.7e9 + i * 0.05, loss=float(2.0 + 0.05 * rng.standard_normal()),
            grad_norm=float(np.sqrt((gn[j].astype(np.float64) ** 2).sum())), clip_max_norm=1.0, clipped=False,
            loss_scale=65536.0, overflow=False, overflow_count=0, lr=3e-4, step_time=0.05, samples_per_s=1000.0,
            tokens_per_s=None, mem_peak=None, ema_divergence=1e-3, input_nonfinite=0, custom={}, layers=lay))
    meta = MetaIn.model_construct(param_names=names, module_names=names, bn_names=None, config={}) if lo == 0 else None
    return IngestBatchIn.model_construct(batch_id=f"{run}-{lo}", project="bench", run=run, rank=0, world_size=1,
                                         meta=meta, steps=steps, events=[], status=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default=None)
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.forensics.precursors import find_precursors, summary
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.storage.models import Run
    from gradwatch.server.operations.settings import Settings

    (ROOT / "bench-data").mkdir(exist_ok=True)
    run_name = f"precursors-{int(time.time())}"
    db_url = args.db or f"sqlite:///{ROOT / 'bench-data' / (run_name + '.db')}"
    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(data_dir=ROOT / "bench-data", database_url=db_url)
    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 6}.p{i % 6}.weight" for i in range(args.layers)]
    failure = args.steps
    grow_from = failure - 96
    t0 = time.perf_counter()
    run_id = None
    for lo in range(0, args.steps, 1000):
        with database.write_sessionmaker() as session:
            out = ingest_batch(session, batch=batch_of(lo, min(1000, args.steps - lo), args.layers, names, rng,
                                                       grow_from, run_name),
                               settings=settings, now=time.time(), evaluate_rules=False)
            session.commit()
            run_id = out.run_id
    print(f"wrote {args.steps:,} steps × {args.layers} layers in {time.perf_counter() - t0:.0f} s ({db_url.split(':')[0]})")
    times = []
    report = None
    for _ in range(args.repeat):
        with database.sessionmaker() as session:
            run = session.get(Run, run_id)
            t = time.perf_counter()
            report = find_precursors(session, run=run, rank=0, failure_step=failure)
            times.append(time.perf_counter() - t)
    batch_times = []
    for k in range(args.repeat):   # the same run's next batches, rules off, as the search's yardstick
        lo = args.steps + 1000 * k
        b = batch_of(lo, 1000, args.layers, names, rng, 10**12, run_name)
        with database.write_sessionmaker() as session:
            t = time.perf_counter()
            ingest_batch(session, batch=b, settings=settings, now=time.time(), evaluate_rules=False)
            session.commit()
            batch_times.append(time.perf_counter() - t)
    search, batch = statistics.median(times), statistics.median(batch_times)
    print(f"series tested: {report.series:,}; found: {summary(report, noun='the NaN loss')}")
    print(f"precursor search p50 {1e3 * search:.1f} ms (max {1e3 * max(times):.1f}); one 1,000-step batch "
          f"p50 {1e3 * batch:.1f} ms; ratio search / batch = {search / batch:.2f}")


if __name__ == "__main__":
    main()
