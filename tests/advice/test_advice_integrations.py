"""The configuration advice through the framework callbacks: the HF Trainer and Lightning hand their LR
scheduler to the agent (H8), and a tiny GPT-2 (HF's GPT2Attention) is told from its modules (H6)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import start_sqlite_server
from tests.integrations.conftest import require, run_of
from tests.integrations.test_hf_trainer import TokenDataset, tiny_gpt2

transformers = require("transformers")
accelerate = require("accelerate")
L = require("lightning.pytorch")

SETUP_RULES = {"H5", "H6", "H7", "H8", "H9"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_sqlite_server(tmp_path_factory.mktemp("advice-integrations"))
    yield srv
    srv.stop()


def notes(server, project: str, run: str) -> dict[str, dict]:
    _, body = server.get(f"/api/v1/alerts?run={run_of(server, project, run)['id']}")
    return {a["rule"]: a for a in body["alerts"] if a["rule"] in SETUP_RULES}


def setup_of(server, project: str, run: str) -> dict:
    _, body = server.get(f"/api/v1/runs/{run_of(server, project, run)['id']}/events?kind=run_setup")
    events = body["events"] if isinstance(body, dict) else body
    assert len(events) == 1, events
    return events[0]["data"]


@pytest.mark.parametrize("schedule,max_grad_norm,expected", [
    ("cosine", 1.0, {"H8"}),     # HF's cosine schedule decays to 0
    ("linear", 0.0, {"H6"}),     # no clipping on a Transformer (max_grad_norm=0 turns it off)
    ("cosine_with_min_lr", 1.0, set()),
], ids=["cosine-to-0", "unclipped", "cosine-min-lr-0.1"])
def test_hf_trainer(server, tmp_path, schedule, max_grad_norm, expected):
    from gradwatch.agent.integrations.hf import GradwatchCallback

    run = f"hf-{schedule}-{max_grad_norm:g}"
    extra = {"lr_scheduler_kwargs": {"min_lr_rate": 0.1}} if schedule == "cosine_with_min_lr" else {}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, learning_rate=5e-3,
        lr_scheduler_type=schedule, warmup_steps=1, max_grad_norm=max_grad_norm, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, **extra)
    cb = GradwatchCallback(project="advice-hf", run=run, server=server.url, flush_interval=0.1)
    transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(32), callbacks=[cb]).train()

    data = setup_of(server, "advice-hf", run)
    assert data["model"]["transformer"] is True and any("GPT2Attention" in m for m in data["model"]["attention"])
    assert data["scheduler"]["class"] == "LambdaLR" and data["scheduler"]["cosine"] is (schedule != "linear")
    assert data["optimizer"]["class"] in ("AdamW", "Adam")     # under whatever wrapper the Trainer's accelerate adds
    assert data["clip"]["calls"] == (1 if max_grad_norm else 0)
    # without max_grad_norm the Trainer still computes the norm it logs: clip_grad_norm_(max_norm=inf), no clip
    # max_grad_norm=0: the Trainer still computes the norm for its log. accelerate < 1.16 did it with
    # clip_grad_norm_(max_norm=inf), counted as a norm-only call; 1.16's DTensor-aware path calls
    # get_total_norm and no clip function at all (and clip_grads_with_norm_ only for a finite max_norm)
    norm_only = 0 if max_grad_norm or hasattr(accelerate.Accelerator, "_clip_grad_norm_dtensor_aware") else 1
    assert data["clip"].get("norm_only_calls", 0) == norm_only
    found = notes(server, "advice-hf", run)
    assert set(found) == expected, found
    assert all(a["severity"] == "info" for a in found.values())


class CosineModule(L.LightningModule):
    def __init__(self, eta_min: float):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.eta_min = eta_min

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=10, eta_min=self.eta_min)}


@pytest.mark.parametrize("eta_min,expected", [(0.0, {"H8"}), (0.005, set())], ids=["to-0", "to-base-over-10"])
def test_lightning(server, tmp_path, eta_min, expected):
    from gradwatch.agent.integrations.lightning import GradwatchCallback

    run = f"lightning-eta-{eta_min:g}"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1]), batch_size=4)
    cb = GradwatchCallback(project="advice-lightning", run=run, server=server.url, flush_interval=0.1)
    torch.manual_seed(0)
    L.Trainer(accelerator="cpu", devices=1, max_steps=3, gradient_clip_val=1.0, callbacks=[cb], logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              default_root_dir=str(tmp_path)).fit(CosineModule(eta_min), data)
    setup = setup_of(server, "advice-lightning", run)
    sched = setup["scheduler"]
    assert setup["optimizer"]["class"] == "SGD"     # under Lightning's LightningOptimizer, if the callback saw that
    assert sched["class"] == "CosineAnnealingLR" and sched["final_lrs"] == [eta_min]
    assert set(notes(server, "advice-lightning", run)) == expected
