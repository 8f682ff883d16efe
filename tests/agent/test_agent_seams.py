"""The public seams the framework callbacks use (docs/agent.md, "Public seams for integrations")."""
from __future__ import annotations

import math

import torch

from gradwatch import agent
from agent_helpers import TinyNet, batches, checklist_step, tiny_loop


def test_seal_step_sends_the_ended_step_and_later_values_go_to_the_next(recorder, agent_settings):
    torch.manual_seed(0)
    model, opt, scaler = tiny_loop()
    monitor = agent.attach(model, scaler, transport=recorder, seal_grace=60.0, **agent_settings)
    data = batches(2)
    checklist_step(model, opt, scaler, *data[0])
    monitor.log(acc=1.0)
    monitor.seal_step()            # a step begins without a forward of the monitored model
    assert monitor._open is None
    monitor.log(acc=2.0)           # belongs to the step in progress now
    checklist_step(model, opt, scaler, *data[1])
    monitor.close()
    assert [s["custom"] for s in recorder.steps] == [{"acc": 1.0}, {"acc": 2.0}]


def test_remeasure_grads_measures_after_a_closures_backward(recorder, agent_settings):
    """``optimizer.step(closure)`` runs backward after the optimizer's pre-hook, where the agent
    measured the (stale or missing) grads; remeasuring after backward gives the real pre-clip norm."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = agent.attach(model, optimizer=opt, transport=recorder, **agent_settings)
    expected = []
    for x, y in batches(3):
        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            expected.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
            monitor.remeasure_grads()
            monitor.log(loss=loss)
            return loss
        opt.step(closure)
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == [0, 1, 2]
    for s, e in zip(steps, expected):
        assert math.isclose(s["grad_norm"], e, rel_tol=1e-5), (s["grad_norm"], e)


def test_the_seams_are_harmless_after_close(recorder, agent_settings):
    model, opt, scaler = tiny_loop()
    monitor = agent.attach(model, scaler, transport=recorder, **agent_settings)
    monitor.close()
    monitor.seal_step()
    monitor.remeasure_grads()
