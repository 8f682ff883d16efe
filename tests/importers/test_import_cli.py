"""``gradwatch import tensorboard|wandb``: real logs in, the same numbers and the same alerts as live out.

The logs are written by the real loggers (torch's SummaryWriter; wandb in offline mode) in
a subprocess (write_logs.py); the import is the real console command; the server is a real
``gradwatch serve`` process. The live comparison sends the same series to the same server
through the ingest API in agent-sized batches, and the alerts (rule ids and first steps)
must be the ones the import raised.
"""
from __future__ import annotations

import math
import os
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.cli.cli_helpers import gradwatch
from tests.conftest import REPO_ROOT, LiveServer, create_token, free_port
from tests.importers.import_helpers import wandb_run_dir, write_logs
from tests.importers.series import (COLLAPSE_FROM, EXPLOSION_STEP, NAN_STEP, SPIKE_STEP, STEPS, TAGS, by_signal,
                                    wire_steps)

EXPECTED_RULES = {"C3", "A2", "B3", "A1"}


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("logs")
    return {"tensorboard": write_logs("tensorboard", root / "tb"), "wandb": write_logs("wandb", root / "wb")}


def run_id_of(srv: LiveServer, project: str, name: str) -> int:
    status, body = srv.get(f"/api/v1/runs?project={project}&name={name}")
    assert status == 200, body
    (run,) = body["runs"]
    return run["id"]


def stored(srv: LiveServer, run_id: int) -> dict[str, dict[int, float]]:
    out = {}
    for signal in TAGS.values():
        status, body = srv.get(f"/api/v1/runs/{run_id}/series?signal={signal}&start=0&end={STEPS - 1}"
                                f"&max_points={STEPS}")
        assert status == 200, body
        assert all(p["count"] == 1 for p in body["steps"]), "one value per step, never doubled"
        out[signal] = {p["step"]: float(p["last"]) for p in body["steps"]}
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def assert_numbers_are_the_logged_ones(srv: LiveServer, run_id: int) -> None:
    got, want = stored(srv, run_id), by_signal()
    for signal, values in want.items():
        assert set(got[signal]) == set(values), signal
        bad = [(s, got[signal][s], v) for s, v in values.items() if not same(got[signal][s], v)]
        assert not bad, f"{signal}: stored != logged at {bad[:5]}"
    # the poisoned stretch is stored non-finite, as logged
    assert math.isnan(got["loss"][NAN_STEP]) and got["grad_norm"][NAN_STEP] == math.inf


def alerts(srv: LiveServer, run_id: int) -> set[tuple[str, int]]:
    status, body = srv.get(f"/api/v1/alerts?run={run_id}")
    assert status == 200, body
    return {(a["rule"], a["first_step"]) for a in body["alerts"]}


def live_alerts(srv: LiveServer, run: str) -> set[tuple[str, int]]:
    """The same series sent as an agent sends it: 50-step batches, fresh batch ids, one after another."""
    steps = wire_steps({i: 1.7e9 + i for i in range(STEPS)})
    for i in range(0, STEPS, 50):
        status, out = srv.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": "live", "run": run,
                                                   "steps": steps[i:i + 50]})
        assert status == 200, out
    return alerts(srv, run_id_of(srv, "live", run))


def printed_alerts(stdout: str) -> set[tuple[str, int]]:
    found = set()
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[2] == "step" and parts[0][:1] in "ABCDEFGH" and parts[3].isdigit():
            found.add((parts[0], int(parts[3])))
    return found


