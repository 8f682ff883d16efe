"""Properties of the rules' one definition: the verdicts do not depend on how a run is cut into batches.

Each rule is written once, as a vectorised evaluation of a whole batch that carries its state to the
next. So a run sent one step per batch, or in batches of random sizes, or all at once must give the same
verdict at every step (a hit with the same evidence, message, diagnosis, actions and severity; clear; or
nothing) and the same final state (as stored: through JSON). The runs are randomised healthy and faulty
runs (``tests/rules/runs.py``) under the default and under tight settings; the rules fire on them, and stop
firing. A last test sends runs through the real ingest path and compares the alerts themselves.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gradwatch.server.ingest.write import _wire_step
from gradwatch.server.storage.models import Alert, Run
from gradwatch.server.rules.batch import Batch, Context, keys_present
from gradwatch.server.rules.registry import rule_classes
from tests.rules.conftest import RulesDB, run_name
from tests.rules.runs import (BN_NAMES, FAULTS, MODULE_NAMES, PARAM_NAMES, RELEVANT, TINY, batches_of, configs,
                              validated_run, wire_run)

BATCH_RULES = [cls for cls in rule_classes("batch") if cls.id in RELEVANT]
# a digest of each rule's verdicts on its cases (the whole run as one batch): the definition itself, which
# batch-cut invariance alone does not pin (a threshold off by one float is cut-invariant). Recorded when the
# rules became vectorised, where it equalled the step walks of the code before (commit 1112a77) on 2008
# runs; a deliberate change of a rule's behaviour regenerates it: GRADWATCH_UPDATE_GOLDEN=1 pytest ...
GOLDEN = Path(__file__).with_name("golden_verdicts.json")


def _verdict(out, i: int) -> Any:
    hit = out.hits.get(i)
    if hit is not None:
        return ("hit", json.dumps([hit.evidence, hit.message, hit.diagnosis, hit.actions, hit.severity],
                                  sort_keys=True, default=str))
    return False if out.clear[i] else None


def run_rule(cls, cfg: dict, batches: list[tuple]) -> tuple[list, str]:
    """The engine's loop for one rule on one run, without a database: [(step, verdict)], final state."""
    state: dict = {}
    verdicts: list = []
    for chunk in batches:
        steps = [_wire_step(s) for s in chunk]          # fresh layer views: nothing decoded carries over
        ctx = Context(run_id=1, rank=0, world_size=1, param_names=PARAM_NAMES, module_names=MODULE_NAMES,
                      bn_names=BN_NAMES, present=keys_present(steps))
        rule = cls()
        if not rule.applies(ctx):
            verdicts.extend((st["step"], None) for st in steps)
            continue
        batch = Batch(steps, ctx)
        out = rule.evaluate(batch, state, cfg)
        assert len(out.clear) == batch.n and all(0 <= i < batch.n for i in out.hits)
        assert not any(out.clear[i] for i in out.hits), "a step both clear and a hit"
        verdicts.extend((st["step"], _verdict(out, i)) for i, st in enumerate(steps))
        state = json.loads(json.dumps(state))           # as stored in rule_states and read back
    return verdicts, json.dumps(state, sort_keys=True)


def _cuts(steps: tuple, rng: random.Random) -> list[list[tuple]]:
    """The run all at once, a step per batch, batches of the sizes agents send, and small random ones."""
    return [[steps], [(s,) for s in steps], batches_of(steps, rng), batches_of(steps, rng, small=True)]


def check_invariant(cls, cfg: dict, steps: tuple, rng: random.Random) -> tuple[int, list]:
    """Every cut gives what the whole run in one batch gives; returns the hits and the verdicts."""
    whole = None
    for k, cut in enumerate(_cuts(steps, rng)):
        verdicts, state = run_rule(cls, cfg, cut)
        if whole is None:
            whole = verdicts, state
            continue
        for (step, a), (_, b) in zip(whole[0], verdicts):
            assert a == b, f"cut {k}: verdicts differ at step {step}: {a} != {b}"
        assert state == whole[1], f"cut {k}: final states differ"
    return sum(1 for _, v in whole[0] if isinstance(v, tuple)), whole[0]


def cases(cls) -> list[tuple[str, dict, tuple]]:
    """(label, settings, steps): the long runs of the rule's faults, and many short two-fault runs."""
    out = []
    for scenario in ("healthy", *RELEVANT[cls.id], "gaps", "mixed"):
        for seed in (0, 1):
            cfgs = configs(cls.id)
            out.append((f"{scenario}/{seed}", cfgs[seed % len(cfgs)], validated_run(scenario, seed)))
    rng = random.Random(f"short/{cls.id}")
    cfgs = [*configs(cls.id), {**configs(cls.id)[0], **TINY.get(cls.id, {})}]
    for k in range(12):
        faults = {rng.choice(RELEVANT[cls.id]), rng.choice(FAULTS)} | ({"gaps"} if k % 2 else set())
        scenario = "+".join(sorted(faults))
        out.append((f"short {scenario}/{k}", cfgs[k % len(cfgs)], validated_run(scenario, k, short=True)))
    return out


