"""The rollback rule itself (server/forensics/rollback.py): which checkpoint, which batches, from which step.

``rollback_plan`` is a pure function of the checkpoints and the incident's steps; the real-run tests
(test_checkpoint_rollback.py) show it wired into ingest. These pin the recipe's edges.
"""
from __future__ import annotations

import pytest

from gradwatch.server.forensics.rollback import SKIP_MAX, SKIP_MIN, anomaly_step, rollback_plan
from gradwatch.server.storage.models import Alert

CKPTS = [(100, "c100"), (200, "c200"), (300, "c300")]


@pytest.mark.parametrize("checkpoints,anomaly,last,expected", [
    # the last checkpoint at or before the anomaly; the window starts there, 200 batches (PaLM's low end)
    (CKPTS, 350, 350, ("c300", 300, [300, 499])),
    # a checkpoint at the anomalous step itself is clean (its weights never saw that step)
    (CKPTS, 300, 300, ("c300", 300, [300, 499])),
    # one step before a checkpoint: the one before it
    (CKPTS, 299, 299, ("c200", 200, [200, 399])),
    # a checkpoint far back: replay up to 100 steps before the anomaly, skip from there
    ([(0, "c0")], 5000, 5000, ("c0", 0, [4900, 5100])),
    # a long incident: the window covers it plus 100 steps, at most 500 batches
    (CKPTS, 350, 500, ("c300", 300, [300, 600])),
    (CKPTS, 350, 2000, ("c300", 300, [300, 799])),
    # a checkpoint without a path (Lightning's trainer.save_checkpoint) is still a restart point
    ([(100, None)], 150, 150, (None, 100, [100, 299])),
])
def test_the_plan_follows_the_recipe(checkpoints, anomaly, last, expected):
    plan = rollback_plan(checkpoints, anomaly=anomaly, last_step=last)
    assert (plan["checkpoint"], plan["step"], plan["skip_batches"]) == expected
    a, b = plan["skip_batches"]
    assert SKIP_MIN <= b - a + 1 <= SKIP_MAX
    assert a <= anomaly <= b, "the anomalous step's batch is skipped"
    assert plan["anomaly_step"] == anomaly


def test_only_later_checkpoints_means_none_is_named():
    plan = rollback_plan([(400, "c400")], anomaly=350, last_step=350)
    assert plan["checkpoint"] is None and plan["step"] is None and plan["skip_batches"] is None
    assert plan["action"].startswith("No checkpoint recorded at or before step 350")


def test_an_earlier_precursor_moves_the_restart_before_it():
    alert = Alert(rule="A1", severity="critical", first_step=350, last_step=350,
                  evidence={"precursors": [{"signal": "grad_norm", "step": 280}, {"step": 320}]})
    assert anomaly_step(alert) == 280
    plan = rollback_plan(CKPTS, anomaly=anomaly_step(alert), last_step=350)
    assert (plan["checkpoint"], plan["skip_batches"]) == ("c200", [200, 450])
    # a precursor "after" the alert's first step, or a malformed one, is ignored
    alert.evidence = {"precursor": {"step": 400}, "precursors": [{"step": "x"}, None]}
    assert anomaly_step(alert) == 350
    # what server/forensics/precursors.py writes: a signal's "from_step"; a loss-scale halving listed
    # beside it is context, not the start
    alert.evidence = {"precursors": [{"signal": "layers.grad_norm", "layer": "fc.weight", "from_step": 290,
                                      "lead_steps": 60},
                                     {"signal": "loss_scale", "event": "halved", "step": 240, "lead_steps": 110}]}
    assert anomaly_step(alert) == 290
