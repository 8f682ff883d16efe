"""The NaN origin found at the failing step itself (agent/capture/replay.py), through a real server.

Each loop is a real training loop on a tiny model with one bad batch that never recurs: the hunt
over the *following* steps (agent/wire.py ``NanHunt``) would hook healthy steps and give up with
``nan_origin_not_found``; the replay of the skipped step names the module at its own step, with the
statistics that say which of the checklist's NaN sources (6.2) it was. The numbers the event carries
are compared with the same module run by the test itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from gradwatch import agent
from tests.conftest import wait_until
from tests.origin.conftest import events, run_id, stored_steps, wait_for_alert

BAD_STEP = 37


class ExpNormalize(torch.nn.Module):
    """A hand-written softmax, exp(x) / sum(exp(x)), without the max subtraction: exp overflows fp16 past 11.09."""

    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(dim=-1, keepdim=True)


class SoftmaxNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.soft = ExpNormalize()
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.drop(self.soft(self.fc1(x))))


def _fp16_softmax_loop(server, project: str, run: str, steps: int = 45, fused: bool = False, **settings):
    """fp16 autocast on the CPU with a real GradScaler; batch BAD_STEP is scaled 1000x (one bad record)."""
    torch.manual_seed(0)
    model = SoftmaxNet()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.01))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = agent.attach(model, scaler, project=project, run=run, server=server.url, flush_interval=0.1,
                           **settings)
    expected = {}
    for step in range(steps):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if step == BAD_STEP:
            x = x * 1000.0
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
                h = model.fc1(x)                       # the bad module's input, as the step computes it
                out = model.soft(h)
            expected = {"h": h.float(), "out": out.float()}
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        if step == BAD_STEP:
            assert not torch.isfinite(loss), "the bad batch must make the loss non-finite"
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    return expected


def test_transient_fp16_softmax_overflow_is_named_at_its_step(live_server, run_name):
    expected = _fp16_softmax_loop(live_server, "origin", run_name)
    rid = run_id(live_server, "origin", run_name)
    assert stored_steps(live_server, rid) == list(range(45))

    found = wait_until(lambda: events(live_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1
    ev = found[0]
    data = ev["data"]
    assert ev["step"] == BAD_STEP
    assert data["module"] == "soft" and data["where"] == "activation"
    assert data["cause"] == "softmax_overflow"
    assert data["method"] == "replay"
    h, out = expected["h"], expected["out"]
    assert data["input"]["dtype"] == "float16" and data["output"]["dtype"] == "float16"
    assert data["input"]["max"] == float(h.max()) and data["input"]["max"] > math.log(65504)
    assert data["input"]["absmax"] == float(h.abs().max())
    assert data["input"]["nonfinite"] == 0
    assert data["output"]["nan"] == int(torch.isnan(out).sum()) > 0
    assert data["output"]["nonfinite"] == int((~torch.isfinite(out)).sum())
    assert events(live_server, rid, "nan_origin_not_found") == []

    a3 = wait_for_alert(live_server, rid, "A3")
    assert len(a3) == 1 and a3[0]["step"] == BAD_STEP
    assert "`soft`" in a3[0]["diagnosis"] and "softmax / exp overflow" in a3[0]["diagnosis"]
    assert f"{float(h.max()):.4g}" in a3[0]["diagnosis"]
    assert a3[0]["evidence"]["cause"] == "softmax_overflow"
    assert any("Subtract the row max" in a for a in a3[0]["actions"])


def test_a_fused_optimizer_that_skips_on_the_device_is_replayed_too(sqlite_server, run_name):
    """AdamW(fused=True) takes the scaler's found_inf itself and is always called; on the CPU the agent
    reads the loss instead (no device to sync with) and replays the same way."""
    _fp16_softmax_loop(sqlite_server, "origin", run_name, steps=BAD_STEP + 3, fused=True)
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert [(e["step"], e["data"]["module"], e["data"]["cause"]) for e in found] == \
        [(BAD_STEP, "soft", "softmax_overflow")]


def test_without_the_replay_the_hunt_gives_up_on_a_transient_nan(sqlite_server, run_name):
    """The reason for the replay: the same run with nan_replay=False ends in nan_origin_not_found."""
    _fp16_softmax_loop(sqlite_server, "origin", run_name, steps=BAD_STEP + 8, nan_replay=False, nan_hunt_steps=5)
    rid = run_id(sqlite_server, "origin", run_name)
    gave_up = wait_until(lambda: events(sqlite_server, rid, "nan_origin_not_found"), what="hunt gave up")
    assert gave_up[0]["step"] > BAD_STEP
    assert events(sqlite_server, rid, "nan_origin") == []


class Log(torch.nn.Module):
    """log of a softplus output: positive, unless softplus underflows to exactly 0, then log(0) = -inf."""

    def forward(self, x):
        return torch.log(x)


class LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.act = torch.nn.Softplus()
        self.log = Log()
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.log(self.act(self.fc1(x))))


def test_log_of_zero_on_one_batch_with_a_loss_closure(sqlite_server, run_name):
    """fp32 with an enabled GradScaler: one batch drives a softplus to exactly 0 (its input -200), log gives -inf."""
    torch.manual_seed(1)
    model = LogNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    monitor = agent.attach(model, scaler, project="origin", run=run_name, server=sqlite_server.url,
                           flush_interval=0.1)
    bad_step, reference = 20, None
    for step in range(30):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == bad_step:
            x[2] = 1e4   # softplus(fc1(x)) underflows to 0 for some features of this row
            with torch.no_grad():
                reference = model.act(model.fc1(x))
        opt.zero_grad()
        monitor.replayable(lambda x=x, y=y: F.mse_loss(model(x), y))
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1 and found[0]["step"] == bad_step
    data = found[0]["data"]
    assert (data["module"], data["where"], data["cause"]) == ("log", "activation", "log_of_nonpositive")
    assert data["input"]["zeros"] == int((reference == 0).sum()) > 0
    assert data["output"]["neginf"] == int((reference == 0).sum())
    assert events(sqlite_server, rid, "nan_origin_not_found") == []
    a3 = wait_for_alert(sqlite_server, rid, "A3")
    assert "log of a value <= 0" in a3[0]["diagnosis"]


class RootAbs(torch.nn.Module):
    """sqrt(|x|): finite forward, but its derivative 1/(2 sqrt|x|) is Inf at an exact 0."""

    def forward(self, x):
        return torch.sqrt(torch.abs(x))


class RootNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.root = RootAbs()
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.root(self.fc1(x)))


def test_nan_guard_without_a_scaler_names_a_backward_origin(sqlite_server, run_name):
    """fp32, no scaler: nan_guard=True checks the grad norm before optimizer.step() and replays the step
    while the weights are still the forward's; the loss closure lets it replay the backward too."""
    torch.manual_seed(2)
    model = RootNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, optimizer=opt, project="origin", run=run_name, server=sqlite_server.url,
                           flush_interval=0.1, nan_guard=True)
    bad_step = 12
    for step in range(bad_step + 1):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == bad_step:
            x[5] = 0.0
            with torch.no_grad():
                model.fc1.bias[3] = 0.0     # fc1(x[5]) has an exact 0 in feature 3
        opt.zero_grad()
        monitor.replayable(lambda x=x, y=y: F.mse_loss(model(x), y))
        loss = F.mse_loss(model(x), y)
        assert torch.isfinite(loss)              # the forward is finite: only the backward makes the NaN
        loss.backward()
        opt.step()
        monitor.log(loss=loss)
    grads_finite = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
    monitor.close()
    assert not all(grads_finite)
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1 and found[0]["step"] == bad_step
    data = found[0]["data"]
    assert (data["module"], data["where"], data["cause"]) == ("root", "grad", "division_by_zero")
    assert data["input"]["zeros"] >= 1
    assert data["grad_output"]["nonfinite"] == 0 and data["grad"]["nonfinite"] > 0