@pytest.mark.parametrize("cls", BATCH_RULES, ids=lambda c: c.id)
def test_verdicts_and_state_do_not_depend_on_the_batch_cuts(cls):
    hits = 0
    digest = hashlib.sha256()
    for label, cfg, steps in cases(cls):
        try:
            n, verdicts = check_invariant(cls, cfg, steps, random.Random(f"cuts/{cls.id}/{label}"))
        except AssertionError as e:
            raise AssertionError(f"{cls.id}, run {label}, settings {cfg}: {e}") from None
        hits += n
        digest.update(json.dumps(verdicts).encode())
    assert hits > 0          # the runs make the rule fire, so the batches around its hits are compared too
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("GRADWATCH_UPDATE_GOLDEN"):
        golden[cls.id] = digest.hexdigest()
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
    assert golden.get(cls.id) == digest.hexdigest(), f"{cls.id}: the verdicts changed (see GOLDEN)"


# rules that judge the agent's events, which these generated runs do not carry: A3 (nan_origin), the
# resume rules G1-G6 (one resume_state event each; G5 then its next steps), tested on real resumes in
# tests/resume and tests/scenarios, the setup notes H5-H9 (one run_setup event; tests/advice) and H11 (one
# attention_coverage event; tests/rules/test_lr_jump_and_coverage_rules.py, tests/agent/test_attention_coverage.py)
EVENT_RULES = {"A3", "G1", "G2", "G3", "G4", "G5", "G6", "H5", "H6", "H7", "H8", "H9", "H11"}


def test_every_batch_rule_is_covered():
    assert {cls.id for cls in rule_classes("batch")} - EVENT_RULES == set(RELEVANT)


def _alerts(rdb: RulesDB, name: str) -> list[tuple]:
    with rdb.db.sessionmaker() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == name))
        return [(a.rule, a.first_step, a.last_step, a.severity, a.status, a.evidence.get("hits"))
                for a in s.scalars(select(Alert).where(Alert.run_id == run_id).order_by(Alert.rule, Alert.id))]


@pytest.mark.parametrize("scenario", ["mixed", "nan_loss+overflow_storm+loss_spike", "layer_faults+gaps"])
def test_alerts_through_ingest_do_not_depend_on_the_batch_cuts(tmp_path, scenario):
    """The same run through the real ingest path (SQLite file) one step per batch and in random batches:
    the same alerts (rule, first / last step, severity, status, hits)."""
    rdb = RulesDB(f"sqlite:///{tmp_path / 'cuts.db'}", tmp_path)
    steps = wire_run(scenario, 3)[:400]
    meta = {"param_names": PARAM_NAMES, "module_names": MODULE_NAMES, "bn_names": BN_NAMES}
    seen = []
    for size in (1, None):
        name = run_name()
        if size:
            rdb.feed(name, steps, batch=size, meta=meta, now=1e9)
        else:
            rng = random.Random(scenario)
            first = True
            i = 0
            while i < len(steps):
                n = rng.choice([1, 3, 17, 50, 178])
                rdb.feed(name, steps[i:i + n], batch=n, meta=meta if first else None, now=1e9)
                first, i = False, i + n
        seen.append(_alerts(rdb, name))
    rdb.close()
    assert seen[0], "the run raises alerts"
    assert seen[0] == seen[1]


def _flat_run(n: int, **values) -> list[dict]:
    return [{"step": i, "time": 1.7e9 + i, **values} for i in range(n)]


def _limit_c3(med: float, cfg: dict) -> float:
    return med + cfg["mad_factor"] * max(0.0, 0.01 * abs(med), 1e-12)     # a flat loss: MAD 0, floored


# (rule, key, the steady value, the threshold that value sets under the defaults, which side is a hit)
THRESHOLDS = [
    ("A2", "grad_norm", 1.0, lambda cfg: cfg["factor"] * 1.0, "above"),
    ("C3", "loss", 1.0, lambda cfg: _limit_c3(1.0, cfg), "above"),
    ("D2", "ema_divergence", 0.01, lambda cfg: cfg["factor"] * 0.01, "above"),
    ("B1", "grad_norm", 1e-9, lambda cfg: cfg["threshold"], "below"),
]


@pytest.mark.parametrize("rule_id, key, steady, threshold, side", THRESHOLDS, ids=[t[0] for t in THRESHOLDS])
def test_a_value_exactly_at_the_threshold_and_one_float_past_it(rule_id, key, steady, threshold, side):
    """The comparisons themselves: a value equal to the threshold is not a hit, the next float past it is
    (B1: a streak of values below; the one at the threshold breaks it). Cut invariance cannot see a
    comparison off by one float; this does."""
    from gradwatch.server.rules.catalogue import RULES_BY_ID
    from gradwatch.server.wire.schemas import StepIn

    cls = next(c for c in rule_classes("batch") if c.id == rule_id)
    cfg = RULES_BY_ID[rule_id].defaults()
    limit = threshold(cfg)
    past = math.nextafter(limit, math.inf if side == "above" else -math.inf)
    n = 80
    for value, hit in ((limit, False), (past, True)):
        steps = _flat_run(n, **{key: steady})
        if side == "above":
            steps[70][key] = value
        else:
            for st in steps[:60]:
                st[key] = 1.0
            for st in steps[60:]:
                st[key] = value
        verdicts, _ = run_rule(cls, cfg, [tuple(StepIn.model_validate(s) for s in steps)])
        fired = [step for step, v in verdicts if isinstance(v, tuple)]
        if side == "above":
            assert (fired == [70]) is hit and (fired == []) is not hit, (value, fired)
        else:
            assert bool(fired) is hit, (value, fired)
