"""Rule logic on real step sequences through the real ingest path (SQLite file, real migrations).

Each test builds the step sequence a real run of that kind produces and checks
the alert that comes out: the rule, the step it starts at, the evidence, and
that the same sequence without the fault stays quiet.
"""
from __future__ import annotations

import math
import random

import pytest
from sqlalchemy import select

from gradwatch.server.storage.models import RuleState, Run
from tests.rules.conftest import RulesDB, run_name, step


def healthy(n: int, seed: int = 0, start: int = 0, **extra) -> list[dict]:
    """A decaying noisy loss, a steady grad norm, a stable fp16 scaler."""
    rng = random.Random(seed)
    out = []
    for i in range(start, start + n):
        loss = 2.0 * math.exp(-i / 300) + 0.3 + rng.gauss(0, 0.03)
        gn = 0.6 + 0.3 * math.exp(-i / 100) + abs(rng.gauss(0, 0.05))
        out.append(step(i, loss=loss, grad_norm=gn, clip_max_norm=1.0, clipped=gn > 1.0, loss_scale=65536.0,
                        overflow=False, overflow_count=0, lr=1e-3, **extra))
    return out


def test_healthy_sequence_raises_nothing(rdb):
    name = run_name()
    rdb.feed(name, healthy(600), batch=37)
    assert rdb.alerts(name) == []


def test_a1_nan_loss_with_normal_grad_norm_points_at_the_loss(rdb):
    name = run_name()
    steps = healthy(80)
    steps[50].update(loss=math.nan, grad_norm=math.nan, overflow=True)
    rdb.feed(name, steps, batch=20)
    alerts = rdb.rules(name)
    assert set(alerts) == {"A1"}, alerts
    a = alerts["A1"]
    assert (a.first_step, a.severity, a.evidence["cause"]) == (50, "critical", "loss_computation")
    assert "loss computation" in a.diagnosis
    assert a.status == "resolved"          # 29 finite steps after it > clear_steps (10)


def test_a1_after_grad_explosion_says_clip_and_lower_lr(rdb):
    """A run that does not clip is told to clip and lower the LR; one that already clips at 1.0 (healthy()'s
    steps do) is told so, and to lower the LR, never to enable the clipping it has (issue 42)."""
    name = run_name()
    steps = [dict(s, clip_max_norm=None, clipped=None) for s in healthy(80)]
    steps[60]["grad_norm"] = 500.0          # after A2's 50 steps of history
    steps[61].update(loss=math.inf, grad_norm=math.nan, overflow=True)
    rdb.feed(name, steps)
    alerts = rdb.rules(name)
    assert alerts["A1"].evidence["cause"] == "grad_explosion_first"
    assert alerts["A1"].actions[0].startswith("Grad norm exploded first: enable gradient clipping")
    assert "lower the learning rate" in alerts["A1"].actions[0]
    assert alerts["A2"].first_step == 60 and alerts["A2"].evidence["ratio"] > 10

    clipping = run_name()
    steps = healthy(80)
    steps[60]["grad_norm"] = 500.0
    steps[61].update(loss=math.inf, grad_norm=math.nan, overflow=True)
    rdb.feed(clipping, steps)
    a1 = rdb.rules(clipping)["A1"]
    assert a1.evidence["cause"] == "grad_explosion_first"
    assert a1.actions[0].startswith("The run already clips its gradients (max_norm=1)")
    assert "lower the learning rate" in a1.actions[0]
    assert not any("enable gradient clipping" in a for a in a1.actions), a1.actions


