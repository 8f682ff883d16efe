"""Bytes per step before and after retention, SQLite and PostgreSQL; ingest p99 while retention runs.

    .venv/bin/python bench/storage_bytes.py                                   # SQLite, 1 rank 20k steps, 64 ranks 1k steps
    .venv/bin/python bench/storage_bytes.py --db postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/storage_bytes.py --steps 20000 --rank-steps 1000 --ranks 64
    .venv/bin/python bench/storage_bytes.py --p99 --p99-steps 200000         # ingest p99 with / without the job

Runs at default telemetry, 150 layers:

- **1 rank**: ``bench/query.py``'s run (its ``build_run``: grad norms every step, six statistics every
  100 steps, 1,000-step batches through the server's own write path) — the run the Storage figures of
  docs/performance.md are measured on, so bytes per step compare with today's 1,375 B/step.
- **64 ranks, sharded**: ``bench/ingest.py``'s ``make_batch`` bodies (each rank's ``*_local`` norms and
  shard layout, as the agent sends them), 100-step batches per rank through ``ingest_batch``; the server
  combines every step (rank -1) as it does live.

Each run is alone in a fresh database. **Bytes** are what the database holds for the run's tables:
SQLite the pages of each table and its indexes (``dbstat``) after ``VACUUM``; PostgreSQL
``pg_total_relation_size`` (heap, TOAST, indexes) after ``VACUUM FULL`` (a plain ``VACUUM`` after the
deletes makes the space reusable for new rows but keeps the files' size; both are printed). Then
retention compacts the whole run (``raw_steps = 0``: every raw row but those of the last, unfinished 16-step bucket)
through ``server/lifecycle/retention.py`` and the bytes are measured again.

``--p99``: a real ``gradwatch serve`` on a database holding a ``--p99-steps`` run; 8 open-loop agents
(``bench/ingest.py``'s bodies, one batch each 0.5 s, 40 steps/s each) for ``--p99-seconds`` without the
retention job, then again with the job compacting that run (the whole of it) in the same server, batches
counted while the pass runs. Prints p50 / p99 / max batch latency of both.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import checkout  # noqa: E402  (bench/, this script's folder)
sys.path.insert(0, str(checkout.shim(ROOT)))   # gradwatch.* is this checkout's code

import ingest as ingest_bench  # noqa: E402  (bench/ingest.py: its bodies, FreshDatabase, start_server)
import query as query_bench  # noqa: E402  (bench/query.py: the Storage run)

RUN_TABLES = ("steps", "layer_stats", "step_rollups", "layer_rollups", "custom_scalars", "step_ranks",
              "rank_layouts", "ingest_batches", "rule_states", "run_events")


def table_bytes(url: str, *, full: bool = True) -> dict[str, int]:
    """Bytes of each run table (and its indexes) as the database holds them."""
    from sqlalchemy import create_engine, text

    from gradwatch.server.operations.settings import normalize_db_url

    engine = create_engine(normalize_db_url(url), isolation_level="AUTOCOMMIT")
    out = {}
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            conn.execute(text("VACUUM"))
            idx = dict(conn.execute(text("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'")).all())
            for name, nbytes in conn.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all():
                table = idx.get(name, name)
                if table in RUN_TABLES:
                    out[table] = out.get(table, 0) + int(nbytes)
            out["_file"] = int(Path(url.split("///", 1)[1]).stat().st_size)
        else:
            conn.execute(text("VACUUM FULL" if full else "VACUUM"))
            for table in RUN_TABLES:
                out[table] = int(conn.scalar(text(f"SELECT pg_total_relation_size('{table}')")))
            out["_file"] = int(conn.scalar(text("SELECT pg_database_size(current_database())")))
    engine.dispose()
    return out


def build_sharded(url: str, ranks: int, steps: int, batch_steps: int = 100) -> int:
    """A ``ranks``-rank FSDP run of ``steps`` steps, each rank's batches as the agent sends them."""
    from gradwatch.server.storage.db import open_database, upgrade
    from gradwatch.server.ingest.write import ingest_batch
    from gradwatch.server.wire.schemas import IngestBatchIn
    from gradwatch.server.operations.settings import Settings

    upgrade(url)
    database = open_database(url)
    settings = Settings(data_dir=tempfile.mkdtemp(), database_url=url)
    t0 = time.perf_counter()
    run_id = None
    for lo in range(0, steps, batch_steps):
        n = min(batch_steps, steps - lo)
        for rank in range(ranks):
            body = ingest_bench.make_batch(rank, lo, n, "default", world_size=ranks, sharded=True)
            body.pop("alerts_after", None)
            batch = IngestBatchIn.model_validate(body)
            with database.write_sessionmaker() as session:
                run_id = ingest_batch(session, batch=batch, settings=settings, now=time.time(),
                                      evaluate_rules=False).run_id
                session.commit()
        print(f"  {lo + n:,} steps x {ranks} ranks, {(lo + n) * ranks / (time.perf_counter() - t0):,.0f} "
              f"rank-steps/s", flush=True)
    database.dispose()
    return run_id


