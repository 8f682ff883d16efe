"""Resume sanity (checklist 7.3) through a real server: the step axis continues, and each forgotten state is named.

A real loop (tests/resume/loop.py) trains under a run name against a real server on SQLite and on
PostgreSQL, saves a ``torch.save`` checkpoint, and is resumed under the same name by a fresh loop
(a second attach in this process, or a second process) that restores everything but what a test
forgets. The stored numbers are compared with the loop's own.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.integrations.conftest import run_of, series
from tests.resume.loop import PARTS, Loop, resume

FIRST, SECOND = 30, 12
RULE_OF = {"scaler": "G1", "optimizer": "G2", "ema": "G3", "batchnorm": "G4", "scheduler": "G5", "rng": "G6"}
RESUME_RULES = set(RULE_OF.values())


def alerts_of(server, run_id: int) -> list[dict]:
    status, body = server.get(f"/api/v1/alerts?run={run_id}")
    assert status == 200, body
    return body["alerts"]


def events_of(server, run_id: int, kind: str) -> list[dict]:
    status, body = server.get(f"/api/v1/runs/{run_id}/events?kind={kind}")
    assert status == 200, body
    return body["events"] if isinstance(body, dict) else body


def first_run(server, run: str, tmp_path, steps: int = FIRST, overflow_at=None, optimizer: str = "adamw") -> Loop:
    loop = Loop(optimizer=optimizer)
    loop.attach(server, run)
    loop.train(steps, overflow_at=overflow_at)
    loop.save(tmp_path / "ckpt.pt")
    loop.monitor.close()
    return loop


def assert_losses(server, run_id: int, expected: dict[int, float]) -> None:
    stored = series(server, run_id, "loss")
    assert sorted(stored) == sorted(expected), f"stored steps {sorted(stored)}"
    for step, value in expected.items():
        assert math.isclose(stored[step], value, rel_tol=1e-6, abs_tol=1e-9) or (
            math.isinf(value) and stored[step] is not None and math.isinf(stored[step])), (step, stored[step], value)


# --------------------------------------------------------------------------- (a) the step axis continues

@pytest.mark.parametrize("how", ["given", "optimizer_counters", "no_counters", "counters_behind_a_skip"])
def test_resumed_steps_are_all_stored_and_continue_the_axis(live_server, tmp_path, how):
    """100 % of the resumed steps are stored after the first run's, whatever says where they start."""
    run = f"axis-{how}"
    optimizer = "sgd" if how == "no_counters" else "adamw"
    # a skipped step (GradScaler overflow) does not count in Adam's step counters: they lag the run by one
    overflow_at = 5 if how == "counters_behind_a_skip" else None
    a = first_run(live_server, run, tmp_path, overflow_at=overflow_at, optimizer=optimizer)
    b = resume(tmp_path / "ckpt.pt", optimizer=optimizer)
    monitor = b.attach(live_server, run, **({"step": FIRST} if how == "given" else {}))
    b.train(SECOND)
    monitor.close()

    run_id = run_of(live_server, "resume", run)["id"]
    expected = dict(enumerate(a.losses)) | {FIRST + i: v for i, v in enumerate(b.losses)}
    assert_losses(live_server, run_id, expected)
    assert monitor.already_stored_steps == 0
    # the server moved a guessed numbering only where it would have collided
    assert monitor.step_shift == {"no_counters": FIRST, "counters_behind_a_skip": 1}.get(how, 0)
    stored_lr = series(live_server, run_id, "lr")
    assert [stored_lr[FIRST + i] for i in range(SECOND)] == pytest.approx(b.lrs, rel=1e-9)


