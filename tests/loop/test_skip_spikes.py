"""The opt-in ``skip_spikes`` guard on real tiny loops: a spiking run stays finite where the unguarded one
goes non-finite; the skipped updates are exactly the injected spikes, stored as ``skipped_update`` flags.

A spike is one batch whose loss is multiplied by a huge factor (a corrupt batch, an overflow in a custom
op): 1e8 gives a grad norm far beyond 6σ of the last 128 steps; 1e30 gives finite fp32 grads whose norm is
infinite (the sum of squares overflows), which a GradScaler does not skip. The references are the loop's
own: which steps it spiked, and its weights before and after each of them.
"""
from __future__ import annotations

import math

import pytest
import torch

from gradwatch import agent
from tests.integrations.conftest import run_of, series
from tests.loop.loops import batch, regression_model

# step -> loss factor; two in a row too: the first must not widen the band for the second
SPIKES = {90: 1e30, 130: 1e8, 131: 1e8, 175: 1e30}
STEPS = 200


def tensors(model, opt) -> list[torch.Tensor]:
    """The weights and SGD's momentum buffers (from the second step on)."""
    out = list(model.parameters())
    return out + [opt.state[p]["momentum_buffer"] for p in out if "momentum_buffer" in opt.state.get(p, {})]


def spiking_sgd_loop(monitor_kwargs: dict, project: str, run: str, server_url: str):
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = agent.attach(model, optimizer=opt, project=project, run=run, server=server_url, flush_interval=0.1,
                           **monitor_kwargs)
    unchanged = []          # per spike: the weights after it equal the weights before it, bit for bit
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step in SPIKES:
            loss = loss * SPIKES[step]
            before = [t.detach().clone() for t in tensors(model, opt)]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step in SPIKES:
            unchanged.append(all(torch.equal(b, t) for b, t in zip(before, tensors(model, opt))))
    count = monitor.skipped_updates
    monitor.close()
    finite = all(torch.isfinite(p).all().item() for p in model.parameters())
    return finite, unchanged, count, losses


def test_the_guard_keeps_a_spiking_run_finite(live_server):
    finite, unchanged, count, losses = spiking_sgd_loop({}, "skip", "unguarded", live_server.url)
    assert not finite, "without the guard the spikes make the weights non-finite (else the test proves nothing)"

    finite, unchanged, count, losses = spiking_sgd_loop({"skip_spikes": True}, "skip", "guarded", live_server.url)
    assert finite
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i not in SPIKES)
    assert unchanged == [True] * len(SPIKES), "each spike's update was undone, momentum buffers included"
    assert count == len(SPIKES)

    run = run_of(live_server, "skip", "guarded")
    flags = series(live_server, run["id"], "skipped_update")
    assert sorted(flags) == list(range(STEPS)), "the flag is recorded on every step the guard decided"
    assert sorted(s for s, v in flags.items() if v) == sorted(SPIKES)
    grad_norm = series(live_server, run["id"], "grad_norm")
    assert math.isinf(grad_norm[90]) and math.isfinite(grad_norm[130]), "both kinds of spike were there"
    # shown: the run page's grad-norm chart, built from the server's series as the dashboard builds it,
    # flags the skips at a finite grad norm; those at an infinite one are on its NaN / Inf rug
    from gradwatch.dashboard.figures import PANELS_BY_KEY, series_figure

    panel = PANELS_BY_KEY["grad_norm"]
    chart = {}
    for signal in panel.signals:
        status, body = live_server.get(f"/api/v1/runs/{run['id']}/series?signal={signal}&max_points=100000")
        assert status == 200, body
        chart[signal] = body
    figure, _ = series_figure(panel, chart)
    traces = {t["name"]: t for t in figure["data"]}
    assert traces["update skipped (guard)"]["x"] == [130, 131]
    assert traces["NaN / Inf"]["x"] == [90, 175]
    unguarded = run_of(live_server, "skip", "unguarded")
    assert set(series(live_server, unguarded["id"], "skipped_update").values()) == {None}, \
        "no guard: not measured"


def test_the_guard_with_a_grad_scaler_and_adam_restores_the_optimizer_state():
    """fp16-style loop (GradScaler on the CPU) with AdamW: a 1e30 grad squares to inf in exp_avg_sq, which
    would freeze every later update; the guard restores the moments. No server: the guard is the agent's."""
    def run(skip: bool):
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        monitor = agent.attach(model, scaler, optimizer=opt, mode="disabled", skip_spikes=skip)
        for step in range(STEPS):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step in SPIKES:
                loss = loss * SPIKES[step]
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        count = monitor.skipped_updates
        monitor.close()
        moments_finite = all(torch.isfinite(t).all().item() for st in opt.state.values()
                             for k, t in st.items() if k != "step")
        return moments_finite, count

    assert run(False) == (False, 0)
    assert run(True) == (True, len(SPIKES))


def test_bad_guard_settings_are_refused_at_attach():
    model = regression_model()
    with pytest.raises(ValueError, match="skip_sigma"):
        agent.attach(model, mode="disabled", skip_spikes=True, skip_sigma=0)
    with pytest.raises(ValueError, match="skip_window"):
        agent.attach(model, mode="disabled", skip_spikes=True, skip_window=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_guard_adds_no_host_device_sync_on_cuda():
    """The guarded fp16 loop under sync_debug_mode("error"): fused AdamW keeps its step counter on the device
    and takes the scaler's found_inf there, so any sync left would be the guard's (an exception that turns
    it off). The spike is still undone."""
    torch.manual_seed(0)
    model = regression_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    # scale 1 and a 1e3 spike: fp16 grads stay finite (a larger one is an overflow the scaler skips itself)
    scaler = torch.amp.GradScaler("cuda", init_scale=1.0, growth_interval=1_000_000)
    monitor = agent.attach(model, scaler, optimizer=opt, mode="disabled", skip_spikes=True)
    data = [tuple(t.cuda() for t in batch(step)) for step in range(80)]
    factor = torch.tensor(1e3, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, (x, y) in enumerate(data):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            if step == 70:
                loss = loss * factor
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert "skip_spikes" not in monitor._disabled, monitor._disabled
    assert monitor.skipped_updates == 1
    monitor.close()


def test_a_nan_on_the_very_first_step_leaves_a_fresh_optimizer():
    """bf16 / fp32 (no scaler): a NaN loss on step 0 would write NaN into the weights and into the AdamW
    moments the step creates; the guard undoes the update and zeroes the new state (a fresh start), so
    training goes on finite from step 1."""
    def run(skip: bool) -> bool:
        model = regression_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        monitor = agent.attach(model, optimizer=opt, mode="disabled", skip_spikes=skip)
        for step in range(10):
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if step == 0:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            opt.step()
        monitor.close()
        return all(torch.isfinite(t).all().item() for t in [*model.parameters(),
                                                            *(v for st in opt.state.values() for v in st.values())])

    assert run(False) is False
    assert run(True) is True
