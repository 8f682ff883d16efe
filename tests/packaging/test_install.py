"""What users install: the wheel and the sdist, each extra in a fresh venv outside the repo.

The editable tree the rest of the suite runs in can hide packaging faults (a module found through
the checkout, a dependency the dev venv happens to have). Here the distribution is built from the
tracked files, installed into new virtual environments under a temporary folder, and driven as a
user would, from a working directory that holds the user's own ``agent.py``, ``server.py`` and
``dashboard/`` (names gradwatch must never take):

- a training node: torch + ``pip install gradwatch`` from the sdist, no server packages;
- a monitoring host: ``pip install "gradwatch[server]"`` from the wheel, no torch; then with
  ``[import]``, importing TensorBoard and W&B history;
- a machine with both (the training node given the server extra): ``gradwatch demo`` twice in a
  row and stopped with SIGTERM.

The tests in this file run in order and share the venvs (building one costs tens of seconds);
the last ones add extras to venvs the first ones checked bare.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port, http_json, wait_until

pytestmark = pytest.mark.slow

PACKAGES = ("agent", "server", "dashboard")
TORCH = os.environ.get("GRADWATCH_TORCH", "torch==2.13.0")   # as .ci/setup: the CPU build on disk


def sh(cmd, *, cwd=None, env=None, timeout=900, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def clean_env(**extra) -> dict:
    """The user's environment: nothing of the test run's Python setup or gradwatch settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADWATCH_", "PYTHON", "VIRTUAL_ENV", "PYTEST"))}
    env.update(extra)
    return env


class Venv:
    def __init__(self, root: Path):
        self.root = root
        sh([sys.executable, "-m", "venv", root])
        self.python = root / "bin" / "python"
        self.gradwatch = root / "bin" / "gradwatch"

    def pip(self, *args, timeout=900):
        return sh([self.python, "-m", "pip", "install", "-q", *args], env=clean_env(), timeout=timeout)

    def run(self, *args, cwd, env=None, timeout=300, check=False):
        return sh([self.python, *args], cwd=cwd, env=env or clean_env(), timeout=timeout, check=check)

    def cli(self, *args, cwd, env=None, timeout=300, check=False):
        return sh([self.gradwatch, *args], cwd=cwd, env=env or clean_env(), timeout=timeout, check=check)


