"""Run ``gradwatch`` as a user does: a real subprocess of the console script's entry point."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

from tests.conftest import REPO_ROOT, http_json


def gradwatch(*args: str, env: Optional[dict] = None, data_dir: Optional[Path] = None, timeout: float = 120,
              cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """``gradwatch ARGS`` (``python -m gradwatch.server`` runs the same ``gradwatch.server.cli:main``), output captured as text."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    full_env["PYTHONUNBUFFERED"] = "1"
    if data_dir is not None:
        full_env["GRADWATCH_DATA_DIR"] = str(data_dir)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "gradwatch.server", *args], cwd=cwd or REPO_ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def ingest(url: str, body: dict, headers: Optional[dict] = None) -> dict:
    status, out = http_json("POST", url + "/api/v1/ingest", body, headers=headers)
    assert status == 200, out
    return out


def batch(run: str, steps: list[dict], project: str = "default", **extra) -> dict:
    return {"batch_id": uuid.uuid4().hex, "project": project, "run": run, "rank": 0, "world_size": 1,
            "steps": steps, **extra}
