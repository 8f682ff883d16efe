"""Shared fixtures: real servers, real databases, a real webhook receiver, a real browser.

Nothing here is mocked. A server is a real ``python -m gradwatch.server serve`` process
on 127.0.0.1; SQLite is a file under the test's tmp dir; PostgreSQL is the
server on this machine with a fresh database per test; the browser is Debian's
headless Chromium. PostgreSQL and Chromium tests skip on a machine without
them, except under ``CI=true`` where a missing part is a failure.
"""
from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

# Tiny models train fastest on one thread, and every test shares two cores with
# the server processes it starts: more torch threads only oversubscribe them.
# Set before torch is imported; inherited by the processes tests start.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

IN_CI = os.environ.get("CI", "").lower() == "true"
REPO_ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN_URL = os.environ.get("GRADWATCH_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
ARTIFACTS = REPO_ROOT / "test-artifacts"


def missing_part(what: str) -> None:
    """Skip on a user's machine; fail under CI, where every part must be there."""
    if IN_CI:
        pytest.fail(f"{what} is required when CI=true")
    pytest.skip(f"{what} not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every wait's limit is multiplied by this. A wait's limit only bounds how long a broken test hangs
# before it fails; it asserts nothing about speed (timing targets are measured in bench/). A CI machine
# running several jobs on its 2 cores can take several times as long as a quiet one, so the limits
# carry that much room. GRADWATCH_TEST_SLACK=1 gives the written limits.
WAIT_SLACK = float(os.environ.get("GRADWATCH_TEST_SLACK", "3"))


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; return that value. ``timeout`` is scaled
    by :data:`WAIT_SLACK`."""
    timeout *= WAIT_SLACK
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def http_json(method: str, url: str, body: Any = None, headers: Optional[dict] = None, timeout: float = 10.0):
    """Tiny HTTP client: returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        raw = e.read()
        status = e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


# --------------------------------------------------------------------------- databases

@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gradwatch.db'}"


def _pg_connect(url: str):
    try:
        import psycopg
    except ImportError:
        missing_part("psycopg")
    try:
        return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True, connect_timeout=3)
    except Exception as e:  # noqa: BLE001 - any connection failure means "no PostgreSQL here"
        missing_part(f"PostgreSQL at {url} ({e})")


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test, dropped afterwards."""
    admin = _pg_connect(PG_ADMIN_URL)
    name = f"gw_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    try:
        yield f"postgresql+psycopg://{base.split('://', 1)[1]}/{name}"
    finally:
        # Servers of the test may still be up (pytest tears this fixture down before a
        # server_factory requested earlier) and reconnect at any moment: FORCE terminates
        # their sessions and drops in one statement (PostgreSQL 13+).
        if admin.info.server_version >= 130000:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        else:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.close()


@pytest.fixture
def pg_admin_url() -> str:
    """The PostgreSQL database the per-test databases are created from (``GRADWATCH_TEST_PG``)."""
    return PG_ADMIN_URL


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    """Parametrises a test over both supported databases."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


# --------------------------------------------------------------------------- servers

@dataclass
class LiveServer:
    """A real ``gradwatch serve`` process on 127.0.0.1."""

    db_url: str
    data_dir: Path
    port: int
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: Optional[subprocess.Popen] = None
    log_path: Optional[Path] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"GRADWATCH_DATA_DIR": str(self.data_dir), "PYTHONUNBUFFERED": "1"})
        env.update(self.env)
        return env

    def migrate(self) -> None:
        """Bring the database to the head revision with the real Alembic migrations, in this process.

        Not a ``gradwatch db upgrade`` subprocess: that paid a Python start and gradwatch's imports
        (1.7 s on a quiet machine, 4-5 s under load) before every one of the suite's ~200 server
        starts, to run the same :func:`gradwatch.server.storage.db.upgrade` this calls (0.2-0.9 s; see
        docs/testing.md "Cuts"). The CLI path itself is tested for real on both databases in
        tests/cli/test_cli_serve_db.py and tests/server/test_server_cli.py.
        """
        from gradwatch.server.storage.db import upgrade

        upgrade(self.db_url)

    def start(self, timeout: float = 30.0) -> "LiveServer":
        self.log_path = self.data_dir / f"server-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gradwatch.server", "serve", "--db", self.db_url,
             "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=self._env(), cwd=REPO_ROOT,
        )

        def healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                status, _ = http_json("GET", self.url + "/api/health", timeout=1)
                return status == 200
            except OSError:
                return False

        wait_until(healthy, timeout=timeout, interval=0.1, what="server health")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Hard stop, as a crash or an OOM kill would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def get(self, path: str, **kw):
        return http_json("GET", self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw):
        return http_json("POST", self.url + path, body, **kw)


def create_token(db_url: str, project: str) -> str:
    """A project API token, made in this process by the function ``gradwatch token create`` calls.

    :func:`gradwatch.server.access.tokens.create_token` in a write session, committed, on the test's real
    database: the same rows the command writes. Not the command itself: a subprocess paid a Python
    start and gradwatch's imports (4-5 s under load) for each of 36 tokens a run, in tests whose
    subject is what the server does with a token, not how the operator makes it (docs/testing.md
    "Cuts"). The command is run for real by :func:`create_token_with_cli`, in
    tests/server/test_server_auth.py on both databases, and in tests/cli and tests/deploy.
    """
    from gradwatch.server.storage.db import open_database, prepare_schema
    from gradwatch.server.access.tokens import create_token as make

    # as the command does (server/cli.py _token_db): an empty database is given the schema first
    prepare_schema(db_url, upgrade_old=False)
    database = open_database(db_url)
    try:
        with database.write_sessionmaker() as session:
            token = make(session, project=project)
            session.commit()
    finally:
        database.dispose()
    assert token.startswith("gw_") and len(token) > 30
    return token


