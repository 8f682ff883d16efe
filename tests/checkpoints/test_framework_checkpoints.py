"""The HF and Lightning callbacks record the checkpoints their frameworks save, with the files' own paths and steps.

Real ``transformers.Trainer`` (``save_steps``) and Lightning ``Trainer.fit`` (``ModelCheckpoint(
every_n_train_steps=...)``) runs on tiny models, a real server. The reference is what the framework
wrote to disk: every checkpoint directory or file it left, and the step stored inside it.
"""
from __future__ import annotations

import json

import torch

from tests.conftest import wait_until
from tests.integrations.conftest import require, run_of

transformers = require("transformers")
require("accelerate")
L = require("lightning.pytorch")

from gradwatch.agent.integrations.hf import GradwatchCallback as HfCallback  # noqa: E402
from gradwatch.agent.integrations.lightning import GradwatchCallback as PlCallback  # noqa: E402


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _checkpoints(srv, project: str, run: str, count: int) -> list[dict]:
    run_id = run_of(srv, project, run)["id"]

    def listed():
        _, body = srv.get(f"/api/v1/runs/{run_id}/checkpoints")
        return body["checkpoints"] if len(body["checkpoints"]) >= count else None
    return wait_until(listed, timeout=15, what=f"{count} checkpoints listed")


def test_hf_trainer_save_steps_records_each_checkpoint(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    out = tmp_path / "out"
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=7, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="steps", save_steps=3, use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    cb = HfCallback(project="hf-ckpt", run="save-steps", server=srv.url, flush_interval=0.1)
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Rows(), callbacks=[cb])
    trainer.train()

    on_disk = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert on_disk, "the Trainer saved no checkpoint"
    # the step the Trainer stored in each checkpoint (a resume continues from it)
    disk_steps = [json.loads((p / "trainer_state.json").read_text())["global_step"] for p in on_disk]
    listed = _checkpoints(srv, "hf-ckpt", "save-steps", len(on_disk))
    assert [(c["step"], c["path"], c["source"]) for c in listed] == \
        [(s, str(p), "transformers") for s, p in zip(disk_steps, on_disk)]
    assert disk_steps == [3, 6, 7]   # save_steps, and the last step


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_lightning_model_checkpoint_records_each_checkpoint(server_factory, sqlite_url, tmp_path):
    srv = server_factory(sqlite_url)
    data = Rows(40)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x, data.y), batch_size=4)
    ckpt_dir = tmp_path / "ckpt"
    saver = L.callbacks.ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3, save_top_k=-1)
    cb = PlCallback(project="pl-ckpt", run="every-3", server=srv.url, flush_interval=0.1)
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, callbacks=[cb, saver], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), loader)

    files = sorted(ckpt_dir.glob("*.ckpt"))
    assert files, "ModelCheckpoint saved nothing"
    on_disk = sorted((torch.load(f, weights_only=False)["global_step"], str(f)) for f in files)
    listed = _checkpoints(srv, "pl-ckpt", "every-3", len(on_disk))
    assert [(c["step"], c["path"], c["source"]) for c in listed] == [(s, p, "lightning") for s, p in on_disk]
    assert [s for s, _ in on_disk] == [3, 6]
