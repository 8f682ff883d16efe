"""The exact-step NaN origin in a real ``transformers.Trainer`` run (CPU, fp32: no scaler, so ``nan_guard``).

The model computes its own loss from ``labels`` (as Hugging Face models do), so the replay runs its
forward, loss and backward without a closure. One sample of the dataset is bad; the Trainer's
shuffled sampler puts it in one batch of the single epoch, and the model itself notes which step
that was (the test's callback tells it the step).
"""
from __future__ import annotations

import torch

from tests.conftest import wait_until
from tests.integrations.conftest import require
from tests.origin.conftest import events, run_id

transformers = require("transformers")
require("accelerate")

from gradwatch.agent.integrations.hf import GradwatchCallback  # noqa: E402

BAD_SAMPLE = 23


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 64):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.x[BAD_SAMPLE] *= 1e4           # one corrupt record: its logits overflow exp() in fp32
        self.y = torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class ExpNormalize(torch.nn.Module):
    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(dim=-1, keepdim=True)


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.attend = ExpNormalize()
        self.head = torch.nn.Linear(16, 1)
        self.step, self.bad_steps = 0, set()

    def forward(self, x, labels):
        if x.abs().max() > 1000:
            self.bad_steps.add(self.step)
        pred = self.head(self.attend(self.proj(x))).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels)}


class StepOfTheModel(transformers.TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_step_begin(self, args, state, control, **kw):
        self.model.step = state.global_step   # gradwatch's step for this optimizer step


def test_hf_trainer_transient_nan_named_at_its_step(sqlite_server, run_name, tmp_path):
    torch.manual_seed(0)
    model = Scorer()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=16, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, max_grad_norm=0.0,
    )
    callback = GradwatchCallback(project="origin", run=run_name, server=sqlite_server.url, flush_interval=0.1,
                                 nan_guard=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(),
                                   callbacks=[StepOfTheModel(model), callback])
    trainer.train()
    assert len(model.bad_steps) == 1
    (bad_step,) = model.bad_steps
    rid = run_id(sqlite_server, "origin", run_name)
    found = wait_until(lambda: events(sqlite_server, rid, "nan_origin"), what="nan_origin event")
    assert len(found) == 1
    assert found[0]["step"] == bad_step
    data = found[0]["data"]
    assert (data["module"], data["where"], data["cause"], data["method"]) == \
        ("attend", "activation", "softmax_overflow", "replay")
    assert events(sqlite_server, rid, "nan_origin_not_found") == []
