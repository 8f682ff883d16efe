"""One writer per signal (agent/owners.py): a monitor refuses, at attach, a composition in which two
writers (collectors, the step builder, the sealer) declare one name, or a loop's report of a step signal
(monitor.log(grad_norm=...)) could go to two owners; the default composition has one owner for each."""
from __future__ import annotations

import pytest
import torch

from gradwatch import agent
from gradwatch.agent import Rewind
from gradwatch.agent import collectors as collector_kinds
from gradwatch.agent.collectors.base import Collector
from gradwatch.agent.collectors.loss_scale import LossScale
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.monitor import Monitor
from gradwatch.agent.owners import LOOP_REPORTS, check_owners, report_takers
from gradwatch.agent.sealer import Sealer
from gradwatch.agent.step_builder import StepBuilder
from agent_helpers import TinyNet, batches


def _monitor(kinds, settings, **kw) -> Monitor:
    model = TinyNet()
    return Monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), collectors=kinds,
                   config=AgentConfig.from_sources({**settings, "mode": "disabled"}, env={}), **kw)


class TwinNorm(Collector):
    name = "twin_norm"
    emits = ("grad_norm",)      # GradNorms' signal


class OwnClock(Collector):
    name = "own_clock"
    emits = ("step_time",)      # the step builder's


class OwnLoss(Collector):
    name = "own_loss"
    emits = ("loss",)           # the sealer's (it picks the logged or the scaled loss)


@pytest.mark.parametrize("kind, first", [(TwinNorm, "GradNorms"), (OwnClock, "StepBuilder"), (OwnLoss, "Sealer")])
def test_a_second_writer_of_a_signal_fails_at_attach(agent_settings, kind, first):
    with pytest.raises(ValueError, match=f"'{kind.emits[0]}' has two writers, {first} and {kind.__name__}"):
        _monitor(collector_kinds.DEFAULT + (kind,), agent_settings)


def test_a_report_has_one_taker_and_it_is_the_signals_writer(agent_settings):
    class Scale(Collector):   # a loss-scale collector of one's own, in place of LossScale: fine
        name = "my_scale"
        emits = ("loss_scale", "overflow")
        reports = ("overflow", "loss_scale")

        def report(self, key, value, rec, ended):
            rec.keep_custom("mine_" + key, float(value))
            return True

    others = tuple(k for k in collector_kinds.DEFAULT if k is not LossScale)
    monitor = _monitor(others + (Scale,), agent_settings)
    assert report_takers(monitor.collectors)["overflow"].name == "my_scale"
    monitor.close()

    class Stray(Collector):
        name = "stray"
        emits = ()
        reports = ("acc",)

    class Foreign(Collector):
        name = "foreign"
        emits = ()
        reports = ("overflow",)   # not a signal it writes

    with pytest.raises(ValueError, match="'loss_scale' has two writers, LossScale and Scale"):
        _monitor(collector_kinds.DEFAULT + (Scale,), agent_settings)
    with pytest.raises(ValueError, match="Stray takes reports of 'acc', which monitor.log does not report"):
        _monitor(collector_kinds.DEFAULT + (Stray,), agent_settings)
    with pytest.raises(ValueError, match="Foreign takes reports of 'overflow' but does not write it"):
        _monitor(others + (Foreign,), agent_settings)


def test_the_default_composition_has_one_writer_per_name_and_an_owner_for_each_report(agent_settings):
    owners = check_owners((StepBuilder, Sealer, *collector_kinds.DEFAULT))
    assert owners["grad_norm"] == owners["clip_max_norm"] == "GradNorms"
    assert owners["overflow"] == owners["loss_scale"] == "LossScale"
    assert owners["loss"] == "Sealer" and owners["step_time"] == "StepBuilder"
    # composed without a GradScaler too: a loop reports its own loss scaler's values to it (DeepSpeed fp16)
    monitor = _monitor(collector_kinds.DEFAULT, agent_settings)
    takers = report_takers(monitor.collectors)
    assert sorted(takers) == sorted(LOOP_REPORTS)
    assert {k: type(c).__name__ for k, c in takers.items()} == {
        "grad_norm": "GradNorms", "clip_max_norm": "GradNorms", "overflow": "LossScale", "loss_scale": "LossScale"}
    monitor.close()


