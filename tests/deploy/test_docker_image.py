"""The server image (server/Dockerfile + .dockerignore), checked and installed without a Docker engine.

The first tests read the Dockerfile as ``docker build`` does (tests/deploy/docker_image.py):
the dependency layer comes before the source, installs the ``server`` extra and no
torch, the image runs as a non-root user with its data dir as a VOLUME, and its
HEALTHCHECK is the healthcheck module the compose file uses too; .dockerignore lets
into the context what the image copies and nothing else.

The last one repeats the image's install in a fresh virtual environment: the files
its COPY instructions take from the context .dockerignore leaves, the requirements its
own reader prints, the project as a wheel with ``--no-deps``, ``pip check``; then it
runs the image's CMD on a SQLite data dir and the image's HEALTHCHECK against it, from
that environment alone.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port, missing_part, wait_until
from tests.deploy import compose_topology as ct
from tests.deploy import docker_image as di

SOURCE_FOLDERS = ("agent", "server", "dashboard")
# Distributions that would mean the ML stack got into the server image.
ML_STACK = {"torch", "torchvision", "lightning", "pytorch-lightning", "transformers", "accelerate", "gradwatch"}
DATA_DIR_ENV = "GRADWATCH_DATA_DIR"


def _env_of(instrs: list[di.Instruction]) -> dict[str, str]:
    env = {}
    for instr in instrs:
        if instr.keyword == "ENV":
            for word in instr.words():
                key, sep, value = word.partition("=")
                assert sep, f"ENV in the key=value form, please: {instr.args}"
                env[key] = value
    return env


def _requirement_name(req: str) -> str:
    return re.split(r"[\[<>=!~;@ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _copies_source(instr: di.Instruction) -> bool:
    return instr.keyword in ("COPY", "ADD") and any(
        src.rstrip("/").split("/")[0] in SOURCE_FOLDERS for src in instr.words()[:-1])


def test_dockerfile_installs_dependencies_before_the_source():
    instrs = di.instructions()
    step = di.requirement_step(instrs)

    # the dependency layer sees pyproject.toml only: a code change does not reinstall the dependencies
    before = [i for i in instrs[:step.index] if i.keyword in ("COPY", "ADD")]
    assert [i.words()[:-1] for i in before] == [["pyproject.toml"]], before
    sources = [n for n, i in enumerate(instrs) if _copies_source(i)]
    assert {i.words()[0].split("/")[0] for i in instrs if _copies_source(i)} == set(SOURCE_FOLDERS)
    assert min(sources) > step.index, "the source is copied before the dependencies are installed"

    # then the project itself, without resolving again, and pip check
    project = [n for n, i in enumerate(instrs) if i.keyword == "RUN" and "--no-deps" in i.words() and "." in i.words()]
    assert project and project[0] > max(sources), "pip install --no-deps . must come after the source COPY"
    assert any("pip check" in i.args for i in instrs[project[0]:] if i.keyword == "RUN"), \
        "pip check runs after the project install"

    # what the reader prints is the server extra of pyproject.toml, and nothing of the ML stack
    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["server"]
    reqs = di.requirements(step, sys.executable, REPO_ROOT)
    assert reqs == extra
    assert not {_requirement_name(r) for r in reqs} & ML_STACK, reqs
    assert "torch" not in " ".join(i.args for i in instrs if i.keyword == "RUN")


def test_dockerfile_runs_unprivileged_with_a_data_volume_and_a_full_health_check():
    instrs = di.instructions()
    users = [(n, i.args.split()[0]) for n, i in enumerate(instrs) if i.keyword == "USER"]
    assert users, "the image must not run as root"
    last_user_at, user = users[-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    assert all(i.keyword != "RUN" for i in instrs[last_user_at:]), "installs run before USER drops root"

    env = _env_of(instrs)
    volumes = [v for i in instrs if i.keyword == "VOLUME" for v in (i.exec_form() or i.words())]
    assert env.get(DATA_DIR_ENV) and env[DATA_DIR_ENV] in volumes, (env, volumes)
    # the data dir is made (and handed to the user) before VOLUME, so a new volume gets that owner
    made = [i for i in instrs if i.keyword == "RUN" and env[DATA_DIR_ENV] in i.args]
    assert made and "chown" in made[0].args and user in made[0].args

    check = di.healthcheck_command(instrs)
    assert check[:3] == ["python", "-m", "gradwatch.server.healthcheck"], check
    cmd = next(i for i in reversed(instrs) if i.keyword == "CMD").exec_form()
    port = cmd[cmd.index("--port") + 1]
    assert check[check.index("--url") + 1] == f"http://127.0.0.1:{port}", "the health check probes the served port"
    assert any(i.keyword == "EXPOSE" and i.args.split()[0] == port for i in instrs)
    # the compose replicas run the same check
    server = ct.load(env={"GRADWATCH_DB_PASSWORD": "x"}).services["server"]
    assert server.healthcheck == ["CMD", *check]


def test_dockerignore_keeps_the_context_to_what_the_image_copies():
    for path in (".venv", ".venv/lib/python3.11/site-packages/torch/__init__.py", ".git", ".git/HEAD",
                 "tests/conftest.py", "bench/ingest.py", "bench-data/run.json", "test-artifacts/shot.png",
                 ".gradwatch/spool/0001.batch", "gradwatch.db", "server/gradwatch.db-wal",
                 "agent/__pycache__/spool.cpython-311.pyc", "docs/screenshots/runs.png", "docs/deployment.md",
                 "build/lib/x.py", "dist/gradwatch-0.1.0.whl", "gradwatch.egg-info/PKG-INFO", ".pytest_cache/v",
                 ".env"):
        assert di.ignored(path), f"{path} would be sent to the docker daemon"

    files = di.context_files()
    copied = [src.rstrip("/") for i in di.instructions() if i.keyword == "COPY" for src in i.words()[:-1]]
    # nothing goes into the context that no COPY takes (server/Dockerfile itself lies in server/)
    stray = [f for f in files if not any(f == c or f.startswith(c + "/") for c in copied)]
    assert not stray, stray
    # and everything git tracks under what is copied is there (migrations, assets, ...)
    tracked = subprocess.run(["git", "ls-files", "-z", "--", *copied], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=30)
    if tracked.returncode != 0:
        pytest.skip(f"not a git checkout: {tracked.stderr.strip()}")
    missing = sorted(set(filter(None, tracked.stdout.split("\0"))) - set(files))
    assert not missing, f"tracked files left out of the build context: {missing}"


def _clean_env(**extra: str) -> dict[str, str]:
    """A shell with nothing of this checkout in it: no PYTHONPATH shim, no GRADWATCH_* settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRADWATCH_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_image_install_runs_in_a_fresh_venv(tmp_path):
    """The image's install steps, in order, in a new venv; then its CMD and HEALTHCHECK from that venv."""
    timings: dict[str, float] = {}
    started = time.monotonic()

    def step(name: str, argv: list[str], *, cwd: Path, timeout: float = 600, check: bool = True, **env: str):
        t0 = time.monotonic()
        done = subprocess.run(argv, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True,
                              timeout=timeout)
        timings[name] = time.monotonic() - t0
        if check:
            assert done.returncode == 0, f"{name}: {' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done

    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    if made.returncode != 0 or not (venv / "bin" / "python").exists():
        missing_part(f"python -m venv ({made.stderr.strip()[-300:]})")
    timings["venv"] = time.monotonic() - started
    python, bin_dir = str(venv / "bin" / "python"), venv / "bin"

    instrs = di.instructions()
    app = tmp_path / "app"            # the image's WORKDIR, filled as its COPY instructions fill it
    app.mkdir()
    di.copy_context(instrs, app)

    # 1. the dependency layer: the Dockerfile's own reader, then pip install -r (pip's cache is welcome here)
    reqs = di.requirements(di.requirement_step(instrs), python, app)
    assert not {_requirement_name(r) for r in reqs} & ML_STACK
    req_file = tmp_path / "server-requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    step("install requirements", [python, "-m", "pip", "install", "-q", "-r", str(req_file)], cwd=app)

    # 2. the project: a wheel built from the copied tree, installed without dependencies
    wheels = tmp_path / "wheels"
    step("build wheel", [python, "-m", "pip", "wheel", "-q", "--no-deps", ".", "-w", str(wheels)], cwd=app)
    (wheel,) = wheels.glob("gradwatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        license_path = f"{dist_info}/licenses/docs/LICENSE"
        assert license_path in names, f"the wheel carries no license text: {[n for n in names if 'dist-info' in n]}"
        assert zf.read(license_path) == (REPO_ROOT / "docs" / "LICENSE").read_bytes()
        metadata = zf.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: docs/LICENSE" in metadata
    assert "Apache License" in (REPO_ROOT / "docs" / "LICENSE").read_text()[:200]
    step("install project", [python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=app)

    checked = step("pip check", [python, "-m", "pip", "check"], cwd=app, check=False)
    assert checked.returncode == 0, f"pip check in the image's environment:\n{checked.stdout}{checked.stderr}"
    no_torch = step("import torch", [python, "-c", "import torch"], cwd=tmp_path, check=False)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, no_torch.stderr
    where = step("import gradwatch", [python, "-c", "import gradwatch.server, gradwatch.dashboard;"
                                      "print(gradwatch.server.__file__)"], cwd=tmp_path)
    assert Path(where.stdout.strip()).is_relative_to(venv), f"not the installed package: {where.stdout}"

    # 3. the image's CMD (its console script) on a SQLite data dir, as the VOLUME would hold it
    data_dir, home = tmp_path / "data", tmp_path / "home"
    data_dir.mkdir()
    home.mkdir()
    cmd = next(i for i in reversed(instrs) if i.keyword == "CMD").exec_form()
    port = free_port()
    argv = ct.rewrite_listen([str(bin_dir / cmd[0]), *cmd[1:]], port)
    container_port = cmd[cmd.index("--port") + 1]
    check_argv = [python if a == "python" else a.replace(f"127.0.0.1:{container_port}", f"127.0.0.1:{port}")
                  for a in di.healthcheck_command(instrs)]
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=home, env=_clean_env(**{DATA_DIR_ENV: str(data_dir)}, PYTHONUNBUFFERED="1"),
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()

        def healthy():
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log_path.read_text()}"
            return subprocess.run(check_argv, cwd=home, env=_clean_env(), capture_output=True, text=True,
                                  timeout=30).returncode == 0

        wait_until(healthy, timeout=90, interval=0.5, what="the image's health check")
        timings["serve until healthy"] = time.monotonic() - t0
        ok = step("healthcheck", check_argv, cwd=home)
        assert "api ok (sqlite), dashboard page ok, layout ok" in ok.stdout, ok.stdout
        assert (data_dir / "gradwatch.db").exists(), "the embedded SQLite file belongs in the data volume"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "No module named" not in log_path.read_text()

    down = step("healthcheck, server stopped", check_argv, cwd=home, check=False)
    assert down.returncode != 0, down.stdout
    assert down.stderr.count("\n") == 1 and down.stderr.startswith("gradwatch unhealthy: api: no answer"), down.stderr

    timings["total"] = time.monotonic() - started
    print("image install timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
