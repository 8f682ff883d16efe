"""A rank replaced by torchrun's elastic agent (``--max-restarts 1``) continues the run's stream for that
rank without loss or duplication: the restarted ranks load their checkpoints and their agents continue the
step axis (the optimizer's step counters, the server's resume bookkeeping), and a step the dead rank had
finished but not yet sent arrives through its crash-tail journal when the new process attaches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, start_sqlite_server
from tests.distributed.test_distributed import run_id, series

WORKER = Path(__file__).with_name("elastic_worker.py")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("elastic-server"))
    yield srv
    srv.stop()


@pytest.mark.slow
def test_an_elastic_restart_continues_each_ranks_steps(server, tmp_path):
    name = f"elastic-{uuid.uuid4().hex[:6]}"
    steps, crash_at = 20, 9
    # --max-restarts=2: the planned restart, and one spare. Once in a CI run (2026-12-02) the restarted ranks'
    # gloo rendezvous failed in torch (connectFullMesh: "Connection refused" from the peer's new port) before any
    # agent code ran; a real elastic job then restarts again, and so may this one. Every attempt that trained
    # is read below, so the continuation is checked across however many restarts it took.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=2",
           "--monitor-interval=0.5", str(WORKER), str(tmp_path), "--server", server.url, "--run-name", name,
           "--steps", str(steps), "--crash-rank", "1", "--crash-at", str(crash_at)]
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default torchrun's workers share the agent's rendezvous store
    # across restarts, so a restarted rank can read the address its dead predecessor published and gloo's
    # connectFullMesh fails ("Connection refused") or hangs in init_process_group: torch issue 135712, seen
    # here in 5 of 10 runs. Each attempt's own store, as that workaround, is what a real elastic job
    # on gloo needs too (docs/integrations.md).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with open(tmp_path / "torchrun.log", "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, timeout=400)
    assert proc.returncode == 0, (tmp_path / "torchrun.log").read_text(errors="replace")[-6000:]
    attempts = sorted(int(p.stem.split("attempt")[1]) for p in tmp_path.glob("rank1-attempt*.json"))
    assert attempts[0] == 0 and len(attempts) >= 2, f"torchrun restarted the ranks: attempts {attempts}"
    rid = run_id(server, name)
    for rank in (0, 1):
        trained: dict[int, float] = {}
        for attempt in attempts:
            path = tmp_path / f"rank{rank}-attempt{attempt}.json"
            assert path.exists(), path.name   # an attempt that trained did so on both ranks
            for step, loss in json.loads(path.read_text())["steps"]:
                assert step not in trained, (rank, step)   # each step trained once: the checkpoint resumed it
                trained[step] = loss
        assert sorted(trained) == list(range(steps))
        stored = series(server, rid, "loss", rank)
        # every step once, on one axis: neither the first attempt's steps overwritten nor the second's lost
        assert sorted(stored) == list(range(steps)), (rank, sorted(stored))
        for step in range(steps):
            assert abs(stored[step] - trained[step]) <= 1e-6 * max(1.0, abs(trained[step])), (rank, step)
