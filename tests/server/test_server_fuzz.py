"""Fuzz every operation in the OpenAPI schema with schemathesis against a real server: no 5xx.

Runs the schemathesis CLI (its pytest plugin does not load under pytest 9)
on SQLite and PostgreSQL with the ``not_a_server_error`` check. The example
budget is small so the suite stays within minutes; raise
GRADWATCH_FUZZ_EXAMPLES for a longer run.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, missing_part
from gw_payloads import batch, step

EXAMPLES = os.environ.get("GRADWATCH_FUZZ_EXAMPLES", "20")


def _schemathesis() -> str:
    exe = Path(sys.executable).with_name("schemathesis")
    if exe.exists():
        return str(exe)
    found = shutil.which("schemathesis")
    if not found:
        missing_part("schemathesis (pip install -e '.[test]')")
    return found


@pytest.mark.slow
def test_openapi_fuzz_finds_no_server_errors(live_server, tmp_path):
    exe = _schemathesis()
    # data to read, so run-scoped reads hit real rows (raw and rollup paths)
    status, _ = live_server.post("/api/v1/ingest", batch([step(i) for i in range(300)], run="fuzz"))
    assert status == 200
    proc = subprocess.run(
        [exe, "run", live_server.url + "/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", EXAMPLES, "--workers", "1", "--request-timeout", "30",
         "--generation-deterministic"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, SCHEMATHESIS_HOOKS="", NO_COLOR="1"),
    )
    out = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out + "\n--- server log ---\n" + live_server.log()[-4000:]
    m = re.search(r"(\d+) generated, (\d+) passed", out)
    assert m and int(m.group(1)) > 100 and m.group(1) == m.group(2), out
    assert re.search(r"Tested: (\d+)", out) and int(re.search(r"Tested: (\d+)", out).group(1)) >= 8, out
