"""What the agent records per optimizer step, on real tiny models and the checklist's loops."""
from __future__ import annotations

import math

import pytest
import torch

from gradwatch import agent
from agent_helpers import ShadowEMA, TinyNet, batches, checklist_step, tiny_loop


def _attach(model, scaler=None, recorder=None, settings=None, **kw):
    return agent.attach(model, scaler, transport=recorder, **{**(settings or {}), **kw})


def test_checklist_loop_records_loss_preclip_norm_scale_and_lr(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ema = ShadowEMA(model)
    monitor = _attach(model, scaler, recorder, agent_settings, ema=ema, ema_every=1)
    expected = []
    for x, y in batches(6):
        loss, total = checklist_step(model, opt, scaler, x, 10 * y, ema=ema, max_norm=0.5)
        expected.append((loss.item(), total.item()))
    monitor.close()

    steps = recorder.steps
    assert [s["step"] for s in steps] == list(range(6))
    for s, (loss, total) in zip(steps, expected):
        assert s["loss"] == pytest.approx(loss, rel=1e-6)
        assert s["grad_norm"] == pytest.approx(total, rel=1e-6)   # the value clip_grad_norm_ returned: pre-clip
        assert s["clip_max_norm"] == 0.5
        assert s["clipped"] is (total > 0.5)
        assert s["loss_scale"] == 1024.0
        assert s["overflow"] is False and s["overflow_count"] == 0
        assert s["lr"] == pytest.approx(3e-4)
        assert len(s["layers"]["grad_norm"]) == 4
        assert s["ema_divergence"] is not None and s["ema_divergence"] > 0
    assert any(s["clipped"] for s in steps)
    assert recorder.bodies[-1]["status"] == "finished"
    meta = recorder.meta()
    assert meta["param_names"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_per_parameter_grad_norms_combine_to_the_global_norm(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    monitor = _attach(model, scaler, recorder, agent_settings)
    x, y = batches(1)[0]
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.unscale_(opt)
    per_param = [p.grad.norm().item() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    monitor.close()
    (step,) = recorder.steps
    assert step["layers"]["grad_norm"] == pytest.approx(per_param, rel=1e-5)
    assert step["grad_norm"] == pytest.approx(math.sqrt(sum(v * v for v in per_param)), rel=1e-5)
    assert step["clip_max_norm"] is None   # no clipping happened in this loop


@pytest.mark.skipif(not hasattr(torch.nn.utils, "clip_grads_with_norm_"), reason="torch < 2.6")
def test_a_clip_with_a_norm_the_caller_computed_is_seen(recorder, agent_settings):
    """accelerate >= 1.16 (the HF Trainer's clip) computes the norm with get_total_norm and clips with
    clip_grads_with_norm_, never calling clip_grad_norm_: the threshold is still seen and the grad norm
    stored is the pre-clip one, the value get_total_norm returned."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    original = torch.nn.utils.clip_grads_with_norm_
    monitor = _attach(model, scaler, recorder, agent_settings)
    assert torch.nn.utils.clip_grads_with_norm_ is not original
    expected = []
    for x, y in batches(4):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), 10 * y)).backward()
        scaler.unscale_(opt)
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm   # looked up at call time, as accelerate
        params = list(model.parameters())
        total = get_total_norm([p.grad for p in params])
        clip_grads_with_norm_(params, 0.25, total)
        expected.append(total.item())
        scaler.step(opt)
        scaler.update()
    monitor.close()
    assert torch.nn.utils.clip_grads_with_norm_ is original
    assert [s["grad_norm"] for s in recorder.steps] == pytest.approx(expected, rel=1e-6)
    assert all(s["clip_max_norm"] == 0.25 for s in recorder.steps)
    assert all(s["clipped"] for s in recorder.steps)   # 10 * y: the norm is far above 0.25


def test_overflow_skips_are_counted_and_the_scale_is_the_one_used(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # A scale near the float32 maximum makes the scaled grads overflow: the scaler halves until they fit.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=1000)
    monitor = _attach(model, scaler, recorder, agent_settings)
    scales = []
    for x, y in batches(4):
        scales.append(scaler.get_scale())   # test-side only: the agent never calls get_scale()
        checklist_step(model, opt, scaler, x, 100 * y)
    monitor.close()
    steps = recorder.steps
    assert [s["loss_scale"] for s in steps] == scales
    overflowed = [s["overflow"] for s in steps]
    assert overflowed[0] is True
    assert [s["overflow_count"] for s in steps] == [sum(overflowed[: i + 1]) for i in range(4)]
    assert math.isinf(steps[0]["grad_norm"]) or math.isnan(steps[0]["grad_norm"])


def test_real_fp16_overflow_under_autocast_is_a_skipped_step(recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    monitor = _attach(model, scaler, recorder, agent_settings)
    for x, y in batches(3):
        checklist_step(model, opt, scaler, x * 1000, y, amp=True)
    monitor.close()
    steps = recorder.steps
    assert steps[0]["overflow"] is True
    assert steps[1]["loss_scale"] == steps[0]["loss_scale"] / 2
    assert all(math.isfinite(s["loss"]) for s in steps)   # a finite loss: a normal skip, not an incident
    assert not [e for e in recorder.events if e["kind"] == "nan_origin"]


def test_gradient_accumulation_sums_micro_batch_losses_into_one_step(recorder, agent_settings):
    """nanoGPT: loss / accum per micro-step, one scaler.step per optimizer step."""
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    monitor = _attach(model, scaler, recorder, agent_settings)
    accum = 4
    data = batches(3 * accum)
    expected = []
    for step in range(3):
        total = 0.0
        for micro in range(accum):
            x, y = data[step * accum + micro]
            loss = torch.nn.functional.mse_loss(model(x), y) / accum
            total += loss.item()
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        expected.append(total)
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 3
    assert [s["loss"] for s in steps] == pytest.approx(expected, rel=1e-5)
    assert all(s["samples_per_s"] and s["samples_per_s"] > 0 for s in steps[1:])


def test_disabled_scaler_still_marks_steps_without_scale_or_overflow(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    monitor = _attach(model, scaler, recorder, agent_settings)
    expected = [checklist_step(model, opt, scaler, x, y) for x, y in batches(3)]
    monitor.close()
    steps = recorder.steps
    assert len(steps) == 3
    for s, (loss, total) in zip(steps, expected):
        assert s["loss"] == pytest.approx(loss.item(), rel=1e-6)
        assert s["grad_norm"] == pytest.approx(total.item(), rel=1e-6)
        assert s["loss_scale"] is None and s["overflow"] is False


def test_no_scaler_bf16_with_optimizer_uses_logged_loss_and_optimizer_steps(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    monitor = _attach(model, None, recorder, agent_settings, optimizer=opt)
    losses = []
    for i, (x, y) in enumerate(batches(4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        pre = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss, acc=0.5 + i)     # logged after the step: belongs to that step
        losses.append((loss.item(), pre.item()))
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    for i, (s, (loss, pre)) in enumerate(zip(steps, losses)):
        assert s["loss"] == pytest.approx(loss, rel=1e-6)
        assert s["grad_norm"] == pytest.approx(pre, rel=1e-6)
        assert s["lr"] == pytest.approx(2e-3)
        assert s["custom"] == {"acc": 0.5 + i}
        assert s["loss_scale"] is None


def test_without_scaler_or_optimizer_each_logged_loss_is_one_step(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _attach(model, None, recorder, agent_settings)
    for x, y in batches(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)
    monitor.log(loss=1.5)
    monitor.close()
    steps = recorder.steps
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[-1]["loss"] == 1.5


def test_attaching_twice_returns_the_same_handle_and_replacing_is_clean(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    first = _attach(model, scaler, recorder, agent_settings)
    assert _attach(model, scaler, recorder, agent_settings) is first
    other_scaler = torch.amp.GradScaler("cpu")
    second = _attach(model, other_scaler, recorder, agent_settings)
    assert second is not first and first.closed
    assert "scale" not in scaler.__dict__          # the first scaler is restored
    for x, y in batches(2):
        checklist_step(model, opt, other_scaler, x, y)
    second.close()
    assert [s["step"] for s in recorder.steps] == [0, 1]


def test_detach_restores_scaler_clip_function_and_hooks(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    original_clip = torch.nn.utils.clip_grad_norm_
    with _attach(model, scaler, recorder, agent_settings, activations_every=1) as monitor:
        assert torch.nn.utils.clip_grad_norm_ is not original_clip
        assert set(scaler.__dict__) >= {"scale", "unscale_", "step", "update"}
        for x, y in batches(2):
            checklist_step(model, opt, scaler, x, y)
    assert monitor.closed
    assert torch.nn.utils.clip_grad_norm_ is original_clip
    assert not {"scale", "unscale_", "step", "update"} & set(scaler.__dict__)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    sent = len(recorder.steps)
    for x, y in batches(2):
        checklist_step(model, opt, scaler, x, y)
    assert len(recorder.steps) == sent


def test_optimizer_hooks_are_removed_on_detach(recorder, agent_settings):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = _attach(model, None, recorder, agent_settings, optimizer=opt)
    assert opt._optimizer_step_pre_hooks and opt._optimizer_step_post_hooks
    monitor.detach()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_the_ema_barrier_hook_and_worker_thread_are_gone_after_detach(recorder, agent_settings):
    import threading
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    model, opt, scaler = tiny_loop()
    ema = ShadowEMA(model)
    before = dict(_global_optimizer_pre_hooks)
    monitor = _attach(model, scaler, recorder, agent_settings, ema=ema, ema_every=1)
    assert len(_global_optimizer_pre_hooks) == len(before) + 1
    for x, y in batches(3):
        checklist_step(model, opt, scaler, x, y, ema=ema)
    assert any(t.name == "gradwatch-ema" for t in threading.enumerate())
    monitor.detach()
    assert dict(_global_optimizer_pre_hooks) == before
    assert not any(t.name == "gradwatch-ema" for t in threading.enumerate())
    assert [s["step"] for s in recorder.steps] == [0, 1, 2]
    assert all(s["ema_divergence"] is not None for s in recorder.steps[:2])