def test_a_resumed_process_continues_the_axis(live_server, tmp_path):
    """The bug as reported: a second *process*, attached with no step, used to store 0 of its steps."""
    first_run(live_server, "process", tmp_path, optimizer="sgd")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from tests.resume.loop import resume
        class S: url = {live_server.url!r}
        b = resume({str(tmp_path / 'ckpt.pt')!r}, optimizer="sgd")
        m = b.attach(S, "process")
        b.train({SECOND})
        m.close()
        print(json.dumps({{"losses": b.losses, "shift": m.step_shift}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    run_id = run_of(live_server, "resume", "process")["id"]
    stored = series(live_server, run_id, "loss")
    assert sorted(stored) == list(range(FIRST + SECOND))
    assert [stored[FIRST + i] for i in range(SECOND)] == pytest.approx(result["losses"], rel=1e-6)
    assert result["shift"] == FIRST
    assert "continuing the run" in out.stderr


def test_steps_given_below_the_stored_ones_are_reported_not_overwritten(live_server, tmp_path):
    """attach(step=N) with N inside the stored range (a resume from an older checkpoint): the stored
    steps stay as they were, the colliding ones are counted, warned about and recorded as an event."""
    a = first_run(live_server, "older", tmp_path)
    b = resume(tmp_path / "ckpt.pt")
    monitor = b.attach(live_server, "older", step=FIRST - 5)
    b.train(SECOND)
    monitor.close()
    run_id = run_of(live_server, "resume", "older")["id"]
    expected = dict(enumerate(a.losses)) | {FIRST + i: v for i, v in enumerate(b.losses[5:])}
    assert_losses(live_server, run_id, expected)
    assert monitor.already_stored_steps == 5
    events = events_of(live_server, run_id, "steps_already_stored")
    assert [(e["data"]["count"], e["data"]["first"], e["data"]["last"]) for e in events] == [(5, FIRST - 5, FIRST - 1)]


# --------------------------------------------------------------------------- (b), (c) what was forgotten

@pytest.mark.parametrize("forget", PARTS)
def test_each_forgotten_state_raises_exactly_its_rule(live_server, tmp_path, forget):
    run = f"forget-{forget}"
    first_run(live_server, run, tmp_path)
    b = resume(tmp_path / "ckpt.pt", forget=(forget,))
    monitor = b.attach(live_server, run)
    b.train(SECOND)
    monitor.close()
    run_id = run_of(live_server, "resume", run)["id"]
    alerts = [a for a in alerts_of(live_server, run_id) if a["rule"] in RESUME_RULES]
    assert [a["rule"] for a in alerts] == [RULE_OF[forget]], [(a["rule"], a["message"]) for a in alerts]
    alert = alerts[0]
    assert FIRST <= alert["first_step"] <= FIRST + 3
    assert alert["actions"] and alert["evidence"]["before_step"] == FIRST - 1
    if forget == "scaler":     # the numbers it compared are the scaler's own
        assert alert["evidence"]["loss_scale"] == 2.0 ** 10
        assert alert["evidence"]["loss_scale_before"] == series(live_server, run_id, "loss_scale")[FIRST - 1]
    if forget == "batchnorm":
        assert alert["evidence"]["layers"] == ["1"]


@pytest.mark.parametrize("forget", [(), ("optimizer",)], ids=["restored", "optimizer_forgotten"])
def test_the_optimizer_handed_over_by_the_scaler_is_read_before_its_first_step(live_server, tmp_path, forget):
    """``agent.attach(model, scaler)``: the optimizer is known only at the first ``scaler.step(opt)``; its
    state is read there, before it changes, and its counters still number the first step."""
    run = "scaler-only-" + ("-".join(forget) or "restored")
    first_run(live_server, run, tmp_path)
    b = resume(tmp_path / "ckpt.pt", forget=forget)
    monitor = b.attach(live_server, run, with_optimizer=False)
    b.train(SECOND)
    monitor.close()
    run_id = run_of(live_server, "resume", run)["id"]
    assert sorted(series(live_server, run_id, "loss")) == list(range(FIRST + SECOND))
    # a forgotten optimizer has no counters: the server continued the run instead
    assert monitor.step_shift == (FIRST if forget else 0)
    assert [a["rule"] for a in alerts_of(live_server, run_id)] == (["G2"] if forget else [])
    event = max(events_of(live_server, run_id, "resume_state"), key=lambda e: e["step"])
    assert event["data"]["optimizer"]["step"] == (None if forget else FIRST)


def test_a_fully_restored_resume_raises_nothing(live_server, tmp_path):
    first_run(live_server, "restored", tmp_path)
    b = resume(tmp_path / "ckpt.pt")
    monitor = b.attach(live_server, "restored")
    b.train(SECOND)
    monitor.close()
    run_id = run_of(live_server, "resume", "restored")["id"]
    assert alerts_of(live_server, run_id) == []
    fresh, event = sorted(events_of(live_server, run_id, "resume_state"), key=lambda e: e["step"])
    assert fresh["step"] == 0 and fresh["data"]["before"] is None
    data = event["data"]
    # what the agent compared: the loaded state, and the stored state before the resume
    assert event["step"] == FIRST and data["before"]["step"] == FIRST - 1
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert data["scaler"]["scale"] == saved["scaler"]["scale"]
    assert data["scaler"]["growth_tracker"] == saved["scaler"]["_growth_tracker"]
    assert data["rng_hash"] == data["before"]["rng_hash"]
    assert data["optimizer"]["step"] == FIRST and data["step_origin"] == "optimizer"


def test_a_fresh_run_is_no_resume(live_server, tmp_path):
    """The first process of a run has nothing stored before it: no resume rule speaks."""
    loop = first_run(live_server, "fresh", tmp_path, steps=8)
    run_id = run_of(live_server, "resume", "fresh")["id"]
    assert alerts_of(live_server, run_id) == []
    (event,) = events_of(live_server, run_id, "resume_state")
    assert event["step"] == 0 and event["data"]["before"] is None
    assert len(series(live_server, run_id, "rng_hash")) == len(loop.losses)
