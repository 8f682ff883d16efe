"""A Lightning Fabric loop (``Fabric(accelerator="cpu", devices=1)``, ``setup``, ``backward``,
``no_backward_sync``, ``clip_gradients``), one process, monitored with
``gradwatch.agent.integrations.fabric.watch`` — and with an optimizer wrapper gradwatch has never
seen, which ``attach`` must not raise on.

Every stored number is read back from a real server and compared with Fabric's own: the grad norm
``fabric.clip_gradients`` returned, and the loss the loop back-propagated (summed over the step's
micro-batches). (2 processes: tests/distributed/test_stacks.py.)
"""
from __future__ import annotations

import uuid

import pytest

from tests.integrations.stacks import launch, max_rel, require_installed, run_id, stored

require_installed("lightning")

STEPS = 4


@pytest.mark.parametrize("precision,accum", [("no", 2), ("bf16", 1)])
def test_fabric_loop_stores_fabrics_loss_and_grad_norm(gw_server, tmp_path, precision, accum):
    name = f"fabric-{precision}-{accum}-{uuid.uuid4().hex[:6]}"
    (rec,) = launch("fabric", tmp_path, server=gw_server, run=name, steps=STEPS,
                    extra=("--precision", precision, "--accum", str(accum)))
    assert rec["steps"] == STEPS and rec["warnings"] == []
    rid = run_id(gw_server, name)
    loss, grad_norm = stored(gw_server, rid, "loss"), stored(gw_server, rid, "grad_norm")
    assert sorted(loss) == list(range(STEPS))
    assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} loss") <= 1e-6
    assert max_rel([grad_norm[s] for s in range(STEPS)], rec["grad_norm"], f"{name} grad_norm") <= 1e-6


def test_an_unknown_optimizer_wrapper_warns_once_and_the_loop_runs(gw_server, tmp_path):
    """The optimizer hidden in a wrapper with neither ``.optimizer`` nor torch's hook dictionaries:
    attach warns once, saying what is not measured; the steps come from ``monitor.log(loss=...)``, and
    the loss and the pre-clip grad norm are still Fabric's."""
    name = f"fabric-unknown-{uuid.uuid4().hex[:6]}"
    (rec,) = launch("fabric", tmp_path, server=gw_server, run=name, steps=STEPS, extra=("--wrapper",))
    assert rec["steps"] == STEPS
    assert len(rec["warnings"]) == 1, rec["warnings"]
    assert "optimizer _Unknown is not a torch.optim.Optimizer" in rec["warnings"][0]
    assert "no learning rate" in rec["warnings"][0]
    rid = run_id(gw_server, name)
    loss, grad_norm = stored(gw_server, rid, "loss"), stored(gw_server, rid, "grad_norm")
    assert sorted(loss) == list(range(STEPS))
    assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} loss") <= 1e-6
    assert max_rel([grad_norm[s] for s in range(STEPS)], rec["grad_norm"], f"{name} grad_norm") <= 1e-6
    assert not any(v is not None for v in stored(gw_server, rid, "lr").values()), "no LR without the optimizer"
