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
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from health_probe import poll_health  # noqa: E402
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


# ----------------------------------------------------------------------------- issue 43's cases, one at a time
#
#   python bench/abuse.py --case redos [--name-length 24]    # a catastrophic silence regex, then a NaN
#   python bench/abuse.py --case heatmap [--parallel 20]     # 20 worst-case heatmaps at once
#
# Each starts its own server (--server-root: another checkout's, for before/after figures) and reports the
# slowest /api/health answer while the case runs (polled every 20 ms from a process of its own, or with
# --probe-in-process from a thread of the bench's own process, as before; the heatmap
# case polls 5 s of an idle server first, the machine's own floor), and for the heatmap case the server's
# RSS (baseline, peak, after) and the answers' status codes.

def _request(port: int, method: str, path: str, body=None, timeout: float = 600.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    resp = conn.getresponse()
    out = resp.status, resp.read(), dict(resp.getheaders())
    conn.close()
    return out


PROBE_IN_PROCESS = False   # --probe-in-process


class HealthProbe:
    """``/api/health`` every ``every_s``: the slowest answer while it runs.

    By default from a process of its own, as a load balancer's or an orchestrator's probe would be. In
    the bench's own process (``in_process``, the way it was measured before) each poll also waits for
    this process's GIL, which the 20 heatmap readers hold while they read their 17.9 MB answers, so a
    slow poll there may be the bench's, not the server's."""

    def __init__(self, port: int, every_s: float = 0.02, in_process: bool = False):
        self.port, self.every_s, self.times, self.failures = port, every_s, [], 0
        self.in_process = in_process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._proc = None

    def _loop(self):
        self.times, self.failures = poll_health(self.port, self.every_s, self._stop)

    def __enter__(self):
        if self.in_process:
            self._thread.start()
        else:
            self._proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("health_probe.py")),
                                           str(self.port), str(self.every_s)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            self._stop.set()
            self._thread.join()
            return
        out, _ = self._proc.communicate(b"", timeout=180)   # stdin closed: the probe stops and reports
        got = json.loads(out)
        self.times, self.failures = got["times"], got["failures"]

    def summary(self) -> str:
        if not self.times:
            return "health: no answers"
        ts = sorted(self.times)
        slow = sum(t > 0.1 for t in ts)
        return (f"/api/health: {len(ts)} answers, max {ts[-1] * 1000:.0f} ms, p99 {percentile(ts, 0.99) * 1000:.0f} ms, "
                f"median {statistics.median(ts) * 1000:.1f} ms, {slow} over 100 ms, failures {self.failures}")


def case_redos(port: int, name_length: int) -> None:
    run = "a" * name_length
    status, body, _ = _request(port, "POST", "/api/v1/silences",
                               {"project": "beta", "matchers": ['run=~"(a+)+b"'], "duration_s": 3600})
    print(f"silence run=~\"(a+)+b\": {status} {body[:200].decode(errors='replace')}")
    for pattern in ('(a|a)*b', '(a*)*b', '(.*a){20}b', '(a)\\1', '(?=a)a'):
        st, b, _ = _request(port, "POST", "/api/v1/silences",
                            {"project": "beta", "matchers": [f'run=~"{pattern}"'], "duration_s": 3600})
        print(f"silence run=~\"{pattern}\": {st} {b[:160].decode(errors='replace')}")
    batch = {"batch_id": "redos-1", "project": "beta", "run": run,
             "steps": [{"step": 0, "time": 1.0, "loss": 1.0}, {"step": 1, "time": 2.0, "loss": "NaN"}]}
    with HealthProbe(port, in_process=PROBE_IN_PROCESS) as probe:
        time.sleep(0.2)
        t = time.perf_counter()
        status, body, _ = _request(port, "POST", "/api/v1/ingest", batch)
        took = time.perf_counter() - t
        time.sleep(0.2)
    print(f"ingest of a NaN loss from run 'a'*{name_length}: {status} in {took * 1000:.0f} ms")
    print(probe.summary())
    _, alerts, _ = _request(port, "GET", "/api/v1/alerts?project=beta")
    rows = json.loads(alerts).get("alerts", [])
    print(f"alerts: {[(a['rule'], a.get('silenced_by')) for a in rows]}")


def _fill_heatmap_run(port: int, steps: int, layers: int) -> int:
    import numpy as np

    from gradwatch.server.wire.numbers import pack_f32_b64

    rnd = np.random.default_rng(0)
    names = [f"blocks.{i // 6}.p{i % 6}.weight" for i in range(layers)]
    per = 2000
    for first in range(0, steps, per):
        n = min(per, steps - first)
        vals = rnd.uniform(0.01, 1.0, size=(n, layers)).astype("<f4")
        body = {"batch_id": f"h{first}", "project": "heat", "run": "wide",
                "meta": {"param_names": names} if first == 0 else None,
                "steps": [{"step": first + i, "time": float(first + i), "loss": 1.0,
                           "layers": {"grad_norm": pack_f32_b64(vals[i])}} for i in range(n)]}
        if body["meta"] is None:
            del body["meta"]
        status, out, _ = _request(port, "POST", "/api/v1/ingest", body)
        if status != 200:
            raise SystemExit(f"filling the heatmap run: {status} {out[:300]!r}")
    _, out, _ = _request(port, "GET", "/api/v1/runs?project=heat")
    return json.loads(out)["runs"][0]["id"]


