"""Load and abuse: the hostile requests of the hostile-input report replayed while agents ingest.

One real server (SQLite by default, or ``--db postgresql://…``), ``--agents`` agents sending open loop at
``--rate`` values/s in total (the agent's batches, as ``bench/ingest.py`` builds them), and one hostile
client that cycles through the attacks below for as long as the agents send, one request every
``--hostile-interval`` seconds (default 0.1: ten a second; 0 floods). Reported: the server's
peak resident memory (sampled every 0.1 s, and the kernel's own high-water mark), the agents' batch
latency, every attack's status codes, the count of 5xx answers, and whether every value the agents sent
was stored.

Targets (the issue): RSS ≤ 1 GB, ingest p99 < 200 ms, 0 answers 5xx, 0 steps lost.

    python bench/abuse.py                                   # SQLite, 8 agents, 1M values/s, 20 s
    python bench/abuse.py --db postgresql://postgres@127.0.0.1:5432/test

The server runs with auth off on loopback, so the token, session and webhook-target attacks (which need
auth on or a wider bind) are left to their tests (tests/server/test_server_auth.py,
tests/webhooks/test_webhook_targets.py); every attack here works against that server.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import (ROOT, FreshDatabase, count_values, make_batch, percentile, start_server,  # noqa: E402
                    stored_values)


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def attacks(run_id: int) -> list[tuple[str, str, str, bytes, dict]]:
    """(name, method, path, body, headers): the report's hostile requests, scaled as reported."""
    js = {"Content-Type": "application/json"}
    gz = {**js, "Content-Encoding": "gzip"}
    bomb = gzip.compress(b'{"batch_id":"bomb","project":"abuse","run":"bomb","steps":[{"step":0,"time":1.0,'
                         b'"layers":{"grad_norm":[' + b"0.5," * (60 * 1024 * 1024) + b'0.5]}}]}', 6)
    nest = gzip.compress(b'{"batch_id":"nest","project":"abuse","run":"bomb","steps":[],"events":[{"kind":"x",'
                         b'"data":{"a":[' + b"[]," * (20 * 1024 * 1024) + b'[]]}}]}', 6)
    deep = (b'{"batch_id":"d","project":"abuse","run":"r","steps":[],"events":[{"kind":"x","data":{"a":'
            + b"[" * 100_000 + b"]" * 100_000 + b"}}]}")
    one = {"batch_id": "x", "project": "abuse", "run": "small", "steps": [{"step": 0, "time": 1.0}]}
    nul = json.dumps({**one, "steps": [{"step": 0, "time": 1.0, "custom": {"a\x00b": 1.0}}]}).encode()
    over = "f32:" + base64.b64encode(b"\x00" * 4 * 100_001).decode()
    f32 = json.dumps({**one, "steps": [{"step": 0, "time": 1.0, "layers": {"grad_norm": over}}]}).encode()
    trailing = gzip.compress(json.dumps(one).encode()) + b"garbage"
    multi = "&".join([f"runs={run_id}"] * 50 + [f"signals={s}" for s in ["loss"] * 20]) + "&max_points=100000"
    return [
        ("series: 50 runs x 20 signals x 100k points", "GET", f"/api/v1/series?{multi}", b"", {}),
        ("heatmap: 10000 x 10000", "GET", f"/api/v1/runs/{run_id}/layers?max_steps=10000&max_layers=10000", b"", {}),
        (f"gzip bomb ({len(bomb) // 1024} KB -> 240 MB of numbers)", "POST", "/api/v1/ingest", bomb, gz),
        (f"nested lists in event data ({len(nest) // 1024} KB gzip)", "POST", "/api/v1/ingest", nest, gz),
        ("JSON nested 100,000 deep", "POST", "/api/v1/ingest", deep, js),
        ("NUL in a custom key", "POST", "/api/v1/ingest", nul, js),
        ("f32 array of 100,001 values", "POST", "/api/v1/ingest", f32, js),
        ("gzip with trailing garbage", "POST", "/api/v1/ingest", trailing, gz),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); for PostgreSQL a fresh database "
                                 "is created next to the one named")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1_000_000.0, help="values/s offered by all agents together")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between an agent's batches")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hostile-interval", type=float, default=0.1,
                    help="seconds between the hostile client's requests (0: as fast as answered)")
    ap.add_argument("--server-root", help="run the server of another checkout (before / after)")
    args = ap.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="gw-abuse-")
    fresh = FreshDatabase(args.db, tmp, "abuse")
    db = fresh.url

    values_per_step = count_values(make_batch(0, 1, 100, "default")) / 100
    steps_per_batch = max(1, round(args.rate * args.interval / (args.agents * values_per_step)))
    batches = max(1, round(args.seconds / args.interval))
    print(f"building {args.agents} x {batches} batches of {steps_per_batch} steps ...", flush=True)
    payloads = []
    for a in range(args.agents):
        mine = []
        for b in range(batches):
            body = make_batch(a, b * steps_per_batch, steps_per_batch, "default")
            mine.append((json.dumps(body).encode(), count_values(body)))
        payloads.append(mine)
    total = sum(v for mine in payloads for _, v in mine)

    proc = start_server(db, port, tmp, Path(args.server_root).resolve() if args.server_root else ROOT)
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    accepted = [0]
    statuses: dict[str, Counter] = {}
    server_errors: list[str] = []
    lock = threading.Lock()
    running = threading.Event()
    running.set()
    rss_peak = [0.0]

    def post(conn, method, path, body, hdrs):
        conn.request(method, path, body=body or None, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()

    def agent(index, mine, t_start):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        for b, (raw, nvalues) in enumerate(mine):
            due = t_start + (b + index / len(payloads)) * args.interval
            if due > time.perf_counter():
                time.sleep(due - time.perf_counter())
            status, data = post(conn, "POST", "/api/v1/ingest", raw, headers)
            with lock:
                latencies.append((time.perf_counter() - due) * 1000)
                if status == 200:
                    accepted[0] += nvalues
                elif status >= 500:
                    server_errors.append(f"agent {status} {data[:100]!r}")
        conn.close()

    def hostile(todo):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while running.is_set():
            for label, method, path, body, hdrs in todo:
                if not running.is_set():
                    break
                time.sleep(args.hostile_interval)
                try:
                    status, data = post(conn, method, path, body, hdrs)
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    status, data = 0, repr(e).encode()
                with lock:
                    statuses.setdefault(label, Counter())[status] += 1
                    if status >= 500 or status == 0:
                        server_errors.append(f"{label}: {status} {data[:100]!r}")
        conn.close()

    def sampler():
        while running.is_set():
            rss_peak[0] = max(rss_peak[0], _rss_mb(proc.pid))
            time.sleep(0.1)

    try:
        # a first batch makes the run the read attacks aim at (it is counted like the others)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        status, data = post(conn, "POST", "/api/v1/ingest", payloads[0][0][0], headers)
        conn.close()
        assert status == 200, data
        accepted[0] += payloads[0][0][1]
        run_id = json.loads(data)["run_id"]
        payloads[0] = payloads[0][1:]
        rss_start = _rss_mb(proc.pid)
        todo = attacks(run_id)          # built before the agents start (the bombs take a few seconds to compress)
        threads = [threading.Thread(target=sampler, daemon=True), threading.Thread(target=hostile, args=(todo,))]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        agents = [threading.Thread(target=agent, args=(i, mine, t0)) for i, mine in enumerate(payloads)]
        for t in agents:
            t.start()
        for t in agents:
            t.join()
        running.clear()
        for t in threads:
            t.join()
        rss_hwm = _rss_mb(proc.pid, "VmHWM")
    finally:
        running.clear()
        proc.terminate()
        proc.wait(timeout=30)
    stored = stored_values(db, project="bench")
    lat = sorted(latencies)
    print(f"database           {db.split(':', 1)[0]}")
    print(f"offered            {total / (batches * args.interval):,.0f} values/s from {args.agents} agents, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"server RSS         start {rss_start:.0f} MB, peak sampled {rss_peak[0]:.0f} MB, high-water mark "
          f"{rss_hwm:.0f} MB   (target <= 1024 MB)")
    print(f"ingest latency ms  p50 {statistics.median(lat):.0f}  p99 {percentile(lat, 0.99):.0f}  max {lat[-1]:.0f}"
          f"   ({len(lat)} batches; target p99 < 200)")
    print(f"stored             {stored:,} of {total:,} values ({'none lost' if stored == total else 'LOST'})")
    print("hostile requests   status codes (count)")
    for label, counts in statuses.items():
        print(f"  {label:<52} {', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}")
    print(f"5xx answers        {len(server_errors)}{': ' + '; '.join(server_errors[:3]) if server_errors else ''}")
    fresh.close()
    return 1 if server_errors or stored != total else 0


if __name__ == "__main__":
    raise SystemExit(main())