def compact_all(url: str, run_id: int, layer_level: int = 4096) -> dict:
    from gradwatch.server.storage.db import open_database
    from gradwatch.server.lifecycle.retention import compact_run
    from gradwatch.server.lifecycle.retention_config import RetentionPolicy

    database = open_database(url)
    t0 = time.perf_counter()
    job = compact_run(database, run_id=run_id, policy=RetentionPolicy(raw_steps=0, layer_level=layer_level),
                      batch_rows=2000)
    seconds = time.perf_counter() - t0
    database.dispose()
    return {"rows": job.rows, "bytes_freed_estimate": job.bytes_freed, "raw_before": job.raw_before,
            "seconds": round(seconds, 2)}


def measure(label: str, url: str, build, rank_steps: int, ranks: int, layer_level: int) -> dict:
    run_id = build()
    before = table_bytes(url)
    compaction = compact_all(url, run_id, layer_level)
    after_plain = table_bytes(url, full=False) if not url.startswith("sqlite") else None
    after = table_bytes(url)
    tb, ta = sum(v for k, v in before.items() if k != "_file"), sum(v for k, v in after.items() if k != "_file")
    per = rank_steps * ranks
    row = {"run": label, "layer_level": layer_level, "steps": rank_steps, "ranks": ranks, "bytes_before": tb, "bytes_after": ta,
           "per_step_rank_before": round(tb / per, 1), "per_step_rank_after": round(ta / per, 1),
           "retained_share": round(ta / tb, 4), "tables_before": before, "tables_after": after,
           "after_plain_vacuum": after_plain, "compaction": compaction}
    print(json.dumps(row, indent=1), flush=True)
    print(f"== {label}: {tb / per:,.1f} B per step per rank raw, {ta / per:,.1f} after retention "
          f"({ta / tb:.1%}; layer_level {layer_level})", flush=True)
    return row


# ------------------------------------------------------------------------------------------ ingest p99

def _agents(port: int, stop: threading.Event, latencies: list, agents: int = 8, steps_per_batch: int = 20,
            interval: float = 0.5) -> list[threading.Thread]:
    import http.client

    def one(k: int):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        first = 0
        due = time.monotonic() + k * interval / agents
        while not stop.is_set():
            body = ingest_bench.make_batch(1000 + k, first, steps_per_batch, "default")
            body["project"] = "live"
            body.pop("alerts_after", None)
            raw = json.dumps(body).encode()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            conn.request("POST", "/api/v1/ingest", raw, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            latencies.append((time.monotonic(), time.monotonic() - due, resp.status))
            first += steps_per_batch
            due += interval

    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(agents)]
    for t in threads:
        t.start()
    return threads


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _summary(lat: list[float]) -> str:
    lat = sorted(lat)
    if not lat:
        return "no batches"
    return (f"{len(lat)} batches, p50 {statistics.median(lat) * 1e3:.0f} ms, "
            f"p99 {ingest_bench.percentile(lat, 0.99) * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms")


