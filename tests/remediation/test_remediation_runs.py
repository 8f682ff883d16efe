"""Runs that really break, healed in-process: the real agent, a real server (SQLite), tiny real models.

* a healthy run with ``remediate=Rewind(every=10)`` computes bitwise the losses of the same run without
  it (the snapshots only read), and never rewinds;
* two scenarios of tests/remediation/scenarios.py (a poisoned batch, an LR spike): the broken run ends
  non-finite; the remediated one ends finite, within the stated tolerance of the clean run's final
  loss, and its ``rewind`` event is stored on the server with the contract's fields
  (docs/remediation.md). Runs take a few seconds each; the waits only bound a hang.
"""
from __future__ import annotations

import math

import pytest

from tests.conftest import wait_until
from tests.remediation.scenarios import BUILDERS, final_loss, policy, run_three
from gradwatch.agent import Rewind

# the remediated run's final loss (mean of its last 20) may exceed the clean run's by this factor
TOLERANCE = 1.5


def _run_id(server, project: str, run: str) -> int:
    def find():
        _, body = server.get(f"/api/v1/runs?project={project}")
        return next((r["id"] for r in body["runs"] if r["name"] == run), None)
    return wait_until(find, timeout=20, what=f"run {run}")


def test_a_healthy_run_is_bitwise_the_same_with_remediation_on(server_factory, sqlite_url):
    server = server_factory(sqlite_url)
    off = BUILDERS["bad_stretch"]().run(server=server.url, project="remediation", run="healthy-off", faulty=False,
                                        pace=0)
    rewind = Rewind(every=10, keep=2)
    on = BUILDERS["bad_stretch"]().run(server=server.url, project="remediation", run="healthy-on", faulty=False,
                                       pace=0, remediate=rewind)
    assert len(on["losses"]) == len(off["losses"]) == 600
    assert on["losses"] == off["losses"], "remediation changed a healthy run's losses"
    assert on["rewinds"] == [] and rewind.rewinds == []
    assert on["snapshot_bytes"] > 0          # it did snapshot: two slots of params + Adam's state
    rid = _run_id(server, "remediation", "healthy-on")
    _, body = server.get(f"/api/v1/runs/{rid}/events?kind=rewind")
    assert body["events"] == []


@pytest.mark.parametrize("name", ["poisoned_batch", "lr_spike"])
def test_a_broken_run_heals_itself(server_factory, sqlite_url, name):
    server = server_factory(sqlite_url)
    runs = run_three(name, server.url)
    clean, broken, healed = (final_loss(runs[k]["losses"]) for k in ("clean", "broken", "remediated"))
    print(f"\n{name}: clean {clean:.4f}  broken {broken}  remediated {healed:.4f}  "
          f"rewinds {[(d['from_step'], d['to_step'], d['trigger']['rule']) for d in runs['remediated']['rewinds']]}")
    assert math.isfinite(clean) and not math.isfinite(broken)
    assert all(math.isfinite(v) for v in runs["remediated"]["losses"][-100:]), "the healed run ends non-finite"
    assert healed <= TOLERANCE * clean, f"healed {healed:.4f} vs clean {clean:.4f}"
    done = [d for d in runs["remediated"]["rewinds"] if d["action"] == "rewind"]
    assert done, "no rewind happened"
    first = done[0]
    assert first["to_step"] <= first["trigger"]["step"] < first["from_step"]
    assert first["to_step"] % policy(name).every == 0

    rid = _run_id(server, "remediation", runs["runs"]["remediated"])
    _, body = server.get(f"/api/v1/runs/{rid}/events?kind=rewind")
    stored = [e for e in body["events"] if e["data"]["action"] == "rewind"]
    assert stored and stored[0]["step"] == first["from_step"]
    data = stored[0]["data"]
    for key in ("from_step", "to_step", "batches_skipped", "lr_factor", "cool_steps", "trigger",
                "snapshot_age_steps", "rewind_number", "max_rewinds", "action"):
        assert data[key] == first[key], key
    assert data["batches_skipped"] == data["from_step"] - data["to_step"] == data["snapshot_age_steps"]
    assert set(data["trigger"]) == {"rule", "alert_id", "step", "name"}
    _, body = server.get(f"/api/v1/alerts?run={rid}")
    alert = next(a for a in body["alerts"] if a["id"] == data["trigger"]["alert_id"])
    assert alert["rule"] == data["trigger"]["rule"] and alert["first_step"] == data["trigger"]["step"]


def _poisoned_again_and_again():
    """The poisoned-batch run whose bad record comes back every 60 steps from step 250 on: a rewind
    cannot outrun it."""
    loop = BUILDERS["poisoned_batch"]()

    def fault(step, xy, _):
        x, y = xy
        if step >= 250 and step % 60 == 10:
            x = x.clone()
            x[5, 3] = math.inf
        return x, y
    loop.fault = fault
    return loop


def test_after_max_rewinds_the_run_stops_on_its_last_good_state(server_factory, sqlite_url, tmp_path):
    import torch

    server = server_factory(sqlite_url)
    path = tmp_path / "ckpt" / "last-good.pt"
    rewind = Rewind(every=50, keep=2, max_rewinds=1, then="stop", checkpoint=str(path))
    loop = _poisoned_again_and_again()
    out = loop.run(server=server.url, project="remediation", run="gives-up", remediate=rewind)
    assert rewind.should_stop and out["stopped_at"] is not None and out["stopped_at"] < loop.steps - 1
    actions = [d["action"] for d in rewind.rewinds]
    assert actions == ["rewind", "gave_up"], actions
    gave_up = rewind.gave_up
    assert gave_up["then"] == "stop" and gave_up["rewind_number"] == 1 and gave_up["max_rewinds"] == 1
    saved = torch.load(path, weights_only=False)
    assert saved["step"] == gave_up["to_step"] <= gave_up["trigger"]["step"]
    assert all(torch.isfinite(t).all() for t in saved["model"].values())
    # the model the loop holds now is that state too: the run stopped on good weights
    for k, t in loop.model.state_dict().items():
        assert torch.equal(t, saved["model"][k]), k
    rid = _run_id(server, "remediation", "gives-up")
    _, body = server.get(f"/api/v1/runs/{rid}/checkpoints")
    assert [c["path"] for c in body["checkpoints"]] == [str(path)]
    _, body = server.get(f"/api/v1/runs/{rid}/events?kind=rewind")
    assert [e["data"]["action"] for e in body["events"]] == ["rewind", "gave_up"]


def test_then_continue_turns_remediation_off_and_goes_on(server_factory, sqlite_url):
    server = server_factory(sqlite_url)
    rewind = Rewind(every=50, keep=2, max_rewinds=1, then="continue")
    loop = _poisoned_again_and_again()
    out = loop.run(server=server.url, project="remediation", run="goes-on", remediate=rewind)
    assert len(out["losses"]) == loop.steps and not rewind.should_stop
    assert [d["action"] for d in rewind.rewinds] == ["rewind", "gave_up"]
    assert rewind.gave_up["then"] == "continue"
    assert not math.isfinite(out["losses"][-1])      # nobody healed it after that: the run ends broken
