"""``gradwatch serve`` and ``gradwatch db upgrade|check`` as real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.cli.cli_helpers import gradwatch
from tests.conftest import REPO_ROOT, free_port, http_json, wait_until


def test_serve_on_the_embedded_default_database_and_stop_with_ctrl_c(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env.update(GRADWATCH_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--port", str(port)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def healthy():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return http_json("GET", f"http://127.0.0.1:{port}/api/health", timeout=1)
            except OSError:
                return None
        status, body = wait_until(healthy, timeout=60, interval=0.2, what="serve health")
        assert status == 200 and body["database"] == "sqlite"
        # no --db: the SQLite file in the data dir, migrated on start
        assert (tmp_path / "gradwatch.db").exists()
        status, _ = http_json("GET", f"http://127.0.0.1:{port}/api/v1/runs")
        assert status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"dashboard at http://127.0.0.1:{port}/" in out
    assert "auth is off" in out, "serve warns that anyone who can reach it may read and write"


def test_db_upgrade_and_check_and_serve_refusing_an_old_schema(db_url, tmp_path):
    proc = gradwatch("db", "check", "--db", db_url, data_dir=tmp_path)
    assert proc.returncode == 1
    assert "gradwatch db upgrade --db" in proc.stdout + proc.stderr

    # a server on a database left at an older schema refuses to start, and says what to run
    assert gradwatch("db", "upgrade", "--db", db_url, "--revision", "0003", data_dir=tmp_path).returncode == 0
    proc = gradwatch("serve", "--db", db_url, "--port", str(free_port()), data_dir=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "gradwatch db upgrade" in proc.stderr

    proc = gradwatch("db", "upgrade", "--db", db_url, data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "database at head" in proc.stdout
    proc = gradwatch("db", "check", "--db", db_url, data_dir=tmp_path)
    assert proc.returncode == 0 and "schema is current" in proc.stdout
    # running the migration again is harmless (every replica's start script may run it)
    assert gradwatch("db", "upgrade", "--db", db_url, data_dir=tmp_path).returncode == 0


def test_errors_a_user_can_fix_are_one_line_that_says_what_to_do(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = gradwatch("serve", "--port", str(port), data_dir=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr

    proc = gradwatch("db", "upgrade", "--db", f"postgresql://nobody@127.0.0.1:{free_port()}/x", data_dir=tmp_path)
    assert proc.returncode == 1
    assert "cannot use the database" in proc.stderr and "GRADWATCH_DATABASE_URL" in proc.stderr
    assert "Traceback" not in proc.stderr

    proc = gradwatch("db", "check", "--db", "not-a-url", data_dir=tmp_path)
    assert proc.returncode == 2
    assert "bad database URL" in proc.stderr and "sqlite:///" in proc.stderr
