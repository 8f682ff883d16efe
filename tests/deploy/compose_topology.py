"""Read docker-compose.yml and turn its services into local processes (no Docker engine needed).

What the file says is what runs: the services, their order (``depends_on``
conditions), each service's ``command`` and ``environment`` (with compose's
``${VAR:-default}`` interpolation), the replica count and the health checks.
Only what cannot exist outside containers is rewritten: service host names
and container ports become 127.0.0.1 and free ports, the ``postgres`` service
is a fresh database on the local PostgreSQL, and the image's ``gradwatch``
console script is ``python -m gradwatch.server`` (the same ``gradwatch.server.cli:main``).
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional
from urllib.parse import urlsplit, urlunsplit

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(ValueError):
    """``${VAR:?message}`` with VAR unset: compose refuses the file with that message."""


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose variable substitution: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}``, ``${VAR?error}``, ``$VAR``, ``$$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        if op in (":?", "?"):
            value = env.get(name)
            if value is None or (op == ":?" and value == ""):
                raise MissingVariable(f"{name}: {default}")
            return value
        return env.get(name, "")

    return _VAR.sub(sub, value)


def _environment(raw: Any) -> dict[str, str]:
    if raw is None:
        return {}
    if isinstance(raw, list):
        out = {}
        for item in raw:
            key, _, val = str(item).partition("=")
            out[key] = val
        return out
    return {str(k): "" if v is None else str(v) for k, v in raw.items()}


def _command(raw: Any) -> list[str]:
    if raw is None:
        return []
    return shlex.split(raw) if isinstance(raw, str) else [str(x) for x in raw]


@dataclass
class Service:
    name: str
    spec: dict
    environment: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)

    @property
    def depends_on(self) -> dict[str, str]:
        deps = self.spec.get("depends_on") or {}
        if isinstance(deps, list):
            return {d: "service_started" for d in deps}
        return {k: (v or {}).get("condition", "service_started") for k, v in deps.items()}

    @property
    def replicas(self) -> int:
        return int(((self.spec.get("deploy") or {}).get("replicas")) or 1)

    @property
    def healthcheck(self) -> list[str]:
        return _command((self.spec.get("healthcheck") or {}).get("test"))

    def container_port(self) -> Optional[int]:
        """The port the service listens on inside its container (right side of ``ports``)."""
        for p in self.spec.get("ports") or []:
            return int(str(p).rsplit(":", 1)[-1].split("/")[0])
        return None


@dataclass
class Topology:
    raw: dict
    services: dict[str, Service]

    def start_order(self) -> list[str]:
        """Services in an order that satisfies every ``depends_on`` (compose's own start order)."""
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in order:
                return
            assert name not in visiting, f"depends_on cycle through {name}"
            visiting.add(name)
            for dep in self.services[name].depends_on:
                assert dep in self.services, f"{name} depends on unknown service {dep}"
                visit(dep)
            order.append(name)

        for name in self.services:
            visit(name)
        return order


def load(env: Optional[Mapping[str, str]] = None, path: Path = COMPOSE_FILE) -> Topology:
    """Parse the compose file the way ``docker compose`` does (YAML anchors, interpolation)."""
    env = os.environ if env is None else env
    raw = yaml.safe_load(path.read_text())
    raw = interpolate(raw, env)
    services = {}
    for name, spec in (raw.get("services") or {}).items():
        services[name] = Service(name, spec, _environment(spec.get("environment")), _command(spec.get("command")))
    return Topology(raw, services)


def console_script(argv: list[str]) -> list[str]:
    """``gradwatch …`` as the image runs it → this interpreter running the same entry point."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv and argv[0] in scripts, f"command {argv} does not start with a console script of this project"
    assert scripts[argv[0]] == "gradwatch.server.cli:main", "python -m gradwatch.server runs gradwatch.server.cli:main"
    return [sys.executable, "-m", "gradwatch.server", *argv[1:]]


def rewrite_listen(argv: list[str], port: int) -> list[str]:
    """``--host 0.0.0.0 --port 8470`` (container) → ``--host 127.0.0.1 --port <port>``."""
    out = list(argv)
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port))):
        assert flag in out, f"the server command {argv} sets no {flag}"
        out[out.index(flag) + 1] = value
    return out


def rewrite_database_url(compose_url: str, postgres: Service, local_url: str) -> str:
    """The compose URL must point at the ``postgres`` service with its credentials; run it on ``local_url``."""
    parts = urlsplit(compose_url)
    pg_env = postgres.environment
    assert parts.hostname == postgres.name, f"database host {parts.hostname!r} is not the {postgres.name!r} service"
    assert parts.port in (None, 5432)
    assert parts.username == pg_env.get("POSTGRES_USER"), "database user differs from POSTGRES_USER"
    assert parts.password == pg_env.get("POSTGRES_PASSWORD"), "database password differs from POSTGRES_PASSWORD"
    assert parts.path.lstrip("/") == pg_env.get("POSTGRES_DB"), "database name differs from POSTGRES_DB"
    local = urlsplit(local_url)
    return urlunsplit((parts.scheme, local.netloc, local.path, parts.query, parts.fragment))


def healthcheck_argv(test: list[str], container_port: int, port: int) -> list[str]:
    """A ``CMD`` health check with the container's port and ``python`` mapped to this machine."""
    assert test and test[0] == "CMD", f"expected an exec-form CMD health check, got {test}"
    argv = [a.replace(f"127.0.0.1:{container_port}", f"127.0.0.1:{port}")
            .replace(f"localhost:{container_port}", f"127.0.0.1:{port}") for a in test[1:]]
    if argv[0] == "python":
        argv[0] = sys.executable
    return argv