def test_a1_carries_nan_origin_and_top_grad_norms_sent_later(rdb):
    name = run_name()
    steps = healthy(40)
    steps[30].update(loss=math.nan, grad_norm=math.nan, overflow=True)
    rdb.feed(name, steps[:31])
    rdb.feed(name, steps[31:], events=[
        {"step": 30, "kind": "nan_origin", "data": {"module": "blocks.3.mlp", "where": "activation"}},
        {"step": 30, "kind": "top_grad_norms", "data": {"params": [["blocks.3.mlp.fc.weight", 912.0]]}}])
    alerts = rdb.rules(name)
    assert alerts["A1"].evidence["nan_origin"]["module"] == "blocks.3.mlp"
    assert alerts["A1"].evidence["top_grad_norms"][0][0] == "blocks.3.mlp.fc.weight"
    assert alerts["A3"].evidence["module"] == "blocks.3.mlp"


def test_a2_nonfinite_grad_without_scaler_but_not_with_one(rdb):
    name = run_name()
    steps = [dict(s, loss_scale=None, overflow=None) for s in healthy(40)]
    steps[30]["grad_norm"] = math.inf
    rdb.feed(name, steps)
    assert rdb.rules(name)["A2"].evidence["no_scaler"] is True
    other = run_name()
    steps = healthy(40)
    steps[30].update(grad_norm=math.inf, overflow=True)
    rdb.feed(other, steps)
    assert "A2" not in rdb.rules(other)


def test_one_episode_per_storm_and_rules_remember_across_batches(rdb):
    """20 skipped steps sent one per batch: A5 and B3 fire once each (state lives in the DB)."""
    name = run_name()
    steps = healthy(80)
    scale = 65536.0
    for i, s in enumerate(steps):
        s["loss_scale"] = scale
        if 20 <= i < 40:
            s.update(loss=math.nan, grad_norm=math.nan, overflow=True)
            scale /= 2
    rdb.feed(name, steps, batch=1)
    alerts = rdb.alerts(name)
    by_rule = {}
    for a in alerts:
        by_rule.setdefault(a.rule, []).append(a)
    assert {r: len(v) for r, v in by_rule.items()} == {"A1": 1, "A5": 1, "B3": 1}
    assert by_rule["A5"][0].first_step == 24      # the 5th consecutive skip
    assert by_rule["B3"][0].first_step == 23      # the 3rd halving after the scaler settled
    assert by_rule["A1"][0].last_step == 39


def test_restart_continues_state(tmp_path):
    """A second process (a new engine on the same file) continues the streak the first began."""
    url = f"sqlite:///{tmp_path / 'r.db'}"
    name = run_name()
    steps = healthy(30)
    for s in steps[20:]:
        s["lr"] = 0.0
    first = RulesDB(url, tmp_path)
    first.feed(name, steps[:25])
    first.close()
    second = RulesDB(url, tmp_path)
    second.feed(name, steps[25:])
    assert second.rules(name)["B4"].first_step == 29
    second.close()


def test_b1_vanishing_and_b4_lr_zero(rdb):
    name = run_name()
    steps = healthy(60)
    for s in steps[30:]:
        s.update(grad_norm=1e-9, lr=0.0)
    rdb.feed(name, steps)
    alerts = rdb.rules(name)
    assert alerts["B1"].first_step == 49 and alerts["B4"].first_step == 39


def test_b5_dead_params_names_them(rdb):
    name = run_name()
    meta = {"param_names": ["enc.weight", "head.weight", "aux.weight"]}
    steps = healthy(80)
    for s in steps:
        s["layers"] = {"grad_norm": [0.5, 0.3, 0.0 if s["step"] >= 10 else 0.1]}
    rdb.feed(name, steps, meta=meta)
    a = rdb.rules(name)["B5"]
    assert a.first_step == 60 and a.evidence["params"] == ["aux.weight"]


