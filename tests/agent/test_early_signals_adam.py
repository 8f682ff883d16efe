"""Early-warning signals H1 / H4 (docs/early-warning-adam.md): Adam's g² / v̂ and the linear layers' output RMS.

Each value the agent sends is checked against the same quantity computed here with plain PyTorch, in
float64, from what the loop itself holds: a deep copy of the optimizer's state taken right before
``scaler.step()`` and the gradients as Adam is about to use them (unscaled, clipped), or the outputs
of the model's own Linear modules caught with hooks of the test's own.
"""
from __future__ import annotations

import copy

import pytest
import torch

from gradwatch import agent
from agent_helpers import TinyNet, batches


def _expected_ratios(model, opt, group_of) -> list:
    """mean(g²) / (mean(v̂_prev) + ε²) per parameter from a deep copy of Adam's state (None: no state)."""
    state = {p: copy.deepcopy(opt.state[p]) for p in model.parameters() if p in opt.state}
    out = []
    for p in model.parameters():
        st = state.get(p)
        g = group_of[id(p)]
        if not st or "exp_avg_sq" not in st or p.grad is None:
            out.append(None)
            continue
        v = (st["max_exp_avg_sq"] if g.get("amsgrad") else st["exp_avg_sq"]).double()
        t = float(st["step"])
        v_hat = v / (1.0 - g["betas"][1] ** t)
        grad = p.grad.detach().double()
        out.append(float((grad * grad).mean() / (v_hat.mean() + g["eps"] ** 2)))
    return out


def _train(model, opt, recorder, settings, steps=8, max_norm=2.0, scaler=True, jump_at=None, **kw):
    scaler_obj = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    monitor = agent.attach(model, scaler_obj, optimizer=opt, transport=recorder, **{"adam_every": 1, **settings, **kw})
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    expected = {}
    for i, (x, y) in enumerate(batches(steps)):
        if jump_at is not None and i >= jump_at:
            x = x * 100.0      # the inputs, so the first layer's gradients, jump: v̂ is stale
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if scaler_obj is not None:
            scaler_obj.scale(loss).backward()
            scaler_obj.unscale_(opt)
        else:
            loss.backward()
        if max_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        expected[i] = _expected_ratios(model, opt, group_of)
        if scaler_obj is not None:
            scaler_obj.step(opt)
            scaler_obj.update()
        else:
            opt.step()
    monitor.close()
    return expected


@pytest.mark.parametrize("variant", ["for-loop", "foreach", "fused", "amsgrad", "adam-two-groups"])
def test_adam_g2_over_v_equals_the_ratio_recomputed_from_the_optimizer_state(variant, recorder, agent_settings):
    torch.manual_seed(0)
    model = TinyNet()
    if variant == "adam-two-groups":
        opt = torch.optim.Adam([{"params": model.fc1.parameters(), "betas": (0.9, 0.9999)},
                                {"params": list(model.fc2.parameters()), "eps": 1e-3}], lr=1e-2)
    else:
        kw = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
              "amsgrad": {"amsgrad": True}}[variant]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)
    expected = _train(model, opt, recorder, agent_settings, jump_at=5)
    steps = recorder.steps
    assert len(steps) == 8
    assert "adam_g2_over_v" not in (steps[0].get("layers") or {})     # no state before Adam's first step
    assert steps[0].get("adam_g2_over_v_max") is None
    for s in steps[1:]:
        want = expected[s["step"]]
        got = s["layers"]["adam_g2_over_v"]
        assert got == pytest.approx(want, rel=1e-5), s["step"]
        assert s["adam_g2_over_v_max"] == pytest.approx(max(want), rel=1e-5)
    # the jump at step 5 reads as a stale second moment on the first layer, not before
    assert max(expected[4]) < 10 < steps[5]["layers"]["adam_g2_over_v"][0]


