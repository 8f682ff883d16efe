"""H10 (an abrupt learning-rate jump) and H11 (a Transformer whose attention logits nobody measures) through
the real ingest path; the end-to-end coverage (a real agent, a real server, the run API) is
tests/agent/test_attention_coverage.py."""
from __future__ import annotations

import math

import pytest

from tests.rules.conftest import run_name, step


def lr_steps(lr_of, n: int = 200) -> list[dict]:
    return [step(i, loss=2.0 * math.exp(-i / 300) + 0.3, grad_norm=0.5, lr=lr_of(i)) for i in range(n)]


def test_h10_names_the_old_and_new_lr_of_a_tenfold_jump(rdb):
    name = run_name()
    rdb.feed(name, lr_steps(lambda i: 1e-3 if i < 120 else 1e-2), batch=33)
    a = rdb.rules(name)["H10"]
    assert a.severity == "warning" and a.first_step == 120
    assert a.evidence["lr_before"] == 1e-3 and a.evidence["lr"] == 1e-2 and a.evidence["step_before"] == 119
    assert "from 0.001 at step 119 to 0.01 at step 120" in a.message and "10x" in a.message


def test_h10_stays_quiet_through_a_warmup_a_decay_and_a_step_schedule(rdb):
    warm = run_name()
    rdb.feed(warm, lr_steps(lambda i: 1e-3 * min(1.0, i / 50)), batch=40)          # from 0: 0 -> 2e-5 is no jump
    steps = run_name()
    rdb.feed(steps, lr_steps(lambda i: 1e-2 * 0.1 ** (i // 60)), batch=40)         # StepLR: / 10 every 60 steps
    cosine = run_name()
    rdb.feed(cosine, lr_steps(lambda i: 1e-3 * (1 + (i + 1) / 200)), batch=40)    # a warm-up from base/200 on
    assert "H10" not in rdb.rules(warm) and "H10" not in rdb.rules(steps) and "H10" not in rdb.rules(cosine)


def test_h10_leaves_a_declared_restarting_schedule_alone(rdb):
    name = run_name()
    setup = {"step": 0, "kind": "run_setup", "data": {"scheduler": {"class": "CosineAnnealingWarmRestarts",
                                                                    "cosine": True}}}
    rdb.feed(name, lr_steps(lambda i: 1e-3 * (0.5 * (1 + math.cos(math.pi * (i % 50) / 50)) + 1e-4)), batch=40,
             events=[setup])
    assert "H10" not in rdb.rules(name)


def test_h10_judges_a_rise_against_the_configured_lr_the_setup_event_carries(rdb):
    """The run_setup event (first batch) says the run was configured with 1e-2: an epoch warm-up's 1e-5 ->
    1e-2 (three batches later) is the schedule's own; a later x50 past it warns, naming the configured LR."""
    setup = {"step": 0, "kind": "run_setup", "data": {"lr": {"at_attach": 1e-5, "initial_lr": 1e-2,
                                                              "configured": 1e-2}}}
    name = run_name()
    rdb.feed(name, lr_steps(lambda i: 1e-5 if i < 100 else 1e-2 if i < 150 else 5e-1), batch=33, events=[setup])
    a = rdb.rules(name)["H10"]
    assert a.first_step == 150 and a.evidence["lr_before"] == 1e-2 and a.evidence["configured_lr"] == 1e-2
    assert "above the 0.01 the run was configured with" in a.message
    quiet = run_name()
    rdb.feed(quiet, lr_steps(lambda i: 1e-5 if i < 100 else 1e-2), batch=33, events=[setup])
    assert "H10" not in rdb.rules(quiet)


def coverage(step_: int, measured: list[str], transformer: bool) -> dict:
    return {"step": step_, "kind": "attention_coverage",
            "data": {"measured": measured, "count": len(measured), "named": [], "transformer": transformer,
                     "attention_like": ["blocks.0.attn: Attention"] if transformer else []}}


def test_h11_says_when_a_transformer_has_no_attention_measured_and_clears_when_it_has(rdb):
    name = run_name()
    rdb.feed(name, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, [], True)])
    a = rdb.rules(name)["H11"]
    assert a.severity == "info" and a.first_step == 0 and a.evidence["attention_like"] == ["blocks.0.attn: Attention"]
    assert "attention_modules=" in a.message and any("attention_modules=" in x for x in a.actions)
    fine = run_name()
    rdb.feed(fine, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, ["blocks.0.attn"], True)])
    mlp = run_name()
    rdb.feed(mlp, lr_steps(lambda i: 1e-3, n=20), events=[coverage(0, [], False)])
    assert "H11" not in rdb.rules(fine) and "H11" not in rdb.rules(mlp)


