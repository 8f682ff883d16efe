"""``gradwatch sync``: upload a spool written offline (or left by a run whose server was down)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.cli.cli_helpers import gradwatch
from tests.conftest import REPO_ROOT

TRAIN_OFFLINE = textwrap.dedent("""
    import sys, torch
    from gradwatch import agent
    spool, run = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = agent.attach(model, optimizer=opt, project="offline", run=run, mode="offline", spool_dir=spool,
                           flush_interval=0.05)
    for step in range(6):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        monitor.log(loss=loss)
        print(f"{step} {float(loss)!r}")
    monitor.close()
""")


def train_offline(spool, run: str) -> list[float]:
    proc = subprocess.run([sys.executable, "-c", TRAIN_OFFLINE, str(spool), run], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [float(line.split()[1]) for line in proc.stdout.splitlines()]


def spooled(spool) -> list:
    return sorted(p for p in spool.rglob("*") if p.is_file())


def test_sync_uploads_an_offline_spool_once_and_keeps_it_until_then(server_factory, sqlite_url, tmp_path):
    spool = tmp_path / "spool"
    losses = train_offline(spool, "offline-1")
    files = spooled(spool)
    assert files, "offline mode writes the batches to the spool"

    # server down: nothing is lost, the command fails and says so
    down = gradwatch("sync", str(spool), "--server", "http://127.0.0.1:9", data_dir=tmp_path, timeout=120)
    assert down.returncode != 0
    assert spooled(spool) == files

    # auth on and no token: refused, with a message that names the token
    srv = server_factory(sqlite_url, env={"GRADWATCH_AUTH": "on"})
    refused = gradwatch("sync", str(spool), "--server", srv.url, data_dir=tmp_path)
    assert refused.returncode != 0
    assert "token" in (refused.stdout + refused.stderr).lower(), "the error says a token is needed"
    assert spooled(spool) == files

    token = gradwatch("token", "create", "--project", "offline", "--db", srv.db_url, data_dir=tmp_path)
    assert token.returncode == 0, token.stderr
    with_token = {"GRADWATCH_TOKEN": token.stdout.strip()}
    ok = gradwatch("sync", str(spool), "--server", srv.url, data_dir=tmp_path, env=with_token)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert not spooled(spool), "sent batches are removed from the spool"

    auth = {"Authorization": f"Bearer {with_token['GRADWATCH_TOKEN']}"}
    status, body = srv.get("/api/v1/runs?project=offline", headers=auth)
    run = next(r for r in body["runs"] if r["name"] == "offline-1")
    assert run["last_step"] == 5 and run["status"] == "finished"
    status, series = srv.get(f"/api/v1/runs/{run['id']}/series?signal=loss&max_points=1000", headers=auth)
    assert [p["step"] for p in series["steps"]] == list(range(6))
    assert [float(p["last"]) for p in series["steps"]] == pytest.approx(losses, rel=1e-6)

    again = gradwatch("sync", str(spool), "--server", srv.url, data_dir=tmp_path, env=with_token)
    assert again.returncode == 0, again.stderr