def case_heatmap(port: int, pid: int, parallel: int, steps: int, layers: int, max_steps: int,
                 retry: bool) -> None:
    print(f"filling a run of {steps} steps x {layers} layers ...", flush=True)
    run_id = _fill_heatmap_run(port, steps, layers)
    path = f"/api/v1/runs/{run_id}/layers?stat=grad_norm&max_steps={max_steps}&max_layers={layers}"
    status, body, _ = _request(port, "GET", path)
    print(f"one heatmap: {status}, {len(body) / 2**20:.1f} MB of JSON")
    time.sleep(2)
    with HealthProbe(port, in_process=PROBE_IN_PROCESS) as idle:     # the machine's own floor: the same polls with nothing else asked
        time.sleep(5)
    print(f"idle server, {idle.summary()}")
    baseline = _rss_mb(pid)
    peak = [baseline]
    done = threading.Event()

    def sampler():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb(pid))
            done.wait(0.05)

    statuses: Counter = Counter()
    retry_after: Counter = Counter()
    lock = threading.Lock()

    def reader():
        for _ in range(50 if retry else 1):
            st, _, hdrs = _request(port, "GET", path)
            with lock:
                statuses[st] += 1
                if "retry-after" in {k.lower() for k in hdrs}:
                    retry_after[st] += 1
            if st == 200 or not retry:
                return
            wait = next((float(v) for k, v in hdrs.items() if k.lower() == "retry-after"), 1.0)
            time.sleep(wait)

    threading.Thread(target=sampler, daemon=True).start()
    with HealthProbe(port, in_process=PROBE_IN_PROCESS) as probe:
        t = time.perf_counter()
        threads = [threading.Thread(target=reader) for _ in range(parallel)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        took = time.perf_counter() - t
    done.set()
    time.sleep(5)
    after = _rss_mb(pid)
    print(f"{parallel} parallel heatmaps (max_steps={max_steps}, {layers} layers), retrying on 429/503: {retry}: "
          f"answers {dict(statuses)} (with Retry-After: {dict(retry_after)}) in {took:.1f} s")
    print(f"server RSS: baseline {baseline:.0f} MB, peak {peak[0]:.0f} MB (kernel high-water "
          f"{_rss_mb(pid, 'VmHWM'):.0f} MB), 5 s after {after:.0f} MB")
    print(probe.summary())


def run_case(args) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="gw-abuse-")
    fresh = FreshDatabase(args.db, tmp, "abuse")
    proc = start_server(fresh.url, port, tmp, Path(args.server_root).resolve() if args.server_root else ROOT)
    try:
        if args.case == "redos":
            case_redos(port, args.name_length)
        else:
            case_heatmap(port, proc.pid, args.parallel, args.heatmap_steps, args.heatmap_layers, args.max_steps,
                         args.retry)
    finally:
        proc.terminate()
        proc.wait(30)
        fresh.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=("redos", "heatmap"), help="one of issue 43's cases instead of the load run")
    ap.add_argument("--name-length", type=int, default=24, help="redos: the run name's length ('a' * N)")
    ap.add_argument("--parallel", type=int, default=20, help="heatmap: readers at once")
    ap.add_argument("--heatmap-steps", type=int, default=53_000, help="heatmap: the run's steps")
    ap.add_argument("--heatmap-layers", type=int, default=150)
    ap.add_argument("--max-steps", type=int, default=6666, help="heatmap: max_steps of each read")
    ap.add_argument("--retry", action="store_true", help="heatmap: readers retry after Retry-After until 200")
    ap.add_argument("--db", help="database URL (default: a fresh SQLite file); for PostgreSQL a fresh database "
                                 "is created next to the one named")
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rate", type=float, default=1_000_000.0, help="values/s offered by all agents together")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between an agent's batches")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hostile-interval", type=float, default=0.1,
                    help="seconds between the hostile client's requests (0: as fast as answered)")
    ap.add_argument("--server-root", help="run the server of another checkout (before / after)")
    ap.add_argument("--probe-in-process", action="store_true",
                    help="poll /api/health from this process (as measured before), not from a process of its own")
    args = ap.parse_args()
    global PROBE_IN_PROCESS
    PROBE_IN_PROCESS = args.probe_in_process
    if args.case:
        return run_case(args)

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
