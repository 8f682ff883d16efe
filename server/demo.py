"""``gradwatch demo``: the server and dashboard on SQLite, plus a demo training run that goes bad.

Both halves run as child processes of this command, exactly as a user runs
them: ``gradwatch serve`` (API + dashboard on one port) and
``python -m agent.demo`` (a real training loop with ``agent.attach``). This
process prints the dashboard URL, echoes each alert as it fires, and keeps
the server up until Ctrl-C.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the server, the dashboard and a demo training job that goes bad",
        description="Start gradwatch on an embedded SQLite file with a demo AMP training run "
                    "that is healthy for a while, then has a bad batch and a NaN loss, so alerts fire. "
                    "Keeps serving until Ctrl-C.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--db", default=None, help="database URL (default: sqlite file demo.db in the data dir)")
    p.add_argument("--steps", type=int, default=600,
                   help="steps of the demo run (>= 60; a bad batch comes at 40%%, a NaN loss from 2/3 on)")
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds per step, to watch it live")
    p.add_argument("--webhook", action="append", default=[], help="also POST alerts to this URL (repeatable)")
    p.add_argument("--exit-after-run", action="store_true",
                   help="stop once the demo run has finished instead of serving until Ctrl-C")
    p.set_defaults(func=run)


def _data_dir() -> Path:
    path = Path(os.environ.get("GRADWATCH_DATA_DIR") or Path.home() / ".gradwatch")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            _get_json(base + "/api/health")
            return True
        except (OSError, ValueError):
            time.sleep(0.2)
    return False


def _stop(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _find_run_id(base: str, run_name: str) -> int | None:
    try:
        runs = _get_json(base + "/api/v1/runs?project=demo")["runs"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r["id"] for r in runs if r["name"] == run_name), None)


def _print_new_alerts(base: str, run_id: int, seen: set[int]) -> None:
    try:
        alerts = _get_json(f"{base}/api/v1/alerts?run={run_id}")["alerts"]
    except (OSError, ValueError, KeyError):
        return
    for a in sorted(alerts, key=lambda a: a["id"]):
        if a["id"] not in seen:
            seen.add(a["id"])
            print(f"[demo] ALERT {a['rule']} {a['name']} ({a['severity']}) at step {a['step']}: {a['message']}",
                  flush=True)


def run(args) -> int:
    if args.steps < 60:
        print("gradwatch demo: --steps must be at least 60 so the run has a healthy phase before it goes bad.",
              file=sys.stderr)
        return 2
    if not _port_free(args.host, args.port):
        print(f"gradwatch demo: port {args.port} on {args.host} is in use; pass --port with a free one.",
              file=sys.stderr)
        return 2
    data_dir = _data_dir()
    db = args.db or f"sqlite:///{data_dir / 'demo.db'}"
    base = f"http://{args.host}:{args.port}"
    run_name = time.strftime("demo-%Y%m%d-%H%M%S")
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")

    serve_cmd = [sys.executable, "-m", "server", "serve", "--db", db, "--host", args.host,
                 "--port", str(args.port), "--migrate"]
    for url in args.webhook:
        serve_cmd += ["--webhook", url]
    server = subprocess.Popen(serve_cmd, env=env)
    job = None
    try:
        if not _wait_healthy(base, server):
            print("gradwatch demo: the server did not come up; see its output above.", file=sys.stderr)
            return 1
        print(f"[demo] dashboard: {base}/   (API: {base}/api/v1/runs)", flush=True)
        job = subprocess.Popen(
            [sys.executable, "-m", "agent.demo", "--server", base, "--project", "demo", "--run", run_name,
             "--steps", str(args.steps), "--step-delay", str(args.step_delay),
             # the failures scale with the run: a bad batch at 40 %, a NaN loss from 2/3 on
             "--bad-batch-at", str(int(args.steps * 0.4)), "--nan-at", str(int(args.steps * 2 / 3)),
             "--nan-steps", str(max(20, args.steps // 25))],
            env=env,
        )
        print(f"[demo] training run {run_name}; press Ctrl-C to stop", flush=True)
        seen: set[int] = set()
        run_id = None
        while True:
            if run_id is None:
                run_id = _find_run_id(base, run_name)
                if run_id is not None:
                    print(f"[demo] run page: {base}/runs/{run_id}", flush=True)
            if run_id is not None:
                _print_new_alerts(base, run_id, seen)
            if server.poll() is not None:
                print("gradwatch demo: the server stopped unexpectedly.", file=sys.stderr)
                return 1
            if job is not None and job.poll() is not None:
                time.sleep(1.0)  # the run's last batch and its alerts
                run_id = run_id or _find_run_id(base, run_name)
                if run_id is not None:
                    _print_new_alerts(base, run_id, seen)
                print(f"[demo] training run finished (exit {job.returncode}); "
                      f"{len(seen)} alerts; still serving {base}/", flush=True)
                if args.exit_after_run:
                    return 0 if job.returncode == 0 else 1
                job = None
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\n[demo] stopping", flush=True)
        return 0
    finally:
        _stop(job)
        _stop(server)
