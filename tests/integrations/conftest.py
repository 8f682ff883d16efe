"""A real gradwatch server (SQLite) shared by the integration tests of one module, and readers for it."""
from __future__ import annotations

import importlib
import math
import os
import uuid

# Tests build tiny models from configs; nothing may be fetched from a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from tests.conftest import IN_CI, LiveServer, start_sqlite_server


def require(module: str):
    """Import a framework a test module drives: skip the module without it, fail under CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError:
        what = f"{module} (pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(f"{what} is required when CI=true", pytrace=False)
        pytest.skip(f"{what} not available", allow_module_level=True)


@pytest.fixture(scope="module")
def gw_server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("gw-server"))
    yield srv
    srv.stop()


@pytest.fixture
def run_name(request) -> str:
    return f"{request.node.name}-{uuid.uuid4().hex[:6]}".replace("[", "-").replace("]", "")


def run_of(server: LiveServer, project: str, name: str) -> dict:
    status, body = server.get(f"/api/v1/runs?project={project}&name={name}")
    assert status == 200, body
    runs = [r for r in body["runs"] if r["name"] == name]
    assert len(runs) == 1, f"expected one run {project}/{name}, got {body}"
    return runs[0]


def series(server: LiveServer, run_id: int, signal: str) -> dict[int, float | None]:
    """step -> value at full resolution (wire strings turned back into floats)."""
    status, body = server.get(f"/api/v1/runs/{run_id}/series?signal={signal}&max_points=100000")
    assert status == 200, body
    assert body["bucket_size"] == 1
    out = {}
    for p in body["steps"]:
        v = p["last"]
        out[p["step"]] = None if v is None else float(v)
    return out


def assert_close(actual: list[float], expected: list[float], rel: float = 1e-5, what: str = "values") -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} values, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a is not None and math.isclose(a, e, rel_tol=rel, abs_tol=1e-7), \
            f"{what}[{i}]: gradwatch has {a}, the framework {e}\n  gradwatch: {actual}\n  framework: {expected}"