def _loop_state(nan_replay: bool, server, run: str):
    """The softmax loop with BatchNorm and dropout; returns what the replay must leave as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), ExpNormalize(), torch.nn.BatchNorm1d(16),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = agent.attach(model, scaler, project="origin", run=run, server=server.url, flush_interval=0.1,
                           nan_replay=nan_replay)
    for step in range(12):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        if step == 6:
            x = x * 1000.0
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        if step == 6:
            grads = [p.grad.clone() for p in model.parameters()]
        scaler.update()
    monitor.close()
    return {"rng": torch.get_rng_state(), "weights": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()], "grads_at_bad_step": grads}


def test_the_replay_leaves_rng_weights_buffers_and_grads_as_they_were(sqlite_server, run_name):
    plain = _loop_state(False, sqlite_server, run_name + "-off")
    replayed = _loop_state(True, sqlite_server, run_name + "-on")
    rid = run_id(sqlite_server, "origin", run_name + "-on")
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert found[0]["step"] == 6 and found[0]["data"]["module"] == "1"   # the ExpNormalize
    assert torch.equal(plain["rng"], replayed["rng"])
    # the bad step's NaN reached BatchNorm's running statistics in both runs (the step's own forward did that)
    for a, b in zip(plain["weights"] + plain["buffers"] + plain["grads_at_bad_step"],
                    replayed["weights"] + replayed["buffers"] + replayed["grads_at_bad_step"]):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


class RootNetWithLoss(RootNet):
    """Returns its own loss, as a Hugging Face model given ``labels`` does (a dict with ``loss``)."""

    def forward(self, x, labels=None):
        logits = super().forward(x)
        return {"logits": logits, "loss": F.mse_loss(logits, labels)}


def test_a_model_that_returns_its_loss_is_replayed_through_its_backward_without_a_closure(sqlite_server, run_name):
    torch.manual_seed(3)
    model = RootNetWithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = agent.attach(model, optimizer=opt, project="origin", run=run_name, server=sqlite_server.url,
                           flush_interval=0.1, nan_guard=True)
    bad_step = 5
    for step in range(bad_step + 1):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == bad_step:
            x[1] = 0.0
            with torch.no_grad():
                model.fc1.bias[6] = 0.0
        opt.zero_grad()
        out = model(x, labels=y)
        out["loss"].backward()
        opt.step()
    monitor.close()
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1 and found[0]["step"] == bad_step
    data = found[0]["data"]
    assert (data["module"], data["where"], data["cause"]) == ("root", "grad", "division_by_zero")
    assert data["input"]["zeros"] == 1        # fc1(x[1]) = fc1.bias, whose feature 6 is exactly 0


class DropoutSoftmaxNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.soft = ExpNormalize()
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.soft(self.drop(self.fc1(x))))


def test_the_bad_micro_batch_is_replayed_with_its_own_dropout_masks(sqlite_server, run_name):
    """Gradient accumulation (4 micro-batches), batches sampled with the global RNG between forwards
    (as nanoGPT's get_batch does), dropout before the overflowing module: the replay's statistics are
    those of the bad micro-batch under the dropout mask the step drew, captured here by a hook of the
    test's own during the real step."""
    torch.manual_seed(4)
    model = DropoutSoftmaxNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = agent.attach(model, scaler, project="origin", run=run_name, server=sqlite_server.url,
                           flush_interval=0.1)
    pool = torch.randn(64, 8)
    bad_step, bad_micro, captured = 9, 2, {}

    def capture(module, args, output):
        captured["drop_out"] = output.detach().float().clone()

    for step in range(12):
        opt.zero_grad()
        for micro in range(4):
            x = pool[torch.randint(0, 64, (4,))]        # consumes the global RNG between forwards
            if (step, micro) == (bad_step, bad_micro):
                x = x * 1000.0
                handle = model.drop.register_forward_hook(capture)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean() / 4
            if (step, micro) == (bad_step, bad_micro):
                handle.remove()
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1 and found[0]["step"] == bad_step
    data = found[0]["data"]
    assert (data["module"], data["cause"], data["micro_batch"], data["forwards"]) == \
        ("soft", "softmax_overflow", bad_micro, 4)
    drop_out = captured["drop_out"]
    # the same mask: every statistic of the step's own dropout output (another mask moves min / counts)
    assert (data["input"]["max"], data["input"]["min"], data["input"]["absmax"]) == \
        (float(drop_out.max()), float(drop_out.min()), float(drop_out.abs().max()))
    assert (data["input"]["zeros"], data["input"]["nonpositive"]) == \
        (int((drop_out == 0).sum()), int((drop_out <= 0).sum()))


def test_the_division_by_zero_scenario_is_told_apart_from_a_log(sqlite_server, run_name):
    """tests/scenarios' A3 loop (row standardisation meets a constant row from step 80: std = 0, 0/0 = NaN):
    the input has no zeros and no NaN sits at a negative input, so it is the denominator inside the module."""
    from tests.scenarios.test_scenarios import a3_division_by_zero

    loop = a3_division_by_zero()
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(loop.model, scaler, optimizer=loop.optimizer, project="origin", run=run_name,
                           server=sqlite_server.url, flush_interval=0.1)
    for step in range(loop.steps):
        x, y = loop.batch(step)
        loop.optimizer.zero_grad()
        loss = loop.loss(loop.model(x), y)
        scaler.scale(loss).backward()
        scaler.step(loop.optimizer)
        scaler.update()
    monitor.close()
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert [(e["step"], e["data"]["module"], e["data"]["cause"]) for e in found] == [(80, "0", "division_by_zero")]
    a3 = wait_for_alert(sqlite_server, rid, "A3")
    assert "division by zero" in a3[0]["diagnosis"]
    assert any("epsilon to the denominator" in a for a in a3[0]["actions"])