def test_b6_gradients_underflowing_to_zero_name_the_layer_against_its_own_history(rdb):
    """fp16 underflow: a layer's share of exactly-zero gradient elements jumps; an embedding whose unused
    rows are always zero (its own median is high) stays quiet."""
    name = run_name()
    meta = {"param_names": ["emb.weight", "fc1.weight", "fc2.weight"]}
    steps = healthy(120)
    for s in steps:
        if s["step"] % 5 == 0:
            s["layers"] = {"grad_zero_fraction": [0.9, 0.97 if s["step"] >= 80 else 0.01, 0.02]}
    rdb.feed(name, steps, meta=meta)
    a = rdb.rules(name)["B6"]
    assert a.first_step == 80 and a.evidence["params"][0][0] == "fc1.weight" and a.evidence["flagged"] == 1
    quiet = run_name()
    for s in steps:
        if "layers" in s:
            s["layers"]["grad_zero_fraction"][1] = 0.01
    rdb.feed(quiet, steps, meta=meta)
    assert "B6" not in rdb.rules(quiet)
    assert "fp16" in a.diagnosis and a.evidence["grad_scaler"] is True      # a GradScaler run: fp16's underflow


def test_b6_on_a_run_without_a_grad_scaler_does_not_blame_fp16(rdb):
    """Issue 33: an fp32 run's gradient zeros were explained by fp16's 6e-8 flush. Without a loss scale
    on its steps (no GradScaler: bf16 or fp32) the alert names the model's own causes."""
    name = run_name()
    meta = {"param_names": ["emb.weight", "fc1.weight", "fc2.weight"]}
    steps = healthy(120)
    for s in steps:
        s.pop("loss_scale")
        if s["step"] % 5 == 0:
            s["layers"] = {"grad_zero_fraction": [0.9, 0.97 if s["step"] >= 80 else 0.01, 0.02]}
    rdb.feed(name, steps, meta=meta)
    a = rdb.rules(name)["B6"]
    assert a.first_step == 80 and a.evidence["grad_scaler"] is False
    assert "6e-8" not in a.diagnosis and "not a number-format underflow" in a.diagnosis
    assert not any("GradScaler" in x or "bf16" in x for x in a.actions) and any(".detach()" in x for x in a.actions)


def test_c3_spike_then_critical_after_five(rdb):
    name = run_name()
    steps = healthy(120)
    steps[60]["loss"] = 50.0
    rdb.feed(name, steps)
    a = rdb.rules(name)["C3"]
    assert a.first_step == 60 and a.severity == "warning"
    other = run_name()
    steps = healthy(120)
    for s in steps[60:66]:
        s["loss"] = 50.0
    rdb.feed(other, steps)
    a = rdb.rules(other)["C3"]
    assert a.severity == "critical" and a.first_step == 60


