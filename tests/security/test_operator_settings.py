"""Issue 43, case 6: every operator setting is checked when the server starts. A value out of range
stops ``gradwatch serve`` with exit 2 and one line naming the setting, the value and what it may be
(no traceback, no retention thread spinning on an interval of 0 or nan, no group waiting 1e308 s).
Ordinary values start. Both databases."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

BAD_ENV = [
    ({"GRADWATCH_RETENTION": "{policy}", "GRADWATCH_RETENTION_INTERVAL": "0"}, "GRADWATCH_RETENTION_INTERVAL='0'"),
    ({"GRADWATCH_RETENTION": "{policy}", "GRADWATCH_RETENTION_INTERVAL": "-5"}, "GRADWATCH_RETENTION_INTERVAL='-5'"),
    ({"GRADWATCH_RETENTION": "{policy}", "GRADWATCH_RETENTION_INTERVAL": "nan"}, "GRADWATCH_RETENTION_INTERVAL='nan'"),
    ({"GRADWATCH_RETENTION": "{policy}", "GRADWATCH_RETENTION_INTERVAL": "inf"}, "GRADWATCH_RETENTION_INTERVAL='inf'"),
    ({"GRADWATCH_RETENTION_BATCH_ROWS": "0"}, "GRADWATCH_RETENTION_BATCH_ROWS='0'"),
    ({"GRADWATCH_RETENTION_PAUSE": "-1"}, "GRADWATCH_RETENTION_PAUSE='-1'"),
    ({"GRADWATCH_RETENTION_LAYER_LEVEL": "16.5"}, "16.5"),
    ({"GRADWATCH_STALL_SECONDS": "nan"}, "GRADWATCH_STALL_SECONDS='nan'"),
    ({"GRADWATCH_STALL_SECONDS": "0"}, "GRADWATCH_STALL_SECONDS='0'"),
    ({"GRADWATCH_MAX_BODY_BYTES": "-1"}, "GRADWATCH_MAX_BODY_BYTES='-1'"),
    ({"GRADWATCH_WRITE_CONCURRENCY": "1e9"}, "GRADWATCH_WRITE_CONCURRENCY='1e9'"),
    ({"GRADWATCH_HEAVY_READ_BUDGET_MB": "0"}, "GRADWATCH_HEAVY_READ_BUDGET_MB='0'"),
    ({"GRADWATCH_SMTP_PORT": "70000"}, "GRADWATCH_SMTP_PORT='70000'"),
]
BAD_FILES = [
    ("retention", "[retention]\nraw_steps = 100\nlayer_level = 16.5\n", "layer_level"),
    ("retention", '[projects."a\\u0000b".retention]\nraw_days = 1\n', "control characters"),
    ("routing", "group_wait = 1e308\n", "group_wait"),
    ("routing", "repeat_interval = nan\n", "repeat_interval"),
    ("routing", '[[routes]]\nreceiver = "default"\nrank_wait = -1\n', "rank_wait"),
]


def _serve(db_url, tmp_path, env):
    full = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-m", "gradwatch.server", "serve", "--db", db_url, "--port", "0"],
                          capture_output=True, text=True, env=full, cwd=REPO_ROOT, timeout=120)


def _refused(done, *words):
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    line = [ln for ln in done.stderr.splitlines() if "refusing to start" in ln]
    assert line, done.stderr
    for w in words:
        assert w in line[0], (w, line[0])


@pytest.mark.parametrize("env,named", BAD_ENV, ids=[next(iter(e[0].values()))[:12] + "-" + e[1][:30]
                                                    for e in BAD_ENV])
def test_a_bad_environment_setting_stops_the_server_naming_it(db_url, tmp_path, env, named):
    policy = tmp_path / "retention.toml"
    policy.write_text("[retention]\nraw_steps = 1000\n")
    env = {k: v.format(policy=policy) for k, v in env.items()}
    done = _serve(db_url, tmp_path, env)
    _refused(done, named)
    assert "expected" in done.stderr or "must be" in done.stderr, done.stderr


@pytest.mark.parametrize("kind,text,named", BAD_FILES, ids=[f"{k}-{n}" for k, _, n in BAD_FILES])
def test_a_bad_settings_file_stops_the_server_naming_the_setting(db_url, tmp_path, kind, text, named):
    path = tmp_path / f"{kind}.toml"
    path.write_text(text)
    done = _serve(db_url, tmp_path, {f"GRADWATCH_{kind.upper()}": str(path)})
    _refused(done, named)
