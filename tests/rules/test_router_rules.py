"""H14 (a mixture of experts' router running away) on step sequences through the real ingest path: a router whose
logit spread doubles faster than the limit fires and names its module; a router that sharpens as a healthy one
does, and one spike, do not.

The sequences are sampled every 25 steps, the agent's cadence for the routers (with the attention logits); the
real training runs are the early-warning benchmark's MoE space (bench/early_warning/router.py, and
tests/scenarios/test_early_warning_protocol.py for the measurement against its own oracle).
"""
from __future__ import annotations

import math
import random

from tests.rules.conftest import run_name, step
from tests.rules.test_early_logits_rules import setup_event

MODULES = ["tok", "blocks.0.mlp", "blocks.0.mlp.router", "blocks.1.mlp", "head"]
META = {"param_names": ["w"], "module_names": MODULES}
EVERY = 25


def router_steps(spreads_of, n: int = 300, seed: int = 0) -> list[dict]:
    """Steps with a loss; every EVERY-th carries the two MoE modules' router logit spreads."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        st = step(i, loss=2.0 + rng.gauss(0, 0.01))
        if i % EVERY == 0:
            a, b = spreads_of(i, rng)
            st["layers"] = {"router_logit_spread": [None, a, None, b, None]}
            st["router_logit_spread"] = max(a, b)
        out.append(st)
    return out


def healthy(i, rng):
    """A healthy router sharpening as its experts specialise: from ~3 to ~14 over 300 steps, x1.6 in its first 25
    (the benchmark's controls reach 5-25 in 300 steps; under SGD they grow x1.1-1.7 in their first 25)."""
    return 3 + 12 * (1 - math.exp(-i / 150)) + rng.gauss(0, 0.2), 2.5 + 6 * (1 - math.exp(-i / 100)) + rng.gauss(0, 0.2)


def test_h14_fires_on_a_runaway_router_and_names_the_module(rdb):
    name = run_name()

    def runaway(i, rng):
        a, b = healthy(i, rng)
        return a, (b if i < 100 else b * 2 ** ((i - 100) / 8))      # blocks.1.mlp doubles every 8 steps from 100
    rdb.feed(name, router_steps(runaway), batch=37, meta=META)
    alerts = rdb.rules(name)
    assert set(alerts) == {"H14"}, alerts
    a = alerts["H14"]
    assert a.severity == "warning" and a.evidence["module"] == "blocks.1.mlp"
    # no run_setup event: the adaptive family's limit, the strictest
    assert 7 <= a.evidence["doubling_steps"] <= 9 and a.evidence["limit_steps"] == 12.0
    assert a.evidence["optimizer_family"] == "adaptive" and "optimizer, adaptive, takes more than 12" in a.message
    assert a.evidence["router_logit_spread"] >= 8 and "doubling every" in a.message
    # 25 steps after the growth starts, the spread is ~6.3 x 2^3 = 50 against 6.3 a sample earlier
    assert a.first_step == 125
    assert "z-loss" in a.diagnosis and any("float32" in x for x in a.actions)


def test_h14_stays_quiet_on_a_healthy_router_and_on_one_spike(rdb):
    quiet, spike, slow = run_name(), run_name(), run_name()
    rdb.feed(quiet, router_steps(healthy), batch=50, meta=META)

    def one_spike(i, rng):
        a, b = healthy(i, rng)
        # one sample 3x its neighbours (a doubling in ~15 steps), then back; a jump of 4.2x or more in 25 steps
        # would fire, as the rule reads one sample (consecutive 1: a runaway router saturates within two samples)
        return (a * 3 if i == 150 else a), b
    rdb.feed(spike, router_steps(one_spike, seed=1), batch=50, meta=META)

    def sharpening(i, rng):
        a, b = healthy(i, rng)
        return a, b * 2 ** (max(0, i - 100) / 16)      # doubling every 16 steps: slower than the limit
    rdb.feed(slow, router_steps(sharpening, seed=2), batch=50, meta=META)
    assert rdb.alerts(quiet) == [] and rdb.alerts(slow) == []
    assert "H14" not in rdb.rules(spike)


def test_h14_reads_the_optimizer_family_from_the_run_setup_event(rdb):
    """SGD's healthy routers sharpen more slowly than AdamW's, and its limit is 25 steps against 12: a spread
    doubling every 18 steps warns under SGD, not under AdamW, RMSprop or an optimizer the run did not report."""
    def doubling_18(i, rng):
        a, b = healthy(i, rng)
        return a, (b if i < 100 else b * 2 ** ((i - 100) / 18))
    runs = {cls: run_name() for cls in ("SGD", "AdamW", "RMSprop", None)}
    for cls, name in runs.items():
        rdb.feed(name, router_steps(doubling_18), batch=37, meta=META, events=[setup_event(cls)] if cls else [])
    a = rdb.rules(runs["SGD"])["H14"]
    assert a.evidence["optimizer_family"] == "sgd" and a.evidence["limit_steps"] == 25.0
    assert 16 <= a.evidence["doubling_steps"] <= 20 and a.first_step == 125
    for cls in ("AdamW", "RMSprop", None):
        assert "H14" not in rdb.rules(runs[cls]), cls
