"""A DeepSpeed engine on DeepSpeed's CPU accelerator (gloo), one process, monitored with
``gradwatch.agent.integrations.deepspeed.watch``: ZeRO stage 0, 1 and 2, fp32 and bf16, with
gradient accumulation.

Compared with the engine's own numbers read back from a real server: the loss the loop
back-propagated (summed over the step's micro-batches), ``engine.get_global_grad_norm()`` (the stored
``grad_norm`` under ZeRO 1/2, where the agent has no ``p.grad`` to measure; ``custom:grad_norm`` at
stage 0, where the agent's own wins), the norm of the reduced ``p.grad`` where stage 0 leaves them
(the reference for the agent's own ``grad_norm``), ``engine.skipped_steps``, the config's clip
threshold and ``clipped``; and no overflow nor loss_scale is stored (fp32 / bf16 have no loss scaler,
and never skip a finite step).
fp16 with DeepSpeed's DynamicLossScaler runs too (ZeRO 0 and 2) where the CPU has native fp16
(skipped elsewhere: DeepSpeed refuses it): the engine's loss scaler is the step's, as a GradScaler's
would be: ``overflow`` on the steps it skipped, ``overflow_count`` its ``skipped_steps``,
``loss_scale`` the scale each step's loss was multiplied by; a step it skips stores no grad_norm and
raises no alert, a burst of skips raises A5 as with a GradScaler.
"""
from __future__ import annotations

import uuid

import pytest

from tests.conftest import http_json, wait_until
from tests.integrations.stacks import (check_loss_scaler, launch, max_rel, needs_cpu_fp16, require_installed,
                                      run_id, stored)

require_installed("deepspeed")

STEPS = 4



@pytest.mark.parametrize("stage,precision", [(0, "no"), (0, "bf16"), (1, "no"), (2, "bf16")])
def test_deepspeed_engine_stores_the_engines_loss_grad_norm_and_skipped_steps(gw_server, tmp_path, stage, precision):
    name = f"ds-z{stage}-{precision}-{uuid.uuid4().hex[:6]}"
    (rec,) = launch("deepspeed", tmp_path, server=gw_server, run=name, steps=STEPS,
                    extra=("--zero-stage", str(stage), "--precision", precision, "--accum", "2"))
    assert rec["steps"] == STEPS and rec["warnings"] == []
    rid = run_id(gw_server, name)
    loss = stored(gw_server, rid, "loss")
    assert sorted(loss) == list(range(STEPS)), "one gradwatch step per engine step at the accumulation boundary"
    assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} loss") <= 1e-6
    skipped = stored(gw_server, rid, "custom:deepspeed_skipped_steps")
    assert [skipped[s] for s in range(STEPS)] == rec["skipped_steps"] == [0] * STEPS
    overflow = stored(gw_server, rid, "overflow")
    assert [overflow[s] for s in range(STEPS)] == [0] * STEPS, "no loss scaler: no overflow is ever stored"
    assert [stored(gw_server, rid, "overflow_count")[s] for s in range(STEPS)] == [0] * STEPS
    assert all(v is None for v in stored(gw_server, rid, "loss_scale").values()), "no loss scaler: no loss_scale"
    clip_max = stored(gw_server, rid, "clip_max_norm")
    assert [clip_max[s] for s in range(STEPS)] == [rec["clip"]] * STEPS   # the config's gradient_clipping
    engine_norm = stored(gw_server, rid, "custom:grad_norm")
    grad_norm = stored(gw_server, rid, "grad_norm")
    clipped = stored(gw_server, rid, "clipped")
    # clipped: the step's norm above the threshold, the engine's where the agent measured none
    reference = rec["grad_norm"] if stage else rec["p_grad_norm"]
    assert [clipped[s] for s in range(STEPS)] == [float(n > rec["clip"]) for n in reference], reference
    assert {clipped[s] for s in range(STEPS)} == {0.0, 1.0}, reference   # steps on both sides of it
    if stage == 0 and precision == "no":
        # the engine clips with its own function and keeps no norm; p.grad is all there, reduced
        assert rec["grad_norm"] == [None] * STEPS and not engine_norm
        assert max_rel([grad_norm[s] for s in range(STEPS)], rec["p_grad_norm"], f"{name} grad_norm vs p.grad") <= 1e-6
        return
    if stage == 0:
        # the agent's own grad_norm of the reduced p.grad wins; the engine's is kept as custom:grad_norm. In
        # bf16 the parameters and grads are bf16, and the agent's per-parameter norms (torch._foreach_norm,
        # agent/capture/norms.py) come out in bf16: rounded to 2^-8 relative each, the total measured 2.5e-3
        # off (the engine's exact value is the custom:grad_norm)
        assert max_rel([engine_norm[s] for s in range(STEPS)], rec["grad_norm"], f"{name} custom:grad_norm") <= 1e-6
        assert max_rel([grad_norm[s] for s in range(STEPS)], rec["p_grad_norm"],
                       f"{name} grad_norm vs p.grad") <= 2 ** -8
    else:            # ZeRO 1/2: no p.grad left at the step; the stored grad_norm is the engine's
        assert rec["p_grad_norm"] == [None] * STEPS and not engine_norm
        assert max_rel([grad_norm[s] for s in range(STEPS)], rec["grad_norm"], f"{name} grad_norm vs engine") <= 1e-6