def test_a_report_goes_to_its_owner_which_keeps_its_own_measurement(recorder, agent_settings):
    """Without a GradScaler, a reported overflow and loss scale are the step's (their owner measured none);
    a reported grad norm where the agent measured its own stays custom:grad_norm."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(model, optimizer=opt, transport=recorder,
                      config=AgentConfig.from_sources(agent_settings, env={}))
    for i, (x, y) in enumerate(batches(2)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        monitor.log(grad_norm=123.0, overflow=i == 1, loss_scale=2.0 ** (10 - i))   # during the step
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)
    monitor.close()
    steps = recorder.steps
    assert [s["overflow"] for s in steps] == [False, True] and [s["loss_scale"] for s in steps] == [1024.0, 512.0]
    assert all(s["custom"]["grad_norm"] == 123.0 and s["grad_norm"] != 123.0 for s in steps)


def test_a_cooled_update_is_recorded_with_the_lr_it_used(recorder, agent_settings):
    """Remediation cools the LR around an update (agent/rewinder.py); the step's lr, written by its one owner
    (the LR collector), is the cooled one that update used, handed over in the record (rec.lr_factor)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.attach(model, optimizer=opt, transport=recorder, **agent_settings,
                           remediate=Rewind(every=10, keep=1, lr_factor=0.5, cool_steps=3))

    def train(n: int) -> None:
        for _ in range(n):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            monitor.log(loss=loss)

    train(25)
    # the server's reply with an alert whose onset (15) is before the only snapshot (20): a cool, no rewind
    monitor._inbox.receive([{"id": 1, "rule": "A1", "name": "a1", "severity": "critical", "status": "firing",
                             "first_step": 15, "last_step": 24, "updated_at": 1.0}], None)
    train(6)
    monitor.close()
    lrs = [s["lr"] for s in recorder.steps]
    assert len(lrs) == 31 and lrs[:26] == [0.1] * 26
    assert lrs[26:] == [0.05, 0.05, 0.05, 0.1, 0.1]
    assert opt.param_groups[0]["lr"] == 0.1


def test_the_step_builder_drives_a_grad_norm_owner_it_does_not_know(recorder, agent_settings):
    """The step builder names no collector class: a grad-norm collector of one's own in place of GradNorms is
    driven through the protocol's hook points (grads_final, measured) and takes the loop's reports, so the
    step's grad_norm is its value, here torch's own norm of the unscaled grads."""
    seen: list = []

    class MyNorms(Collector):
        name = "my_norms"
        emits = ("grad_norm", "clip_max_norm")
        reports = ("grad_norm", "clip_max_norm")
        total = None
        clip_max_norm = None   # the clip threshold it saw: the owner of clip_max_norm is read for the run_setup event

        def grads_final(self):
            if self.total is None:
                grads = [p.grad for p in self.watched.params if p.grad is not None]
                self.total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                seen.append(float(self.total))

        def measured(self, name):
            return self.total

        def end_step(self, step, rec):
            total, self.total = self.total, None
            if total is not None:
                rec.add("grad_norm", total)

        def report(self, key, value, rec, ended):
            rec.keep_custom("reported_" + key, float(value))
            return True

    kinds = tuple(k for k in collector_kinds.DEFAULT if k.__name__ != "GradNorms") + (MyNorms,)
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = Monitor(model, scaler, optimizer=opt, transport=recorder, collectors=kinds,
                      config=AgentConfig.from_sources(agent_settings, env={}))
    for x, y in batches(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)          # unscales inside: grads_final there
        scaler.update()
        opt.zero_grad()
        monitor.log(grad_norm=7.0)
    monitor.close()
    assert not monitor._disabled, monitor._disabled
    steps = recorder.steps
    assert len(steps) == 3 and len(seen) == 3
    assert [s["grad_norm"] for s in steps] == pytest.approx(seen, rel=1e-6)
    assert all(s["custom"]["reported_grad_norm"] == 7.0 for s in steps)
