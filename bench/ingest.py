"""Ingest benchmark: N concurrent agents against a real ``gradwatch serve`` on loopback.

    .venv/bin/python bench/ingest.py                                    # SQLite (temp file)
    .venv/bin/python bench/ingest.py --db postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/ingest.py --agents 8 --batches 40 --steps-per-batch 100 --layer-stats all

Each agent is a thread with its own keep-alive connection, its own run, and
real wire-format payloads (the agent's fields, 150-layer statistics, NaNs
now and then), built and serialised before the clock starts so the client
side costs the server's CPU as little as possible. ``--layer-stats default``
mirrors the agent's defaults (per-parameter grad norms every step, the other
seven statistics every 100 steps); ``all`` sends all nine every step.

Reports values/s accepted (acknowledged by the server) and verified as stored
(counted in the database afterwards), and p50 / p99 batch latency.
Target: >= 1,000,000 values/s per server process with p99 < 200 ms.
"""
from __future__ import annotations

import argparse
import gzip
import http.client
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS = 150
ALL_STATS = ("grad_norm", "weight_norm", "update_ratio", "act_mean", "act_std", "act_absmax", "act_nonfinite",
             "bn_mean_norm", "bn_var_norm")


def make_batch(agent: int, first: int, n: int, stats: str) -> dict:
    import random

    rnd = random.Random(agent * 1_000_003 + first)
    steps = []
    for i in range(first, first + n):
        layers = {"grad_norm": [round(rnd.random(), 6) for _ in range(LAYERS)]}
        if stats == "all" or i % 100 == 0:
            for st in ALL_STATS[1:]:
                layers[st] = [round(rnd.random(), 6) for _ in range(LAYERS)]
        if i % 997 == 3:
            layers["grad_norm"][5] = "NaN"
        steps.append({
            "step": i, "time": 1.7e9 + i * 0.05, "loss": 2.0 + rnd.random() * 0.1, "grad_norm": 0.8 + rnd.random(),
            "clip_max_norm": 1.0, "clipped": False, "loss_scale": 65536.0, "overflow": False, "overflow_count": 0,
            "lr": 3e-4, "step_time": 0.05, "samples_per_s": 1000.0, "tokens_per_s": 512000.0, "mem_peak": 1.2e9,
            "ema_divergence": 1e-3, "input_nonfinite": 0 if i % 10 == 0 else None, "custom": {}, "layers": layers,
        })
    body = {"batch_id": uuid.uuid4().hex, "project": "bench", "run": f"agent-{agent}", "rank": 0,
            "world_size": 1, "steps": steps}
    if first == 0:
        body["meta"] = {"param_names": [f"blocks.{k // 6}.p{k % 6}.weight" for k in range(LAYERS)],
                        "module_names": [f"blocks.{k // 6}.m{k % 6}" for k in range(LAYERS)],
                        "bn_names": [f"bn{k}" for k in range(LAYERS)]}
    return body


def count_values(body: dict) -> int:
    n = 0
    for s in body["steps"]:
        n += sum(1 for k, v in s.items() if k not in ("step", "time", "custom", "layers") and v is not None)
        n += sum(len(v) for v in s["layers"].values())
    return n


