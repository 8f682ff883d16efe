"""``GET /metrics`` carries per-run health for Prometheus / Alertmanager, from the shared database."""
from __future__ import annotations

import math
import re
import urllib.request
import uuid

from tests.conftest import create_token, wait_until

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, token: str = "") -> tuple[dict[tuple, float], str]:
    """Parse the text exposition format strictly enough to catch a malformed line."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: dict[tuple, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"malformed sample line: {line!r}"
        name, _, labels, value = m.groups()
        key = (name, tuple(sorted(_LABEL.findall(labels or ""))))
        assert key not in samples, f"duplicate sample {line!r}"
        samples[key] = float(value.replace("+Inf", "inf").replace("-Inf", "-inf"))
    return samples, text


def _batch(run: str, steps: list[dict]) -> dict:
    return {"batch_id": uuid.uuid4().hex, "project": "ops", "run": run, "rank": 0, "world_size": 1, "steps": steps}


def test_metrics_expose_open_alerts_last_step_and_loss_per_run(server_factory, db_url):
    srv = server_factory(db_url)
    healthy, broken = f"healthy-{uuid.uuid4().hex[:4]}", f"broken-{uuid.uuid4().hex[:4]}"
    ok = [{"step": i, "time": 1e9 + i, "loss": 1.0 - 0.01 * i, "grad_norm": 0.5, "lr": 1e-3} for i in range(20)]
    assert srv.post("/api/v1/ingest", _batch(healthy, ok))[0] == 200
    bad = [dict(s) for s in ok]
    bad[-1]["loss"] = "NaN"                      # A1 loss_nonfinite: critical
    status, body = srv.post("/api/v1/ingest", _batch(broken, bad))
    assert status == 200, body

    def a1_open():
        return srv.get(f"/api/v1/alerts?run={body['run_id']}&status=firing")[1]["alerts"]
    alerts = wait_until(a1_open, what="the A1 alert")
    a1 = next(a for a in alerts if a["rule"] == "A1")

    samples, text = scrape(srv.url)
    lbl = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert samples[("gradwatch_run_open_alerts",
                    lbl(project="ops", run=broken, rule="A1", name=a1["name"], severity=a1["severity"]))] == 1
    assert samples[("gradwatch_run_health", lbl(project="ops", run=broken))] == 2
    assert samples[("gradwatch_run_health", lbl(project="ops", run=healthy))] == 0
    assert not any(k[0] == "gradwatch_run_open_alerts" and ("run", healthy) in k[1] for k in samples)
    assert samples[("gradwatch_run_last_step", lbl(project="ops", run=healthy))] == 19
    assert samples[("gradwatch_run_last_loss", lbl(project="ops", run=healthy))] == 1.0 - 0.19
    assert math.isnan(samples[("gradwatch_run_last_loss", lbl(project="ops", run=broken))])
    assert samples[("gradwatch_run_status", lbl(project="ops", run=healthy, status="running"))] == 1
    assert samples[("gradwatch_run_status", lbl(project="ops", run=healthy, status="finished"))] == 0
    assert "# TYPE gradwatch_run_open_alerts gauge" in text

    # a run that finishes cleanly reads as finished; its firing alerts stay visible until resolved
    status, _ = srv.post("/api/v1/ingest", {**_batch(broken, []), "status": "finished"})
    assert status == 200
    samples, _ = scrape(srv.url)
    assert samples[("gradwatch_run_status", lbl(project="ops", run=broken, status="finished"))] == 1
    assert samples[("gradwatch_run_health", lbl(project="ops", run=broken))] == 2


def test_label_values_are_escaped(server_factory, sqlite_url):
    srv = server_factory(sqlite_url)
    name = 'odd "run" \\ name'
    assert srv.post("/api/v1/ingest", _batch(name, [{"step": 0, "time": 1e9, "loss": 2.0}]))[0] == 200
    samples, _ = scrape(srv.url)
    assert samples[("gradwatch_run_last_step", (("project", "ops"), ("run", 'odd \\"run\\" \\\\ name')))] == 0


def test_with_auth_on_run_names_and_losses_need_a_project_token(server_factory, db_url, tmp_path):
    """Hostile-input report: /metrics served every project's run names and last losses to anyone."""
    srv = server_factory(db_url, env={"GRADWATCH_AUTH": "on"})
    ops, other = create_token(db_url, "ops"), create_token(db_url, "secret-lab")
    steps = [{"step": i, "time": 1e9 + i, "loss": 1.0, "grad_norm": 0.5} for i in range(3)]
    for token, project, run in ((ops, "ops", "visible"), (other, "secret-lab", "hidden-run")):
        status, body = srv.post("/api/v1/ingest", {**_batch(run, steps), "project": project},
                                headers={"Authorization": f"Bearer {token}"})
        assert status == 200, body
    samples, text = scrape(srv.url)
    assert "gradwatch_ingest_batches_total" in text                       # the counts stay open
    assert not any(k[0].startswith("gradwatch_run_") for k in samples)
    assert "hidden-run" not in text and "visible" not in text
    samples, text = scrape(srv.url, token=ops)
    assert samples[("gradwatch_run_last_step", (("project", "ops"), ("run", "visible")))] == 2
    assert "hidden-run" not in text and "secret-lab" not in text
