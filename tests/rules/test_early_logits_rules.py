"""H2 (attention-logit growth) and H3 (output-logit divergence) on step sequences through the real ingest
path: a steady rise fires and names its module, a single spike and a trained model's ordinary rise do not.

The sequences are sampled every 10 steps, the agent's default cadence for these signals; the real
training runs that show the failure are tests/scenarios/early_logits.py.
"""
from __future__ import annotations

import math
import random

from tests.rules.conftest import step, run_name

MODULES = ["tok", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "head"]
META = {"param_names": ["w"], "module_names": MODULES}
EVERY = 10


def attn_steps(values_of, n: int = 400, seed: int = 0) -> list[dict]:
    """Steps with a loss; every EVERY-th carries the per-module max attention logit (None: no attention)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        st = step(i, loss=1.0 + rng.gauss(0, 0.01))
        if i % EVERY == 0:
            a, b = values_of(i, rng)
            st["layers"] = {"attn_logit_max": [None, a, None, b, None]}
            st["attn_logit_max"] = max(a, b)
        out.append(st)
    return out


def healthy_logits(i, rng):
    """The ordinary rise as attention learns: from ~2 to ~13, with noise."""
    return 2 + 11 * (1 - math.exp(-i / 80)) + rng.gauss(0, 0.3), 1.5 + 8 * (1 - math.exp(-i / 80)) + rng.gauss(0, 0.3)


def test_h2_fires_on_a_steady_rise_and_names_the_module(rdb):
    name = run_name()

    def growing(i, rng):
        a, b = healthy_logits(i, rng)
        return a, (b if i < 150 else b * 1.03 ** ((i - 150) / EVERY * 4))   # blocks.1.attn grows from step 150
    rdb.feed(name, attn_steps(growing), batch=37, meta=META)
    alerts = rdb.rules(name)
    assert "H2" in alerts and set(alerts) <= {"H2", "H12"}, alerts     # H12 forecasts the same growth
    a = alerts["H2"]
    assert a.severity == "warning" and a.evidence["module"] == "blocks.1.attn"
    assert a.evidence["attn_logit_max"] >= 50 and a.evidence["ratio"] >= 4 and a.evidence["samples_in_a_row"] >= 3
    assert "qk-layernorm" in a.diagnosis and any("warm-up" in x for x in a.actions)
    # the growth rate, from the run's first flagged sample: 1.03^4 a sample of 10 steps doubles in ~58 steps
    assert 40 <= a.evidence["doubling_steps"] <= 80 and "doubling every" in a.message


def test_h2_stays_quiet_on_the_ordinary_rise_and_on_one_spike(rdb):
    quiet = run_name()
    rdb.feed(quiet, attn_steps(healthy_logits), batch=50, meta=META)
    spike = run_name()

    def one_spike(i, rng):
        a, b = healthy_logits(i, rng)
        return (500.0 if i == 200 else a), b
    rdb.feed(spike, attn_steps(one_spike), batch=50, meta=META)
    assert rdb.alerts(quiet) == [] and rdb.alerts(spike) == []


def z_steps(z_of, n: int = 500, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [step(i, loss=2.0 * math.exp(-i / 300) + 0.3 + rng.gauss(0, 0.01), **({"output_log_z": z_of(i, rng)} if i % EVERY == 0 else {}))
            for i in range(n)]


def trained_z(i, rng):
    """log Z from log(64) at init up to ~13 as the model grows confident (the scenarios' LM)."""
    return 4.2 + 9 * (1 - math.exp(-i / 60)) + rng.gauss(0, 0.2)


def test_h3_fires_when_log_z_drifts_away_and_stays(rdb):
    name = run_name()
    rdb.feed(name, z_steps(lambda i, rng: trained_z(i, rng) + (0.0 if i < 200 else -0.25 * (i - 200))),
             batch=43)
    alerts = rdb.rules(name)
    assert set(alerts) == {"H3"}, alerts
    a = alerts["H3"]
    assert a.evidence["output_log_z"] <= -20 and a.evidence["samples_in_a_row"] >= 5
    assert any("z-loss" in x for x in a.actions) and any("weight decay" in x.lower() for x in a.actions)
    # where it started: |log Z| past 20 and 10 from its median (~13) at step ~340; 5 samples later
    assert 330 <= a.first_step <= 420


def test_h3_stays_quiet_on_a_trained_models_log_z_and_on_one_spike(rdb):
    quiet, spike = run_name(), run_name()
    rdb.feed(quiet, z_steps(trained_z), batch=50)
    rdb.feed(spike, z_steps(lambda i, rng: -80.0 if i == 300 else trained_z(i, rng)), batch=50)
    assert rdb.alerts(quiet) == [] and rdb.alerts(spike) == []


def forecast_steps(values_of, n: int = 400, every=lambda i: i % 50 == 0) -> list[dict]:
    """Steps sampled as the agent samples by default: every 50 steps (``every`` may add more)."""
    rng = random.Random(3)
    out = []
    for i in range(n):
        st = step(i, loss=1.0 + rng.gauss(0, 0.01))
        if every(i):
            a, b = values_of(i, rng)
            st["layers"] = {"attn_logit_max": [None, a, None, b, None]}
            st["attn_logit_max"] = max(a, b)
        out.append(st)
    return out


def test_h12_forecasts_a_fast_growth_and_names_the_module(rdb):
    # blocks.1.attn doubles every 8 steps from step 200 (from ~10); the agent samples every step once it grows
    name = run_name()

    def growing(i, rng):
        a, b = healthy_logits(i, rng)
        return a, (b if i < 200 else b * 2 ** ((i - 200) / 8))
    rdb.feed(name, forecast_steps(growing, n=300, every=lambda i: i % 50 == 0 or i >= 200), batch=37, meta=META,
             events=[setup_event("SGD")])
    alerts = rdb.rules(name)
    a = alerts["H12"]
    assert a.severity == "warning" and a.evidence["module"] == "blocks.1.attn"
    assert 6 <= a.evidence["doubling_steps"] <= 10 and "doubling every" in a.message
    assert "limit_steps" not in a.evidence and "healthy run" not in a.message      # the gate is off by default
    # the logit passes 60 near step 221 (1000 near step 254): H12 confirms 2 samples later, ~30 steps ahead
    assert 220 <= a.first_step <= 226 and a.evidence["steps_to_danger"] <= 40


def test_h12_stays_quiet_on_a_sharpening_that_levels_off(rdb):
    # a healthy run's attention sharpening: from ~1 to ~55 within 50 steps, then level (the sweep's controls)
    name = run_name()

    def sharpening(i, rng):
        x = 1 + 54 / (1 + math.exp(-(i - 150) / 8)) + rng.gauss(0, 1.0)
        return x, x / 2
    rdb.feed(name, forecast_steps(sharpening, n=400, every=lambda i: i % 50 == 0 or 100 <= i <= 250), batch=50,
             meta=META)
    assert "H12" not in rdb.rules(name)


def test_h12_with_the_doubling_time_gate_warns_only_on_a_growth_faster_than_the_optimizer_familys_limit(tmp_path):
    """The balanced profile (docs/early-warning.md): H12 with H13's limits, 5 / 8 / 10 steps. The same growth,
    doubling every 8 steps, warns under SGD (limit 10); under AdamW, or with no optimizer reported (the strictest
    limit, 5), it is what a healthy adaptive run does, and H12 stays quiet. The default project has no gate."""
    from tests.rules.conftest import RulesDB

    def growing(i, rng):
        a, b = healthy_logits(i, rng)
        return a, (b if i < 200 else b * 2 ** ((i - 200) / 8))
    rules = tmp_path / "rules.toml"
    rules.write_text('[projects.balanced.rules.H12]\ndoubling_adaptive = 5\ndoubling_rmsprop = 8\n'
                     'doubling_sgd = 10\n')
    r = RulesDB(f"sqlite:///{tmp_path / 'g.db'}", tmp_path, rules_file=str(rules))
    runs = {(project, opt): run_name() for project in ("balanced", "p") for opt in ("SGD", "AdamW", None)}
    for (project, opt), name in runs.items():
        r.feed(name, forecast_steps(growing, n=300, every=lambda i: i % 50 == 0 or i >= 200), batch=37, meta=META,
               events=[setup_event(opt)] if opt else [], project=project)
    a = r.rules(runs["balanced", "SGD"])["H12"]
    assert a.severity == "warning" and a.evidence["optimizer_family"] == "sgd" and a.evidence["limit_steps"] == 10
    assert "(a healthy run with this optimizer, sgd, takes more than 10)" in a.message
    for opt in ("AdamW", None):
        assert "H12" not in r.rules(runs["balanced", opt]), opt
    for opt in ("SGD", "AdamW", None):
        assert r.rules(runs["p", opt])["H12"].severity == "warning", opt
    r.close()


def setup_event(optimizer_class: str) -> dict:
    """The agent's run_setup event (agent/setup.py) as far as H12 and H13 read it."""
    return {"step": 0, "kind": "run_setup", "data": {"optimizer": {"class": optimizer_class}}}


def runaway(doubling: float, start: int = 200):
    """blocks.1.attn doubles every ``doubling`` steps from ``start`` (from ~10); the rest of the model is healthy."""
    def values(i, rng):
        a, b = healthy_logits(i, rng)
        return a, (b if i < start else b * 2 ** ((i - start) / doubling))
    return values


def sampled_as_the_agent_does(i: int) -> bool:
    """Every 25 steps, and every step once the logits grow (agent/collectors/early_logits.py escalates)."""
    return i % 25 == 0 or i >= 200


def test_h13_fires_on_a_runaway_logit_and_names_the_module_and_the_optimizer_family(rdb):
    name = run_name()
    rdb.feed(name, forecast_steps(runaway(4.0), n=300, every=sampled_as_the_agent_does), batch=37, meta=META,
             events=[setup_event("AdamW")])
    a = rdb.rules(name)["H13"]
    assert a.severity == "warning" and a.evidence["module"] == "blocks.1.attn"
    assert a.evidence["optimizer_family"] == "adaptive" and a.evidence["limit_steps"] == 5.0
    assert 3.5 <= a.evidence["doubling_steps"] <= 4.5 and "doubling every" in a.message and "(adaptive)" in a.message
    # the logit passes 20 near step 204, and a reference 25-50 steps back exists from step 225: H13 holds there
    # and confirms one sample later
    assert 225 <= a.first_step <= 227


def test_h13_reads_the_optimizer_family_from_the_run_setup_event(rdb):
    # doubling every 8 steps: faster than SGD's healthy runs (limit 10), not than AdamW's (limit 5)
    sgd, adamw, unsaid = run_name(), run_name(), run_name()
    for name, events in ((sgd, [setup_event("SGD")]), (adamw, [setup_event("AdamW")]), (unsaid, [])):
        rdb.feed(name, forecast_steps(runaway(8.0), n=300, every=sampled_as_the_agent_does), batch=37, meta=META,
                 events=events)
    a = rdb.rules(sgd)["H13"]
    assert a.evidence["optimizer_family"] == "sgd" and 7 <= a.evidence["doubling_steps"] <= 9
    # AdamW, and a run that does not say its optimizer (the strictest limit): quiet
    assert "H13" not in rdb.rules(adamw) and "H13" not in rdb.rules(unsaid)


def test_h13_stays_quiet_on_a_sharpening_that_levels_off(rdb):
    # the sweep's healthy AdamW controls: the max logit sharpens from ~1 to ~2,000 (doubling every ~7 steps at
    # its fastest: faster than SGD's limit, not than AdamW's), then levels off: one-hot attention, on a task that
    # rewards it
    name = run_name()

    def sharpening(i, rng):
        x = math.exp(math.log(2000) / (1 + math.exp(-(i - 150) / 20))) * (1 + rng.gauss(0, 0.02))
        return x, x / 3
    rdb.feed(name, forecast_steps(sharpening, n=400, every=lambda i: i % 25 == 0 or 100 <= i <= 250), batch=50,
             meta=META, events=[setup_event("AdamW")])
    assert "H13" not in rdb.rules(name)
