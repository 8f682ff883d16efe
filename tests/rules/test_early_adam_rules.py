"""H1 adam_stale and H4 linear_output_growth on step sequences through the real ingest path (SQLite file, real
migrations): the alert, its first step, the layer it names, and the same run without the fault staying quiet.
The same rules on real training runs: tests/scenarios/early_adam.py."""
from __future__ import annotations

import math
import random

from tests.rules.conftest import RulesDB, run_name
from tests.rules.test_engine import healthy

PARAMS = ["emb.weight", "fc1.weight", "fc1.bias", "fc2.weight"]
MODULES = ["emb", "blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.2", "head"]


def _adam_run(n: int = 120, jump_at=None, jump: float = 5000.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    steps = healthy(n, seed=seed)
    for s in steps:
        i = s["step"]
        if i == 0:
            continue                          # no Adam state before the first step: not measured
        # emb.weight reads high all along (sparse rows: its own median is ~300); the others sit near 1
        r = [300.0 * math.exp(0.3 * rng.gauss(0, 1))] + [math.exp(0.4 * rng.gauss(0, 1)) for _ in PARAMS[1:]]
        if jump_at is not None and jump_at <= i < jump_at + 3:
            r[1] *= jump / 10 ** (i - jump_at)   # the stale v̂ catches up over a few steps
        s["layers"] = {"adam_g2_over_v": r}
    return steps


def test_h1_names_the_layer_whose_gradient_outran_its_second_moment(rdb):
    name = run_name()
    rdb.feed(name, _adam_run(jump_at=80), meta={"param_names": PARAMS}, batch=23)
    a = rdb.rules(name)["H1"]
    assert a.severity == "warning" and a.first_step == 80
    assert a.evidence["params"][0] == "fc1.weight" and "emb.weight" not in a.evidence["params"]
    assert a.evidence["g2_over_v"] > 1000 and a.evidence["median_g2_over_v"] < 3
    assert "1-8 steps" in a.message and any("beta2" in x for x in a.actions)


def test_h1_quiet_for_a_layer_that_always_reads_high_and_before_its_history_fills(rdb):
    name = run_name()
    steps = _adam_run()
    for s in steps[1:12]:
        s["layers"]["adam_g2_over_v"][2] = 500.0   # within min_history: not judged yet
    rdb.feed(name, steps, meta={"param_names": PARAMS})
    assert "H1" not in rdb.rules(name)


def test_h1_leaves_out_the_steps_the_scaler_skipped(rdb):
    name = run_name()
    steps = _adam_run()
    for s in steps[60:65]:
        s.update(overflow=True, grad_norm="Infinity")
        s["layers"]["adam_g2_over_v"] = ["NaN", "Infinity", 1e9, "NaN"]
    rdb.feed(name, steps, meta={"param_names": PARAMS})
    assert "H1" not in rdb.rules(name)


def _linear_run(n: int = 400, every: int = 10, grow_from=None, rate: float = 1.3, early: bool = True,
                seed: int = 1, learning: bool = False, plateau: bool = False) -> list[dict]:
    """``healthy`` steps with every Linear's output RMS sampled each ``every`` steps; from ``grow_from`` on,
    FC2's grows ``rate``-fold a sample. The loss stops falling there and climbs, +80 % over 100 steps (as
    before the measured divergence: lr_warmup_never_capped's 0.32 -> 0.86), unless ``learning``: then it keeps
    falling fast (8 % per 40 steps), or ``plateau``: then it stays flat, noisy (a plateau while features form,
    the hand-written decoder's qk-layernorm control in tests/scenarios/early_heldout.py)."""
    rng, loss_rng = random.Random(seed), random.Random(seed + 1000)
    steps = healthy(n, seed=seed)
    for s in steps:
        i = s["step"]
        if grow_from is not None and i >= grow_from:
            base = 2.0 * math.exp(-grow_from / 300) + 0.3
            s["loss"] = (base * math.exp(-(i - grow_from) / 480) if learning else base if plateau else
                         base * (1 + 0.8 * min(1.0, (i - grow_from) / 100))) + loss_rng.gauss(0, 0.03)
        if i % every:
            continue
        k = i // every
        # every layer's outputs grow early in training and level off (healthy): x2.7 over ~100 steps
        level = (1.0 + 1.7 * (1 - math.exp(-i / 40))) if early else 1.0
        v = [None] + [level * base * (1 + 0.03 * rng.gauss(0, 1)) for base in (0.5, 0.8, 0.3, 2.0)]
        if grow_from is not None and i >= grow_from:
            v[3] *= rate ** (k - grow_from // every)      # blocks.0.mlp.2 (FC2) grows sample after sample
        s["layers"] = {"linear_out_rms": v}
    return steps


def test_h4_names_the_linear_layer_whose_output_keeps_growing(rdb):
    name = run_name()
    rdb.feed(name, _linear_run(grow_from=200), meta={"module_names": MODULES}, batch=31)
    a = rdb.rules(name)["H4"]
    assert a.severity == "warning"
    # rising on 4 samples, x2.5 over them (1.3^4), from step 240 on; > 3x its own (levelled-off) median: 1.3^5 > 3,
    # step 250; the loss climbing since 200, its last four samples' mean 1.28x its best
    assert a.first_step == 250
    assert a.evidence["modules"] == ["blocks.0.mlp.2"] and a.evidence["linear_out_rms"] > 3 * a.evidence["median"]
    assert any("learning rate" in x for x in a.actions)


def test_h4_quiet_on_healthy_early_growth_and_on_slow_drift(rdb):
    quiet = run_name()
    rdb.feed(quiet, _linear_run(), meta={"module_names": MODULES})
    slow = run_name()
    rdb.feed(slow, _linear_run(grow_from=100, rate=1.02), meta={"module_names": MODULES})
    assert "H4" not in rdb.rules(quiet) and "H4" not in rdb.rules(slow)


def test_h4_quiet_while_the_loss_sits_on_a_plateau(rdb, tmp_path):
    """Issue 33: the same growth with the loss flat (a plateau while the LR warms up and features form) drew H4
    on a healthy qk-layernorm model. The loss has not left its best: quiet. With that gate off, it fires."""
    name = run_name()
    rdb.feed(name, _linear_run(grow_from=200, plateau=True), meta={"module_names": MODULES}, batch=31)
    assert "H4" not in rdb.rules(name)
    rules = tmp_path / "rules.toml"
    rules.write_text("[rules.H4]\nloss_rise = 0.0\n")
    off = RulesDB(f"sqlite:///{tmp_path / 'off.db'}", tmp_path, rules_file=str(rules))
    try:
        other = run_name()
        off.feed(other, _linear_run(grow_from=200, plateau=True), meta={"module_names": MODULES}, batch=31)
        assert off.rules(other)["H4"].first_step == 250
    finally:
        off.close()


def test_h4_quiet_while_the_loss_falls_fast(rdb, tmp_path):
    """The same growth as the firing case, but the loss keeps falling 8 % per 40 steps: the model is learning
    (the qk-layernorm control's o_proj grew 0.24 -> 1.13 in four samples while its loss fell 4.0 -> 2.3)."""
    name = run_name()
    rdb.feed(name, _linear_run(grow_from=200, learning=True), meta={"module_names": MODULES}, batch=31)
    assert "H4" not in rdb.rules(name)
    # the same run with both loss gates off (a loss drop of 100 % never happens; any loss is >= 1.0x its best)
    # fires: the growth alone was enough
    rules = tmp_path / "rules.toml"
    rules.write_text("[rules.H4]\nloss_drop = 1.0\nloss_rise = 0.0\n")
    off = RulesDB(f"sqlite:///{tmp_path / 'off.db'}", tmp_path, rules_file=str(rules))
    try:
        other = run_name()
        off.feed(other, _linear_run(grow_from=200, learning=True), meta={"module_names": MODULES}, batch=31)
        assert off.rules(other)["H4"].first_step == 250
    finally:
        off.close()
