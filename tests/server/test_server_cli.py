"""CLI entry points: db upgrade, refusing an out-of-date schema, an empty database given its schema by serve,
the embedded default upgraded on serve."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT, free_port, http_json, wait_until


def _run(args, data_dir, timeout=60):
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir))
    env.pop("GRADWATCH_DATABASE_URL", None)
    return subprocess.run([sys.executable, "-m", "gradwatch.server", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout)


def test_serve_refuses_an_out_of_date_schema_and_says_what_to_run(db_url, tmp_path):
    # an explicit database one migration behind: its operator decides when to upgrade it
    assert _run(["db", "upgrade", "--db", db_url, "--revision", "0001"], tmp_path).returncode == 0
    out = _run(["serve", "--db", db_url, "--port", str(free_port())], tmp_path)
    assert out.returncode == 2 and "0001" in out.stderr
    assert f"gradwatch db upgrade --db {db_url}" in out.stderr.replace("postgresql://", "postgresql+psycopg://")
    check = _run(["db", "check", "--db", db_url], tmp_path)
    assert check.returncode == 1 and "db upgrade" in check.stdout
    assert _run(["db", "upgrade", "--db", db_url], tmp_path).returncode == 0
    assert _run(["db", "check", "--db", db_url], tmp_path).returncode == 0


def test_serve_migrate_flag_and_embedded_default(tmp_path):
    # the embedded SQLite default under GRADWATCH_DATA_DIR is created and upgraded by serve itself
    port = free_port()
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path))
    env.pop("GRADWATCH_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--port", str(port)], env=env, cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up():
            assert proc.poll() is None, "server exited"
            try:
                return http_json("GET", f"http://127.0.0.1:{port}/api/health", timeout=1)[0] == 200
            except OSError:
                return False
        wait_until(up, timeout=60, interval=0.2, what="embedded server")
        assert (tmp_path / "gradwatch.db").exists()
        assert http_json("GET", f"http://127.0.0.1:{port}/api/health")[1] == {"status": "ok", "database": "sqlite"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # an explicit URL with --migrate is upgraded before serving
    db = f"sqlite:///{tmp_path / 'explicit.db'}"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--db", db, "--port", str(port), "--migrate"],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is None and _health(port), timeout=60, interval=0.2, what="migrated server")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert _run(["db", "check", "--db", db], tmp_path).returncode == 0


def _health(port):
    try:
        return http_json("GET", f"http://127.0.0.1:{port}/api/health", timeout=1)[0] == 200
    except OSError:
        return False


def test_serve_creates_the_schema_in_an_empty_database(db_url, tmp_path):
    # a new SQLite file / an empty PostgreSQL database: nothing to lose, so serve just works
    port = free_port()
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path))
    env.pop("GRADWATCH_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "gradwatch.server", "serve", "--db", db_url, "--port", str(port)],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: proc.poll() is None and _health(port), timeout=60, interval=0.2,
                   what=f"server on an empty database (stderr: {proc.stderr.read() if proc.poll() is not None else ''})")
        body = {"batch_id": "b1", "project": "p", "run": "r", "steps": [{"step": 0, "time": 1e9, "loss": 1.5}]}
        assert http_json("POST", f"http://127.0.0.1:{port}/api/v1/ingest", body)[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert _run(["db", "check", "--db", db_url], tmp_path).returncode == 0


def test_serve_refuses_gradwatch_tables_without_a_revision(db_url, tmp_path):
    # tables of ours but no record of which schema they are: creating or upgrading could destroy data
    import sqlalchemy

    assert _run(["db", "upgrade", "--db", db_url], tmp_path).returncode == 0
    engine = sqlalchemy.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("DROP TABLE alembic_version"))
    engine.dispose()
    out = _run(["serve", "--db", db_url, "--port", str(free_port())], tmp_path)
    assert out.returncode == 2 and "db upgrade" in out.stderr, out.stderr
