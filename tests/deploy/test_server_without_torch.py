"""The server image has no PyTorch (server/Dockerfile installs the ``server`` extra only).

Run the commands the image runs — ``db upgrade``, ``serve``, ``token create``,
``export``, ``sync`` — in processes where ``import torch`` (and the training frameworks)
fail, and use the server: health, ingest, the dashboard page, /metrics.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from tests.conftest import REPO_ROOT, free_port, http_json, wait_until

# Python run as the image would: the same entry point, with the ML stack made unimportable.
NO_TORCH = ("import sys\n"
            "for name in ('torch', 'transformers', 'lightning', 'pytorch_lightning', 'accelerate'):\n"
            "    sys.modules[name] = None\n"
            "from gradwatch.server.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")


def gradwatch_no_torch(*args: str) -> list[str]:
    return [sys.executable, "-c", NO_TORCH, *args]


def test_server_commands_work_without_torch(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    db = f"sqlite:///{tmp_path / 'gw.db'}"
    env.update(GRADWATCH_DATA_DIR=str(tmp_path), GRADWATCH_DATABASE_URL=db, GRADWATCH_AUTH="on",
               PYTHONUNBUFFERED="1")

    def run(*args):
        return subprocess.run(gradwatch_no_torch(*args), cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=120)

    up = run("db", "upgrade")
    assert up.returncode == 0, up.stderr
    token = run("token", "create", "--project", "p")
    assert token.returncode == 0, token.stderr
    auth = {"Authorization": f"Bearer {token.stdout.strip()}"}

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(gradwatch_no_torch("serve", "--host", "127.0.0.1", "--port", str(port)),
                            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return http_json("GET", base + "/api/health", timeout=1)[0] == 200
            except OSError:
                return False
        wait_until(healthy, timeout=60, interval=0.2, what="health")
        body = {"batch_id": uuid.uuid4().hex, "project": "p", "run": "r", "rank": 0, "world_size": 1,
                "steps": [{"step": i, "time": 1e9 + i, "loss": 1.0 / (i + 1)} for i in range(5)]}
        status, out = http_json("POST", base + "/api/v1/ingest", body, headers=auth)
        assert status == 200 and out["accepted"] == 5, out
        status, _ = http_json("GET", base + "/login")
        assert status == 200, "the dashboard's login page is served"
        status, metrics = http_json("GET", base + "/metrics")          # counts for anyone ...
        assert status == 200 and "gradwatch_ingest_batches_total" in metrics
        status, metrics = http_json("GET", base + "/metrics", headers=auth)   # ... runs for the project's token
        assert status == 200 and "gradwatch_run_last_step" in metrics

        # an offline machine's spool, copied next to the server, is synced from the torch-free image
        from gradwatch.agent.spool import Spool

        spool_dir = tmp_path / "spool"
        spool = Spool(spool_dir, max_bytes=1 << 20)
        for first in (0, 3):
            batch = {"batch_id": uuid.uuid4().hex, "project": "p", "run": "offline", "rank": 0,
                     "world_size": 1, "steps": [{"step": i, "time": 1e9 + i, "loss": 2.0} for i in range(first, first + 3)]}
            assert spool.append(json.dumps(batch).encode())
        synced = run("sync", str(spool_dir), "--server", base, "--token", token.stdout.strip(), "--quiet")
        assert synced.returncode == 0, synced.stderr
        assert "2 batch(es) sent (6 steps)" in synced.stderr
        status, runs = http_json("GET", base + "/api/v1/runs?name=offline", headers=auth)
        assert status == 200 and [r["last_step"] for r in runs["runs"]] == [5], runs
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log.close()
    assert "No module named" not in (tmp_path / "serve.log").read_text()

    exported = run("export", "r", "-o", "-")
    assert exported.returncode == 0, exported.stderr
    assert len(exported.stdout.strip().splitlines()) == 1 + 5
