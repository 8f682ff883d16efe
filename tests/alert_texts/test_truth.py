"""The truth check (tests/alert_texts/truth.py) over every alert of real runs: the README demo, the scenario
suite's runs (tests/scenarios, reused read-only: the same loops, run here against a server of this test's
own) and a small fp16 loop of a user's own (clipping at 1.0, a GradScaler that skips the poisoned step).

Each run's alerts are read back through the public API and every text is checked against the stored data;
the test lists every lie it found. ``check_run`` is also exercised on texts known to lie (the ones issue 42
reported), so that the check itself cannot pass by checking nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.alert_texts.truth import RunData, api_getter, check_alert, check_run
from tests.conftest import REPO_ROOT, LiveServer, free_port, wait_until


def _run_id(get, project: str, name: str) -> int:
    def find():
        runs = get(f"/api/v1/runs?project={project}")["runs"]
        return next((r["id"] for r in runs if r["name"] == name), None)
    return wait_until(find, timeout=30, what=f"run {name}")


def test_the_demo_tells_the_truth(tmp_path):
    """`gradwatch demo` as the README runs it (600 steps: a bad batch at 240, a NaN loss from 400 on), then
    its database served and read back."""
    port = free_port()
    env = dict(os.environ, GRADWATCH_DATA_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "gradwatch.server", "demo", "--port", str(port), "--steps", "600",
                           "--step-delay", "0", "--exit-after-run"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)   # a bound that only catches a hang
    assert proc.returncode == 0, proc.stdout + proc.stderr
    srv = LiveServer(db_url=f"sqlite:///{tmp_path / 'gradwatch.db'}", data_dir=tmp_path, port=free_port())
    srv.start()
    try:
        get = api_getter(srv.url)
        runs = get("/api/v1/runs?project=demo")["runs"]
        assert len(runs) == 1
        alerts = get(f"/api/v1/alerts?run={runs[0]['id']}")["alerts"]
        assert {"A1", "A2", "A3", "A5", "B3", "C3"} <= {a["rule"] for a in alerts}, alerts
        problems = check_run(get, runs[0]["id"])
    finally:
        srv.stop()
    assert not problems, "\n".join(problems)


def _user_fp16_loop():
    """A user's small fp16 loop (issue 42): autocast fp16, a GradScaler, clipping at 1.0, an EMA; at step 80
    a batch whose labels are 1e4 times too large: the loss spikes and the fp16 gradients overflow, so the
    scaler skips that step."""
    from tests.scenarios.training import Loop, mlp, regression_data

    torch.manual_seed(42)
    data = regression_data(42)

    def batch(step):
        x, y = data(step)
        return (x * 300.0, y * 1e4) if step == 80 else (x, y)
    model = mlp()
    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, F.mse_loss, steps=140,
                amp=torch.float16, clip=1.0)


@pytest.fixture(scope="module")
def suite_server(tmp_path_factory):
    from tests.scenarios.test_scenarios import RULES_FILE

    tmp = tmp_path_factory.mktemp("truth")
    rules = tmp / "rules.toml"
    rules.write_text(RULES_FILE)
    srv = LiveServer(db_url=f"sqlite:///{tmp / 'truth.db'}", data_dir=tmp, port=free_port(),
                     extra_args=["--rules", str(rules)])
    srv.migrate()
    srv.start()
    yield srv
    srv.stop()


def _suite() -> list[tuple[str, str, object]]:
    from tests.scenarios.test_scenarios import SCENARIOS

    return [(s.name, s.project, s.build) for s in SCENARIOS] + [("user_fp16_loop", "users", _user_fp16_loop)]


SUITE = _suite()


@pytest.mark.parametrize("name,project,build", SUITE, ids=[name for name, _, _ in SUITE])
def test_every_alert_of_the_scenario_suite_and_a_users_fp16_loop_tells_the_truth(suite_server, name, project, build):
    """One real run each (the scenario suite's loops, and the user's fp16 loop), its alerts checked."""
    get = api_getter(suite_server.url)
    build().run(server=suite_server.url, project=project, run=name)
    rid = _run_id(get, project, name)
    problems = check_run(get, rid)
    assert not problems, "\n".join(problems)
    if name == "user_fp16_loop":
        # the issue's case is there: a loss spike on a step the scaler skipped, told so
        c3 = [a for a in get(f"/api/v1/alerts?run={rid}")["alerts"] if a["rule"] == "C3"]
        assert c3 and c3[0]["evidence"].get("skipped") is True, c3


# --------------------------------------------------------------------------- the check catches the lies

class _Fake:
    """Stored facts for the texts below, in the shape RunData reads (the real data the issue's run had)."""

    def __init__(self, series: dict, setup: dict, timeline=(), rewinds=()):
        self.series, self.timeline, self.rewinds = series, list(timeline), list(rewinds)
        self.setup = setup

    def __call__(self, path: str):
        if path.endswith("/rewinds"):
            return {"rewinds": self.rewinds}
        if path.endswith("/events"):
            return {"events": [{"kind": "run_setup", "data": self.setup}]}
        if "/incident" in path:
            return {"timeline": self.timeline}
        q = dict(kv.split("=") for kv in path.split("?", 1)[1].split("&"))
        start, end = int(q["start"]), int(q["end"])
        values = self.series.get(q["signal"], {})
        return {"steps": [{"step": s, "min": v, "max": v, "last": v, "count": 1, "nonfinite": 0}
                          for s, v in sorted(values.items()) if start <= s <= end]}


def _alert(**kw):
    base = dict(id=9, rule="X", name="x", severity="critical", status="firing", rank=0, first_step=400,
                last_step=400, message="", diagnosis="", actions=[], evidence={})
    base.update(kw)
    return base


def test_the_check_catches_each_lie_issue_42_reported():
    facts = _Fake({"loss_scale": {403: 8192.0, 599: 0.00390625}, "clip_max_norm": {240: 1.0, 400: 1.0},
                   "overflow": {100: 1.0}, "grad_norm": {399: 0.1594}},
                  setup={"clip": {"max_norm": 1.0}, "ema": {"class": "EMA"}})
    run = RunData(facts, 1)
    earlier = _alert(id=1, rule="A2", name="grad_explosion", first_step=240, last_step=240)
    cases = {
        "nothing drifted": _alert(diagnosis="The loss became NaN.\n\nWhat deviated first: no signal left its normal "
                                            "band in the 200 steps before the NaN loss (a sudden failure: nothing "
                                            "drifted before it)."),
        "normal and exploded": _alert(actions=["Grad norm was normal before the NaN: check the loss computation.",
                                               "Grad norm exploded first: enable gradient clipping (max_norm=1.0)."]),
        "clip on": _alert(rule="A2", first_step=240, last_step=240,
                          actions=["Enable gradient clipping: clip_grad_norm_(..., max_norm=1.0)."]),
        "skipped step": _alert(rule="C3", first_step=100, last_step=100, severity="warning",
                               actions=["A single spike: consider rolling back to the checkpoint before it and "
                                        "skipping that batch."]),
        "stale now": _alert(rule="B3", first_step=403, last_step=599,
                            message="Loss scale halved 3 times with no growth (now 8192)"),
        "wrong last grad norm": _alert(diagnosis="The gradient norm exploded first (last grad norm 12.5, 90x its "
                                                 "median 0.13), then the loss became NaN/Inf."),
        "EMA present": _alert(actions=["Add an EMA of the weights."]),
    }
    for what, alert in cases.items():
        found = check_alert(run, alert, [earlier, alert])
        assert found, f"the truth check missed: {what}"
    true = _alert(rule="B3", first_step=403, last_step=599, message="Loss scale 8192 at step 403")
    assert check_alert(run, true, [true]) == []


def test_the_check_catches_a_rewind_told_wrong():
    """Issue 44: what the alert says the Rewind policy did is the stored rewind (``/rewinds``)."""
    stored = {"step": 412, "action": "rewind", "from_step": 412, "to_step": 300, "batches_skipped": 112,
              "lr_factor": 0.5, "cool_steps": 200, "trigger": {"alert_id": 9}}
    run = RunData(_Fake({}, setup={}, rewinds=[stored]), 1)
    acted = "Acted on at step 412 by the Rewind policy: rewound to step {to}, skipped {k} batches, LR ×{f} for " \
            "{c} steps (rewind 1 of 3)."
    cases = {
        "wrong target": _alert(actions=[acted.format(to=250, k=112, f=0.5, c=200)]),
        "wrong count": _alert(actions=[acted.format(to=300, k=100, f=0.5, c=200)]),
        "wrong LR": _alert(actions=[acted.format(to=300, k=112, f=0.25, c=200)]),
        "no such rewind": _alert(actions=[acted.format(to=300, k=112, f=0.5, c=200).replace("412", "500")]),
        "not said": _alert(actions=["Lower the LR."]),
    }
    for what, alert in cases.items():
        assert check_alert(run, alert, [alert]), f"the truth check missed: {what}"
    true = _alert(actions=[acted.format(to=300, k=112, f=0.5, c=200), "Lower the LR."])
    assert check_alert(run, true, [true]) == []
    # a rewind whose own numbers disagree (skipped 100 of a 112-step rewind) is a lie even if the alert copies it
    bad = dict(stored, batches_skipped=100)
    run = RunData(_Fake({}, setup={}, rewinds=[bad]), 1)
    assert check_alert(run, _alert(actions=[acted.format(to=300, k=100, f=0.5, c=200)]), [])
