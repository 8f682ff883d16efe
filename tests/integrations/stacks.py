"""Launch ``tests/distributed/stacks_worker.py`` under ``torchrun`` (one process or several, gloo, CPU)
and read back what each rank's stack computed; shared by the stacks' test files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, http_json

WORKER = REPO_ROOT / "tests" / "distributed" / "stacks_worker.py"


def launch(stack: str, out: Path, *, server, run: str, nproc: int = 1, steps: int = 4,
           extra: tuple[str, ...] = (), launcher: tuple[str, ...] | None = None) -> list[dict]:
    """Run the worker; ``launcher``: the command before the script (default torchrun --standalone)."""
    out.mkdir(parents=True, exist_ok=True)
    launcher = launcher or (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}")
    cmd = [*launcher, str(WORKER), stack, str(out), "--server", server.url, "--run-name", run,
           "--steps", str(steps), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
    with open(out / "launch.log", "wb") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, (out / "launch.log").read_text(errors="replace")[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_id(server, name: str) -> int:
    _, body = http_json("GET", f"{server.url}/api/v1/runs?project=stacks&name={name}")
    (run,) = [r for r in body["runs"] if r["name"] == name]
    return run["id"]


def stored(server, rid: int, signal: str, rank: int = 0) -> dict[int, float | None]:
    """step -> the stored value of ``signal`` on ``rank``, at full resolution."""
    _, body = http_json("GET", f"{server.url}/api/v1/runs/{rid}/series?signal={signal}&rank={rank}&max_points=100000")
    return {p["step"]: None if p["last"] is None else float(p["last"]) for p in body["steps"]}


def check_loss_scaler(server, rid: int, rec: dict, steps: int, rank: int = 0) -> None:
    """The stored overflow, overflow_count and loss_scale are the engine's loss scaler's, as read from the
    engine by the loop (tests/distributed/stacks_worker.py): the steps engine.skipped_steps grew at, its
    count, engine.optimizer.loss_scale before each engine.step() (and after it: custom:deepspeed_loss_scale)."""
    counts = rec["skipped_steps"]
    was_skipped = [float(b > a) for a, b in zip([0] + counts, counts)]
    overflow = stored(server, rid, "overflow", rank)
    assert [overflow[s] for s in range(steps)] == was_skipped, (overflow, counts)
    overflow_count = stored(server, rid, "overflow_count", rank)
    assert [overflow_count[s] for s in range(steps)] == counts
    scale = stored(server, rid, "loss_scale", rank)
    assert [scale[s] for s in range(steps)] == rec["loss_scale_used"]
    after = stored(server, rid, "custom:deepspeed_loss_scale", rank)
    assert [after[s] for s in range(steps)] == rec["loss_scale"]
    assert rec["loss_scale_used"][1:] == rec["loss_scale"][:-1]   # the scale after a step is the next one's


def max_rel(actual: list, expected: list, label: str = "") -> float:
    """The largest relative difference; printed with ``label`` (``pytest -s`` shows the figures that
    docs/integrations.md quotes)."""
    assert len(actual) == len(expected), (actual, expected)
    worst = 0.0
    for a, e in zip(actual, expected):
        assert a is not None and e is not None, (actual, expected)
        worst = max(worst, abs(float(a) - float(e)) / max(abs(float(e)), 1e-12))
    if label:
        print(f"\n[max rel] {label}: {worst:.2e}")
    return worst


def require_installed(module: str) -> None:
    """Skip the calling test module when ``module`` is not installed (fail under CI=true), without
    importing it here: the stacks run in their own processes."""
    import importlib.util

    import pytest

    from tests.conftest import IN_CI

    if importlib.util.find_spec(module) is None:
        what = f"{module} (pip install -e '.[test]')"
        if IN_CI:
            pytest.fail(f"{what} is required when CI=true", pytrace=False)
        pytest.skip(f"{what} not available", allow_module_level=True)


def _cpu_fp16() -> bool:
    """DeepSpeed's CPU accelerator takes fp16 only where oneDNN has native fp16 (AVX512-FP16 / AMX-FP16);
    elsewhere deepspeed.initialize raises "Type fp16 is not supported on your device."."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - an older torch without the op: no fp16 either
        return False


# DeepSpeed fp16 tests: skipped (also under CI=true: it is the hardware, not the install) on a CPU without it
needs_cpu_fp16 = pytest.mark.skipif(not _cpu_fp16(), reason="this CPU has no native fp16: DeepSpeed refuses fp16")