def start_server(db: str, port: int, data_dir: str) -> subprocess.Popen:
    env = dict(os.environ, GRADWATCH_DATA_DIR=data_dir)
    subprocess.run([sys.executable, "-m", "server", "db", "upgrade", "--db", db], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--db", db, "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/api/health")
            if c.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit("server did not start")


def stored_values(db: str) -> int:
    """Count what the database holds: non-null step scalars (+ NaN bits) and layer values."""
    import numpy as np
    from sqlalchemy import func, select

    from server.db import open_database
    from server.models import STEP_SIGNALS, LayerStat, Step

    database = open_database(db)
    with database.sessionmaker() as s:
        scalars = 0
        for name in STEP_SIGNALS:
            scalars += s.scalar(select(func.count(getattr(Step, name))))
        scalars += s.scalar(select(func.count()).where(Step.nan_mask != 0))
        layer_bytes = s.scalar(select(func.sum(func.length(LayerStat.values)))) or 0
    database.dispose()
    return scalars + int(layer_bytes) // 4


def in_process_split(db: str, batches: int, steps_per_batch: int, stats: str) -> None:
    """Where a batch's time goes, without HTTP: parse + validate, then the write path with and
    without the rule engine (``ingest_batch(evaluate_rules=False)``), on one core."""
    from server.api.ingest import decode_body
    from server.db import open_database, upgrade
    from server.ingest import ingest_batch
    from server.schemas import IngestBatchIn
    from server.settings import Settings

    raws = [json.dumps(make_batch(0, b * steps_per_batch, steps_per_batch, stats)).encode() for b in range(batches)]
    nvals = sum(count_values(json.loads(r)) for r in raws)
    for rules in (False, True):
        upgrade(db)
        database = open_database(db)
        settings = Settings(data_dir=tempfile.mkdtemp(), database_url=db)
        run = f"split-{uuid.uuid4().hex[:6]}"
        t_parse = t_write = 0.0
        for raw in raws:
            t = time.perf_counter()
            body = decode_body(raw, "", limit=1 << 30)
            body["run"], body["batch_id"] = run, uuid.uuid4().hex
            batch = IngestBatchIn.model_validate(body)
            t_parse += time.perf_counter() - t
            t = time.perf_counter()
            with database.write_sessionmaker() as session:
                ingest_batch(session, batch=batch, settings=settings, now=time.time(), evaluate_rules=rules)
                session.commit()
            t_write += time.perf_counter() - t
        database.dispose()
        total = t_parse + t_write
        print(f"rules {'on ' if rules else 'off'}  {nvals / total:>12,.0f} values/s  "
              f"{batches * steps_per_batch / total:>7,.0f} steps/s   parse+validate {t_parse / total:4.0%}  "
              f"write{' + rules' if rules else ''} {t_write / total:4.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); for PostgreSQL a fresh database "
                                 "is created next to the one named")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--batches", type=int, default=30, help="batches per agent")
    ap.add_argument("--steps-per-batch", type=int, default=100)
    ap.add_argument("--layer-stats", choices=["default", "all"], default="default")
    ap.add_argument("--gzip", action="store_true", help="send Content-Encoding: gzip bodies")
    ap.add_argument("--port", type=int, default=8478)
    ap.add_argument("--in-process", action="store_true",
                    help="instead: time parse/validate/write in this process, rule engine off and on")
    args = ap.parse_args()

    from server.settings import normalize_db_url

    tmp = tempfile.mkdtemp(prefix="gw-bench-")
    pg_admin = None
    if args.db and not args.db.startswith("sqlite"):
        import psycopg

        admin_url = args.db.replace("postgresql+psycopg://", "postgresql://")
        pg_admin = psycopg.connect(admin_url, autocommit=True)
        name = f"gw_bench_{uuid.uuid4().hex[:8]}"
        pg_admin.execute(f'CREATE DATABASE "{name}"')
        db = normalize_db_url(admin_url.rsplit("/", 1)[0] + "/" + name)
    else:
        db = args.db or f"sqlite:///{tmp}/bench.db"
        name = None

    if args.in_process:
        in_process_split(db, args.batches, args.steps_per_batch, args.layer_stats)
        if pg_admin is not None:
            pg_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        return 0
    print(f"building {args.agents} x {args.batches} batches of {args.steps_per_batch} steps "
          f"({args.layer_stats} layer stats) ...", flush=True)
    payloads: list[list[tuple[bytes, int, int]]] = []
    for a in range(args.agents):
        mine = []
        for b in range(args.batches):
            body = make_batch(a, b * args.steps_per_batch, args.steps_per_batch, args.layer_stats)
            raw = json.dumps(body).encode()
            mine.append((gzip.compress(raw, 1) if args.gzip else raw, count_values(body), len(body["steps"])))
        payloads.append(mine)
    total_values = sum(v for mine in payloads for _, v, _ in mine)
    mb = sum(len(p) for mine in payloads for p, _, _ in mine) / 1e6

    proc = start_server(db, args.port, tmp)
    latencies: list[float] = []
    accepted = [0]
    errors: list[str] = []
    lock = threading.Lock()

    def agent(mine):
        conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if args.gzip:
            headers["Content-Encoding"] = "gzip"
        for raw, nvalues, _ in mine:
            t = time.perf_counter()
            conn.request("POST", "/api/v1/ingest", body=raw, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            dt = time.perf_counter() - t
            with lock:
                latencies.append(dt * 1000)
                if resp.status == 200:
                    accepted[0] += nvalues
                else:
                    errors.append(f"{resp.status} {data[:200]!r}")
        conn.close()

    try:
        threads = [threading.Thread(target=agent, args=(mine,)) for mine in payloads]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    stored = stored_values(db)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)]
    print(f"database          {db.split(':', 1)[0]}")
    print(f"agents x batches  {args.agents} x {args.batches}, {args.steps_per_batch} steps/batch, "
          f"{total_values / (args.agents * args.batches * args.steps_per_batch):.0f} values/step, "
          f"{mb:.1f} MB {'gzip' if args.gzip else 'JSON'}")
    print(f"wall              {wall:.2f} s")
    print(f"accepted          {accepted[0]:,} values = {accepted[0] / wall:,.0f} values/s "
          f"({accepted[0] / wall * 60 / 100_000:,.0f}x W&B's 100k values/min/run guidance)")
    print(f"stored            {stored:,} values ({'all' if stored == total_values else 'MISMATCH vs ' + format(total_values, ',')})")
    print(f"batch latency ms  p50 {statistics.median(latencies):.0f}  p99 {p99:.0f}  max {latencies[-1]:.0f}")
    if errors:
        print(f"errors            {len(errors)}: {errors[:3]}")
    if pg_admin is not None:
        pg_admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        pg_admin.close()
    return 1 if errors or stored != total_values else 0


if __name__ == "__main__":
    raise SystemExit(main())
