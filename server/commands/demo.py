"""``gradwatch demo``: the server and dashboard on SQLite, plus a demo training run that goes bad.

Both halves run as child processes of this command, exactly as a user runs
them: ``gradwatch serve`` (API + dashboard on one port) and
``python -m gradwatch.agent.demo`` (a real training loop with ``agent.attach``). This
process prints the dashboard URL, echoes each alert as it fires, and keeps
the server up until Ctrl-C.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gradwatch.server.commands.extras import install_hint
from gradwatch.server.operations.ports import DEFAULT_PORT, port_problem
from gradwatch.server.commands.processes import Terminated, module_command, popen, raise_on_sigterm, stop

MIN_STEPS = 150   # the bad batch (at 40 %) must come after the 50 steps of history A2 judges from


def add_subparser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the server, the dashboard and a demo training job that goes bad",
        description="Start gradwatch on an embedded SQLite file with a demo AMP training run "
                    "that is healthy for a while, then has a bad batch and a NaN loss, so alerts fire. "
                    "Keeps serving until Ctrl-C.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--db", default=None,
                   help="database URL (default: as for serve, export and import: GRADWATCH_DATABASE_URL or the "
                        "SQLite file gradwatch.db in the data dir, so that `gradwatch serve` shows the demo's runs)")
    p.add_argument("--steps", type=int, default=600,
                   help=f"steps of the demo run (>= {MIN_STEPS}; a bad batch comes at 40%%, a NaN loss from 2/3 on)")
    p.add_argument("--step-delay", type=float, default=0.05, help="seconds per step, to watch it live")
    p.add_argument("--webhook", action="append", default=[], help="also POST alerts to this URL (repeatable)")
    p.add_argument("--exit-after-run", action="store_true",
                   help="stop once the demo run has finished instead of serving until Ctrl-C")
    p.set_defaults(func=run)


def _data_dir() -> Path:
    path = Path(os.environ.get("GRADWATCH_DATA_DIR") or Path.home() / ".gradwatch")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _get_json(url: str, timeout: float = 10.0):
    # 10 s, not 2: on a busy machine (a CI runner beside other jobs) the server answered a read later than
    # 2 s while it took the run's batches, and the demo, which skips a failed poll, missed alerts
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """The API answers and the dashboard is mounted (the image's health check: a server that failed
    to load the dashboard serves the API alone, and the demo's URL would lead nowhere)."""
    from gradwatch.server.operations.healthcheck import Unhealthy, check

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            check(base, timeout=5.0)
            return True
        except (Unhealthy, OSError):
            time.sleep(0.2)
    return False


def _find_run_id(base: str, run_name: str) -> int | None:
    try:
        runs = _get_json(base + "/api/v1/runs?project=demo")["runs"]
    except (OSError, ValueError, KeyError):
        return None
    return next((r["id"] for r in runs if r["name"] == run_name), None)


def _print_new_alerts(base: str, run_id: int, seen: set[int]) -> bool:
    """Print the run's alerts not printed yet; False when the server could not be read this time."""
    try:
        alerts = _get_json(f"{base}/api/v1/alerts?run={run_id}")["alerts"]
    except (OSError, ValueError, KeyError):
        return False
    for a in sorted(alerts, key=lambda a: a["id"]):
        if a["id"] not in seen:
            seen.add(a["id"])
            print(f"[demo] ALERT {a['rule']} {a['name']} ({a['severity']}) at step {a['step']}: {a['message']}",
                  flush=True)
    return True


def _run_status(base: str, run_id: int) -> str | None:
    try:
        return _get_json(f"{base}/api/v1/runs/{run_id}")["status"]
    except (OSError, ValueError, KeyError):
        return None


def _print_final_alerts(base: str, run_name: str, run_id: int | None, seen: set[int],
                        timeout: float = 30.0) -> None:
    """After the job exited: its last batch is stored once the run is no longer running (the agent's close()
    sent it); then every alert is read, retried while the server is busy, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run_id = run_id or _find_run_id(base, run_name)
        if run_id is not None and _run_status(base, run_id) not in (None, "running"):
            break
        time.sleep(0.5)
    while run_id is not None and not _print_new_alerts(base, run_id, seen) and time.monotonic() < deadline:
        time.sleep(0.5)


def run(args) -> int:
    if args.steps < MIN_STEPS:
        print(f"gradwatch demo: --steps must be at least {MIN_STEPS} so the run has a healthy phase before it goes "
              f"bad (the grad-norm rule compares with its first 50 steps).", file=sys.stderr)
        return 2
    for module in ("torch", "fastapi"):   # the demo is a training job and a server on one machine
        if importlib.util.find_spec(module) is None:
            print(install_hint("demo", ModuleNotFoundError(name=module)), file=sys.stderr)
            return 2
    busy = port_problem(args.host, args.port)
    if busy:
        print(f"gradwatch demo: port {args.port} on {args.host} cannot be used ({busy}); pass --port with a free one.",
              file=sys.stderr)
        return 2
    data_dir = _data_dir()
    # one default database for demo, serve, export and import (issue 42: the demo wrote demo.db and a `gradwatch
    # serve` after it showed an empty runs list); the demo's runs live in the project "demo"
    from gradwatch.server.operations.settings import Settings

    db = args.db or Settings.from_env(env=dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir))).database_url
    base = f"http://{args.host}:{args.port}"
    run_name = time.strftime("demo-%Y%m%d-%H%M%S")
    # the demo is a sandbox on this machine: its server and job talk without tokens whatever the
    # shell's GRADWATCH_AUTH says (a token-less job would be refused, and the demo read nothing)
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", GRADWATCH_AUTH="off")

    serve_cmd = module_command("gradwatch.server", "serve", "--db", db, "--host", args.host,
                               "--port", str(args.port), "--migrate")
    for url in args.webhook:
        serve_cmd += ["--webhook", url]
    raise_on_sigterm()    # `kill PID` stops the demo like Ctrl-C: the finally below ends both children
    # Started from a non-interactive shell's background job (`nohup ... &`, a CI runner), the demo inherits
    # SIGINT ignored, so Python installs no KeyboardInterrupt for it, while its server child gets Ctrl-C back
    # (processes.py): a SIGINT to the group then stopped the server alone and the demo exited 1 ('the server
    # stopped unexpectedly'; the fresh-clone CI run from a background shell met it). Ctrl-C stops both.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = job = None
    try:
        server = popen(serve_cmd, env=env)
        if not _wait_healthy(base, server):
            print("gradwatch demo: the server did not come up; see its output above.", file=sys.stderr)
            return 1
        where = f"; database: {db}" if db.startswith("sqlite") else ""    # a server URL may hold a password
        print(f"[demo] dashboard: {base}/   (API: {base}/api/v1/runs{where})", flush=True)
        job = popen(
            module_command("gradwatch.agent.demo", "--server", base, "--project", "demo", "--run", run_name,
                           "--steps", str(args.steps), "--step-delay", str(args.step_delay),
                           # the failures scale with the run: a bad batch at 40 %, a NaN loss from 2/3 on
                           "--bad-batch-at", str(int(args.steps * 0.4)), "--nan-at", str(int(args.steps * 2 / 3)),
                           "--nan-steps", str(max(20, args.steps // 25))),
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
                _print_final_alerts(base, run_name, run_id, seen)
                print(f"[demo] training run finished (exit {job.returncode}); "
                      f"{len(seen)} alerts; still serving {base}/", flush=True)
                if args.exit_after_run:
                    return 0 if job.returncode == 0 else 1
                job = None
            time.sleep(0.5)
    except (KeyboardInterrupt, Terminated):
        print("\n[demo] stopping", flush=True)
        return 0
    finally:
        stop(job)
        stop(server)
