"""What a user's own run says and leaves behind (issue 42): the run's URL at attach (and quiet with
announce=False), a server-down message that says what happens and what to run, no spool folder left by a
run whose batches all reached the server, and the folder kept while batches wait."""
from __future__ import annotations

import logging

import torch
import torch.nn as nn

from gradwatch import agent
from tests.conftest import free_port


def _train(monitor_kw: dict, steps: int = 12) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, **monitor_kw)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    monitor.close()


def test_a_run_that_uploaded_says_where_it_is_and_leaves_no_spool_folder(live_server, tmp_path, capfd):
    spool = tmp_path / "spool"
    _train(dict(project="nlp", run="exp-1", server=live_server.url, spool_dir=str(spool)))
    err = capfd.readouterr().err
    assert f"gradwatch: run 'exp-1' (project 'nlp'): {live_server.url}/?project=nlp&run=exp-1" in err, err
    assert err.count("gradwatch: run ") == 1
    _, body = live_server.get("/api/v1/runs?project=nlp")
    assert [r["name"] for r in body["runs"]] == ["exp-1"]
    assert not (spool / "nlp").exists(), list(spool.rglob("*"))      # nothing left to upload: no folder

    _train(dict(project="nlp", run="exp-2", server=live_server.url, spool_dir=str(spool), announce=False))
    assert "gradwatch: run " not in capfd.readouterr().err               # announce=False: quiet


def test_server_down_says_what_happens_and_what_to_run_and_keeps_the_spool(tmp_path, caplog):
    spool = tmp_path / "spool"
    down = f"http://127.0.0.1:{free_port()}"                          # nothing listens there
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _train(dict(project="nlp", run="offline-1", server=down, spool_dir=str(spool), exit_timeout=2.0))
    said = [r.getMessage() for r in caplog.records if "not reachable" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    msg = said[0]
    assert "connection refused" in msg and "Errno" not in msg and "URLError" not in msg, msg
    assert "Training goes on" in msg and "gradwatch sync" in msg, msg
    folder = spool / "nlp" / "offline-1" / "rank0"
    assert str(folder) in msg
    assert any(folder.glob("*")), "the batches wait in the spool for `gradwatch sync`"


def test_the_users_own_run_echoes_its_alerts_to_stderr(live_server, tmp_path, capfd):
    """As the demo does: a NaN loss on the user's run is printed with the run page's address."""
    import math
    import time

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="nlp", run="nan-run", server=live_server.url,
                           spool_dir=str(tmp_path / "spool"), flush_interval=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    err = ""
    try:
        for step in range(400):          # bounded: the alert comes back with a reply a few steps later
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y) * (math.nan if step == 30 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            time.sleep(0.02)
            err += capfd.readouterr().err
            if "gradwatch: ALERT A1 loss_nonfinite" in err:
                break
    finally:
        monitor.close()
    err += capfd.readouterr().err
    line = next((ln for ln in err.splitlines() if "gradwatch: ALERT A1 loss_nonfinite" in ln), None)
    assert line is not None, err
    assert "(critical) at step 30: Loss is NaN at step 30" in line and f"{live_server.url}/runs/" in line, line
    assert sum("gradwatch: ALERT A1" in ln for ln in err.splitlines()) == 1        # once, not at every change