def user_project(where: Path) -> Path:
    """A working directory holding the names a user's own code commonly has."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "agent.py").write_text("class Agent:\n    '''an RL agent: the user's, not gradwatch's'''\n"
                                    "    def act(self, obs):\n        return 0\n")
    (where / "server.py").write_text("raise SystemExit('the user server.py was imported')\n")
    (where / "dashboard").mkdir(exist_ok=True)
    (where / "dashboard" / "__init__.py").write_text("raise SystemExit('the user dashboard/ was imported')\n")
    return where


def tracked_files() -> list[str]:
    out = sh(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT)
    return [f for f in out.stdout.splitlines() if (REPO_ROOT / f).is_file()]


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict:
    """The sdist, and the wheel built *from that sdist*: what the sdist holds must be enough."""
    base = tmp_path_factory.mktemp("dist")
    src = base / "src"
    for rel in tracked_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / rel, src / rel)
    out = base / "out"
    sh([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, src], timeout=600)
    wheel, = out.glob("gradwatch-*.whl")
    sdist, = out.glob("gradwatch-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


@pytest.fixture(scope="module")
def server_venv(dist, tmp_path_factory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("host") / "venv")
    venv.pip(f"gradwatch[server] @ {dist['wheel'].as_uri()}")
    return venv


@pytest.fixture(scope="module")
def agent_venv(dist, tmp_path_factory) -> Venv:
    venv = Venv(tmp_path_factory.mktemp("node") / "venv")
    venv.pip(TORCH)                       # the training environment's own torch
    venv.pip(dist["sdist"])               # then gradwatch, built from the sdist by pip
    return venv


def package_dirs() -> set[str]:
    return {str(p.parent.relative_to(REPO_ROOT)).replace("/", ".")
            for name in PACKAGES for p in (REPO_ROOT / name).rglob("__init__.py")
            if "__pycache__" not in p.parts}


def test_the_wheel_installs_one_name_with_every_module_and_data_file(dist):
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gradwatch", "gradwatch-0.1.0.dist-info"}, tops
    assert "gradwatch/__init__.py" not in names, "gradwatch is a namespace package"
    # every package folder and every file of it the tree tracks (code, migrations, assets)
    shipped = {n for n in names if n.startswith("gradwatch/")}
    tracked = [f for f in tracked_files() if f.split("/")[0] in PACKAGES and not f.endswith("Dockerfile")]
    missing = [f for f in tracked if f"gradwatch/{f}" not in shipped]
    assert not missing, f"tracked files the wheel leaves out: {missing}"
    for pkg in package_dirs():
        assert f"gradwatch/{pkg.replace('.', '/')}/__init__.py" in shipped, pkg
    assert any(n.endswith("dist-info/licenses/docs/LICENSE") for n in names), "the license text ships"
    meta = zipfile.ZipFile(dist["wheel"]).read("gradwatch-0.1.0.dist-info/METADATA").decode()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in r for r in requires), "the base install pulls nothing"
    assert [r for r in requires if r.split()[1].startswith("torch")] == \
        ['Requires-Dist: torch>=2.3; extra == "agent"'], "torch only with the agent extra, as a range"
    entry = zipfile.ZipFile(dist["wheel"]).read("gradwatch-0.1.0.dist-info/entry_points.txt").decode()
    assert "gradwatch = gradwatch.server.cli:main" in entry


def test_the_package_list_in_pyproject_names_every_package_folder():
    import tomllib

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {f"gradwatch.{p}" for p in package_dirs()} <= listed
    # the rest are data folders (migrations, assets): each exists
    for name in listed:
        assert (REPO_ROOT / name.removeprefix("gradwatch.").replace(".", "/")).is_dir(), name


def test_every_extra_requirement_has_its_install_hint():
    import re
    import tomllib

    from gradwatch.server.commands.extras import MODULE_EXTRA

    # distribution name -> import name where they differ
    import_name = {"uvicorn[standard]": "uvicorn", "psycopg[binary]": "psycopg", "google-re2": "re2"}
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("agent", "server", "import", "hf", "lightning", "deepspeed"):
        for req in extras[extra]:
            dist_name = re.split(r"[<>=!~ ;]", req, maxsplit=1)[0]
            module = import_name.get(dist_name, dist_name).replace("-", "_")
            assert MODULE_EXTRA.get(module) == extra, f"{req} ({extra}) has no install hint"


def test_a_monitoring_host_runs_the_server_without_torch(server_venv, tmp_path):
    assert sh([server_venv.python, "-m", "pip", "check"], env=clean_env()).returncode == 0
    no_torch = server_venv.run("-c", "import torch", cwd=tmp_path)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    # imports warning-free, the dashboard's pages included (create_app mounts them)
    code = ("import sys; from gradwatch.server.operations.settings import Settings; from gradwatch.server.app import create_app; "
            f"create_app(Settings.from_env(db='sqlite:///{tmp_path / 'w.db'}'))")
    warn = server_venv.run("-W", "error", "-c", code, cwd=tmp_path)
    assert warn.returncode == 0, warn.stderr

    cwd = user_project(tmp_path / "work")
    port = free_port()
    env = clean_env(GRADWATCH_DATA_DIR=str(tmp_path / "data"))
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([server_venv.gradwatch, "serve", "--port", str(port)], cwd=cwd, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def up():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return http_json("GET", base + "/api/health", timeout=1)[0] == 200
            except OSError:
                return False
        wait_until(up, timeout=90, interval=0.3, what="serve from the host venv")
        status, layout = http_json("GET", base + "/_dash-layout")
        assert status == 200 and layout, "the dashboard is mounted, not the API alone"
        body = {"batch_id": "pkg-1", "project": "p", "run": "r",
                "steps": [{"step": i, "time": 1e9 + i, "loss": 2.0 - i / 10} for i in range(5)]}
        assert http_json("POST", base + "/api/v1/ingest", body)[0] == 200
        run_id = http_json("GET", base + "/api/v1/runs?project=p")[1]["runs"][0]["id"]
        assert _steps(base, run_id, ["loss"])["loss"] == pytest.approx([2.0 - i / 10 for i in range(5)])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert "the user" not in (tmp_path / "serve.log").read_text()

    # the command that needs the training side says which extra, in one line
    demo = server_venv.cli("demo", "--port", str(free_port()), cwd=cwd)
    assert demo.returncode == 2
    assert demo.stderr.strip().count("\n") == 0 and 'pip install "gradwatch[agent]"' in demo.stderr, demo.stderr


def test_a_monitoring_host_imports_history_with_the_alerts_a_live_run_raises(server_venv, dist, tmp_path):
    """``gradwatch[server,import]`` from the wheel: a TensorBoard log (the real SummaryWriter's) into the
    host's database and a W&B offline run to its server raise the alerts the same series raises live."""
    import uuid

    from tests.importers.import_helpers import wandb_run_dir, write_logs
    from tests.importers.series import STEPS, wire_steps
    from tests.importers.test_import_cli import printed_alerts

    server_venv.pip(f"gradwatch[server,import] @ {dist['wheel'].as_uri()}")
    assert sh([server_venv.python, "-m", "pip", "check"], env=clean_env()).returncode == 0
    tb = write_logs("tensorboard", tmp_path / "tb", 0, STEPS)     # written by this (dev) venv's loggers
    wb = write_logs("wandb", tmp_path / "wb")
    cwd = user_project(tmp_path / "work")
    env = clean_env(GRADWATCH_DATA_DIR=str(tmp_path / "data"))

    port = free_port()
    proc = subprocess.Popen([server_venv.gradwatch, "serve", "--port", str(port)], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(base), timeout=90, interval=0.3, what="host server")
        steps = wire_steps({i: 1.7e9 + i for i in range(STEPS)})
        for i in range(0, STEPS, 50):       # as an agent sends it: 50-step batches
            body = {"batch_id": uuid.uuid4().hex, "project": "live", "run": "live", "steps": steps[i:i + 50]}
            assert http_json("POST", base + "/api/v1/ingest", body)[0] == 200
        live_id = http_json("GET", base + "/api/v1/runs?project=live")[1]["runs"][0]["id"]
        live = {(a["rule"], a["first_step"]) for a in http_json("GET", f"{base}/api/v1/alerts?run={live_id}")[1]["alerts"]}
        assert live, "the series raises alerts live"
        to_server = server_venv.cli("import", "wandb", wandb_run_dir(wb), "--server", base, cwd=cwd, env=env)
        assert to_server.returncode == 0, to_server.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    to_db = server_venv.cli("import", "tensorboard", tb, "--db", f"sqlite:///{tmp_path / 'history.db'}",
                            cwd=cwd, env=env)
    assert to_db.returncode == 0, to_db.stderr
    assert printed_alerts(to_db.stdout) == live, to_db.stdout
    assert printed_alerts(to_server.stdout) == live, to_server.stdout


TRAIN = textwrap.dedent("""
    import json, sys, torch
    import agent as rl                      # the user's own agent.py, next to this script
    from gradwatch import agent
    assert rl.Agent().act(None) == 0 and hasattr(agent, "attach")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    monitor = agent.attach(model, scaler, optimizer=opt, project="node", run="offline-1", mode="offline",
                           spool_dir=sys.argv[1], flush_interval=0.05)
    losses, norms = [], []
    for step in range(8):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        monitor.log(loss=loss)
        losses.append(float(loss))
    monitor.close()
    json.dump({"loss": losses, "grad_norm": norms}, open(sys.argv[2], "w"))
""")


def test_a_training_node_with_the_agent_only(agent_venv, server_venv, tmp_path):
    assert sh([agent_venv.python, "-m", "pip", "check"], env=clean_env()).returncode == 0
    assert agent_venv.run("-c", "import pydantic", cwd=tmp_path).returncode != 0, "no server packages here"
    # gradwatch's own imports warning-free (torch first: without numpy, torch itself warns at import)
    warn = agent_venv.run("-c", "import torch, warnings; warnings.simplefilter('error'); from gradwatch import agent; "
                          "import gradwatch.agent.monitor, gradwatch.agent.sync, gradwatch.agent.integrations.callback",
                          cwd=tmp_path)
    assert warn.returncode == 0, warn.stderr
    cwd = user_project(tmp_path / "work")
    (cwd / "train.py").write_text(TRAIN)
    spool, logged = tmp_path / "spool", tmp_path / "logged.json"
    train = agent_venv.run("-W", "error::DeprecationWarning:gradwatch", "train.py", spool, logged, cwd=cwd)
    assert train.returncode == 0, train.stderr
    truth = json.loads(logged.read_text())

    helped = agent_venv.cli("--help", cwd=cwd)
    assert helped.returncode == 0 and "sync" in helped.stdout, helped.stderr
    serve = agent_venv.cli("serve", "--port", str(free_port()), cwd=cwd)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr
    assert serve.stderr.strip().count("\n") == 0 and 'pip install "gradwatch[server]"' in serve.stderr, serve.stderr

    # the spool, uploaded by the node's `gradwatch sync` to a server run from the host venv
    port = free_port()
    proc = subprocess.Popen([server_venv.gradwatch, "serve", "--port", str(port)], cwd=tmp_path,
                            env=clean_env(GRADWATCH_DATA_DIR=str(tmp_path / "host-data")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(base), timeout=90, interval=0.3, what="host server")
        sync = agent_venv.cli("sync", spool, "--server", base, "--quiet", cwd=cwd)
        assert sync.returncode == 0, sync.stdout + sync.stderr
        run_id = http_json("GET", base + "/api/v1/runs?project=node")[1]["runs"][0]["id"]
        stored = _steps(base, run_id, ["loss", "grad_norm"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert stored["loss"] == pytest.approx(truth["loss"], rel=1e-6)
    assert stored["grad_norm"] == pytest.approx(truth["grad_norm"], rel=1e-4), "clip_grad_norm_'s own value"


def _healthy(base: str) -> bool:
    try:
        return http_json("GET", base + "/api/health", timeout=1)[0] == 200
    except OSError:
        return False


def _steps(base: str, run_id: int, signals: list[str]) -> dict:
    """Each signal's value per step, raw (max_points well above the steps: one step per bucket)."""
    out = {}
    for name in signals:
        status, body = http_json("GET", f"{base}/api/v1/runs/{run_id}/series?signal={name}&max_points=10000")
        assert status == 200, body
        assert all(p["count"] == 1 for p in body["steps"]), body
        out[name] = [p["last"] for p in body["steps"]]
    return out


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_demo_twice_in_a_row_and_stopped_with_sigterm(agent_venv, dist, tmp_path):
    agent_venv.pip(f"gradwatch[server] @ {dist['wheel'].as_uri()}")      # now a machine with both
    cwd = user_project(tmp_path / "work")
    env = clean_env(GRADWATCH_DATA_DIR=str(tmp_path / "data"), PYTHONUNBUFFERED="1")
    port = free_port()
    for attempt in (1, 2):    # the second right after the first: the port is reused like serve's
        demo = agent_venv.cli("demo", "--port", str(port), "--steps", "150", "--step-delay", "0",
                              "--exit-after-run", cwd=cwd, env=env, timeout=400)
        assert demo.returncode == 0, f"attempt {attempt}:\n{demo.stdout[-2000:]}\n{demo.stderr[-2000:]}"
        assert "[demo] ALERT" in demo.stdout and "the user" not in demo.stdout + demo.stderr

    log = open(tmp_path / "demo.log", "w")
    proc = subprocess.Popen([agent_venv.gradwatch, "demo", "--port", str(port), "--steps", "2000"], cwd=cwd,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is None and "run page:" in (tmp_path / "demo.log").read_text(),
                   timeout=120, interval=0.3, what="the demo's run page")
        children = _children(proc.pid)
        assert len(children) >= 2, "a server and a training job"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "demo.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [c for c in children if _alive(c)], "no process left behind"
    assert not _healthy(f"http://127.0.0.1:{port}"), "the demo's server is gone"
