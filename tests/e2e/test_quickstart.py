"""docs/quickstart.md, run as a newcomer runs it: its commands as written, top to bottom, on a clean HOME.

The commands are read from the page's code blocks, not restated here, so a changed page is what runs.
Decided here (issue 42): §1 (install) is not run, the test uses the repository's installed ``.venv`` (a
``.venv`` link in a fresh working directory, so ``.venv/bin/gradwatch`` resolves as written); ``demo`` and
``serve`` get ``--port P`` with a free port, and the agent of §4 is pointed at it through
``GRADWATCH_SERVER``, which §4 names; §4's snippet is run with its ``...`` filled in by a tiny model and loop
(the page marks that line as the user's own). Ctrl-C is SIGINT. Every wait is bounded.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import REPO_ROOT, free_port, http_json, wait_until

PAGE = REPO_ROOT / "docs" / "quickstart.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)


def _commands() -> list[str]:
    """Every shell command of the page after §1, comments stripped."""
    text = PAGE.read_text(encoding="utf-8")
    after_install = text.split("## 2.", 1)[1]
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", after_install, flags=re.S):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                cmds.append(line)
    return cmds


def _env(home: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADWATCH_")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1", **extra)
    return env


def _stop(proc: subprocess.Popen) -> str:
    """Ctrl-C, as the page says (SIGINT to the command's process group, as a terminal sends it); the output
    it printed."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    pumped = getattr(proc, "pumped", None)
    if pumped is None:
        return proc.stdout.read() if proc.stdout else ""
    out = []
    while True:
        try:
            line = pumped.get(timeout=10)
        except Exception:  # noqa: BLE001 - queue.Empty: the reader is done or stuck
            break
        if line is None:
            break
        out.append(line)
    return "".join(out)


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """The process's output up to the first line matching ``pattern`` (bounded: a hang fails the test). A
    thread reads the pipe, so the process never blocks on a full pipe and a quiet one is not waited on."""
    import queue
    import threading

    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    proc.pumped = lines
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        out.append(line)
        if re.search(pattern, line):
            return "".join(out)
    raise AssertionError(f"no line matching {pattern!r} within {timeout}s:\n{''.join(out)}")


USER_LOOP = '''
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
loader = [(torch.randn(32, 8), torch.randn(32, 1)) for _ in range(40)]
'''
USER_STEP = '''\
optimizer.zero_grad(set_to_none=True)
loss = nn.functional.mse_loss(model(x), y)
scaler.scale(loss).backward()
scaler.unscale_(optimizer)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(optimizer)
scaler.update()'''


def test_the_quickstart_works_verbatim_on_a_clean_home(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (work / ".venv").symlink_to(REPO_ROOT / ".venv")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmds = _commands()
    demo = next(c for c in cmds if c.split()[1:2] == ["demo"])
    serve = next(c for c in cmds if c.split()[1:2] == ["serve"])
    export = next(c for c in cmds if c.split()[1:2] == ["export"])
    assert all(c.startswith(".venv/bin/") for c in (demo, serve, export)), cmds

    # §2: the demo, until its run is over; then Ctrl-C
    proc = subprocess.Popen(shlex.split(demo) + ["--port", str(port)], cwd=work, env=_env(home), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = _read_until(proc, r"training run finished", timeout=600)   # bounds a hang only
    finally:
        out += _stop(proc)
    assert proc.returncode == 0, out
    for rule in ("A2", "C3", "A1", "A3", "B3", "A5"):      # the alerts §2 lists, as the demo raised them
        assert f"ALERT {rule} " in out, (rule, out)
    assert (home / ".gradwatch" / "gradwatch.db").exists(), out

    # §3: serve, on the same database: the demo's run is listed
    log = open(tmp_path / "serve.log", "w")       # a file: a full pipe would stall the server
    proc = subprocess.Popen(shlex.split(serve) + ["--port", str(port)], cwd=work, env=_env(home), text=True,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def up():
            try:
                return http_json("GET", base + "/api/health", timeout=2)[0] == 200
            except OSError:
                return False
        wait_until(up, timeout=60, interval=0.2, what="gradwatch serve")
        _, body = http_json("GET", base + "/api/v1/runs")
        assert [r["project"] for r in body["runs"]] == ["demo"], body       # the demo's run, not an empty list

        # §4: the snippet, its "..." filled in by a tiny loop
        (python,) = [b for b in _blocks("python") if "agent.attach" in b]
        snippet = re.sub(r"^(\s*)\.\.\..*$", lambda m: textwrap.indent(USER_STEP, m.group(1)), python, flags=re.M)
        script = work / "train.py"
        script.write_text(USER_LOOP + snippet)
        run = subprocess.run([sys.executable, str(script)], cwd=work, env=_env(home, GRADWATCH_SERVER=base),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        # attach says where the run can be seen (one line; announce=False turns it off)
        assert f"{base}/?project=nlp&run=exp-42" in run.stderr, run.stderr
        _, body = http_json("GET", base + "/api/v1/runs?project=nlp")
        assert [r["name"] for r in body["runs"]] == ["exp-42"], body
    finally:
        _stop(proc)
        log.close()

    # §6: export, as written (the default database is the one the server used)
    done = subprocess.run(shlex.split(export), cwd=work, env=_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(work / "exp-42.parquet")
    assert table.num_rows == 40 and "loss" in table.column_names, table.schema