def test_h10_leaves_a_resumed_process_s_first_steps_to_the_resume_rules(rdb):
    """A fresh optimizer and a restored scheduler set the LR twice as a resumed process starts (G2 / G5's
    matter); a jump later in that process is H10's."""
    name = run_name()
    resumed = {"step": 100, "kind": "resume_state", "data": {}}
    rdb.feed(name, lr_steps(lambda i: 1e-3 if i < 100 else 1e-4 if i == 100 else 2e-3 if i < 150 else 2e-2),
             batch=30, events=[resumed])
    a = rdb.rules(name)["H10"]
    assert a.first_step == 150 and a.evidence["lr_before"] == 2e-3


# --------------------------------------------------------------------------- real schedulers, a real agent, a real server

class TimmCosineLR:
    """timm's epoch-based ``CosineLRScheduler`` (timm/scheduler/scheduler.py + cosine_lr.py, 1.0.x), the parts a
    ``train.py`` run with ``--warmup-epochs`` uses, transcribed (timm cannot be imported beside the CPU torch
    here: tests/agent/zoo_models.py says why): it writes ``initial_lr`` into each group as timm's ``Scheduler``
    does, sets ``warmup_lr_init`` at once, and ``step(epoch)`` sets the epoch's LR: the warm-up's linear
    steps from ``warmup_lr_init``, then the cosine from the base LR (``warmup_prefix=False``)."""

    def __init__(self, optimizer, t_initial: int, lr_min: float = 0.0, warmup_t: int = 0,
                 warmup_lr_init: float = 0.0):
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_values = [g["initial_lr"] for g in optimizer.param_groups]
        self.t_initial, self.lr_min, self.warmup_t, self.warmup_lr_init = t_initial, lr_min, warmup_t, warmup_lr_init
        if warmup_t:
            self.warmup_steps = [(v - warmup_lr_init) / warmup_t for v in self.base_values]
            self._update_groups([warmup_lr_init] * len(self.base_values))
        else:
            self.warmup_steps = [1 for _ in self.base_values]

    def _get_lr(self, t: int) -> list[float]:
        if t < self.warmup_t:
            return [self.warmup_lr_init + t * s for s in self.warmup_steps]
        return [self.lr_min + 0.5 * (v - self.lr_min) * (1 + math.cos(math.pi * t / self.t_initial))
                for v in self.base_values]

    def _update_groups(self, values) -> None:
        for group, value in zip(self.optimizer.param_groups, values):
            group["lr"] = value

    def step(self, epoch: int, metric=None) -> None:
        self._update_groups(self._get_lr(epoch))


STEPS_PER_EPOCH, EPOCHS = 20, 6
LR = 1e-2


def _schedules():
    """name -> (make(optimizer) -> scheduler, when it steps: "step" / "epoch" / "plateau")."""
    import torch
    from torch.optim import lr_scheduler as S

    def hf(kind):
        def make(opt):
            import transformers
            fn = {"linear": transformers.get_linear_schedule_with_warmup,
                  "cosine": transformers.get_cosine_schedule_with_warmup}[kind]
            return fn(opt, num_warmup_steps=30, num_training_steps=STEPS_PER_EPOCH * EPOCHS)
        return make

    total = STEPS_PER_EPOCH * EPOCHS
    return {
        # timm train.py --warmup-epochs 1 --warmup-lr 1e-5: 1e-5 for the first epoch, then ~LR at once
        "timm-epoch-warmup": (lambda opt: TimmCosineLR(opt, t_initial=EPOCHS, warmup_t=1, warmup_lr_init=1e-5),
                              "epoch"),
        # Lightning with interval="epoch": a LinearLR warm-up stepped once an epoch (1e-3 x the LR, then the LR)
        "lightning-epoch-linear-warmup": (lambda opt: S.LinearLR(opt, start_factor=1e-3, total_iters=1), "epoch"),
        # Lightning / a hand-written loop, interval="step": LambdaLR from 0
        "step-warmup-from-zero": (lambda opt: S.LambdaLR(opt, lambda s: min(1.0, s / 30)), "step"),
        "hf-linear-warmup": (hf("linear"), "step"),
        "hf-cosine-warmup": (hf("cosine"), "step"),
        "cosine": (lambda opt: S.CosineAnnealingLR(opt, T_max=total), "step"),
        "step": (lambda opt: S.StepLR(opt, step_size=40, gamma=0.1), "step"),
        "onecycle": (lambda opt: S.OneCycleLR(opt, max_lr=LR, total_steps=total), "step"),
        "plateau": (lambda opt: S.ReduceLROnPlateau(opt, factor=0.1, patience=0), "plateau"),
        # a 30-step hold at 1/100 of the LR, then back to the optimizer's initial_lr (a 100x rise in one step)
        "back-to-initial-lr": (lambda opt: S.ConstantLR(opt, factor=0.01, total_iters=30), "step"),
        # the bug: a lambda that multiplies the LR by 50 from step 60 on
        "x50-bug": (lambda opt: S.LambdaLR(opt, lambda s: 1.0 if s < 60 else 50.0), "step"),
    }