def ingest_p99(db: str | None, steps: int, seconds: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="gw-retention-p99-")
    fresh = ingest_bench.FreshDatabase(db, tmp, "retention_p99")
    out = {}
    try:
        run_id = query_bench.build_run(fresh.url, steps)
        for mode in ("without job", "with job"):
            env_keys = {}
            if mode == "with job":
                policy = Path(tmp) / "retention.toml"
                policy.write_text("[projects.bench.retention]\nraw_steps = 0\n")
                env_keys = {"GRADWATCH_RETENTION": str(policy), "GRADWATCH_RETENTION_INTERVAL": "3600"}
            os.environ.update(env_keys)
            port = 18000 + (os.getpid() % 1000)
            server = ingest_bench.start_server(fresh.url, port, tmp)
            for k in env_keys:
                os.environ.pop(k, None)
            try:
                latencies: list = []
                stop = threading.Event()
                threads = _agents(port, stop, latencies)
                t0 = time.monotonic()
                if mode == "with job":
                    # the job's first pass starts 5 s after the server; count the batches sent while it runs
                    while _metric(port, "gradwatch_retention_rows_compacted_total") == 0:
                        time.sleep(0.2)
                    start = time.monotonic()
                    while _metric(port, "gradwatch_retention_passes_total") < 1:
                        time.sleep(0.5)
                    end = time.monotonic()
                    rows = _metric(port, "gradwatch_retention_rows_compacted_total")
                    freed = _metric(port, "gradwatch_retention_bytes_freed_estimate_total")
                else:
                    time.sleep(seconds)
                    start, end, rows, freed = t0 + 2, time.monotonic(), 0, 0
                stop.set()
                for t in threads:
                    t.join(60)
                window = [lat for t, lat, _ in latencies if start <= t <= end]
                bad = sum(1 for _, _, st in latencies if st != 200)
                out[mode] = {"summary": _summary(window), "seconds": round(end - start, 1), "rows_compacted": rows,
                             "bytes_freed_estimate": freed, "non_200": bad}
                print(f"== ingest {mode}: {out[mode]}", flush=True)
            finally:
                server.terminate()
                server.wait(30)
        _ = run_id
    finally:
        fresh.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="PostgreSQL URL (a fresh database is created next to it); default SQLite")
    ap.add_argument("--steps", type=int, default=20000, help="steps of the 1-rank run")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rank-steps", type=int, default=1000, help="steps of the sharded run")
    ap.add_argument("--only", choices=("one", "sharded"), help="measure one of the two runs")
    ap.add_argument("--p99", action="store_true", help="ingest p99 with and without the retention job")
    ap.add_argument("--p99-steps", type=int, default=200000)
    ap.add_argument("--p99-seconds", type=float, default=30.0)
    ap.add_argument("--layer-level", type=int, default=4096, choices=(16, 256, 4096),
                    help="the policy's layer_level (default: the default policy's)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    results = []
    tmp = tempfile.mkdtemp(prefix="gw-storage-")
    try:
        if args.p99:
            results.append(ingest_p99(args.db, args.p99_steps, args.p99_seconds))
        else:
            if args.only in (None, "one"):
                fresh = ingest_bench.FreshDatabase(args.db, tmp, "storage_one")
                try:
                    results.append(measure("1 rank", fresh.url, lambda: query_bench.build_run(fresh.url, args.steps),
                                           args.steps, 1, args.layer_level))
                finally:
                    fresh.close()
            if args.only in (None, "sharded"):
                fresh = ingest_bench.FreshDatabase(args.db, tmp, "storage_sharded")
                try:
                    # per step per rank counts the sending ranks (the combined row is the server's own)
                    results.append(measure(f"{args.ranks} ranks sharded", fresh.url,
                                           lambda: build_sharded(fresh.url, args.ranks, args.rank_steps),
                                           args.rank_steps, args.ranks, args.layer_level))
                finally:
                    fresh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
