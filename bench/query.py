"""Query benchmark: a synthetic 1,000,000-step, 150-layer run; chart and heatmap latency.

    .venv/bin/python bench/query.py                          # SQLite file under ./bench-data
    createdb -h 127.0.0.1 -U postgres gw_bench && .venv/bin/python bench/query.py --db postgresql://postgres@127.0.0.1:5432/gw_bench
    .venv/bin/python bench/query.py --steps 200000 --reuse   # smaller run / keep the data

The run is written in-process through ``server.ingest.write.ingest_batch`` (the
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
import checkout  # noqa: E402  (bench/, this script's folder)
sys.path.insert(0, str(checkout.shim(ROOT)))   # gradwatch.* is this checkout's code

LAYERS = 150
SPARSE_STATS = ("weight_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_nonfinite")


def build_run(db_url: str, steps: int, batch_steps: int = 1000) -> int:
    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.wire.schemas import IngestBatchIn, MetaIn, StepIn
    from gradwatch.server.operations.settings import Settings

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
    if database.dialect == "postgresql":
        # what autovacuum does on its own a little later; without statistics the
        # planner may pick a sequential scan for the first queries
        from sqlalchemy import text

        with database.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
    database.dispose()
    print(f"built {steps:,} steps x {LAYERS} layers in {time.perf_counter() - t0:.0f} s")
    return run_id


def compare_layouts(db_url: str, steps: int) -> None:
    """Write ``steps`` x 150 grad norms in three layouts; time writes and a 500-column heatmap."""
    from sqlalchemy import text

    from gradwatch.server.storage.db import open_database
    from gradwatch.server.ingest.write import bulk_insert
    from gradwatch.server.storage.rollups import layer_partials

    database = open_database(db_url)
    rng = np.random.default_rng(1)
    values = rng.random((steps, LAYERS), dtype=np.float32)
    blobs = [values[i].tobytes() for i in range(steps)]
    bucket = max(1, steps // 500)
    pg = database.dialect == "postgresql"
    blob_t = "BYTEA" if pg else "BLOB"
    with database.write_sessionmaker() as s:
        for ddl in (
            "DROP TABLE IF EXISTS lay_value", "DROP TABLE IF EXISTS lay_packed", "DROP TABLE IF EXISTS lay_rollup",
            "CREATE TABLE lay_value (step BIGINT, layer INTEGER, value REAL, PRIMARY KEY (step, layer))",
            f"CREATE TABLE lay_packed (step BIGINT PRIMARY KEY, vals {blob_t})",
            f"CREATE TABLE lay_rollup (level INTEGER, bucket BIGINT, data {blob_t})",
            "CREATE INDEX ix_lay_rollup ON lay_rollup (level, bucket)",
        ):
            s.execute(text(ddl))
        s.commit()
    results = []

    def write(label, fn):
        t = time.perf_counter()
        for lo in range(0, steps, 1000):
            with database.write_sessionmaker() as s:
                fn(s, lo, min(lo + 1000, steps))
                s.commit()
        dt = time.perf_counter() - t
        return steps * LAYERS / dt

    def timed(fn, repeat=5):
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            with database.sessionmaker() as s:
                fn(s)
            times.append((time.perf_counter() - t) * 1000)
        return statistics.median(times)

    def w_value(s, lo, hi):
        rows = [(i, k, float(values[i, k])) for i in range(lo, hi) for k in range(LAYERS)]
        bulk_insert(s, "lay_value", ("step", "layer", "value"), rows)

    def q_value(s):
        s.execute(text(f"SELECT step / {bucket} AS b, layer, max(value) FROM lay_value GROUP BY b, layer")).all()

    def w_packed(s, lo, hi):
        bulk_insert(s, "lay_packed", ("step", "vals"), [(i, blobs[i]) for i in range(lo, hi)])

    def q_packed(s):
        rows = s.execute(text("SELECT step, vals FROM lay_packed ORDER BY step")).all()
        arr = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), LAYERS)
        cols = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)) // bucket
        np.fmax.reduceat(arr, np.concatenate(([0], np.flatnonzero(np.diff(cols)) + 1)), axis=0)

    def w_rollup(s, lo, hi):
        w_packed(s, lo, hi)
        parts = layer_partials(np.arange(lo, hi, dtype=np.int64), blobs[lo:hi])
        bulk_insert(s, "lay_rollup", ("level", "bucket", "data"), parts)

    def q_rollup(s):
        from gradwatch.server.storage.models import ROLLUP_LEVELS
        from gradwatch.server.storage.rollups import layer_partial_arrays

        level = max([lv for lv in ROLLUP_LEVELS if lv <= bucket] or [1])
        rows = s.execute(text(f"SELECT bucket, data FROM lay_rollup WHERE level = {level} ORDER BY bucket")).all()
        b, _, arr = layer_partial_arrays([(r[0], r[1]) for r in rows], LAYERS)
        cols = b * level // (max(1, bucket // level) * level)
        np.fmax.reduceat(arr[:, 1], np.concatenate(([0], np.flatnonzero(np.diff(cols)) + 1)), axis=0)

    def size(table):
        with database.sessionmaker() as s:
            if pg:
                return s.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar()
            try:
                return s.execute(text(f"SELECT sum(pgsize) FROM dbstat WHERE name = '{table}' OR name LIKE "
                                      f"'sqlite_autoindex_{table}%' OR name = 'ix_{table}'")).scalar()
            except Exception:  # noqa: BLE001 - dbstat is optional in SQLite builds
                return None

    results.append(("row per value (step, layer, value)", write("v", w_value), timed(q_value, 3), size("lay_value")))
    results.append(("row per step, packed float32[150]", write("p", w_packed), timed(q_packed), size("lay_packed")))
    with database.write_sessionmaker() as s:
        s.execute(text("DELETE FROM lay_packed"))
        s.commit()
    results.append(("packed + insert-only rollups (chosen)", write("r", w_rollup), timed(q_rollup),
                    (size("lay_packed") or 0) + (size("lay_rollup") or 0)))
    scale = 1_000_000 / steps
    print(f"layouts on {database.dialect}: {steps:,} steps x {LAYERS} layers (x{scale:.0f} for 1M steps)")
    print(f"{'layout':40s} {'write values/s':>15s} {'heatmap ms':>11s} {'-> 1M ms':>9s} {'bytes/value':>12s}")
    for label, rate, ms, nbytes in results:
        bpv = f"{nbytes / (steps * LAYERS):.1f}" if nbytes else "?"
        est = ms * scale if "rollups" not in label else ms * 1.0
        print(f"{label:40s} {rate:15,.0f} {ms:11.1f} {est:9.0f} {bpv:>12s}")
    print("(-> 1M: rows read grow with the run for the first two; the rollup read is bounded by the column count)")
    with database.write_sessionmaker() as s:
        for t in ("lay_value", "lay_packed", "lay_rollup"):
            s.execute(text(f"DROP TABLE IF EXISTS {t}"))
        s.commit()
    database.dispose()


def find_run(db_url: str):
    from sqlalchemy import select

    from gradwatch.server.storage.db import open_database
    from gradwatch.server.storage.models import Run

    database = open_database(db_url)
    with database.sessionmaker() as session:
        rid = session.scalar(select(Run.id).where(Run.name == "million"))
    database.dispose()
    return rid


def find_or_build_run(db: str, steps: int, *, reuse: bool) -> int:
    """The benchmark run already in ``db`` (``reuse``), or a new one built there (a SQLite file starts over)."""
    run_id = find_run(db) if reuse else None
    if run_id is None:
        if db.startswith("sqlite"):
            for suffix in ("", "-wal", "-shm"):
                p = Path(db.split("///", 1)[1] + suffix)
                if p.exists():
                    p.unlink()
        run_id = build_run(db, steps)
    return run_id


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
    ap.add_argument("--port", type=int, default=0, help="default: a free port")
    ap.add_argument("--layouts", type=int, metavar="STEPS", default=0,
                    help="instead: compare storage layouts on STEPS x 150 values (e.g. 20000)")
    args = ap.parse_args()
    from gradwatch.server.operations.settings import normalize_db_url

    db = normalize_db_url(args.db)
    if args.layouts:
        from gradwatch.server.storage.db import upgrade

        upgrade(db)
        compare_layouts(db, args.layouts)
        return 0
    run_id = find_or_build_run(db, args.steps, reuse=args.reuse)
    if not args.port:   # never a fixed default: another benchmark's or test's server may hold it
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            args.port = sock.getsockname()[1]
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(ROOT / "bench-data"), **checkout.pythonpath(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--db", db, "--port", str(args.port),
                             "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(200):
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode} (port {args.port} taken?)")
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
