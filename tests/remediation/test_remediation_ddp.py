"""DDP on 2 ranks (torchrun, gloo, CPU) with ``remediate=Rewind(...)``: the ranks agree inside DDP's own
gradient all-reduce (agent/rewind_agreement.py), so they restore the same snapshot at the same step, even
when one rank hears the alert long after the other, and a healthy step issues no collective of its own.

Each rank of tests/remediation/ddp_worker.py writes its own JSON (losses, rewinds, a hash of its
parameters right after each rewind and at the end); a real server raises the alerts."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, start_sqlite_server

WORKER = Path(__file__).with_name("ddp_worker.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("ddp-rewind-server"))
    yield srv
    srv.stop()


def torchrun(out: Path, server, *extra: str, timeout: int = 300) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), str(out),
           "--server", server.url, "--run-name", f"ddp-{uuid.uuid4().hex[:8]}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(out / "torchrun.log", "wb") as log:     # ranks interleave here; each writes its own JSON
        # the timeout bounds a hang (a deadlock would hold both ranks), it measures nothing
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, timeout=timeout)
    assert proc.returncode == 0, (out / "torchrun.log").read_text(errors="replace")[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_both_ranks_restore_the_same_snapshot_at_the_same_step_when_one_hears_late(server, tmp_path):
    # the loop runs until 60 steps past the rewind (3,000 at most): the alert on step 150 reaches rank 0
    # ~10-20 steps later on a quiet machine, but a fresh-clone run at load 5-12 ended a fixed 400 steps
    # before it arrived (no rank rewound); the subprocess timeout bounds a hang
    ranks = torchrun(tmp_path / "late", server, "--poison-at", "150", "--late-rank", "1", "--late-s", "0.5",
                     "--steps", "3000", "--after-rewind", "60")
    acted = [[a for a in r["after_rewind"] if a["data"]["action"] == "rewind"] for r in ranks]
    assert acted[0] and len(acted[0]) == len(acted[1]), acted
    for a0, a1 in zip(*acted):
        d0, d1 = a0["data"], a1["data"]
        assert (d0["from_step"], d0["to_step"]) == (d1["from_step"], d1["to_step"])
        assert d0["to_step"] <= 150 < d0["from_step"]
        # the same parameters, bit for bit, right after the rewind and at the end
        assert a0["hash"] == a1["hash"] and a0["loop_step"] == a1["loop_step"]
    first0, first1 = acted[0][0]["data"], acted[1][0]["data"]
    print(f"\nrank 0 heard at step {first0['heard_at_step']}, rank 1 (0.5 s late a batch) at {first1['heard_at_step']}; "
          f"both rewound at {first0['from_step']} to {first0['to_step']}")
    assert first1["heard_at_step"] > first0["heard_at_step"], "rank 1 was meant to hear later"
    assert first0["from_step"] >= max(first0["heard_at_step"], first1["heard_at_step"])
    assert ranks[0]["final_hash"] == ranks[1]["final_hash"]
    # every loss after the rewind is finite (the loop ran 60 steps past it)
    for r, rank_acted in zip(ranks, acted):
        after = r["losses"][rank_acted[0]["loop_step"] + 1:]
        assert len(after) >= 50 and all(math.isfinite(v) for v in after), (r["rank"], after[:5])


def test_a_healthy_ddp_run_issues_the_same_collectives_and_the_same_losses(server, tmp_path):
    on = torchrun(tmp_path / "on", server, "--count", "--steps", "120", "--pace", "0")
    off = torchrun(tmp_path / "off", server, "--count", "--steps", "120", "--pace", "0", "--off")
    for r_on, r_off in zip(on, off):
        assert r_on["rewinds"] == []
        assert r_on["losses"] == r_off["losses"], "the hook changed a healthy run's numbers"
        assert r_on["final_hash"] == r_off["final_hash"]
        # DDP's reducer issues its bucket all-reduce from C++ (not counted); with the hook, that same
        # all-reduce is made from Python, one per bucket per step (this model fits one bucket), and nothing else
        assert r_off["collective_calls"] == []
        assert r_on["collective_calls"] == ["all_reduce"] * len(r_on["losses"])
        assert r_on["collective_ops"] == r_off["collective_ops"]