def test_a2_one_grad_spike_warns_and_a_second_within_50_steps_is_critical(rdb):
    """Checklist 3.5: grad-norm peaks that recur are an explosion. One spike a run trains on past is a warning
    (healthy CNNs and GRUs take one, docs/early-warning.md); a second within 50 steps, or one that lasts 3
    steps, or with the loss at 3x its median at the spike and a step later, escalates the same alert."""
    name = run_name()
    steps = [dict(s, clip_max_norm=None, clipped=None) for s in healthy(200)]
    steps[60]["grad_norm"] = 15.0
    rdb.feed(name, steps)
    a = rdb.rules(name)["A2"]
    assert (a.first_step, a.severity, a.evidence["spikes"]) == (60, "warning", 1)
    assert a.diagnosis.startswith("A single grad-norm spike") and "within 50 steps" in a.diagnosis
    assert a.status == "resolved"
    assert set(rdb.rules(name)) == {"A2"}

    twice = run_name()
    steps[100]["grad_norm"] = 15.0          # 40 steps later: the same alert (cooldown 50), now critical
    rdb.feed(twice, steps, batch=7)
    alerts = [x for x in rdb.alerts(twice) if x.rule == "A2"]
    assert len(alerts) == 1, alerts
    a = alerts[0]
    assert (a.first_step, a.severity, a.evidence["last"]["spikes"]) == (60, "critical", 2)
    assert "2 spikes in 50 steps" in a.message
    assert a.diagnosis.startswith("The gradient norm exploded (a precursor of NaN).")   # the escalated state

    two, three = run_name(), run_name()
    steps[100]["grad_norm"] = steps[99]["grad_norm"]
    steps[61]["grad_norm"] = 15.0           # the step after a bad update: still the one spike
    rdb.feed(two, steps)
    assert [(x.severity, x.evidence["hits"]) for x in rdb.alerts(two) if x.rule == "A2"] == [("warning", 2)]
    steps[62]["grad_norm"] = 15.0           # a third step in a row: the explosion goes on
    rdb.feed(three, steps)
    a = rdb.rules(three)["A2"]
    assert (a.severity, a.evidence["last"]["spike_steps"]) == ("critical", 3) and "3 steps in a row" in a.message
    steps[61]["grad_norm"] = steps[62]["grad_norm"] = steps[59]["grad_norm"]

    bad_batch, broke = run_name(), run_name()
    steps[60]["loss"] = 4 * steps[59]["loss"]     # a bad batch: the loss up at the spike's step only
    rdb.feed(bad_batch, steps)
    a = rdb.rules(bad_batch)["A2"]
    assert (a.first_step, a.severity) == (60, "warning") and a.evidence["loss_ratio"] > 3, a.evidence
    assert f"the loss is {a.evidence['loss_ratio']:.1f}x its median" in a.message
    assert a.diagnosis.startswith("A grad-norm spike with the loss at") and "next step" in a.diagnosis
    steps[61]["loss"] = 4 * steps[59]["loss"]     # still up a step later, the grad norm back: the run broke
    rdb.feed(broke, steps, batch=61)              # the spike's step ends a batch: carried to the next
    a = rdb.rules(broke)["A2"]
    assert (a.first_step, a.severity) == (60, "critical"), (a.first_step, a.severity)
    assert a.message.startswith("The loss stayed up after the grad-norm spike at step 60"), a.message
    assert a.evidence["last"]["after_spike"] == 60
    steps[60]["loss"] = steps[61]["loss"] = steps[59]["loss"]

    apart = run_name()
    steps[150]["grad_norm"] = 15.0          # 90 steps later: a new single spike, a warning again
    rdb.feed(apart, steps)
    assert [(x.first_step, x.severity) for x in rdb.alerts(apart) if x.rule == "A2"] == [(60, "warning"),
                                                                                        (150, "warning")]


# The pre-clip grad norm of a healthy CNN's first 80 steps: bench/early_warning case 274's control (conv_cls,
# AdamW, 100 warm-up steps), recorded in plain PyTorch with torch.nn.utils.get_total_norm. It climbs from 0.1
# at init to 1-4 by step 20-30 and trains on; the run never diverges.
LEAVING_INIT = [0.083, 0.2, 0.15, 0.16, 0.097, 0.12, 0.12, 0.14, 0.17, 0.14, 0.091, 0.15, 0.22, 0.25, 0.3, 0.39,
                0.42, 0.55, 0.5, 1.7, 2, 0.69, 3.1, 2.9, 2.6, 4.2, 4.4, 1.5, 2.9, 3.8, 3.3, 1.8, 1.1, 1.6, 2.1, 1.8,
                1.9, 0.72, 0.57, 0.86, 1.4, 1.9, 1.5, 0.58, 1.2, 0.67, 0.96, 1.6, 3.1, 0.56, 2.3, 1.7, 0.55, 0.92,
                0.78, 1.4, 0.51, 1.2, 2.6, 1.2, 1.3, 1.5, 0.43, 0.91, 1, 0.82, 0.7, 1.9, 1.1, 1.4, 0.88, 0.91, 1.6,
                1.4, 1.5, 1.8, 2.2, 2.1, 1.4, 0.96]