@pytest.fixture(scope="module")
def schedule_server(tmp_path_factory):
    from tests.conftest import start_sqlite_server
    srv = start_sqlite_server(tmp_path_factory.mktemp("lr-schedules"))
    yield srv
    srv.stop()


def schedule_loop(name: str, attach=None) -> tuple[list[float], list[float]]:
    """A tiny regression trained for EPOCHS x STEPS_PER_EPOCH steps with AdamW(lr=LR) and the named real
    scheduler; ``attach(model, optimizer)`` returns a monitor that is given each loss (None: plain PyTorch, as
    bench/early_warning/loss_regression.py runs it). Returns the losses and the LRs the loop used. Its batches
    come in the same order every epoch, so the loss varies with the batch as well as with training."""
    import torch

    make, when = _schedules()[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = make(opt)
    monitor = attach(model, opt) if attach is not None else None
    x = torch.randn(256, 8)
    y = x[:, :1] * 0.5 - x[:, 1:2]
    losses, used = [], []
    for epoch in range(EPOCHS):
        for i in range(STEPS_PER_EPOCH):
            rows = slice(i * 12 % 256, i * 12 % 256 + 64)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            if monitor is not None:
                monitor.log(loss=loss)
            loss.backward()
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            losses.append(float(loss.detach()))
            if when == "step":
                sched.step()
        if when == "epoch":
            sched.step(epoch + 1)
        elif when == "plateau":
            sched.step(1.0)            # a metric that never improves: the LR falls every epoch
    if monitor is not None:
        monitor.close()
    return losses, used


def train_with_schedule(srv, tmp_path, name: str) -> tuple[list[dict], list[float]]:
    """schedule_loop with the agent attached to a real server; returns the run's alerts and the LRs the loop
    used."""
    from gradwatch import agent
    from tests.conftest import wait_until

    _, used = schedule_loop(name, lambda model, opt: agent.attach(
        model, optimizer=opt, server=srv.url, project="lr-schedules", run=name, spool_dir=str(tmp_path / name),
        flush_interval=0.1))
    last = len(used) - 1

    def done():
        _, body = srv.get("/api/v1/runs?project=lr-schedules")
        r = next((r for r in body["runs"] if r["name"] == name), None)
        return r if r and r.get("last_step") == last else None
    run = wait_until(done, timeout=30, what=f"run {name}'s steps")     # a hang guard, not a timing bound
    _, alerts = srv.get(f"/api/v1/alerts?run={run['id']}")
    return alerts["alerts"], used


@pytest.mark.parametrize("name", [n for n in _schedules() if n != "x50-bug"])
def test_h10_raises_nothing_above_info_on_standard_schedules(name, schedule_server, tmp_path):
    alerts, used = train_with_schedule(schedule_server, tmp_path, name)
    rises = [b / a for a, b in zip(used, used[1:]) if a > 0]
    if name in ("timm-epoch-warmup", "lightning-epoch-linear-warmup", "back-to-initial-lr"):
        assert max(rises) >= 5, f"{name}: the schedule has no >= 5x rise, so the test would show nothing"
    above_info = [(a["rule"], a["severity"], a["message"]) for a in alerts if a["severity"] != "info"]
    assert not above_info, (name, above_info)
    assert "H10" not in {a["rule"] for a in alerts}


def test_h10_warns_on_a_scheduler_bug_that_multiplies_the_lr_by_50(schedule_server, tmp_path):
    alerts, used = train_with_schedule(schedule_server, tmp_path, "x50-bug")
    assert used[59] == LR and used[60] == 50 * LR
    (a,) = [a for a in alerts if a["rule"] == "H10"]
    assert a["severity"] == "warning" and a["first_step"] == 60
    assert "from 0.01 at step 59 to 0.5 at step 60" in a["message"] and "50x" in a["message"], a["message"]
    assert "configured with" in a["message"]
