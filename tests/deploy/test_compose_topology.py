"""The docker-compose topology, started without Docker: PostgreSQL + migrations + the server replicas.

``docker-compose.yml`` is parsed (tests/deploy/compose_topology.py) and its
services are started in its own dependency order with its own commands,
environment and replica count — only host names, ports and the database name
are rewritten. Then the topology has to work: health checks answer, batches of
one run sent through both replicas in interleaved order (with a project token,
since the file turns auth on) are all stored exactly once. The health checks are the file's own command
(server/healthcheck.py: the API and the dashboard), run with each replica's
environment.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import uuid
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO_ROOT, free_port, http_json, missing_part, wait_until
from tests.deploy import compose_topology as ct

# What a user exports before `docker compose up` (the file refuses to start without it);
# everything else keeps the file's own defaults.
COMPOSE_ENV: dict[str, str] = {"GRADWATCH_DB_PASSWORD": "compose-test-password"}


def _base_env(data_dir) -> dict[str, str]:
    """The process environment a container would have: no GRADWATCH_* leaking in from this shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env.update(GRADWATCH_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    return env


def _batch(run: str, steps: range, project: str) -> dict:
    return {
        "batch_id": uuid.uuid4().hex,
        "project": project,
        "run": run,
        "rank": 0,
        "world_size": 1,
        "steps": [{"step": s, "time": 1_764_400_000.0 + s, "loss": 3.0 / (1 + s), "grad_norm": 0.5 + s % 7,
                   "lr": 1e-3, "loss_scale": 65536.0, "overflow": False, "overflow_count": 0} for s in steps],
    }


def _token_from(stdout: str) -> str:
    lines = [ln.strip() for ln in stdout.strip().splitlines() if ln.strip()]
    assert lines, "token create printed nothing"
    if len(lines) == 1 and " " not in lines[0]:
        return lines[0]
    m = re.search(r"(?i)token\S*\s*[:=]\s*(\S+)", stdout)
    if m:
        return m.group(1)
    candidates = re.findall(r"\b[A-Za-z0-9_\-\.]{24,}\b", stdout)
    assert candidates, f"no token found in: {stdout!r}"
    return candidates[-1]


class ComposeProcesses:
    """The compose services as processes on this machine."""

    def __init__(self, topology: ct.Topology, pg_url: str, tmp_path):
        self.topology = topology
        self.pg_url = pg_url
        self.tmp_path = tmp_path
        self.replicas: list[tuple[subprocess.Popen, int, object]] = []
        self.server_env: dict[str, str] = {}

    def service_env(self, name: str, data_dir) -> dict[str, str]:
        service = self.topology.services[name]
        env = _base_env(data_dir)
        env.update(service.environment)
        if "GRADWATCH_DATABASE_URL" in env:
            env["GRADWATCH_DATABASE_URL"] = ct.rewrite_database_url(
                env["GRADWATCH_DATABASE_URL"], self.topology.services["postgres"], self.pg_url)
        return env

    def run_to_completion(self, name: str) -> subprocess.CompletedProcess:
        service = self.topology.services[name]
        data_dir = self.tmp_path / f"{name}-data"
        data_dir.mkdir(exist_ok=True)
        return subprocess.run(ct.console_script(service.command), env=self.service_env(name, data_dir),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    def start_replicas(self, name: str) -> None:
        service = self.topology.services[name]
        container_port = service.container_port()
        assert container_port, f"{name} publishes no port"
        for i in range(service.replicas):
            port = free_port()
            data_dir = self.tmp_path / f"{name}-{i + 1}-data"
            data_dir.mkdir(exist_ok=True)
            env = self.service_env(name, data_dir)
            self.server_env = env
            argv = ct.rewrite_listen(ct.console_script(service.command), port)
            log = open(data_dir / "server.log", "wb")
            proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
            self.replicas.append((proc, port, data_dir / "server.log"))

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for _, port, _ in self.replicas]

    def healthcheck(self, name: str, index: int, **extra_env: str) -> subprocess.CompletedProcess:
        """The service's health check command, in the replica's environment (as docker runs it)."""
        service = self.topology.services[name]
        _, port, log = self.replicas[index]
        argv = ct.healthcheck_argv(service.healthcheck, service.container_port(), port)
        env = {**self.service_env(name, log.parent), **extra_env}
        return subprocess.run(argv, env=env, cwd=self.tmp_path, capture_output=True, text=True, timeout=30)

    def wait_healthy(self, name: str) -> None:
        for i, (proc, _, log) in enumerate(self.replicas):
            def ok(i=i, proc=proc, log=log):
                if proc.poll() is not None:
                    raise AssertionError(f"replica {i + 1} exited with {proc.returncode}:\n{log.read_text()}")
                return self.healthcheck(name, i).returncode == 0
            wait_until(ok, timeout=60, interval=0.3, what=f"replica {i + 1} health check")

    def stop(self) -> None:
        for proc, _, _ in self.replicas:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def compose(pg_url, tmp_path):
    topo = ct.load(env=COMPOSE_ENV)   # a clean shell: the file's own defaults
    procs = ComposeProcesses(topo, pg_url, tmp_path)
    yield procs
    procs.stop()


def test_compose_file_describes_postgres_migrations_and_replicas():
    topo = ct.load(env=COMPOSE_ENV)
    assert {"postgres", "migrate", "server"} <= set(topo.services)
    pg, migrate, server = (topo.services[n] for n in ("postgres", "migrate", "server"))
    # a named volume keeps the data; PostgreSQL has a health check the migration waits for
    volumes = [str(v).split(":")[0] for v in pg.spec.get("volumes", [])]
    assert volumes and all(v in (topo.raw.get("volumes") or {}) for v in volumes)
    assert pg.healthcheck and migrate.depends_on == {"postgres": "service_healthy"}
    # replicas start only after the migration finished, and are health-checked
    assert server.depends_on.get("migrate") == "service_completed_successfully"
    assert server.replicas >= 2 and server.healthcheck
    assert topo.start_order().index("migrate") < topo.start_order().index("server")
    # configuration by environment, shared by the migration and the replicas
    assert migrate.environment["GRADWATCH_DATABASE_URL"] == server.environment["GRADWATCH_DATABASE_URL"]
    assert server.environment["GRADWATCH_AUTH"] == "on"
    assert ct.load(env={**COMPOSE_ENV, "GRADWATCH_AUTH": "off"}).services["server"].environment["GRADWATCH_AUTH"] \
        == "off"
    # no cookie secret to configure: replicas share the key kept in the database (the topology
    # test logs in through one replica and is recognised by the other); one can be set
    assert server.environment["GRADWATCH_SESSION_SECRET"] == ""
    assert ct.load(env={**COMPOSE_ENV, "GRADWATCH_SESSION_SECRET": "s3cret"}).services["server"].environment[
        "GRADWATCH_SESSION_SECRET"] == "s3cret"
    # the health check covers the API and the dashboard (server/healthcheck.py), as the image's does
    assert server.healthcheck[:4] == ["CMD", "python", "-m", "gradwatch.server.healthcheck"]
    assert server.environment["GRADWATCH_HEALTHCHECK_TOKEN"] == ""
    assert "--migrate" not in server.command, "replicas must not migrate on their own; the migrate service does"


def test_compose_database_password_comes_from_the_environment():
    """No password in the file: PostgreSQL's and the servers' come from GRADWATCH_DB_PASSWORD, which is required."""
    text = ct.COMPOSE_FILE.read_text()
    assert "POSTGRES_PASSWORD: gradwatch" not in text and "gradwatch:gradwatch@" not in text
    for password in ("compose-test-password", "0f3a9c"):
        topo = ct.load(env={"GRADWATCH_DB_PASSWORD": password})
        assert topo.services["postgres"].environment["POSTGRES_PASSWORD"] == password
        for name in ("migrate", "server"):
            url = topo.services[name].environment["GRADWATCH_DATABASE_URL"]
            assert urlsplit(url).password == password, url
    for unset in ({}, {"GRADWATCH_DB_PASSWORD": ""}):
        with pytest.raises(ct.MissingVariable, match="GRADWATCH_DB_PASSWORD") as refused:
            ct.load(env=unset)
        assert "set GRADWATCH_DB_PASSWORD" in str(refused.value), "the message says what to do"


@pytest.mark.postgres
def test_compose_topology_runs_without_docker(compose):
    topo = compose.topology
    order = topo.start_order()
    assert order.index("postgres") < order.index("migrate") < order.index("server")

    # Before `migrate` has run on a database at an older schema (an upgrade of gradwatch), a replica
    # refuses to start and says what to do: why depends_on matters. (An empty database it would
    # simply give the schema, under PostgreSQL's advisory lock.)
    old = subprocess.run(ct.console_script(["gradwatch", "db", "upgrade", "--revision", "0005"]),
                         env=compose.service_env("migrate", compose.tmp_path), cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert old.returncode == 0, old.stderr
    proc = subprocess.run(
        ct.rewrite_listen(ct.console_script(topo.services["server"].command), free_port()),
        env=compose.service_env("server", compose.tmp_path), cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "gradwatch db upgrade" in proc.stdout + proc.stderr

    # migrate: the one-shot service's own command, to completion, exit 0
    done = compose.run_to_completion("migrate")
    assert done.returncode == 0, done.stdout + done.stderr

    # server: deploy.replicas processes with the service's command and environment; health checks pass
    compose.start_replicas("server")
    assert len(compose.replicas) == topo.services["server"].replicas >= 2
    compose.wait_healthy("server")
    urls = compose.urls()
    check = compose.healthcheck("server", 0)
    assert check.returncode == 0 and "api ok (postgresql)" in check.stdout, check.stdout + check.stderr
    # auth is on and no token is configured: the page is checked, the layout is behind the login
    assert "layout behind login" in check.stdout, check.stdout
    for url in urls:
        status, body = http_json("GET", url + "/api/health")
        assert status == 200 and body["database"] == "postgresql"

    project, run = "compose", f"topology-{uuid.uuid4().hex[:6]}"
    headers = {}
    if compose.server_env.get("GRADWATCH_AUTH") == "on":
        created = subprocess.run(ct.console_script(["gradwatch", "token", "create", "--project", project]),
                                 env=compose.server_env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
        assert created.returncode == 0, created.stdout + created.stderr
        headers = {"Authorization": f"Bearer {_token_from(created.stdout)}"}
        # with a project token the health check reads the dashboard's layout too
        for i in range(len(compose.replicas)):
            check = compose.healthcheck("server", i, GRADWATCH_HEALTHCHECK_TOKEN=_token_from(created.stdout))
            assert check.returncode == 0 and "layout ok" in check.stdout, check.stdout + check.stderr
        status, body = http_json("POST", urls[0] + "/api/v1/ingest", _batch(run, range(0, 1), project))
        assert status == 401, f"auth is on in the compose file: a batch without a token must be refused ({body})"

    # 12 batches of 25 steps: the first two race each other (both replicas create the run at once),
    # the rest alternate replicas; two are retried through the other replica.
    batches = [_batch(run, range(i * 25, (i + 1) * 25), project) for i in range(12)]
    results: list = [None, None]

    def send(i: int) -> None:
        results[i] = http_json("POST", urls[i % 2] + "/api/v1/ingest", batches[i], headers=headers)

    threads = [threading.Thread(target=send, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for status, body in results:
        assert status == 200 and body["accepted"] == 25 and body["duplicate"] is False, body
    run_ids = {results[0][1]["run_id"], results[1][1]["run_id"]}
    assert len(run_ids) == 1, f"both replicas must write into one run, got {run_ids}"
    for i in range(2, 12):
        status, body = http_json("POST", urls[i % 2] + "/api/v1/ingest", batches[i], headers=headers)
        assert status == 200 and body["duplicate"] is False, body
    for i in (3, 8):   # a retry that lands on the other replica is recognised
        status, body = http_json("POST", urls[(i + 1) % 2] + "/api/v1/ingest", batches[i], headers=headers)
        assert status == 200 and body["duplicate"] is True, body

    run_id = run_ids.pop()
    expected = {s["step"]: s["loss"] for b in batches for s in b["steps"]}
    for url in urls:   # every replica reads the same, complete data
        status, body = http_json("GET", f"{url}/api/v1/runs/{run_id}/series?signal=loss&max_points=100000",
                                 headers=headers)
        assert status == 200, body
        got = {p["step"]: float(p["last"]) for p in body["steps"]}
        assert got == pytest.approx(expected) and len(body["steps"]) == 300
        status, body = http_json("GET", f"{url}/api/v1/runs?project={project}", headers=headers)
        assert [r["last_step"] for r in body["runs"] if r["id"] == run_id] == [299]

    # in the database itself: each step stored once, each batch id once
    import psycopg

    with psycopg.connect(compose.pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        steps, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT step) FROM steps WHERE run_id = %s", (run_id,)).fetchone()
        n_batches = conn.execute("SELECT count(*) FROM ingest_batches WHERE run_id = %s", (run_id,)).fetchone()[0]
    assert (steps, distinct, n_batches) == (300, 300, 12)

    if headers:
        # a dashboard login made through one replica is honoured by the other (shared session secret)
        cookie = _login(urls[0], headers["Authorization"].split(" ", 1)[1])
        for url in urls[::-1]:
            status, location = _get_raw(url + "/api/v1/runs", cookie)
            assert status == 200, f"{url} refused the session cookie made by {urls[0]} ({status} {location})"

    # the health checks still answer after the load
    for i in range(len(compose.replicas)):
        assert compose.healthcheck("server", i).returncode == 0

    # a replica that is gone fails its health check, with one line saying why
    proc, _, _ = compose.replicas[-1]
    proc.terminate()
    proc.wait(timeout=15)
    check = compose.healthcheck("server", len(compose.replicas) - 1)
    assert check.returncode == 1 and check.stderr.count("\n") == 1 and "api: no answer" in check.stderr, check.stderr


def _login(url: str, token: str) -> str:
    """POST the dashboard's login form; the session cookie it sets."""
    import http.client
    from urllib.parse import urlencode, urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request("POST", "/login", body=urlencode({"token": token, "next": "/"}),
                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 303, f"login failed with {resp.status}"
    cookie = resp.getheader("Set-Cookie")
    conn.close()
    assert cookie
    return cookie.split(";", 1)[0]


def _get_raw(url: str, cookie: str) -> tuple[int, str]:
    """GET without following redirects (a redirect to /login means "not logged in")."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers={"Cookie": cookie})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, resp.getheader("Location") or ""


def test_docker_compose_accepts_the_file(tmp_path):
    """``docker compose config`` (or v1 ``docker-compose config``) validates the file without an engine."""
    candidates = []
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    if not candidates:
        missing_part("docker compose or docker-compose")
    shell = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    for tool in candidates:
        # without the database password the tool refuses the file and prints the file's message
        refused = subprocess.run([*tool, "-f", str(ct.COMPOSE_FILE), "config", "-q"], capture_output=True,
                                 text=True, cwd=tmp_path, timeout=60, env=shell)
        assert refused.returncode != 0 and "set GRADWATCH_DB_PASSWORD" in refused.stderr, refused.stderr
        env = {**shell, **COMPOSE_ENV}
        proc = subprocess.run([*tool, "-f", str(ct.COMPOSE_FILE), "config", "-q"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60, env=env)
        assert proc.returncode == 0, f"{' '.join(tool)} config rejected docker-compose.yml:\n{proc.stderr}"
        rendered = subprocess.run([*tool, "-f", str(ct.COMPOSE_FILE), "config"], capture_output=True, text=True,
                                  cwd=tmp_path, timeout=60, env=env)
        assert rendered.returncode == 0
        # the tool resolves the anchors and defaults the same way the topology test does
        import yaml

        tool_view = yaml.safe_load(rendered.stdout)["services"]["server"]["environment"]
        ours = ct.load(env=env).services["server"]
        for key in ("GRADWATCH_DATABASE_URL", "GRADWATCH_AUTH", "GRADWATCH_SESSION_SECRET", "GRADWATCH_PUBLIC_URL",
                    "GRADWATCH_HEALTHCHECK_TOKEN"):
            assert tool_view[key] == ours.environment[key], key
        pg_view = yaml.safe_load(rendered.stdout)["services"]["postgres"]["environment"]
        assert pg_view["POSTGRES_PASSWORD"] == COMPOSE_ENV["GRADWATCH_DB_PASSWORD"]
        assert yaml.safe_load(rendered.stdout)["services"]["server"]["healthcheck"]["test"] == \
            ours.spec["healthcheck"]["test"]
