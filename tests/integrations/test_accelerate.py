"""A plain Hugging Face Accelerate loop (``Accelerator(cpu=True)``, ``prepare``, ``accumulate``,
``backward``, ``clip_grad_norm_``), one process, monitored with ``agent.attach`` on the prepared
objects (the issue's line) or with ``gradwatch.agent.integrations.accelerate.watch``.

Every stored number is read back from a real server and compared with Accelerate's own: the grad
norm ``accelerator.clip_grad_norm_`` returned, and the loss the loop back-propagated (summed over the
micro-batches of one optimizer step). One gradwatch step per real optimizer step.
(2 processes: tests/distributed/test_stacks.py. fp16 is GPU-only in Accelerate: on CPU
``mixed_precision="fp16"`` gives no GradScaler, ``accelerator.scaler`` is None.)
"""
from __future__ import annotations

import uuid

import pytest

from tests.integrations.stacks import launch, max_rel, require_installed, run_id, stored

require_installed("accelerate")

STEPS = 4


@pytest.mark.parametrize("precision,accum,how", [("no", 1, "attach"), ("no", 2, "watch"), ("bf16", 2, "watch-twice"),
                                                 ("bf16", 1, "attach")])
def test_accelerate_loop_stores_accelerates_loss_and_grad_norm(gw_server, tmp_path, precision, accum, how):
    """``how``: the plain ``agent.attach`` line with ``monitor.log(loss=...)``; ``watch``; ``watch`` called
    twice (the second call returns the same monitor and the loss is not reported twice)."""
    name = f"acc-{precision}-{accum}-{uuid.uuid4().hex[:6]}"
    extra = ("--precision", precision, "--accum", str(accum)) + {
        "attach": ("--plain",), "watch": (), "watch-twice": ("--twice",)}[how]
    (rec,) = launch("accelerate", tmp_path, server=gw_server, run=name, steps=STEPS, extra=extra)
    assert rec["steps"] == STEPS and rec["world_size"] == 1
    assert rec["warnings"] == [], "Accelerate's wrappers are unwrapped without a warning"
    rid = run_id(gw_server, name)
    loss, grad_norm = stored(gw_server, rid, "loss"), stored(gw_server, rid, "grad_norm")
    assert sorted(loss) == list(range(STEPS)), "one gradwatch step per optimizer step, not per micro-batch"
    assert max_rel([loss[s] for s in range(STEPS)], rec["loss"], f"{name} loss") <= 1e-6
    assert max_rel([grad_norm[s] for s in range(STEPS)], rec["grad_norm"], f"{name} grad_norm") <= 1e-6
