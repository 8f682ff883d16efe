"""The decisions of ``Remedy`` (agent/rewinder.py), fed real alerts' fields step by step on a real tiny model:
which snapshot, when an alert is history already undone, when to cool instead, when to give up (``window``).
The server's part (raising the alerts) is covered by test_remediation_runs.py; here the alerts are LoopAlerts
as the inbox makes them, so every branch is reached at a chosen step."""
from __future__ import annotations

import torch

from gradwatch.agent import Rewind
from gradwatch.agent.collectors.base import Watched
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.loop_alerts import LoopAlert
from gradwatch.agent.rewinder import Remedy


def alert(id: int, rule: str, step: int, last: int | None = None, status: str = "firing") -> LoopAlert:
    return LoopAlert(id=id, run_id=1, rule=rule, name=rule.lower(), severity="critical", status=status, step=step,
                     last_step=step if last is None else last, rank=0, message="", diagnosis="")


class Run:
    """A tiny model trained step by step, with a Remedy driven the way the step builder drives it."""

    def __init__(self, policy: Rewind):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.events: list[dict] = []
        self.remedy = Remedy(policy, Watched(self.model, None, self.opt, None, AgentConfig(mode="disabled"), None),
                             scheduler=None, submit=self.events.append, barrier=lambda: None,
                             record_checkpoint=lambda path, step: None)
        self.step = 0
        self.weights: dict[int, torch.Tensor] = {}

    def train(self, n: int) -> None:
        for _ in range(n):
            self.remedy.before_update()
            loss = self.model(torch.randn(4, 3)).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.remedy.after_update()
            self.step += 1
            self.weights[self.step] = self.model.weight.detach().clone()   # before step `self.step` is applied
            self.remedy.at_step_end(self.step, torch.tensor(1.0), loss.detach())

    def hear(self, *alerts: LoopAlert) -> list:
        return self.remedy.on_news(list(alerts), self.step)


def test_the_newest_snapshot_at_or_before_the_onset_and_the_undone_history_after_it():
    run = Run(Rewind(every=10, keep=3, max_rewinds=5))
    run.train(47)
    acted = run.hear(alert(1, "A1", 33))
    assert acted[0].remediation["to_step"] == 30 and acted[0].remediation["from_step"] == 47
    assert torch.equal(run.model.weight, run.weights[30])
    assert run.remedy.store.steps() == [20, 30]               # 40 held the abandoned stretch (10: the oldest, gone)
    # the same incident's other alerts, heard after the rewind: history already undone, not acted on
    assert run.hear(alert(2, "A2", 34, last=46))[0].remediation is None
    run.train(5)
    # a new episode after the rewind: rewinds again, to the snapshot taken on the new stretch (step 50)
    again = run.hear(alert(3, "A1", 50))[0].remediation
    assert again["action"] == "rewind" and again["to_step"] == 50 and again["rewind_number"] == 2
    assert torch.equal(run.model.weight, run.weights[50])
    # an episode whose onset is before the last rewind but which goes on after it: no later than that rewind
    run.train(4)
    third = run.hear(alert(4, "A1", 40, last=55))[0].remediation
    assert third["to_step"] == 50 and third["from_step"] == 56
    assert [e["data"]["action"] for e in run.events] == ["rewind", "rewind", "rewind"]


def test_no_snapshot_old_enough_cools_instead_and_a_resolved_alert_does_nothing():
    run = Run(Rewind(every=10, keep=1, lr_factor=0.5, cool_steps=3))
    run.train(25)
    assert run.hear(alert(1, "A1", 15, status="resolved"))[0].remediation is None
    data = run.hear(alert(2, "A1", 15))[0].remediation        # the only snapshot is step 20's
    assert data["action"] == "cool" and data["lr_factor"] == 0.5 and data["batches_skipped"] == 0
    lrs = []
    original = run.opt.step

    def spy(*a, **k):
        lrs.append(run.opt.param_groups[0]["lr"])
        return original(*a, **k)
    run.opt.step = spy
    run.train(5)
    assert lrs == [0.05, 0.05, 0.05, 0.1, 0.1]                # cooled around 3 updates, then back
    assert run.opt.param_groups[0]["lr"] == 0.1               # never left cooled between updates


def test_an_early_warning_cools_once_while_cooled():
    run = Run(Rewind(every=10, cool_on=("H12",), lr_factor=0.25, cool_steps=20))
    run.train(12)
    assert run.hear(alert(1, "H12", 5))[0].remediation["action"] == "cool"
    run.train(3)
    assert run.hear(alert(1, "H12", 5, last=14))[0].remediation is None     # flapping: already cooled
    assert [e["data"]["action"] for e in run.events] == ["cool"]


def test_window_counts_only_recent_rewinds_and_max_rewinds_gives_up():
    run = Run(Rewind(every=10, keep=2, max_rewinds=1, window=30, then="continue"))
    run.train(25)
    assert run.hear(alert(1, "A1", 21))[0].remediation["action"] == "rewind"    # at 25, to 20
    run.train(40)                                                               # step 65: the rewind is old
    assert run.hear(alert(2, "A1", 61))[0].remediation["action"] == "rewind"    # outside the window: allowed
    run.train(5)
    gave_up = run.hear(alert(3, "A1", 68))[0].remediation                      # inside it: the second
    assert gave_up["action"] == "gave_up" and gave_up["then"] == "continue"
    assert not run.remedy.active and not run.remedy.policy.should_stop
    run.train(20)
    assert run.hear(alert(4, "A1", 85))[0].remediation is None                 # remediation is off now


def test_an_episode_still_firing_after_the_rewind_rewinds_again():
    """The server extends a firing episode without making it news again (a bad stretch longer than the alert's
    round trip: after the rewind its last batches spike again): such an update reaching a step after the
    rewind is acted on; one that stays before it is the undone history."""
    run = Run(Rewind(every=10, keep=2, max_rewinds=5))
    run.train(27)
    assert run.hear(alert(1, "A2", 21))[0].remediation["to_step"] == 20
    assert run.remedy.on_news([], run.step, updates=[alert(1, "A2", 21, last=26)])[0].remediation is None
    run.train(3)
    again = run.remedy.on_news([], run.step, updates=[alert(1, "A2", 21, last=28)])[0].remediation
    assert again["action"] == "rewind" and again["to_step"] == 20 and again["from_step"] == 30


def test_the_inbox_keeps_an_extended_firing_alert_as_an_update_not_news():
    from gradwatch.agent.loop_alerts import AlertInbox

    def wire(last: int, updated: float, status: str = "firing") -> dict:
        return {"id": 7, "run_id": 1, "rule": "A2", "name": "grad_explosion", "severity": "critical",
                "status": status, "first_step": 21, "last_step": last, "updated_at": updated}
    inbox = AlertInbox()
    inbox.receive([wire(21, 100.0)], cursor=100.0)
    assert [a.id for a in inbox.take_news()] == [7] and not inbox.has_updates
    inbox.receive([wire(28, 101.0)], cursor=101.0)
    assert not inbox.has_news and inbox.has_updates
    assert [(a.id, a.last_step) for a in inbox.take_updates()] == [(7, 28)] and not inbox.has_updates
    inbox.receive([wire(28, 102.0, status="resolved")], cursor=102.0)
    assert inbox.has_news and not inbox.has_updates