def test_a2_waits_for_50_steps_while_a_network_leaves_its_initialisation(tmp_path):
    """A median of the first 20 steps is the init's: with 20 steps of history A2 calls the healthy climb an
    explosion (critical, at step 20); with its default of 50 it stays quiet, and still fires on a spike after."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[projects.old.rules.A2]\nmin_history = 20\n')
    r = RulesDB(f"sqlite:///{tmp_path / 'o.db'}", tmp_path, rules_file=str(rules))
    steps = [dict(s, grad_norm=g, clip_max_norm=None, clipped=None) for s, g in zip(healthy(80), LEAVING_INIT)]
    old, new = run_name(), run_name()
    r.feed(old, steps, project="old")
    r.feed(new, steps)
    assert [(a.first_step, a.severity) for a in r.alerts(old) if a.rule == "A2"] == [(20, "critical")]
    assert r.alerts(new) == []
    spiked = run_name()
    steps[70]["grad_norm"] = 30.0
    r.feed(spiked, steps)
    assert [(a.first_step, a.severity) for a in r.alerts(spiked)] == [(70, "warning")]
    r.close()


def test_a2_single_spike_follows_a_configured_severity_below_critical(tmp_path):
    """A team that set A2 to info gets info for a single spike and for repeated ones; critical_spikes = 1
    makes every spike critical, as before."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[projects.quiet.rules.A2]\nseverity = "info"\n[projects.strict.rules.A2]\ncritical_spikes = 1\n')
    r = RulesDB(f"sqlite:///{tmp_path / 'o.db'}", tmp_path, rules_file=str(rules))
    steps = [dict(s, clip_max_norm=None, clipped=None) for s in healthy(120)]
    steps[60]["grad_norm"] = steps[70]["grad_norm"] = 15.0
    quiet, strict = run_name(), run_name()
    r.feed(quiet, steps, project="quiet")
    r.feed(strict, steps[:65], project="strict")
    assert r.rules(quiet)["A2"].severity == "info"
    assert r.rules(strict)["A2"].severity == "critical"
    r.close()


