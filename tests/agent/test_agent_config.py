"""Agent settings: arguments over GRADWATCH_* variables over defaults; clear messages for bad values."""
from __future__ import annotations

import os
import re

import pytest
import torch

from gradwatch import agent
from gradwatch.agent.config import AgentConfig
from agent_helpers import RecordingTransport, TinyNet, batches


def test_defaults_without_environment():
    cfg = AgentConfig.from_sources({}, env={})
    assert cfg.server == "http://127.0.0.1:8470"
    assert cfg.project == "default"
    assert re.fullmatch(rf"run-\d{{8}}-\d{{6}}-{os.getpid()}", cfg.run)
    assert cfg.token is None and cfg.mode == "online"


def test_environment_fills_settings_and_arguments_win():
    env = {"GRADWATCH_SERVER": "http://gw.internal:9000/", "GRADWATCH_PROJECT": "nlp", "GRADWATCH_RUN": "exp-7",
           "GRADWATCH_TOKEN": "t0k", "GRADWATCH_MODE": "offline", "GRADWATCH_ACTIVATIONS_EVERY": "0",
           "GRADWATCH_NAN_HUNT": "off", "GRADWATCH_FLUSH_INTERVAL": "2.5"}
    cfg = AgentConfig.from_sources({"run": "from-argument"}, env=env)
    assert cfg.server == "http://gw.internal:9000"
    assert (cfg.project, cfg.run, cfg.token, cfg.mode) == ("nlp", "from-argument", "t0k", "offline")
    assert cfg.activations_every == 0 and cfg.nan_hunt is False and cfg.flush_interval == 2.5


@pytest.mark.parametrize("arguments, message", [
    ({"server": "127.0.0.1:8470"}, "server='127.0.0.1:8470': give an http:// or https:// URL"),
    ({"mode": "later"}, "mode='later': use one of online, offline, disabled"),
    ({"activations_every": -1}, "activations_every=-1: use 0 to turn it off"),
    # every *_every setting is checked alike (agent/config.py cadences()): a step interval is a whole number
    ({"weights_every": 2.5}, "weights_every=2.5: use 0 to turn it off"),
    ({"output_logits_every": -5}, "output_logits_every=-5: use 0 to turn it off"),
    ({"nan_hunt_steps": -1}, "nan_hunt_steps=-1: use 0 to turn it off"),
    ({"flush_interval": 0}, "flush_interval=0: must be a positive number of seconds"),
    ({"run": "  "}, "run='  ': give a non-empty name"),
    ({"batch_size": 0}, "batch_size=0: must be a positive integer"),
    ({"activation_every": 5}, "unknown setting(s) activation_every; known settings are"),
])
def test_bad_settings_say_what_to_fix(arguments, message):
    with pytest.raises(ValueError) as info:
        AgentConfig.from_sources(arguments, env={})
    assert message in str(info.value)


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match=r"GRADWATCH_WEIGHTS_EVERY='often' is not a valid int"):
        AgentConfig.from_sources({}, env={"GRADWATCH_WEIGHTS_EVERY": "often"})


def test_attach_validates_before_training_starts(tmp_path):
    model = TinyNet()
    with pytest.raises(ValueError, match="mode="):
        agent.attach(model, mode="sometimes")
    with pytest.raises(ValueError, match="model="):
        agent.attach(object())
    assert not model._forward_pre_hooks    # nothing was installed


def test_attach_drops_a_scaler_or_optimizer_it_cannot_hook_with_one_warning(caplog):
    """Not a bad setting: a wrapper it does not know (issue 36). Tested further in
    tests/integrations/test_unknown_wrappers.py."""
    model = TinyNet()
    with caplog.at_level("WARNING", logger="gradwatch.agent"):
        monitor = agent.attach(model, scaler=object(), optimizer=object(), mode="disabled")
    assert monitor.scaler is None and monitor.optimizer is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "gradwatch.agent"]
    assert "scaler object is not a torch.amp.GradScaler" in warning and "optimizer object" in warning
    monitor.close()


def test_attach_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADWATCH_PROJECT", "env-project")
    monkeypatch.setenv("GRADWATCH_RUN", "env-run")
    monkeypatch.setenv("GRADWATCH_SPOOL_DIR", str(tmp_path / "spool"))
    rec = RecordingTransport()
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with agent.attach(model, optimizer=opt, transport=rec) as monitor:
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert monitor.config.spool_dir == str(tmp_path / "spool")
    assert (rec.bodies[0]["project"], rec.bodies[0]["run"]) == ("env-project", "env-run")


def test_disabled_mode_records_steps_but_sends_nothing(tmp_path):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with agent.attach(model, optimizer=opt, mode="disabled", spool_dir=str(tmp_path / "s")) as monitor:
        for x, y in batches(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    assert monitor.step == 2 and monitor.sender is None
    assert not (tmp_path / "s").exists()


def test_the_cadences_are_the_every_settings_and_every_step_sets_each_to_one():
    from dataclasses import fields

    from gradwatch.agent.config import EVERY_STEP, cadences
    every = {f.name for f in fields(AgentConfig) if f.name.endswith("_every")}
    assert set(cadences()) == every == set(EVERY_STEP) and len(every) >= 9
    cfg = AgentConfig.every_step()
    assert all(getattr(cfg, name) == 1 for name in every)
