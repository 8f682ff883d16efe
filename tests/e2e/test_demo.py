"""`gradwatch demo` as a user runs it: server + dashboard + a training run that goes bad."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO_ROOT, free_port, http_json


def test_demo_serves_the_dashboard_and_its_run_raises_alerts(tmp_path):
    port = free_port()
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "gradwatch.server", "demo", "--port", str(port), "--steps", "150", "--step-delay", "0",
         "--exit-after-run"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"dashboard: http://127.0.0.1:{port}/" in out
    assert re.search(rf"run page: http://127\.0\.0\.1:{port}/runs/\d+", out), out
    # the bad batch at 40 % and the NaN loss from 2/3 on are both diagnosed
    assert re.search(r"ALERT A2 grad_explosion \(\w+\) at step 60", out), out
    assert re.search(r"ALERT A1 loss_nonfinite \(critical\) at step 100", out), out
    assert "ALERT A5 overflow_storm" in out, out
    assert "ALERT B3 loss_scale_collapse" in out, out
    # the embedded SQLite file that serve, export and import use by default too (issue 42)
    assert (tmp_path / "gradwatch.db").exists(), "the demo keeps its data in serve's default database"
    assert not (tmp_path / "demo.db").exists()


def test_demo_refuses_a_port_in_use_with_a_clear_message(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gradwatch.server", "demo", "--port", str(port)],
            cwd=REPO_ROOT, env=dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path)),
            capture_output=True, text=True, timeout=60,
        )
    assert proc.returncode == 2
    assert f"port {port}" in proc.stderr and "--port" in proc.stderr
    # nothing was started: no server answers there
    try:
        status, _ = http_json("GET", f"http://127.0.0.1:{port}/api/health", timeout=1)
    except OSError:
        status = None
    assert status != 200