def test_overrides_file_and_api(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[rules.B4]\nsteps = 3\n[projects.quiet.rules.lr_zero]\nenabled = false\n')
    r = RulesDB(f"sqlite:///{tmp_path / 'o.db'}", tmp_path, rules_file=str(rules))
    steps = healthy(20)
    for s in steps[10:]:
        s["lr"] = 0.0
    loud, quiet = run_name(), run_name()
    r.feed(loud, steps)
    r.feed(quiet, steps, project="quiet")
    assert r.rules(loud)["B4"].first_step == 12
    assert "B4" not in r.rules(quiet)
    from gradwatch.server.rules.config import get_rule_config, set_rule_override
    with r.db.write_sessionmaker() as s:
        out = set_rule_override(s, project="quiet", rule="B4", settings=r.settings, enabled=True, steps=5)
        s.commit()
        assert out["enabled"] is True and out["steps"] == 5 and out["overridden"] == ["enabled", "steps"]
        assert get_rule_config(s, project="quiet", settings=r.settings)["B4"]["steps"] == 5
    again = run_name()
    r.feed(again, steps, project="quiet")
    assert r.rules(again)["B4"].first_step == 14
    r.close()


@pytest.mark.parametrize("toml, rule, key", [
    ('[rules.A2]\nfactr = 3\n', "A2", "factr"),
    ('[rules.grad_explosion]\nfactor = "big"\n', "A2", "factor"),
    ('[rules.C3]\nwindow = 0\n', "C3", "window"),
    ('[rules.A5]\nfraction = 5\n', "A5", "fraction"),
    ('[rules.B9]\nsteps = 3\n', "B9", None),
    ('[projects.x.rules.B2]\nseverity = "loud"\n', "B2", "severity"),
])
def test_bad_config_names_rule_and_key(toml, rule, key):
    from gradwatch.server.rules.config import RuleConfigError, parse_rules_toml
    with pytest.raises(RuleConfigError) as e:
        parse_rules_toml(toml)
    assert rule in str(e.value)
    if key:
        assert f"'{key}'" in str(e.value)


def test_f1_one_rank_nan(rdb):
    name = run_name()
    good = healthy(40)
    bad = healthy(40, seed=1)
    for s in bad[25:]:
        s.update(loss=math.nan, grad_norm=math.nan, overflow=True)
    rdb.feed(name, bad, rank=1, world_size=2)     # the bad rank arrives first, stored as NULL + nan bit
    rdb.feed(name, good, rank=0, world_size=2)
    f1 = [a for a in rdb.alerts(name) if a.rule == "F1"]
    assert [(a.rank, a.first_step) for a in f1] == [(1, 25)]


def _replica_steps(n: int, odd: dict) -> list[dict]:
    return [{"step": i, "time": 1.0 + i, "loss": 1.0, "grad_norm": 0.5 + 0.01 * i + odd.get(i, 0.0)}
            for i in range(n)]


def test_f5_names_the_replica_whose_grad_norm_differs(rdb):
    """DDP ranks (meta.grad_replicas): rank 2's grad norm differs by one part in 1e7 from step 10 on;
    judged once all three ranks have sent a step, so whichever order they arrive in, rank 2 is named."""
    name = run_name()
    meta = {"param_names": ["w"], "grad_replicas": "ddp"}
    rdb.feed(name, _replica_steps(20, {i: 5e-8 for i in range(10, 20)}), rank=2, world_size=3, meta=meta)
    rdb.feed(name, _replica_steps(20, {}), rank=0, world_size=3, meta=meta)
    assert not [a for a in rdb.alerts(name) if a.rule == "F5"]      # two of three ranks: not judged yet
    rdb.feed(name, _replica_steps(20, {}), rank=1, world_size=3, meta=meta)
    f5 = [a for a in rdb.alerts(name) if a.rule == "F5"]
    assert [(a.rank, a.first_step, a.severity) for a in f5] == [(2, 10, "critical")]
    assert f5[0].evidence["agreeing_ranks"] == [0, 1]


def test_f5_needs_replicas(rdb):
    """Without the agent's word that the grads are all-reduced copies, ranks may differ by design."""
    name = run_name()
    rdb.feed(name, _replica_steps(20, {}), rank=0, world_size=2, meta={"param_names": ["w"]})
    rdb.feed(name, _replica_steps(20, {i: 0.1 for i in range(20)}), rank=1, world_size=2)
    assert not [a for a in rdb.alerts(name) if a.rule == "F5"]


def test_the_combined_row_of_a_sharded_run_feeds_the_batch_rules(rdb):
    """Two sharded ranks whose pieces are each unremarkable, but whose combined grad norm explodes at
    step 60: A2 fires on the combined row (rank -1), and no cross-rank rule compares it with a rank."""
    name = run_name()
    for rank in range(2):
        steps = []
        for i in range(70):
            piece = 0.3 * (1 + 0.01 * (i % 5)) * (100.0 if i == 60 else 1.0)
            steps.append({"step": i, "time": 1.0 + i, "loss": 1.0, "grad_norm_local": piece,
                          "layers": {"grad_norm_local": [piece]}})
        rdb.feed(name, steps, rank=rank, world_size=2,
                 meta={"param_names": ["w"], "param_shards": [[rank, 2]]})
    a2 = [a for a in rdb.alerts(name) if a.rule == "A2"]
    assert [(a.rank, a.first_step) for a in a2] == [(-1, 60)]
    assert not [a for a in rdb.alerts(name) if a.rule.startswith("F")]


def test_acknowledge(rdb):
    from gradwatch.server.rules.alerts import acknowledge_alert
    name = run_name()
    steps = healthy(40)
    steps[30].update(loss=math.nan, grad_norm=math.nan, overflow=True)
    rdb.feed(name, steps)
    alert = rdb.rules(name)["A1"]
    with rdb.db.write_sessionmaker() as s:
        assert acknowledge_alert(s, alert_id=alert.id).acknowledged is True
        assert acknowledge_alert(s, alert_id=10**9) is None
        s.commit()
    assert rdb.rules(name)["A1"].acknowledged is True


def _states(rdb: RulesDB, name: str) -> dict[str, dict]:
    with rdb.db.sessionmaker() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == name))
        return {r.rule: r.state for r in s.scalars(select(RuleState).where(RuleState.run_id == run_id,
                                                                           RuleState.rank == 0))}


