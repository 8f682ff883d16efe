"""Ingest latency while a huge run is deleted: p99 during the delete against before and after, one server.

    .venv/bin/python bench/delete_ingest.py                                  # SQLite, a 1,000,000-step run
    .venv/bin/python bench/delete_ingest.py --db postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python bench/delete_ingest.py --steps 200000 --agents 8 --steps-per-s 20

1. A fresh database (a new SQLite file, or a new PostgreSQL database next to the one named, dropped at
   the end) gets bench/query.py's run: ``--steps`` steps x 150 layers, written through the server's own
   write path (``query.build_run``).
2. A real ``gradwatch serve`` (bench/ingest.py ``start_server``) takes ``--agents`` open-loop agents, each
   its own run, sending one batch every ``--interval`` s (the agent's default flush) of
   ``--steps-per-s`` x interval steps as bench/ingest.py's agents build them (default telemetry: 150
   per-parameter grad norms every step, every statistic every 100 steps). Latency counts from each
   batch's scheduled send time, so a stalled server shows in full.
3. Phases, one after the other on the same server and agents: ``before`` (``--baseline-s``), ``during``
   (``DELETE /api/v1/runs/<id>?force=true`` of the big run, from its request to its answer), ``after``
   (``--baseline-s``). Printed: batches, p50 / p99 / max latency per phase, and p99 during over p99
   without (before and after together). Target (issue 34): p99 < 200 ms during the delete.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import ingest as ingest_bench  # noqa: E402  (bench/ingest.py: agents' batches, the server, a fresh database)
import query as query_bench    # noqa: E402  (bench/query.py: the 1M-step, 150-layer run)


WARMUP_S = 3.0


def _latencies(samples: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    return sorted(lat for due, lat in samples if lo <= due < hi)


def _row(name: str, lats: list[float]) -> str:
    if not lats:
        return f"{name:<8} {0:>8}"
    p = ingest_bench.percentile
    return (f"{name:<8} {len(lats):>8} {1000 * p(lats, 0.5):>9.1f} {1000 * p(lats, 0.99):>9.1f} "
            f"{1000 * lats[-1]:>9.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); for PostgreSQL a fresh database "
                                 "is created next to the one named and dropped at the end")
    ap.add_argument("--steps", type=int, default=1_000_000, help="steps of the run to delete")
    ap.add_argument("--agents", type=int, default=4, help="runs sending meanwhile (one thread each)")
    ap.add_argument("--steps-per-s", type=float, default=20.0, help="each agent's training speed")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between an agent's batches")
    ap.add_argument("--baseline-s", type=float, default=20.0, help="seconds of ingest alone before and after")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="gw-delete-bench-")
    fresh = ingest_bench.FreshDatabase(args.db, tmp, "delete")
    proc = None
    try:
        print(f"building a {args.steps:,}-step, {query_bench.LAYERS}-layer run in {fresh.url.split('@')[-1]} ...",
              flush=True)
        big = query_bench.build_run(fresh.url, args.steps)
        port = args.port
        if not port:
            import socket
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        proc = ingest_bench.start_server(fresh.url, port, tmp)
        steps_per_batch = max(1, round(args.steps_per_s * args.interval))
        prepared_s = 2 * args.baseline_s + 240          # the agents' batches are built for this long
        n_batches = int(prepared_s / args.interval) + 1
        print(f"{args.agents} agents, {steps_per_batch} steps per batch every {args.interval} s; "
              f"building their batches ...", flush=True)
        bodies = [[json.dumps(ingest_bench.make_batch(a, i * steps_per_batch, steps_per_batch, "default")).encode()
                   for i in range(n_batches)]
                  for a in range(args.agents)]
        samples: list[tuple[float, float]] = []
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        t0 = time.time() + 1.0

        def agent(a: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            for i, body in enumerate(bodies[a]):
                due = t0 + i * args.interval + a * args.interval / args.agents     # staggered phases
                if stop.is_set():
                    return
                wait = due - time.time()
                if wait > 0:
                    time.sleep(wait)
                conn.request("POST", "/api/v1/ingest", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                done = time.time()
                with lock:
                    samples.append((due, done - due))
                    if resp.status != 200:
                        errors.append(f"agent {a}: {resp.status}")

        threads = [threading.Thread(target=agent, args=(a,), daemon=True) for a in range(args.agents)]
        for t in threads:
            t.start()
        time.sleep(max(0.0, t0 + args.baseline_s - time.time()))
        print(f"deleting run {big} ({args.steps:,} steps) while the agents send ...", flush=True)
        d0 = time.time()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        conn.request("DELETE", f"/api/v1/runs/{big}?force=true")
        resp = conn.getresponse()
        answer = json.loads(resp.read())
        d1 = time.time()
        if resp.status != 200:
            raise SystemExit(f"the delete answered {resp.status}: {answer}")
        time.sleep(args.baseline_s)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        if d1 + args.baseline_s > t0 + len(bodies[0]) * args.interval:
            print("note: the agents ran out of prepared batches before the end of 'after'")

        before = _latencies(samples, t0 + WARMUP_S, d0)      # each agent's first batches create its run
        during = _latencies(samples, d0, d1)
        after = _latencies(samples, d1, d1 + args.baseline_s)
        without = sorted(before + after)
        print()
        print(f"database          {'SQLite' if fresh.url.startswith('sqlite') else 'PostgreSQL'}")
        print(f"deleted           run of {args.steps:,} steps: {answer['rows']:,} rows, "
              f"{answer['bytes'] / 1e6:,.0f} MB estimated, in {d1 - d0:.1f} s")
        print(f"ingest            {args.agents} agents x {args.steps_per_s:g} steps/s, a batch every {args.interval} s")
        print(f"{'phase':<8} {'batches':>8} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}")
        for name, lats in (("before", before), ("during", during), ("after", after), ("without", without)):
            print(_row(name, lats))
        if during and without:
            p = ingest_bench.percentile
            print(f"p99 during / p99 without: {p(during, 0.99) / p(without, 0.99):.2f}x")
        if errors:
            print(f"{len(errors)} batches not accepted: {errors[:5]}")
        return 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                proc.kill()
        fresh.close()
        for name in os.listdir(tmp):
            try:
                os.unlink(os.path.join(tmp, name))
            except OSError:
                pass


if __name__ == "__main__":
    raise SystemExit(main())
