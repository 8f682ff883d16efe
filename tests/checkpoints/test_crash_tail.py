"""The crash tail survives the crash: a loop SIGKILLed at a random moment loses at most its last finished step.

A real training loop at ~10 steps/s (crash_loop.py) in its own process streams to a real server;
the test kills it with SIGKILL (what the OOM killer and a scheduler's hard stop send: no exit
handler runs) at a random moment after step K, then syncs the spool (``gradwatch sync``, the CLI)
or starts the run again (the next ``agent.attach`` of the run recovers it). Every step up to the
last one the loop finished must be on the server except, at most, that last one (still open in
the agent, waiting for post-step values, when the kill came). The loop reports its finished steps
through a file it flushes after each one. How many steps the same kill costs without the journal
(``GRADWATCH_CRASH_TAIL=0``) is printed, a figure, not an assertion.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, wait_until

LOOP = Path(__file__).with_name("crash_loop.py")
KILLS = 3


def _finished(progress: Path) -> list[int]:
    text = progress.read_text() if progress.exists() else ""
    return [int(line) for line in text.split("\n")[:-1] if line]   # a line without its newline is unfinished


def _start(srv, run: str, progress: Path, env: dict, start: int = 0, steps: int = 10_000) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LOOP), srv.url, run, str(progress), str(start), str(steps)],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _kill_after(proc: subprocess.Popen, progress: Path, k: int, rng: random.Random) -> int:
    """SIGKILL at a random moment after step ``k`` finished; returns the last finished step."""
    wait_until(lambda: proc.poll() is not None or (_finished(progress) or [-1])[-1] >= k, timeout=60,
               interval=0.005, what=f"step {k} finished")
    assert proc.poll() is None, proc.stderr.read().decode(errors="replace")
    time.sleep(rng.uniform(0.0, 0.25))     # anywhere within the next ~2.5 steps
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return _finished(progress)[-1]


def _stored_steps(srv, run: str) -> set[int]:
    _, body = srv.get("/api/v1/runs?project=crash")
    run_id = next(r["id"] for r in body["runs"] if r["name"] == run)
    _, series = srv.get(f"/api/v1/runs/{run_id}/series?signal=loss&max_points=100000")
    assert series["bucket_size"] == 1
    return {p["step"] for p in series["steps"]}


def _sync(srv, spool: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "gradwatch.server", "sync", str(spool), "--server", srv.url,
                           "--quiet"], env=dict(os.environ), cwd=REPO_ROOT, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stderr.decode(errors="replace")


def test_a_sigkilled_loop_loses_at_most_its_last_step(live_server, tmp_path, isolated_agent_spool):
    srv = live_server
    rng = random.Random(int(time.time()))
    lost_with, lost_without = [], []
    for i in range(KILLS):
        for tail in (True, False):
            run = f"killed-{i}-{'tail' if tail else 'no-tail'}"
            progress = tmp_path / f"{run}.progress"
            env = {**os.environ, "GRADWATCH_CRASH_TAIL": "1" if tail else "0"}
            k = rng.randint(15, 40)
            last = _kill_after(_start(srv, run, progress, env), progress, k, rng)
            _sync(srv, isolated_agent_spool)
            stored = _stored_steps(srv, run)
            missing = set(range(last + 1)) - stored
            (lost_with if tail else lost_without).append(len(missing))
            if tail:
                assert missing <= {last}, \
                    f"killed after step {last}: the server lacks steps {sorted(missing)} (at most {last} may be missing)"
                assert not stored - set(range(last + 2)), "a step the loop never reached is stored"
                # the journal of the killed process is gone: sent, not left to be sent twice
                assert not list(isolated_agent_spool.rglob("tail-*.jsonl"))
    print(f"\nfinished steps lost to SIGKILL at ~10 steps/s over {KILLS} kills: with the crash tail {lost_with}, "
          f"without it {lost_without}")


def test_the_next_attach_of_the_run_sends_the_killed_processs_tail(live_server, tmp_path, isolated_agent_spool):
    srv = live_server
    rng = random.Random(int(time.time()) + 1)
    progress = tmp_path / "resumed.progress"
    env = dict(os.environ)
    proc = _start(srv, "resumed", progress, env)
    wait_until(lambda: (_finished(progress) or [-1])[-1] >= 5, timeout=60, what="step 5 finished")
    # a sync while the loop lives leaves its journal alone (the loop holds its lock)
    _sync(srv, isolated_agent_spool)
    assert proc.poll() is None
    assert [p.name for p in isolated_agent_spool.rglob("tail-*.jsonl")] == [f"tail-{proc.pid}.jsonl"]
    last = _kill_after(proc, progress, rng.randint(15, 30), rng)
    # no sync: the same run started again (resuming after the last finished step) recovers the journal
    resumed = _start(srv, "resumed", progress, env, start=last + 1, steps=5)
    assert resumed.wait(timeout=60) == 0, resumed.stderr.read().decode(errors="replace")
    stored = _stored_steps(srv, "resumed")
    missing = set(range(last + 6)) - stored
    assert missing <= {last}, f"killed after step {last}, resumed for 5 steps: the server lacks {sorted(missing)}"
    _, body = srv.get("/api/v1/runs?project=crash")
    assert next(r for r in body["runs"] if r["name"] == "resumed")["status"] == "finished"


def test_a_journal_whose_batch_got_through_is_stored_once(live_server, tmp_path, isolated_agent_spool):
    """What a kill between "batch stored" and "journal emptied" leaves: the batch on the server and its
    journal on disk. The journal names the batch id, so its recovery is a duplicate: no step and no
    event (a checkpoint every 5 steps) is stored twice."""
    srv = live_server
    progress = tmp_path / "dup.progress"
    proc = _start(srv, "dup", progress, dict(os.environ), steps=30)
    journal = isolated_agent_spool / "crash" / "dup" / "rank0" / f"tail-{proc.pid}.jsonl"

    def snapshot():   # the journal as a SIGKILL at this moment would leave it, holding a checkpoint
        text = journal.read_bytes() if journal.exists() else b""
        return text if b'"kind": "checkpoint"' in text and text.endswith(b"\n") else None
    copy = wait_until(snapshot, timeout=60, interval=0.005, what="a journal holding a checkpoint")
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode(errors="replace")
    assert not journal.exists(), "a process that closed its monitor leaves no journal"
    # the dead process's journal, as it would be left (no process holds its lock); a killed process never
    # reaches the clean close that prunes its emptied spool folder, so the folder is there with it
    journal.parent.mkdir(parents=True, exist_ok=True)
    (journal.parent / "tail-4194303.jsonl").write_bytes(copy)
    out = _sync(srv, isolated_agent_spool)
    assert "0 batch(es) sent (0 steps), 1 already there" in out, out
    assert _stored_steps(srv, "dup") == set(range(30))
    _, body = srv.get("/api/v1/runs?project=crash")
    run = next(r for r in body["runs"] if r["name"] == "dup")
    assert run["status"] == "finished", "a duplicate batch changes nothing, its 'crashed' status included"
    run_id = run["id"]
    _, events = srv.get(f"/api/v1/runs/{run_id}/events?kind=checkpoint")
    assert [e["step"] for e in events["events"]] == [5, 10, 15, 20, 25, 30]
