"""``monitor.log(grad_norm=..., clip_max_norm=...)``: the loop reports a grad norm the agent did not
measure (DeepSpeed ZeRO 1/2 keeps no ``p.grad`` at the step), and it becomes the step's ``grad_norm``.

The loops here update their weights by hand, with no optimizer and no ``clip_grad_norm_`` the agent
could hook, so the agent measures no grad norm of its own; the reported norm is the one the loop
computed from its own grads. Where the agent does measure one (torch's ``clip_grad_norm_``), its value
wins and the reported one is kept as ``custom:grad_norm``.
"""
from __future__ import annotations

import math

import torch

from gradwatch import agent
from agent_helpers import TinyNet, batches, find_run
from tests.conftest import wait_until


def _hand_step(model, x, y, lr: float = 0.05, scale_grads: float = 1.0):
    """Forward, backward, the loop's own global grad norm, a plain SGD update without an optimizer."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(scale_grads)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        for p in model.parameters():
            p.sub_(lr * p.grad)
            p.grad = None
    return loss.detach(), norm


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_a_reported_norm_fills_grad_norm_and_clipped_when_the_agent_measured_none(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    monitor = agent.attach(model, transport=recorder, **agent_settings)
    norms = []
    for i, (x, y) in enumerate(batches(8)):
        loss, norm = _hand_step(model, x, y)
        norms.append(float(norm))
        if i % 2:   # a device tensor (no sync) and a Python number take the same path
            monitor.log(loss=loss, grad_norm=norm, clip_max_norm=0.5)
        else:
            monitor.log(loss=loss, grad_norm=float(norm), clip_max_norm=0.5)
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == list(range(8))
    for s, norm in zip(steps, norms):
        assert _rel(s["grad_norm"], norm) <= 1e-6, (s["step"], s["grad_norm"], norm)
        assert "grad_norm" not in (s.get("custom") or {})   # the step's grad_norm, not also a custom value
        assert s["clip_max_norm"] == 0.5 and s["clipped"] is (norm > 0.5)
        assert s["overflow"] is False   # no scaler: nothing to overflow
    assert {s["clipped"] for s in steps} == {True, False}, norms   # both sides of the threshold were seen


def test_the_agents_own_norm_and_clip_threshold_win_over_the_reported_ones(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = agent.attach(model, optimizer=opt, transport=recorder, **agent_settings)
    clipped_by_torch = []
    for x, y in batches(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        monitor.log(loss=loss)
        clipped_by_torch.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)))
        opt.step()
        monitor.log(grad_norm=123.0, clip_max_norm=7.0)   # right after the step: its open record
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 4
    for s, norm in zip(steps, clipped_by_torch):
        assert _rel(s["grad_norm"], norm) <= 1e-6
        assert s["custom"]["grad_norm"] == 123.0
        assert s["clip_max_norm"] == 1.0 and s["clipped"] is (norm > 1.0)


def test_a_norm_reported_during_the_step_counts_when_the_agent_measures_none(recorder, agent_settings):
    """``grad_norms=False``: the agent measures nothing, the step ends at the optimizer's hook; the
    values logged before it belong to the step in progress."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = agent.attach(model, optimizer=opt, transport=recorder, grad_norms=False, **agent_settings)
    norms = []
    for x, y in batches(4):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        norms.append(float(norm))
        monitor.log(loss=loss, grad_norm=norm, clip_max_norm=2.0)
        opt.step()
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 4
    for s, norm in zip(steps, norms):
        assert _rel(s["grad_norm"], norm) <= 1e-6
        assert s["clip_max_norm"] == 2.0 and s["clipped"] is False


def test_a_norm_reported_during_the_step_is_custom_when_the_agent_measures_its_own(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = agent.attach(model, optimizer=opt, transport=recorder, **agent_settings)
    own = []
    for x, y in batches(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        own.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                               for p in model.parameters()]))))
        monitor.log(loss=loss, grad_norm=torch.tensor(5.0))   # before the step: the agent measures at its hook
        opt.step()
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 3
    for s, norm in zip(steps, own):
        assert _rel(s["grad_norm"], norm) <= 1e-6 and s["custom"]["grad_norm"] == 5.0


def test_a_bad_clip_threshold_is_ignored_with_one_warning(recorder, agent_settings, caplog):
    torch.manual_seed(0)
    model = TinyNet()
    monitor = agent.attach(model, transport=recorder, **agent_settings)
    for x, y in batches(3):
        loss, norm = _hand_step(model, x, y)
        monitor.log(loss=loss, grad_norm=norm, clip_max_norm=torch.tensor(1.0))
    monitor.close()
    assert all(s["clip_max_norm"] is None and s["clipped"] is None for s in recorder.steps)
    assert all(s["grad_norm"] is not None for s in recorder.steps)
    assert sum("clip_max_norm=...) needs a number" in r.getMessage() for r in caplog.records) == 1


def test_the_server_stores_the_reported_norm_and_a2_fires_on_it(shared_server, tmp_path):
    """End to end: the stored ``grad_norm`` is the reported one and the grad-norm rule reads it."""
    srv = shared_server
    torch.manual_seed(0)
    model = TinyNet()
    monitor = agent.attach(model, server=srv.url, project="reported-norm", run="a2",
                           spool_dir=str(tmp_path / "spool"), flush_interval=0.1)
    norms = []
    for i, (x, y) in enumerate(batches(60)):
        # step 55 (after A2's 50 steps of history): the gradients 1000x larger (a loss spike's), the update too
        # small to notice after
        loss, norm = _hand_step(model, x, y, lr=0.05 if i != 55 else 5e-5, scale_grads=1000.0 if i == 55 else 1.0)
        norms.append(float(norm))
        monitor.log(loss=loss, grad_norm=norm)
    monitor.close()
    run = find_run(srv, "reported-norm", "a2")
    status, body = srv.get(f"/api/v1/runs/{run['id']}/series?signal=grad_norm&max_points=100000")
    assert status == 200, body
    stored = {p["step"]: float(p["last"]) for p in body["steps"]}
    assert sorted(stored) == list(range(60))
    assert max(_rel(stored[i], norms[i]) for i in range(60)) <= 1e-6

    def a2():
        status, body = srv.get(f"/api/v1/alerts?run={run['id']}")
        assert status == 200, body
        return [a for a in body["alerts"] if a["rule"] == "A2"]
    alerts = wait_until(a2, timeout=10, what="the A2 alert")
    assert alerts[0]["first_step"] == 55
    assert not math.isnan(norms[55]) and norms[55] > 10 * sorted(norms[:55])[27]