def test_rule_states_round_trip_a_failing_rule_keeps_its_stored_state_and_unchanged_rows_are_not_rewritten(
        db_url, tmp_path, monkeypatch, caplog):
    """States are read and written with plain SQL (the ``::json`` cast on PostgreSQL): a streak begun in
    one batch continues in the next; a rule that raises half-way through a batch leaves its stored state as
    it was while the others' are saved; a batch that changes no state writes no rule_states row."""
    from gradwatch.server.rules.catalog.schedule import LrZero

    rdb = RulesDB(db_url, tmp_path)
    name = run_name()
    steps = healthy(40)
    for s in steps[20:]:
        s["lr"] = 0.0
    rdb.feed(name, steps[:25], batch=25)
    before = _states(rdb, name)
    assert before["B4"]["streak"] == 5 and before["B4"]["since"] == 20

    real = LrZero.evaluate

    def broken(self, batch, state, cfg):
        real(self, batch, state, cfg)     # mutates the state first, then fails
        raise RuntimeError("boom")

    monkeypatch.setattr(LrZero, "evaluate", broken)
    with caplog.at_level("ERROR", logger="gradwatch.rules"):
        rdb.feed(name, steps[25:35], batch=10)
    assert "rule B4 failed" in caplog.text
    after = _states(rdb, name)
    assert after["B4"] == before["B4"]                        # the failed batch's changes thrown away
    assert after["C1"] != before["C1"]                        # the others were saved
    monkeypatch.setattr(LrZero, "evaluate", real)
    rdb.feed(name, steps[35:40], batch=5)
    assert _states(rdb, name)["B4"]["streak"] == 10           # 20..24 and 35..39: the lost batch stays lost

    # a batch of events only (no steps): no rule state changes, so nothing is written
    from sqlalchemy import event

    written = []

    def spy(conn, cursor, statement, params, context, executemany):
        if "rule_states" in statement and statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            written.append(statement)

    event.listen(rdb.db.engine, "before_cursor_execute", spy)
    try:
        rdb.feed(name, [], events=[{"kind": "note", "step": 39, "data": {"x": 1}}])
        assert written == []
        rdb.feed(name, healthy(1, start=40))
        assert written, "a batch with steps must write the states it changed"
    finally:
        event.remove(rdb.db.engine, "before_cursor_execute", spy)
    rdb.close()


def test_a_state_the_rule_cannot_read_is_started_afresh_with_a_note(rdb, caplog):
    """A stored state of a layout the code does not know (an older version, a hand edit): the rule logs a
    note, starts its memory afresh, keeps its alert lifecycle, and the batch goes on."""
    name = run_name()
    steps = healthy(60)
    rdb.feed(name, steps[:30])
    with rdb.db.write_sessionmaker() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == name))
        row = s.get(RuleState, (run_id, 0, "C2"))
        row.state = {**row.state, "bits": 12345}          # not a string of 0 / 1
        s.commit()
    for st in steps[30:]:
        st["lr"] = 0.0
    with caplog.at_level("WARNING", logger="gradwatch.rules"):
        rdb.feed(name, steps[30:])
    assert "rule C2 could not read its state" in caplog.text
    assert isinstance(_states(rdb, name)["C2"]["bits"], str)
    assert rdb.rules(name)["B4"].first_step == 39          # the others carry on
