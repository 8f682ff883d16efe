"""The last step before a stall: its record is sealed by the sender thread after ``seal_grace``.

A step's record stays open after ``scaler.update()`` so that the EMA update and
``monitor.log()`` calls right after the step belong to it; these tests check
both halves: a loop that stops right after a (NaN) step still gets that step and
its alert to the server without ``close()``, and a loop that keeps going still
has its post-step values attributed to the right step.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import pytest
import torch

from gradwatch import agent
from agent_helpers import ShadowEMA, batches, checklist_step, find_run, stored_counts, tiny_loop
from tests.conftest import wait_until


def _ema_divergence(ema: ShadowEMA, model: torch.nn.Module) -> float:
    num = sum(float((ema.shadow[n] - p.detach()).pow(2).sum()) for n, p in model.named_parameters())
    den = sum(float(p.detach().pow(2).sum()) for _, p in model.named_parameters())
    return math.sqrt(num) / math.sqrt(den)


def test_a_nan_step_right_before_a_stall_reaches_the_server_with_its_alert_without_close(
        server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    # A 60 s flush interval: only the stale-record seal (plus the critical-step fast path) can send step 4 now.
    monitor = agent.attach(model, scaler, server=srv.url, project="stall", run="nan-then-hang",
                           spool_dir=str(tmp_path / "spool"), flush_interval=60.0)
    try:
        data = batches(5)
        for i, (x, y) in enumerate(data):
            if i == 4:
                x = x.clone()
                x[0, 0] = float("nan")
            checklist_step(model, opt, scaler, x, y)
        assert monitor.step == 5 and not monitor.closed
        # The loop "hangs" here: no forward, no scale(), no log(), no close().
        t0 = time.perf_counter()
        counts = wait_until(lambda: (c := stored_counts(srv, "stall", "nan-then-hang")) and 4 in c and c,
                            timeout=15, what="the NaN step stored")
        print(f"last step stored {time.perf_counter() - t0:.3f} s after it ended (seal_grace 0.2 s)")
        assert counts[4] == 1
        run = find_run(srv, "stall", "nan-then-hang")
        assert run["status"] == "running"   # nothing closed the run
        _, series = srv.get(f"/api/v1/runs/{run['id']}/series?signal=loss&max_points=100000")
        last = next(b for b in series["steps"] if b["step"] == 4)
        assert last["count"] == 1

        def a1_alerts():
            status, body = srv.get(f"/api/v1/alerts?run={run['id']}")
            assert status == 200, body
            return [a for a in body["alerts"] if a["rule"] == "A1"]
        alerts = wait_until(a1_alerts, timeout=10, what="the A1 alert")
        assert alerts[0]["first_step"] == 4
        assert not monitor.closed
    finally:
        monitor.close()


def test_post_step_ema_and_logged_values_stay_with_their_step(recorder, agent_settings):
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    ema = ShadowEMA(model, decay=0.9)
    monitor = agent.attach(model, scaler, ema=ema, transport=recorder, ema_every=1, **agent_settings)
    expected_div: dict[int, float] = {}
    for i, (x, y) in enumerate(batches(10)):
        checklist_step(model, opt, scaler, x, y, ema=ema)   # ends with ema.update(model) after scaler.update()
        monitor.log(acc=float(i), seen=torch.tensor(10.0 * i))
        expected_div[i] = _ema_divergence(ema, model)
        if i == 4:
            # A pause longer than seal_grace: step 4 is sealed by the sender thread and sent without close(),
            # its logged values (logged before the pause) included; training then goes on.
            wait_until(lambda: any(s["step"] == 4 for s in recorder.steps), timeout=10, what="step 4 sent")
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == list(range(10))
    for s in steps:
        i = s["step"]
        assert s["custom"] == {"acc": float(i), "seen": 10.0 * i}, s
        # Measured after that step's EMA update, not the previous or the next one's; step 4, sealed
        # by the sender thread, included.
        assert s["ema_divergence"] is not None and math.isclose(s["ema_divergence"], expected_div[i],
                                                                rel_tol=1e-4), (i, s["ema_divergence"])


def _run_with_pause_after(pause_after: Optional[int], recorder, agent_settings, steps: int = 8) -> list[dict]:
    """The checklist's loop (scaler, clipping, EMA every step, a logged scalar), seeded; after step
    ``pause_after`` the loop pauses (an end-of-epoch validation or checkpoint, as timm's train.py
    does) until the sender thread has sealed and sent that step."""
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    ema = ShadowEMA(model, decay=0.9)
    monitor = agent.attach(model, scaler, ema=ema, transport=recorder, ema_every=1, weights_every=1,
                           **agent_settings)
    for i, (x, y) in enumerate(batches(steps)):
        checklist_step(model, opt, scaler, x, y, ema=ema)
        monitor.log(acc=float(i))
        if i == pause_after:
            wait_until(lambda: any(s["step"] == i for s in recorder.steps), timeout=10, what=f"step {i} sent")
            # sealed by the sender thread (agent/sealer.py sets the flag when it takes the record; the
            # training thread, waiting here, clears it at its next step): the effect, not how long it took
            assert monitor._sealer.stale_sealed
    monitor.close()
    return recorder.steps


def test_a_step_sealed_by_the_sender_thread_after_a_pause_keeps_its_ema_divergence(agent_settings):
    """The hand-over loses nothing: the step before a pause longer than ``seal_grace`` (sealed and
    sent by the sender thread while training waits) carries the EMA divergence, and every other
    value, exactly as the same step of the same loop without the pause."""
    from agent_helpers import RecordingTransport
    paused = _run_with_pause_after(3, RecordingTransport(), agent_settings)
    straight = _run_with_pause_after(None, RecordingTransport(), {**agent_settings, "run": "r2"})
    assert [s["step"] for s in paused] == [s["step"] for s in straight] == list(range(8))
    for p, q in zip(paused, straight):
        assert p["ema_divergence"] is not None, p
        assert math.isclose(p["ema_divergence"], q["ema_divergence"], rel_tol=1e-6), (p, q)
        volatile = ("time", "step_time", "data_time", "samples_per_s", "tokens_per_s")
        assert {k: v for k, v in p.items() if k not in volatile} == \
            {k: v for k, v in q.items() if k not in volatile}, p["step"]


def test_seal_grace_is_validated():
    import pytest
    from gradwatch.agent.config import AgentConfig
    with pytest.raises(ValueError, match="seal_grace"):
        AgentConfig.from_sources({"seal_grace": -1}, env={})
    assert AgentConfig.from_sources({}, env={"GRADWATCH_SEAL_GRACE": "0.5"}).seal_grace == 0.5


def test_a_slow_data_loader_does_not_make_every_step_a_stall(recorder, agent_settings):
    """Each step waits 0.35 s for its batch (longer than seal_grace): after the first step the
    agent knows that gap is usual, keeps the records open and measures EMA divergence in the
    training thread."""
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    ema = ShadowEMA(model, decay=0.9)
    monitor = agent.attach(model, scaler, ema=ema, transport=recorder, ema_every=1, **agent_settings)
    for x, y in batches(6):
        time.sleep(0.35)   # the loader
        checklist_step(model, opt, scaler, x, y, ema=ema)
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == list(range(6))
    # Step 0 may be sealed by the sender (nothing known yet); from then on the gap is the usual one.
    assert all(s["ema_divergence"] is not None for s in steps[1:]), [s["ema_divergence"] for s in steps]


class GatedEMA(ShadowEMA):
    """A ShadowEMA whose ``shadow``, read by any thread but the main one while ``gate`` is set up,
    waits for the gate and then 0.3 s more: a slow EMA divergence job that began no earlier than
    the gate opened, whenever its thread got to run."""

    def __init__(self, model, decay=0.9):
        self.gate = None
        self.readers: list[str] = []
        super().__init__(model, decay)

    @property
    def shadow(self):
        import threading
        gate = self.gate
        if gate is not None and threading.current_thread() is not threading.main_thread():
            self.readers.append(threading.current_thread().name)
            gate.wait(30)
            time.sleep(0.3)   # without the barrier the optimizer step would run meanwhile
        return self._shadow

    @shadow.setter
    def shadow(self, value):
        self._shadow = value


@pytest.mark.parametrize("with_scaler", [True, False], ids=["scaler", "optimizer-only"])
def test_a_cpu_models_ema_divergence_runs_off_the_training_thread_and_the_optimizer_step_waits_for_it(
        recorder, agent_settings, with_scaler):
    """On CPU the sampled EMA divergence is computed by the agent's worker thread while the next
    forward and backward run; the next optimizer step must wait for it, or it would change the
    weights the job is reading. The job is held at the EMA until just before the optimizer step
    and then takes 0.3 s more; the step must begin only after it, and the value must be the one
    of the state right after the EMA update. (Barriers: the scaler.step() wrapper, and a global
    optimizer step pre-hook for loops without a scaler.)"""
    import threading
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    if not with_scaler:
        scaler = None
    ema = GatedEMA(model, decay=0.9)
    monitor = agent.attach(model, scaler, optimizer=opt, ema=ema, transport=recorder, ema_every=1,
                           **agent_settings)
    job_done_when_step_began: list[bool] = []
    # Per-optimizer pre-hooks run after every global one and after the scaler wrapper.
    mine = opt.register_step_pre_hook(
        lambda o, a, k: job_done_when_step_began.append(monitor._ema_worker._idle.is_set()))

    def step(x, y, gate=None):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)   # seals the previous step: its job starts
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if gate is not None:
            gate.set()   # the job may read the EMA now (and then takes 0.3 s)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        ema.update(model)

    try:
        data = batches(3)
        step(*data[0])
        expected = _ema_divergence(ema, model)
        gate = ema.gate = threading.Event()
        step(*data[1], gate=gate)
        ema.gate = None
        step(*data[2])
        monitor.close()
    finally:
        mine.remove()
    assert ema.readers == ["gradwatch-ema"], ema.readers
    assert job_done_when_step_began[1] is True
    steps = recorder.steps
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert math.isclose(steps[0]["ema_divergence"], expected, rel_tol=1e-4), (steps[0], expected)
    assert not any(t.name == "gradwatch-ema" for t in threading.enumerate())   # close() ended it