def test_a_parameter_without_grad_is_not_measured_and_no_scaler_works_through_the_optimizer_hooks(
        recorder, agent_settings):
    torch.manual_seed(1)
    model = TinyNet()
    model.unused = torch.nn.Linear(3, 3)      # never called: no grad, no Adam state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = _train(model, opt, recorder, agent_settings, steps=5, max_norm=0, scaler=False)
    steps = recorder.steps
    names = recorder.meta()["param_names"]
    assert names[-2:] == ["unused.weight", "unused.bias"]
    for s in steps[1:]:
        got = s["layers"]["adam_g2_over_v"]
        assert got[-2:] == [None, None]
        assert got[:-2] == pytest.approx(expected[s["step"]][:-2], rel=1e-5)


def test_no_adam_state_no_signal(recorder, agent_settings):
    torch.manual_seed(2)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, recorder, agent_settings, steps=4)
    assert all("adam_g2_over_v" not in (s.get("layers") or {}) and s.get("adam_g2_over_v_max") is None
               for s in recorder.steps)


def test_adam_every_samples_the_ratio_and_zero_turns_it_off(recorder, agent_settings):
    torch.manual_seed(3)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, recorder, agent_settings, steps=7, adam_every=3)
    assert [s["step"] for s in recorder.steps if "adam_g2_over_v" in (s.get("layers") or {})] == [3, 6]


@pytest.mark.parametrize("amp", [False, True])
def test_linear_out_rms_equals_each_linear_outputs_rms_on_sampled_steps(amp, recorder, agent_settings):
    torch.manual_seed(4)
    model = TinyNet()
    outs: dict[str, list] = {"fc1": [], "fc2": []}
    model.fc1.register_forward_hook(lambda m, a, out: outs["fc1"].append(out.detach().double()))
    model.fc2.register_forward_hook(lambda m, a, out: outs["fc2"].append(out.detach().double()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = agent.attach(model, None, optimizer=opt, transport=recorder, linear_every=2, **agent_settings)
    for x, y in batches(5):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()
        # the agent's hooks exist only while a sampled step's forward runs
        assert len(model.fc1._forward_hooks) == 1 and len(model._forward_hooks) == 0
        opt.step()
    monitor.close()
    assert recorder.meta()["module_names"] == ["fc1", "bn", "act", "fc2"]
    sampled = [s for s in recorder.steps if "linear_out_rms" in (s.get("layers") or {})]
    assert [s["step"] for s in sampled] == [0, 2, 4]
    for s in sampled:
        got = s["layers"]["linear_out_rms"]
        i = s["step"]
        assert got[1] is None and got[2] is None        # Identity, GELU: not linear layers
        for k, name in ((0, "fc1"), (3, "fc2")):
            y = outs[name][i]
            assert got[k] == pytest.approx(float(y.pow(2).mean().sqrt()), rel=1e-5)


def test_the_carried_second_moment_sum_follows_adam_through_skipped_steps_and_resyncs(recorder, agent_settings,
                                                                                     monkeypatch):
    """Between exact reads of the state, sum(v) is carried with Adam's own recursion: it must stay equal to
    the state's through steps the GradScaler skips (an inf gradient) and across the periodic exact reads."""
    from gradwatch.agent.collectors.adam import AdamStaleness

    monkeypatch.setattr(AdamStaleness, "EXACT_EVERY", 7)
    torch.manual_seed(5)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    monitor = agent.attach(model, scaler, optimizer=opt, transport=recorder, adam_every=1, **agent_settings)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    expected, skipped = {}, {10, 11, 19}
    for i, (x, y) in enumerate(batches(30)):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if i in skipped:
            model.fc2.bias.grad[0] = float("inf")     # an fp16-style overflow: the scaler skips the step
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        expected[i] = _expected_ratios(model, opt, group_of)
        scaler.step(opt)
        scaler.update()
    monitor.close()
    compared = 0
    for s in recorder.steps[1:]:
        if s["step"] in skipped:
            continue
        assert s["layers"]["adam_g2_over_v"] == pytest.approx(expected[s["step"]], rel=1e-5), s["step"]
        compared += 1
    assert compared == 26
