"""Pieces of the ingest write path that take a shortcut, checked against the general code they stand for."""
from __future__ import annotations

import math
import random

from gradwatch.agent.signals import STEP_SIGNALS as DECLARED
from gradwatch.server.ingest.write import _keys_present, _wire_step
from gradwatch.server.rules.batch import keys_present
from gradwatch.server.wire.schemas import IngestBatchIn

STEP_SIGNALS = [s.name for s in DECLARED]
_BOOLS = {s.name for s in DECLARED if s.kind == "bool"}
_COUNTS = {s.name for s in DECLARED if s.kind == "count"}


def _random_step(rng: random.Random, i: int, signals: list[str]) -> dict:
    st = {"step": i, "time": 1.7e9 + i}
    for name in signals:
        if rng.random() < 0.3:
            continue                                  # not sent at this step
        if name in _BOOLS:
            st[name] = rng.random() < 0.5
        elif name in _COUNTS:
            st[name] = rng.choice([0, 3, None])
        else:
            st[name] = rng.choice([1.5, -2.0, "NaN", "Infinity", None, 0.0])
    if rng.random() < 0.5:
        st["custom"] = {"acc": rng.choice([0.5, "NaN"])}
    layers = {}
    for stat in ("grad_norm", "act_std", "weight_norm"):
        r = rng.random()
        if r < 0.3:
            layers[stat] = [rng.random() for _ in range(4)]
        elif r < 0.4:
            layers[stat] = []                         # an empty array: not "present"
    st["layers"] = layers
    return st


def test_keys_present_from_the_models_equals_the_rules_own_walk():
    rng = random.Random(7)
    for trial in range(300):
        signals = rng.sample(list(STEP_SIGNALS), k=rng.randint(0, len(STEP_SIGNALS)))
        n = rng.choice([0, 1, 2, 5, 40])
        body = {"batch_id": f"b{trial}", "project": "p", "run": "r",
                "steps": [_random_step(rng, i, signals) for i in range(n)]}
        steps = IngestBatchIn.model_validate(body).steps
        assert _keys_present(steps) == keys_present([_wire_step(s) for s in steps]), (trial, signals)


def test_keys_present_sees_a_signal_set_only_on_the_last_step():
    body = {"batch_id": "b", "project": "p", "run": "r",
            "steps": [{"step": i, "time": 1.0, "loss": 1.0} for i in range(10)]}
    body["steps"][-1]["lr"] = float("nan")
    steps = IngestBatchIn.model_validate(body).steps
    got = _keys_present(steps)
    assert "lr" in got and "grad_norm" not in got and math.isnan(steps[-1].lr)


def test_wire_step_holds_exactly_the_step_fields_the_rules_read():
    from gradwatch.server.ingest.write import _WIRE_KEYS
    from gradwatch.server.wire.schemas import StepIn

    assert set(StepIn.model_fields) == set(_WIRE_KEYS)
    body = {"batch_id": "b", "project": "p", "run": "r",
            "steps": [{"step": 3, "time": 1.0, "loss": "NaN", "custom": {"a": 1.0}, "layers": {"grad_norm": [1.0]},
                       "unknown_field": 5}]}
    st = IngestBatchIn.model_validate(body).steps[0]
    d = _wire_step(st)
    assert list(d) == list(_WIRE_KEYS)
    assert d["step"] == 3 and math.isnan(d["loss"]) and d["lr"] is None and d["custom"] == {"a": 1.0}
    assert d["custom"] is not st.custom and d["layers"]["grad_norm"] == [1.0]
