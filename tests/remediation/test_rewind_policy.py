"""``Rewind``: its settings are checked where it is built, its event has the contract's fields, and a
snapshot puts back exactly what it took (model, optimizer, scheduler, RNG, EMA) without changing anything."""
from __future__ import annotations

import copy

import pytest
import torch

from gradwatch.agent import Rewind
from gradwatch.agent.collectors.base import Watched
from gradwatch.agent.config import AgentConfig
from gradwatch.agent.demo import EMA
from gradwatch.agent.remediation import rewind_event, rewind_line
from gradwatch.agent.snapshots import SnapshotStore


@pytest.mark.parametrize("bad, says", [
    (dict(every=0), "every=0"), (dict(keep=0), "keep=0"), (dict(lr_factor=0.0), "lr_factor=0.0"),
    (dict(lr_factor=2), "lr_factor=2"), (dict(cool_steps=-1), "cool_steps=-1"), (dict(max_rewinds=0), "max_rewinds"),
    (dict(then="retry"), "then='retry'"), (dict(on=()), "on=()"), (dict(on=[3]), "on=[3]"),
    (dict(window=0), "window=0"), (dict(checkpoint="x.pt", then="continue"), "with then='stop'"),
])
def test_bad_settings_say_what_to_do(bad, says):
    with pytest.raises(ValueError, match="Rewind: ") as e:
        Rewind(**bad)
    assert says in str(e.value)


def test_attach_refuses_what_is_not_a_policy():
    from gradwatch import agent

    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="remediate="):
        agent.attach(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), mode="disabled",
                     remediate={"every": 100})


def test_the_event_has_the_contract_fields():
    e = rewind_event(from_step=412, to_step=300, lr_factor=0.5, cool_steps=200, rewind_number=1, max_rewinds=3,
                     action="rewind", trigger={"rule": "A1", "alert_id": 17, "step": 405, "name": "loss_nonfinite"})
    assert e["kind"] == "rewind" and e["step"] == 412
    assert e["data"] == {"from_step": 412, "to_step": 300, "batches_skipped": 112, "lr_factor": 0.5,
                         "cool_steps": 200, "trigger": {"rule": "A1", "alert_id": 17, "step": 405,
                                                        "name": "loss_nonfinite"},
                         "snapshot_age_steps": 112, "rewind_number": 1, "max_rewinds": 3, "action": "rewind"}
    assert rewind_line(e["data"]) == ("gradwatch: rewound to step 300, skipped 112 batches, LR x0.5 for 200 steps "
                                      "(A1 at step 405)")


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    ema = EMA(model, 0.9)
    return model, opt, sched, ema


def _train(model, opt, sched, ema, steps: int):
    for _ in range(steps):
        x = torch.randn(16, 4)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ema.update(model)


def _state(model, opt, sched, ema):
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                          "ema": {k: v.clone() for k, v in ema.shadow.items()}, "rng": torch.get_rng_state()})


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), "a tensor differs"
    else:
        assert a == b


def test_a_snapshot_restores_exactly_what_it_took_and_taking_it_changes_nothing():
    model, opt, sched, ema = _setup()
    watched = Watched(model, None, opt, ema, AgentConfig(mode="disabled"), None)
    store = SnapshotStore(watched, sched, keep=2)
    _train(model, opt, sched, ema, 5)                 # the optimizer state exists now
    before = _state(model, opt, sched, ema)
    assert store.take(5)
    _assert_same(_state(model, opt, sched, ema), before)     # read-only
    buffers = [b.data_ptr() for b in store.slots[0].buffers]
    assert store.nbytes == sum(b.numel() * b.element_size() for b in store.slots[0].buffers) > 0
    _train(model, opt, sched, ema, 7)
    assert store.take(12)
    _train(model, opt, sched, ema, 3)
    assert store.take(15)                              # a third: the oldest slot (step 5) is written over
    assert store.steps() == [12, 15]
    assert [b.data_ptr() for b in store.slots[0].buffers] == buffers, "the slot's buffers were reallocated"

    model2, opt2, sched2, ema2 = _setup()            # the run at step 12, replayed from the same seed
    _train(model2, opt2, sched2, ema2, 12)
    # the RNG after 12 steps of the same seed differs from the one the snapshot saved only if the
    # snapshot or the training drew numbers of its own: it did not, so both paths agree
    expected = _state(model2, opt2, sched2, ema2)
    snap = store.newest_before(14)
    assert snap.step == 12
    assert store.restore(snap) == []
    _assert_same(_state(model, opt, sched, ema), expected)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_a_nonfinite_state_is_never_snapshotted():
    model, opt, sched, ema = _setup()
    watched = Watched(model, None, opt, ema, AgentConfig(mode="disabled"), None)
    store = SnapshotStore(watched, sched, keep=2)
    _train(model, opt, sched, ema, 2)
    assert not store.take(2, grad_norm=torch.tensor(float("nan")))
    assert not store.take(2, loss=float("inf"))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    assert not store.take(2)
    assert store.steps() == [] and store.skipped_nonfinite == 3


def test_the_gradscaler_state_comes_back_with_the_rest():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)

    def step(nan: bool = False):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        if nan:
            loss = loss * float("nan")
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for _ in range(4):
        step()
    store = SnapshotStore(Watched(model, scaler, opt, None, AgentConfig(mode="disabled"), None), keep=1)
    assert store.take(4)
    kept = (scaler.get_scale(), int(scaler._growth_tracker), {k: v.clone() for k, v in model.state_dict().items()})
    step(nan=True)                                    # the scaler halves its scale and skips the step
    step()
    assert scaler.get_scale() != kept[0]
    assert store.restore(store.newest_before(4)) == []
    assert scaler.get_scale() == kept[0] and int(scaler._growth_tracker) == kept[1]
    for k, v in model.state_dict().items():
        assert torch.equal(v, kept[2][k]), k
