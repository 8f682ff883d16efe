"""``remediate=`` through a framework callback: a real HF Trainer (its own LambdaLR schedule, fp32 on the CPU,
no GradScaler) whose loss turns NaN on the forwards in ``NAN_AT``. The callback hands ``remediate=`` to
``attach`` with the Trainer's scheduler: the first NaN is rewound (weights, AdamW state and the scheduler
put back), the second gives up: ``then="stop"`` restores the last good state and ends the Trainer as ``stop_on`` does."""
from __future__ import annotations

import math
import time

import torch

from tests.conftest import wait_until
from tests.integrations.conftest import require, run_of

NAN_AT = (45, 200)       # forwards (one optimizer step each) whose loss is NaN
MAX_STEPS = 3000         # reached only if the stop never comes
PACE_S = 0.004


def test_hf_trainer_rewinds_then_gives_up_and_stops(server_factory, sqlite_url, tmp_path):
    transformers = require("transformers")
    require("accelerate")
    from gradwatch.agent import Rewind
    from gradwatch.agent.integrations.hf import GradwatchCallback

    server = server_factory(sqlite_url)

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.forwards = 0

        def forward(self, x, labels):
            loss = torch.nn.functional.mse_loss(self.net(x), labels)
            if self.training:
                if self.forwards in NAN_AT:
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
    rewind = Rewind(every=20, keep=2, max_rewinds=1, then="stop")
    cb = GradwatchCallback(project="remediate-hf", run="hf", server=server.url, flush_interval=0.1,
                           announce=False, remediate=rewind)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=MAX_STEPS, learning_rate=1e-2,
        logging_steps=1000, report_to=[], save_strategy="no", use_cpu=True, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, logging_nan_inf_filter=False, lr_scheduler_type="linear",
    )
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[cb, Pace()])
    trainer.train()

    actions = [(d["action"], d["trigger"]["step"]) for d in rewind.rewinds]
    print(f"\nHF: {rewind.rewinds}; stopped at global step {trainer.state.global_step}")
    assert [a for a, _ in actions] == ["rewind", "gave_up"], actions
    first, last = rewind.rewinds
    assert first["trigger"]["rule"] == "A1" and first["trigger"]["step"] == NAN_AT[0]
    assert first["to_step"] <= NAN_AT[0] < first["from_step"] and first["to_step"] % 20 == 0
    assert last["trigger"]["step"] >= first["from_step"]
    # the rewind healed the first NaN: the run went on with finite weights until the second one
    assert rewind.should_stop and last["from_step"] <= trainer.state.global_step < MAX_STEPS
    assert trainer.state.global_step > NAN_AT[1]
    # then="stop" restored the last good state before stopping: the Trainer ends with finite weights
    assert last["to_step"] <= NAN_AT[1] and last["to_step"] % 20 == 0
    assert all(math.isfinite(p.detach().sum().item()) for p in trainer.model.parameters())
    detail = wait_until(lambda: (d := run_of(server, "remediate-hf", "hf"))["status"] == "finished" and d,
                        timeout=20, what="the run's final batch")
    _, body = server.get(f"/api/v1/runs/{detail['id']}/events?kind=rewind")
    assert [e["data"]["action"] for e in body["events"]] == ["rewind", "gave_up"]