@needs_cpu_fp16
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_fp16_loss_scaler_skips_are_counted_not_read_as_explosions(gw_server, tmp_path, stage):
    """fp16 with DeepSpeed's DynamicLossScaler, on its CPU accelerator: at 2^16 the first step overflows
    under ZeRO 2 and the engine skips it (its norm is inf then). That step stores overflow true and no
    grad_norm, and raises no alert (the loss scaler did its job: one skip is no A5 storm, no A2);
    overflow_count and custom:deepspeed_skipped_steps are engine.skipped_steps, loss_scale the scale
    the step's loss was multiplied by (read from the engine before engine.step()), and
    custom:deepspeed_loss_scale the one after it; every other step's grad_norm is the engine's."""
    name = f"ds-z{stage}-fp16-{uuid.uuid4().hex[:6]}"
    (rec,) = launch("deepspeed", tmp_path, server=gw_server, run=name, steps=STEPS,
                    extra=("--zero-stage", str(stage), "--precision", "fp16", "--accum", "2"))
    assert rec["steps"] == STEPS and rec["warnings"] == []
    rid = run_id(gw_server, name)
    loss = stored(gw_server, rid, "loss")
    assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} loss") <= 1e-6
    skipped = stored(gw_server, rid, "custom:deepspeed_skipped_steps")
    assert [skipped[s] for s in range(STEPS)] == rec["skipped_steps"]
    scale = stored(gw_server, rid, "custom:deepspeed_loss_scale")
    assert [scale[s] for s in range(STEPS)] == rec["loss_scale"]
    grad_norm = stored(gw_server, rid, "grad_norm")
    was_skipped = [b > a for a, b in zip([0] + rec["skipped_steps"], rec["skipped_steps"])]
    check_loss_scaler(gw_server, rid, rec, STEPS)
    if stage == 2:
        assert was_skipped[0] and rec["grad_norm"][0] == float("inf"), rec   # the overflow this test is for
    kept = [s for s in range(STEPS) if not was_skipped[s]]
    assert kept and all(grad_norm.get(s) is None for s in range(STEPS) if was_skipped[s])
    if stage == 0:
        # the agent's own norm of the fp16 p.grad (DeepSpeed 0.19.8 scales no loss at stage 0, so they are
        # unscaled), per parameter in fp16: rounded to 2^-11 relative each; the engine's is custom:grad_norm
        assert max_rel([grad_norm[s] for s in kept], [rec["p_grad_norm"][s] for s in kept],
                       f"{name} grad_norm vs p.grad") <= 2 ** -10
        engine_norm = stored(gw_server, rid, "custom:grad_norm")
        assert max_rel([engine_norm[s] for s in kept], [rec["grad_norm"][s] for s in kept],
                       f"{name} custom:grad_norm") <= 1e-6
    else:
        assert max_rel([grad_norm[s] for s in kept], [rec["grad_norm"][s] for s in kept],
                       f"{name} grad_norm vs engine") <= 1e-6
    _, body = http_json("GET", f"{gw_server.url}/api/v1/alerts?run={rid}")
    assert [a["rule"] for a in body["alerts"] if a["rule"] in ("A1", "A2", "A5", "B3")] == [], body["alerts"]
    assert [a for a in body["alerts"] if a["severity"] == "critical"] == [], body["alerts"]


@needs_cpu_fp16
def test_deepspeed_fp16_overflow_burst_raises_a5_as_with_a_gradscaler(gw_server, tmp_path):
    """An absurd initial loss scale (2^40, as tests/scenarios' absurd_init_scale gives a GradScaler): the
    engine skips step after step while its scaler halves the scale; the stored overflow flags are the
    engine's skips, and A5 (overflow storm, a warning) fires on them, as on a GradScaler run. The skipped
    steps are the scaler's calibration: no critical alert (no A2 on them, no B3 before a step went through)."""
    steps = 12
    name = f"ds-z2-fp16-burst-{uuid.uuid4().hex[:6]}"
    (rec,) = launch("deepspeed", tmp_path, server=gw_server, run=name, steps=steps,
                    extra=("--zero-stage", "2", "--precision", "fp16", "--accum", "2", "--scale-power", "40"))
    assert rec["steps"] == steps and rec["warnings"] == []
    assert rec["skipped_steps"][4] == 5, rec["skipped_steps"]   # a burst: the first 5 steps all skipped
    rid = run_id(gw_server, name)
    check_loss_scaler(gw_server, rid, rec, steps)
    alerts = wait_until(lambda: [a for a in http_json("GET", f"{gw_server.url}/api/v1/alerts?run={rid}")[1]["alerts"]
                                 if a["rule"] == "A5"], what="A5 on the overflow burst")
    assert alerts[0]["severity"] == "warning"
    _, body = http_json("GET", f"{gw_server.url}/api/v1/alerts?run={rid}")
    assert [a for a in body["alerts"] if a["severity"] == "critical"] == [], body["alerts"]
