"""``agent.attach`` given objects it has never seen: it unwraps what it can, drops what it cannot hook
with ONE warning that says what is not measured, never raises, and the loop runs monitored.

Plain torch loops in this process against a real server; the references are the loop's own
numbers (its loss, the value ``clip_grad_norm_`` returned, the optimizer's learning rate).
"""
from __future__ import annotations

import logging

import pytest
import torch

from gradwatch import agent
from tests.integrations.conftest import assert_close, run_of, series

STEPS = 4


class HiddenOptimizer:
    """An optimizer wrapper gradwatch does not know: no ``.optimizer``, not a ``torch.optim.Optimizer``,
    none of its private hook dictionaries; it exposes ``param_groups`` and steps what it hides."""

    def __init__(self, inner):
        self._hidden = inner

    @property
    def param_groups(self):
        return self._hidden.param_groups

    @property
    def state(self):
        return self._hidden.state

    def step(self, closure=None):
        return self._hidden.step(closure)

    def zero_grad(self, set_to_none=True):
        self._hidden.zero_grad(set_to_none=set_to_none)


class OddLossScaler:
    """A loss scaler that is not a GradScaler (DeepSpeed's DynamicLossScaler keeps ``cur_scale`` too)."""

    cur_scale = 2.0 ** 10


class Holder:
    """A model wrapper that is not an ``nn.Module``: it holds one."""

    def __init__(self, net):
        self.net = net

    def __call__(self, x):
        return self.net(x)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gradwatch.agent" and r.levelno >= logging.WARNING]


def test_unknown_optimizer_scaler_and_model_wrappers_warn_once_and_the_loop_runs(gw_server, run_name, caplog):
    net = _model()
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    opt, model = HiddenOptimizer(inner), Holder(net)
    with caplog.at_level(logging.WARNING, logger="gradwatch.agent"):
        monitor = agent.attach(model, OddLossScaler(), optimizer=opt, project="wrappers", run=run_name,
                               server=gw_server.url, flush_interval=0.1)
    (warning,) = _warnings(caplog)     # one warning for everything that is not measured
    assert "optimizer HiddenOptimizer is not a torch.optim.Optimizer" in warning and "no learning rate" in warning
    assert "scaler OddLossScaler is not a torch.amp.GradScaler" in warning and "overflow" in warning
    assert monitor.model is net and monitor.scaler is None and monitor.optimizer is None
    losses, norms = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1] * 2)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)          # no optimizer hook: each call is one step
        losses.append(loss.item())
    monitor.close()
    assert len(_warnings(caplog)) == 1, "nothing more was said during the loop"
    run = run_of(gw_server, "wrappers", run_name)
    loss, grad_norm = series(gw_server, run["id"], "loss"), series(gw_server, run["id"], "grad_norm")
    assert sorted(loss) == list(range(STEPS))
    assert_close([loss[s] for s in range(STEPS)], losses, rel=1e-6, what="loss")
    assert_close([grad_norm[s] for s in range(STEPS)], norms, rel=1e-6, what="grad_norm")


def test_an_unknown_optimizer_wrapper_with_a_gradscaler_takes_the_steps_from_the_scaler(gw_server, run_name, caplog):
    net = _model()
    opt = HiddenOptimizer(torch.optim.SGD(net.parameters(), lr=0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with caplog.at_level(logging.WARNING, logger="gradwatch.agent"):
        monitor = agent.attach(net, scaler, optimizer=opt, project="wrappers", run=run_name,
                               server=gw_server.url, flush_interval=0.1)
    (warning,) = _warnings(caplog)
    assert "steps end at scaler.update()" in warning
    losses, norms = [], []
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        x = torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(net(x), x[:, :1] * 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    monitor.close()
    run = run_of(gw_server, "wrappers", run_name)
    loss, grad_norm = series(gw_server, run["id"], "loss"), series(gw_server, run["id"], "grad_norm")
    assert sorted(loss) == list(range(STEPS))
    assert_close([loss[s] for s in range(STEPS)], losses, rel=1e-6, what="loss")
    assert_close([grad_norm[s] for s in range(STEPS)], norms, rel=1e-6, what="grad_norm")
    assert set(series(gw_server, run["id"], "loss_scale").values()) == {2.0 ** 8}


def test_lightnings_optimizer_wrapper_is_unwrapped_without_a_warning(gw_server, run_name, caplog):
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer

    net = _model()
    inner = torch.optim.SGD(net.parameters(), lr=0.05)
    wrapped = LightningOptimizer(inner)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    with caplog.at_level(logging.WARNING, logger="gradwatch.agent"):
        monitor = agent.attach(net, optimizer=wrapped, project="wrappers", run=run_name, server=gw_server.url,
                               flush_interval=0.1)
    assert _warnings(caplog) == [] and monitor.optimizer is inner
    lrs = []
    for _ in range(STEPS):
        x = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(net(x), x[:, :1])
        loss.backward()
        monitor.log(loss=loss)
        lrs.append(inner.param_groups[0]["lr"])
        inner.step()
        inner.zero_grad()
        sched.step()
    monitor.close()
    run = run_of(gw_server, "wrappers", run_name)
    lr = series(gw_server, run["id"], "lr")
    assert sorted(lr) == list(range(STEPS)), "steps from the unwrapped optimizer's hooks"
    assert_close([lr[s] for s in range(STEPS)], lrs, rel=1e-6, what="lr")
