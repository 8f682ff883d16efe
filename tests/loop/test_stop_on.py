"""``stop_on="critical"``: a real HF Trainer run and a real Lightning fit that go NaN stop themselves.

The loss turns NaN at step ``NAN_STEP`` (fp32 on the CPU, no GradScaler to skip it: the weights go NaN and
every later step is NaN too, the run is lost). The server raises A1; the reply to the agent's next batch
carries it; the callback stops the run at the end of the step during which it arrived. The loops are paced
at a few milliseconds a step so that "soon after" is a small number of steps; the assertions are on step
numbers, not on time.
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from tests.conftest import wait_until
from tests.integrations.conftest import require, run_of

NAN_STEP = 25
MAX_STEPS = 3000          # ~15 s at the pace below: reached only if the stop never comes
PACE_S = 0.005


def _assert_stopped_soon(global_step: int, cb, server, project: str, run: str) -> None:
    assert cb.stopped_by is not None, "the callback never saw a critical alert"
    assert cb.stopped_by.rule == "A1" and cb.stopped_by.step == NAN_STEP
    assert NAN_STEP < global_step < MAX_STEPS, f"stopped at global step {global_step}"
    # soon: well under a second of steps at this pace (the alert's round trip is a few tenths of a second)
    assert global_step - NAN_STEP < 400, f"stopped {global_step - NAN_STEP} steps after the NaN"
    print(f"\n{project}: NaN at step {NAN_STEP}, stopped at global step {global_step} "
          f"({global_step - NAN_STEP} steps later at {PACE_S * 1000:.0f} ms a step)")
    # the callback's close() sends the final batch (status "finished") within exit_timeout; on a loaded
    # machine that batch may still be on its way when close() returns, so wait for it, do not race it
    detail = wait_until(lambda: (d := run_of(server, project, run))["status"] == "finished" and d, timeout=20,
                        what="the run's final batch (status finished)")
    status, body = server.get(f"/api/v1/alerts?run={detail['id']}&rule=A1")
    assert status == 200 and [a["id"] for a in body["alerts"]] == [cb.stopped_by.id]


def test_hf_trainer_stops_on_a_critical_alert(live_server, tmp_path):
    transformers = require("transformers")
    require("accelerate")
    from gradwatch.agent.integrations.hf import GradwatchCallback

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.forwards = 0

        def forward(self, x, labels):
            loss = torch.nn.functional.mse_loss(self.net(x), labels)
            if self.training:
                if self.forwards == NAN_STEP:          # one optimizer step per forward (no accumulation)
                    loss = loss * torch.tensor(float("nan"))
                self.forwards += 1
            return {"loss": loss}

    class Data(torch.utils.data.Dataset):
        def __init__(self, n=64):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 4, generator=g)
            self.y = self.x.sum(1, keepdim=True) * 0.5

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    class Pace(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(PACE_S)

    torch.manual_seed(0)
    cb = GradwatchCallback(project="stop-hf", run="hf-nan", server=live_server.url, flush_interval=0.1,
                           stop_on="critical")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=MAX_STEPS, learning_rate=1e-2,
        logging_steps=1000, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, logging_nan_inf_filter=False,
    )
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[cb, Pace()])
    trainer.train()
    assert any(math.isnan(p.detach().sum().item()) for p in trainer.model.parameters()), \
        "the NaN step ruined the weights (the run was worth stopping)"
    _assert_stopped_soon(trainer.state.global_step, cb, live_server, "stop-hf", "hf-nan")


def test_lightning_stops_on_a_critical_alert(live_server, tmp_path):
    L = require("lightning.pytorch")
    from gradwatch.agent.integrations.lightning import GradwatchCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if self.trainer.global_step == NAN_STEP:
                loss = loss * torch.tensor(float("nan"))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    class Pace(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            time.sleep(PACE_S)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True) * 0.5),
                                       batch_size=8)
    torch.manual_seed(0)
    cb = GradwatchCallback(project="stop-lightning", run="pl-nan", server=live_server.url, flush_interval=0.1,
                           stop_on={"critical"})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=MAX_STEPS, callbacks=[cb, Pace()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    module = Module()
    trainer.fit(module, data)
    assert any(math.isnan(p.detach().sum().item()) for p in module.parameters())
    _assert_stopped_soon(trainer.global_step, cb, live_server, "stop-lightning", "pl-nan")


def test_a_bad_stop_on_is_refused_when_the_callback_is_built():
    require("lightning.pytorch")
    from gradwatch.agent.integrations.lightning import GradwatchCallback

    with pytest.raises(ValueError, match="stop_on"):
        GradwatchCallback(stop_on=[])
