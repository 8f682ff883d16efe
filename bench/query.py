"""Query benchmark: a synthetic 1,000,000-step, 150-layer run; chart and heatmap latency.

    .venv/bin/python bench/query.py                          # SQLite file under ./bench-data
    .venv/bin/python bench/query.py --db postgresql://postgres@127.0.0.1:5432/gw_bench
    .venv/bin/python bench/query.py --steps 200000 --reuse   # smaller run / keep the data

The run is written in-process through ``server.ingest.ingest_batch`` (the
server's own write path, 1,000-step batches, validation and rules skipped), then a real
``gradwatch serve`` answers HTTP queries on loopback:

- series: ``/api/v1/runs/<id>/series?signal=loss&max_points=2000`` over the whole run,
  and over a zoomed 50,000-step window
- heatmap: ``/api/v1/runs/<id>/layers?stat=grad_norm&max_steps=500&max_layers=150``

Prints p50 / p95 / max latency per query (targets: series <= 200 ms, heatmap <= 500 ms).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS = 150
SPARSE_STATS = ("weight_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_nonfinite")


def build_run(db_url: str, steps: int, batch_steps: int = 1000) -> int:
    from server.db import open_database, upgrade
    from server.ingest import ingest_batch
    from server.schemas import IngestBatchIn, MetaIn, StepIn
    from server.settings import Settings

    upgrade(db_url)
    database = open_database(db_url)
    settings = Settings(data_dir=ROOT / "bench-data", database_url=db_url)
    rng = np.random.default_rng(0)
    names = [f"blocks.{i // 6}.p{i % 6}.weight" for i in range(LAYERS)]
    t0 = time.perf_counter()
    run_id = None
    for lo in range(0, steps, batch_steps):
        idx = np.arange(lo, min(lo + batch_steps, steps))
        loss = 3.0 * np.exp(-idx / 300_000) + 0.05 * rng.standard_normal(len(idx))
        loss[idx % 99_991 == 5] = 40.0                    # spikes
        loss[idx % 249_989 == 7] = np.nan                 # a few NaNs
        gn = np.abs(1.0 + 0.2 * rng.standard_normal((len(idx), LAYERS))).astype("<f4")
        step_objs = []
        for j, i in enumerate(idx.tolist()):
            layers = {"grad_norm": gn[j].tobytes()}
            if i % 100 == 0:
                for st in SPARSE_STATS:
                    layers[st] = gn[j].tobytes()
            step_objs.append(StepIn.model_construct(
                step=i, time=1.7e9 + i * 0.05, loss=float(loss[j]), grad_norm=float(gn[j].sum() / 10),
                clip_max_norm=1.0, clipped=False, loss_scale=65536.0, overflow=False, overflow_count=0, lr=3e-4,
                step_time=0.05, samples_per_s=1000.0, tokens_per_s=None, mem_peak=None, ema_divergence=1e-3,
                input_nonfinite=0, custom={}, layers=layers,
            ))
        meta = MetaIn.model_construct(param_names=names, module_names=names, bn_names=None, config={}) if lo == 0 else None
        batch = IngestBatchIn.model_construct(batch_id=f"bench-{lo}", project="bench", run="million", rank=0,
                                              world_size=1, meta=meta, steps=step_objs, events=[], status=None)
        with database.write_sessionmaker() as session:
            out = ingest_batch(session, batch=batch, settings=settings, now=time.time(), evaluate_rules=False)
            session.commit()
            run_id = out.run_id
        if (lo // batch_steps) % 100 == 0:
            done = lo + len(idx)
            print(f"  wrote {done:,} steps, {done / (time.perf_counter() - t0):,.0f} steps/s", flush=True)
    database.dispose()
    print(f"built {steps:,} steps x {LAYERS} layers in {time.perf_counter() - t0:.0f} s")
    return run_id


def find_run(db_url: str):
    from sqlalchemy import select

    from server.db import open_database
    from server.models import Run

    database = open_database(db_url)
    with database.sessionmaker() as session:
        rid = session.scalar(select(Run.id).where(Run.name == "million"))
    database.dispose()
    return rid


def timed_get(url: str) -> tuple[float, bytes]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return (time.perf_counter() - t) * 1000, body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", default=f"sqlite:///{ROOT / 'bench-data' / 'query-bench.db'}")
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--reuse", action="store_true", help="keep an existing benchmark run")
    ap.add_argument("--port", type=int, default=8479)
    args = ap.parse_args()
    from server.settings import normalize_db_url

    db = normalize_db_url(args.db)
    run_id = find_run(db) if args.reuse else None
    if run_id is None:
        if db.startswith("sqlite"):
            for suffix in ("", "-wal", "-shm"):
                p = Path(db.split("///", 1)[1] + suffix)
                if p.exists():
                    p.unlink()
        run_id = build_run(db, args.steps)
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(ROOT / "bench-data"))
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--db", db, "--port", str(args.port),
                             "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(200):
            try:
                timed_get(base + "/api/health")
                break
            except OSError:
                time.sleep(0.1)
        half = args.steps // 2
        queries = {
            "series loss, whole run, 2000 buckets": f"/api/v1/runs/{run_id}/series?signal=loss&max_points=2000",
            "series grad_norm, whole run, 2000 buckets": f"/api/v1/runs/{run_id}/series?signal=grad_norm&max_points=2000",
            "series loss, 50k-step window, 2000 buckets":
                f"/api/v1/runs/{run_id}/series?signal=loss&start={half}&end={half + 49_999}&max_points=2000",
            "series loss, 2000-step window (raw rows)":
                f"/api/v1/runs/{run_id}/series?signal=loss&start={half}&end={half + 1999}&max_points=2000",
            "heatmap grad_norm, whole run, 500 x 150":
                f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps=500&max_layers=150",
            "heatmap grad_norm, 50k window, 500 x 150":
                f"/api/v1/runs/{run_id}/layers?stat=grad_norm&start={half}&end={half + 49_999}&max_steps=500&max_layers=150",
            "heatmap act_std (every 100 steps), whole run":
                f"/api/v1/runs/{run_id}/layers?stat=act_std&max_steps=500&max_layers=150",
        }
        print(f"database: {db.split(':', 1)[0]}, run {run_id}, {args.steps:,} steps x {LAYERS} layers")
        print(f"{'query':48s} {'p50 ms':>8s} {'p95 ms':>8s} {'max ms':>8s} {'KB':>6s}")
        for label, path in queries.items():
            timed_get(base + path)  # warm
            times = []
            size = 0
            for _ in range(args.repeat):
                ms, body = timed_get(base + path)
                times.append(ms)
                size = len(body)
            times.sort()
            p95 = times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)]
            print(f"{label:48s} {statistics.median(times):8.1f} {p95:8.1f} {times[-1]:8.1f} {size / 1024:6.0f}")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