def create_token_with_cli(db_url: str, project: str, data_dir) -> str:
    """A project API token, made as an operator makes one: a ``gradwatch token create`` process."""
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(data_dir))
    out = subprocess.run([sys.executable, "-m", "gradwatch.server", "token", "create", "--project", project, "--db", db_url],
                         check=True, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60)
    token = out.stdout.strip()
    assert token.startswith("gw_") and len(token) > 30
    return token


def start_sqlite_server(data_dir: Path) -> LiveServer:
    """A migrated, started server on a SQLite file in ``data_dir`` (for wider-scoped fixtures)."""
    srv = LiveServer(db_url=f"sqlite:///{data_dir / 'gradwatch.db'}", data_dir=data_dir, port=free_port())
    srv.migrate()
    return srv.start()


@pytest.fixture
def server_factory(tmp_path: Path, request) -> Iterator[Callable[..., LiveServer]]:
    """Start real servers: ``server_factory(db_url, extra_args=[...], env={...})``. A failing test's
    report ends with each server's log tail (``pytest_runtest_makereport``): a race seen once in a
    full run is gone from tmp by the time anyone reads the CI output."""
    started: list[LiveServer] = []
    request.node._gradwatch_servers = started

    def make(db_url: str, extra_args: Optional[list[str]] = None, env: Optional[dict] = None,
             port: Optional[int] = None, migrate: bool = True) -> LiveServer:
        data_dir = tmp_path / f"server-data-{len(started)}"
        data_dir.mkdir(exist_ok=True)
        srv = LiveServer(db_url=db_url, data_dir=data_dir, port=port or free_port(),
                         extra_args=list(extra_args or []), env=dict(env or {}))
        if migrate:
            srv.migrate()
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()


SERVER_LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for i, srv in enumerate(getattr(item, "_gradwatch_servers", ())):
        tail = "\n".join(srv.log().splitlines()[-SERVER_LOG_TAIL_LINES:])
        report.sections.append((f"server {i} log (last {SERVER_LOG_TAIL_LINES} lines)", tail or "(empty)"))


@pytest.fixture
def live_server(server_factory, db_url) -> LiveServer:
    """A server on each database in turn."""
    return server_factory(db_url)


# --------------------------------------------------------------------------- webhook receiver

@dataclass
class Received:
    time: float            # time.time() when the request arrived
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class WebhookReceiver:
    """A real HTTP server on 127.0.0.1 that records every POST.

    ``status`` can be set to make it answer errors (a receiver that is down
    for a while is ``stop()`` then ``start()`` again on the same port); ``reply_delay`` seconds make
    it a slow one (it records the request on arrival, then waits before answering).
    """

    def __init__(self, port: Optional[int] = None):
        self.port = port or free_port()
        self.received: list[Received] = []
        self.status = 200
        self.reply_delay = 0.0
        self._lock = threading.Lock()
        self._server: Optional[http.server.ThreadingHTTPServer] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> "WebhookReceiver":
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with receiver._lock:
                    status = receiver.status
                    if status < 300:
                        receiver.received.append(
                            Received(time.time(), self.path, {k: v for k, v in self.headers.items()}, body)
                        )
                if receiver.reply_delay:
                    time.sleep(receiver.reply_delay)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="webhook-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def bodies(self) -> list[Any]:
        with self._lock:
            return [r.json() for r in self.received]

    def wait_for(self, predicate: Callable[[Received], bool], timeout: float = 10.0) -> Received:
        def find():
            with self._lock:
                return next((r for r in self.received if predicate(r)), None)
        return wait_until(find, timeout=timeout, what="webhook delivery")


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    r = WebhookReceiver().start()
    yield r
    r.stop()


# --------------------------------------------------------------------------- browser

def _find_chromium() -> tuple[Optional[str], Optional[str]]:
    browser = next((p for p in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser"),
                                shutil.which("google-chrome")) if p and os.path.exists(p)), None)
    driver = next((p for p in ("/usr/bin/chromedriver", shutil.which("chromedriver")) if p and os.path.exists(p)), None)
    return browser, driver


@pytest.fixture
def browser(tmp_path: Path):
    """Headless Chromium driven by Selenium through Debian's chromedriver."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing_part("selenium")
    binary, driver_path = _find_chromium()
    if not binary or not driver_path:
        missing_part("chromium and chromedriver (apt-get install -y chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-dev-shm-usage", "--disable-component-update", "--disable-sync", "--no-first-run",
                "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


def save_screenshot(drv, name: str) -> Path:
    """Screenshots are test artifacts under test-artifacts/ (ignored by git)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    drv.save_screenshot(str(path))
    return path


@pytest.fixture(autouse=True)
def isolated_agent_spool(tmp_path: Path, monkeypatch) -> Path:
    """Each test gets its own agent spool (inherited by the processes it starts).

    The default spool under ~/.cache is replayed into whatever server answers
    next: a leftover from an earlier test must never leak into this one.
    """
    spool = tmp_path / "agent-spool"
    monkeypatch.setenv("GRADWATCH_SPOOL_DIR", str(spool))
    return spool