def test_tensorboard_into_a_database_stores_the_logged_numbers_and_raises_the_live_alerts(
        logs, server_factory, tmp_path):
    url = f"sqlite:///{tmp_path / 'imported.db'}"
    LiveServer(db_url=url, data_dir=tmp_path, port=0).migrate()
    first = gradwatch("import", "tensorboard", str(logs["tensorboard"]), "--db", url, "--project", "imp",
                      data_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "run imp/run-a (id 1) from tensorboard" in out
    assert f"steps imported: {STEPS}\n" in out
    assert ("signals mapped: grad_norm <- train/grad_norm, loss <- train/loss, loss_scale <- scaler/scale, "
            "lr <- train/learning_rate") in out
    assert "left out: train/epoch" in out
    imported_alerts = printed_alerts(out)
    assert {r for r, _ in imported_alerts} == EXPECTED_RULES, out
    assert ("C3", SPIKE_STEP) in imported_alerts and ("A2", EXPLOSION_STEP) in imported_alerts
    assert ("A1", NAN_STEP) in imported_alerts
    assert any(r == "B3" and COLLAPSE_FROM <= s < NAN_STEP for r, s in imported_alerts)

    def counts():
        with sqlite3.connect(tmp_path / "imported.db") as c:
            return tuple(c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                         for t in ("steps", "alerts", "ingest_batches", "runs"))

    before = counts()
    again = gradwatch("import", "tensorboard", str(logs["tensorboard"]), "--db", url, "--project", "imp",
                      data_dir=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"steps imported: 0, {STEPS} already in the run" in again.stdout
    assert counts() == before and before[0] == STEPS

    srv = server_factory(url)
    run_id = run_id_of(srv, "imp", "run-a")
    assert_numbers_are_the_logged_ones(srv, run_id)
    assert alerts(srv, run_id) == imported_alerts
    assert live_alerts(srv, "live-tb") == imported_alerts


def test_a_log_that_grew_is_imported_up_to_date_with_its_new_steps_judged_once(server_factory, sqlite_url, tmp_path):
    """A job imported while it ran, then again once it resumed and finished (a second event file)."""
    logdir = write_logs("tensorboard", tmp_path / "tb", 0, SPIKE_STEP + 5)
    srv = server_factory(sqlite_url)
    first = gradwatch("import", "tensorboard", str(logdir), "--server", srv.url, data_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    assert f"steps imported: {SPIKE_STEP + 5}\n" in first.stdout
    write_logs("tensorboard", logdir, SPIKE_STEP + 5, STEPS)
    second = gradwatch("import", "tensorboard", str(logdir), "--server", srv.url, data_dir=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"steps imported: {STEPS - SPIKE_STEP - 5}, {SPIKE_STEP + 5} already in the run" in second.stdout
    run_id = run_id_of(srv, "default", "run-a")
    assert_numbers_are_the_logged_ones(srv, run_id)
    # the same alerts as the whole log sent live: the steps of the first import were not judged twice
    assert alerts(srv, run_id) == printed_alerts(second.stdout) == live_alerts(srv, "live-grown")


def test_wandb_offline_run_to_a_server_stores_the_logged_numbers_and_raises_the_live_alerts(
        logs, server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    run_dir = wandb_run_dir(logs["wandb"])
    first = gradwatch("import", "wandb", str(run_dir), "--server", srv.url, data_dir=tmp_path)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    run_id = run_id_of(srv, "wb-project", "wb-run")     # W&B's project and run name by default
    assert f"run wb-project/wb-run (id {run_id}) from wandb" in out
    assert f"steps imported: {STEPS}\n" in out
    assert "left out: train/epoch" in out          # train/global_step is the step, not a value
    assert f"dashboard: {srv.url}/runs/{run_id}" in out
    imported_alerts = printed_alerts(out)
    assert {r for r, _ in imported_alerts} == EXPECTED_RULES, out
    # HF's train/global_step is the step (W&B's own _step runs one ahead: a row was logged before training)
    assert ("C3", SPIKE_STEP) in imported_alerts and ("A1", NAN_STEP) in imported_alerts

    assert_numbers_are_the_logged_ones(srv, run_id)
    assert alerts(srv, run_id) == imported_alerts
    assert live_alerts(srv, "live-wb") == imported_alerts

    # again, and through the wandb/ folder that holds the run (and its latest-run link): nothing doubles
    again = gradwatch("import", "wandb", str(logs["wandb"] / "wandb"), "--server", srv.url, data_dir=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("\nrun ") + again.stdout.startswith("run ") == 1, again.stdout
    assert f"steps imported: 0, {STEPS} already in the run" in again.stdout
    assert_numbers_are_the_logged_ones(srv, run_id)
    assert alerts(srv, run_id) == imported_alerts
    # the batches themselves are idempotent: sent again (a retry, two imports at once) each is a duplicate
    from gradwatch.server.importers import sinks, tagmap, wandb_reader
    from gradwatch.server.importers.source import batches, prepare

    (log,) = run_dir.glob("run-*.wandb")
    bodies = batches(prepare(wandb_reader.read_run(str(log)), tagmap.TagMap.build()), project="wb-project",
                     run_name="wb-run")
    assert all(sinks.HttpSink(srv.url).send(b).duplicate for b in bodies)
    assert_numbers_are_the_logged_ones(srv, run_id)
    status, run = srv.get(f"/api/v1/runs/{run_id}")
    assert run["status"] == "finished" and run["last_step"] == STEPS - 1


def test_a_server_with_auth_on_takes_the_projects_token(logs, server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url, env={"GRADWATCH_AUTH": "on"})
    token = create_token(sqlite_url, "secured")
    args = ("import", "tensorboard", str(logs["tensorboard"]), "--server", srv.url, "--project", "secured")
    refused = gradwatch(*args, data_dir=tmp_path)
    assert refused.returncode == 1 and "pass --token or set GRADWATCH_TOKEN" in refused.stderr, refused.stderr
    ok = gradwatch(*args, env={"GRADWATCH_TOKEN": token}, data_dir=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert f"steps imported: {STEPS}\n" in ok.stdout
    again = gradwatch(*args, "--token", token, data_dir=tmp_path)
    assert f"steps imported: 0, {STEPS} already in the run" in again.stdout, again.stderr


def test_map_overrides_and_the_step_key(logs, tmp_path):
    url = f"sqlite:///{tmp_path / 'm.db'}"
    LiveServer(db_url=url, data_dir=tmp_path, port=0).migrate()
    # W&B's own _step instead of the logged global step: everything one step later
    proc = gradwatch("import", "wandb", str(wandb_run_dir(logs["wandb"])), "--db", url, "--step-key", "_step",
                     "--run", "by-wandb-step", "--map", "scaler/scale=", "--map", "train/epoch=ema_divergence",
                     data_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "run wb-project/by-wandb-step" in proc.stdout
    assert "ema_divergence <- train/epoch" in proc.stdout and "left out: scaler/scale" in proc.stdout
    assert ("A1", NAN_STEP + 1) in printed_alerts(proc.stdout)
    assert "B3" not in {r for r, _ in printed_alerts(proc.stdout)}     # no loss scale imported
    bad = gradwatch("import", "tensorboard", str(logs["tensorboard"]), "--db", url, "--map", "train/loss=losss",
                    data_dir=tmp_path)
    assert bad.returncode == 2
    assert "unknown signal 'losss'; one of loss, grad_norm" in bad.stderr


def test_errors_are_one_line_that_say_what_to_do(logs, tmp_path):
    url = f"sqlite:///{tmp_path / 'e.db'}"

    def err(*args) -> str:
        proc = gradwatch("import", *args, data_dir=tmp_path)
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines()
                 if line.startswith("gradwatch import:") and " reading " not in line]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        return lines[0]

    assert "no such directory" in err("tensorboard", str(tmp_path / "missing"), "--db", url)
    (tmp_path / "empty").mkdir()
    assert "no TensorBoard event files" in err("tensorboard", str(tmp_path / "empty"), "--db", url)
    assert "not a W&B offline run directory" in err("wandb", str(tmp_path / "empty"), "--db", url)
    assert "not a W&B offline run directory" in err("wandb", str(logs["tensorboard"]), "--db", url)
    # a database at an older schema (an empty one is given the schema, as serve does): the command that upgrades it
    assert gradwatch("db", "upgrade", "--db", url, "--revision", "0003", data_dir=tmp_path).returncode == 0
    assert f"run: gradwatch db upgrade --db {url}" in err("tensorboard", str(logs["tensorboard"]), "--db", url)
    port = free_port()      # nothing listens there
    assert "cannot reach the server" in err("tensorboard", str(logs["tensorboard"]), "--server",
                                            f"http://127.0.0.1:{port}")


# An install without a package, made real for one process: the import system finds no such module.
BLOCK = r"""
import sys
blocked = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = ["gradwatch", *sys.argv[2:]]
"""


# The import subcommand on its own: server/cli.py also registers commands (rules) whose modules need the
# server extra when the parser is built, so without SQLAlchemy only the import command can be run alone.
IMPORT_ONLY = ("import argparse\n"
               "from gradwatch.server.importers import cli\n"
               "p = argparse.ArgumentParser(prog='gradwatch'); cli.add_subparser(p.add_subparsers(required=True))\n"
               "args = p.parse_args(sys.argv[1:]); raise SystemExit(args.func(args))\n")


def blocked(modules: str, *args: str, tmp_path: Path, whole_cli: bool = True) -> subprocess.CompletedProcess:
    code = BLOCK + ("from gradwatch.server.cli import main; raise SystemExit(main())" if whole_cli else IMPORT_ONLY)
    return subprocess.run([sys.executable, "-c", code, modules, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env=_env(tmp_path))


def _env(tmp_path: Path) -> dict:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}, "GRADWATCH_DATA_DIR": str(tmp_path)}


def test_missing_extras_name_the_install_command(logs, tmp_path):
    tb = blocked("tensorboard", "import", "tensorboard", str(logs["tensorboard"]), tmp_path=tmp_path)
    assert tb.returncode == 1 and 'pip install "gradwatch[import]"' in tb.stderr, tb.stderr
    wb = blocked("wandb", "import", "wandb", str(wandb_run_dir(logs["wandb"])), tmp_path=tmp_path)
    assert wb.returncode == 1 and 'pip install "gradwatch[import]"' in wb.stderr, wb.stderr
    db = blocked("sqlalchemy", "import", "tensorboard", str(logs["tensorboard"]), "--db", "sqlite:///x.db",
                 tmp_path=tmp_path, whole_cli=False)
    assert db.returncode == 1 and 'pip install "gradwatch[server]"' in db.stderr and "--server URL" in db.stderr, \
        db.stderr
    for proc in (tb, wb, db):
        assert "Traceback" not in proc.stderr


def test_the_cli_module_imports_only_the_standard_library():
    """`gradwatch import` registers on an install with neither the server extra nor the loggers."""
    code = BLOCK + ("import argparse\n"
                    "from gradwatch.server.importers import cli\n"
                    "p = argparse.ArgumentParser(); cli.add_subparser(p.add_subparsers())\n"
                    "print(sorted(m for m in sys.modules if m.split('.')[0] in blocked))\n")
    proc = subprocess.run([sys.executable, "-c", code, "pydantic,tensorboard,wandb,sqlalchemy,numpy,fastapi,torch"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_http_path_needs_no_database_layer(logs, server_factory, sqlite_url, tmp_path):
    """--server sends JSON with the standard library: no SQLAlchemy, FastAPI or uvicorn needed to import."""
    srv = server_factory(sqlite_url)
    proc = blocked("sqlalchemy,fastapi,uvicorn,alembic", "import", "wandb", str(wandb_run_dir(logs["wandb"])),
                   "--server", srv.url, "--run", "no-db-layer", tmp_path=tmp_path, whole_cli=False)
    assert proc.returncode == 0, proc.stderr
    assert f"steps imported: {STEPS}" in proc.stdout


def test_http_status_codes_are_plain_messages(logs, tmp_path):
    """A server that is not gradwatch (any HTTP server answering 404) is named, not a traceback."""
    import http.server
    import threading

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        proc = gradwatch("import", "tensorboard", str(logs["tensorboard"]), "--server",
                         f"http://127.0.0.1:{httpd.server_address[1]}", data_dir=tmp_path)
    finally:
        httpd.shutdown()
    assert proc.returncode == 1
    assert "HTTP 501" in proc.stderr and "Traceback" not in proc.stderr

