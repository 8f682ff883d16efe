"""A compacted run's page in headless Chromium: its charts and heatmap still draw, from the rollups, with
the values the run sent (server/lifecycle/retention.py; the job in a real ``gradwatch serve``)."""
from __future__ import annotations

import math

import pytest
from sqlalchemy import func, select

from gradwatch.server.storage.db import open_database
from gradwatch.server.storage.models import Step
from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, approx_list, graph, severe_console_entries, trace, wait_trace
from tests.dashboard.runs_feed import PARAM_NAMES, ingest, make_steps

pytestmark = pytest.mark.browser


def _metric(srv, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_compacted_run_page_draws_from_rollups(server_factory, sqlite_url, tmp_path, browser):
    policy = tmp_path / "retention.toml"
    policy.write_text("[projects.archive.retention]\nraw_days = 0\nlayer_level = 256\n")
    srv = server_factory(sqlite_url, env={"GRADWATCH_RETENTION": str(policy), "GRADWATCH_RETENTION_INTERVAL": "0.5"})
    steps = make_steps(300, layers_every=10, t0=1_700_000_000.0)
    steps[120]["loss"] = "NaN"
    run_id = ingest(srv, project="archive", run="old", steps=steps, status="finished", batch=50)

    def compacted():
        database = open_database(sqlite_url)
        try:
            with database.sessionmaker() as s:
                return s.scalar(select(func.count()).where(Step.run_id == run_id, Step.step < 288)) == 0
        finally:
            database.dispose()

    wait_until(lambda: _metric(srv, "gradwatch_retention_passes_total") >= 1 and compacted(), timeout=60,
               what="the run compacted")

    browser.get(f"{srv.url}/runs/{run_id}")
    # 16-step buckets now (the raw steps are gone): each bucket drawn as (start, max), (start + 8, min)
    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) >= 30, what="loss drawn")
    want_x, want_y = [], []
    for b in range(0, 300, 16):
        vals = [steps[i]["loss"] for i in range(b, min(b + 16, 300)) if steps[i]["loss"] != "NaN"]
        want_x += [b, b + 8]
        want_y += [max(vals), min(vals)]
    assert loss["x"] == want_x
    assert approx_list(loss["y"], want_y)
    assert trace(graph(browser, "run-graph-loss"), "NaN / Inf")["x"] == [112]      # the NaN step's bucket
    grad = wait_trace(browser, "run-graph-grad_norm", "grad norm", lambda t: len(t["x"]) >= 30, what="grad norm")
    assert grad["x"][:2] == [0, 8]
    g0 = [steps[i]["grad_norm"] for i in range(16)]
    assert approx_list(grad["y"][:2], [max(g0), min(g0)])

    # the grad-norm heatmap: one column per kept level-256 bucket, its cells the max of the sampled steps
    heat = wait_until(lambda: (g := graph(browser, "run-heatmap-grad_norm")) and g["data"] and g["data"][0].get("y")
                      and g, timeout=WAIT, what="grad-norm heatmap")
    cell = heat["data"][0]
    assert cell["y"] == PARAM_NAMES
    assert cell["x"][0] == 0 and len(cell["x"]) == 2
    top = max(steps[i]["layers"]["grad_norm"][2] for i in range(0, 256, 10))
    assert math.isclose(cell["z"][2][0], math.log10(top), rel_tol=1e-5)
    save_screenshot(browser, "retention-compacted-run-page")
    assert severe_console_entries(browser) == []
