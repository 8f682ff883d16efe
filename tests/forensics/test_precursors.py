"""The precursor timeline (server/forensics/precursors.py) on real runs through a real server.

A run whose one layer's grad norm grows from a known step before a NaN loss at a known step: the
critical A1 alert's evidence names that layer (and no other layer), from within a few steps of the
true onset, with the lead time to the NaN; its diagnosis says it in a sentence. A run that is healthy
until a sudden NaN: the alert says no precursor was found and lists no excursion. Both databases.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradwatch.server.forensics.precursors import DIAGNOSIS_MARK, Watch, excursion
from tests.forensics.loops import GROWING_PARAM, precursor_loop
from tests.scenarios.test_scenarios import run_alerts

TOLERANCE = 5      # steps between the onset found and the true one


def _a1(srv, run: str) -> dict:
    alerts = [a for a in run_alerts(srv, "forensics", run) if a["rule"] == "A1"]
    assert alerts, f"A1 did not fire on {run}"
    return alerts[0]


def test_grad_norm_growth_named_with_its_lead_time(server_factory, db_url):
    srv = server_factory(db_url)
    grow_from, nan_at = 150, 230
    precursor_loop(nan_at=nan_at, grow_from=grow_from).run(server=srv.url, project="forensics", run="growing")
    a1 = _a1(srv, "growing")
    assert a1["first_step"] == nan_at
    ev = a1["evidence"]
    layers = [p for p in ev["precursors"] if p["signal"] == "layers.grad_norm"]
    assert [p["layer"] for p in layers] == [GROWING_PARAM], ev["precursors"]
    found = layers[0]
    print(f"\n[precursor] {db_url.split(':')[0]}: {ev['precursor_summary']}")
    assert abs(found["from_step"] - grow_from) <= TOLERANCE, found
    assert found["lead_steps"] == nan_at - found["from_step"]
    assert found["ratio"] > 50          # 1.08 ** 80 ≈ 470× by the NaN
    # the global grad norm carries the same growth; nothing else left its band
    assert {p["signal"] for p in ev["precursors"]} <= {"layers.grad_norm", "grad_norm"}
    assert ev["precursor_search"]["found"] == len(ev["precursors"])
    assert f"{GROWING_PARAM} grad norm" in ev["precursor_summary"]
    assert "steps before the NaN loss" in ev["precursor_summary"]
    assert DIAGNOSIS_MARK.strip() in a1["diagnosis"] and ev["precursor_summary"] in a1["diagnosis"]


def test_sudden_nan_says_no_precursor(server_factory, db_url):
    srv = server_factory(db_url)
    precursor_loop(nan_at=230, grow_from=None).run(server=srv.url, project="forensics", run="sudden")
    a1 = _a1(srv, "sudden")
    ev = a1["evidence"]
    assert ev["precursors"] == [] and ev["precursor_search"]["found"] == 0, ev["precursors"]
    assert ev["precursor_summary"].startswith("no signal left its normal band")
    assert ev["precursor_search"]["series"] > 4        # it looked at the step signals and every layer


# --------------------------------------------------------------------------- the band test itself

def _series(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return np.arange(n), np.exp(0.15 * rng.standard_normal(n))


@pytest.mark.parametrize("onset", [250, 330])
def test_exponential_growth_onset(onset):
    steps, v = _series()
    v[onset:] *= 1.1 ** np.arange(1, len(v) - onset + 1)
    got = excursion(steps, v, split=200, watch=Watch("x", "x"))
    assert got is not None and abs(got[0] - onset) <= TOLERANCE, got


def test_excursion_that_came_back_is_no_precursor():
    steps, v = _series()
    v[300:320] *= 50                       # a burst that ended 80 steps before the failure
    assert excursion(steps, v, split=200, watch=Watch("x", "x")) is None


def test_one_noisy_sample_is_no_precursor_but_a_far_one_is():
    steps, v = _series()
    v[-1] *= 5                             # z ≈ 11 against σ 0.15: high, but alone and not far out
    assert excursion(steps, v, split=200, watch=Watch("x", "x")) is None
    v[-1] *= 20                            # 100× the step before the failure: that is what went wrong
    got = excursion(steps, v, split=200, watch=Watch("x", "x"))
    assert got is not None and got[0] == 399


def test_a_falling_signal_is_no_precursor():
    steps, v = _series()
    v[250:] /= 100                          # a falling grad norm is training going well, not a warning
    assert excursion(steps, v, split=200, watch=Watch("x", "x")) is None


def test_lr_jump_is_the_precursor_of_the_explosion(server_factory, sqlite_url):
    """tests/scenarios' A2 run: LR ×100 at step 100 (SGD with momentum, no clipping). The grad explosion's
    alert names the LR, from step 100, as what deviated first."""
    from tests.scenarios.test_scenarios import a2_lr_jump

    srv = server_factory(sqlite_url)
    a2_lr_jump().run(server=srv.url, project="forensics", run="lr_jump")
    a2 = next(a for a in run_alerts(srv, "forensics", "lr_jump") if a["rule"] == "A2")
    ev = a2["evidence"]
    print(f"\n[precursor] A2 at {a2['first_step']}: {ev['precursor_summary']}")
    first = ev["precursors"][0]
    assert first["signal"] == "lr" and first["from_step"] == 100, ev["precursors"]
    assert first["lead_steps"] == a2["first_step"] - 100 and first["ratio"] == pytest.approx(100, rel=0.01)
    assert ev["precursor_summary"].startswith("learning rate 100× its median from step 100")
    assert "before the grad explosion" in ev["precursor_summary"]
