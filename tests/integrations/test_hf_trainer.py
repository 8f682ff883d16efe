"""GradwatchCallback on a real ``transformers.Trainer`` training tiny randomly initialised models.

No downloads: the models are built from tiny configs. The Trainer's own log
(``logging_steps=1``: one entry per optimizer step with ``loss``,
``grad_norm`` and ``learning_rate``) is the reference the server's data must
match — one gradwatch step per optimizer step, not per micro-batch, and the
loss neither summed twice nor left undivided under gradient accumulation.
"""
from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import wait_until
from tests.integrations.conftest import assert_close, require, run_of, series

transformers = require("transformers")
require("accelerate")

from gradwatch.agent.integrations.hf import GradwatchCallback, watch  # noqa: E402

VOCAB, SEQ = 64, 16


class TokenDataset(torch.utils.data.Dataset):
    """Arithmetic sequences: learnable, so the loss moves; labels = inputs (causal LM)."""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PlainRegressor(torch.nn.Module):
    """A model that does not take ``num_items_in_batch``: the Trainer divides its loss by the accumulation steps."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, input_ids, labels):
        pred = self.head(self.embed(input_ids).mean(1)).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(pred, labels.float().mean(1) / VOCAB)}


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def train(model, tmp_path, *, accumulation: int, bf16: bool, max_steps: int, callback=None, bind=False,
          samples: int = 64):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        max_steps=max_steps, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=bf16, seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(samples),
                                   callbacks=[callback] if callback and not bind else None)
    if bind:
        callback = watch(trainer, **callback)
    trainer.train()
    return trainer, callback


def framework_log(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


@pytest.mark.parametrize("model_kind,accumulation,bf16,bind", [
    ("gpt2", 2, False, False),     # model normalises by num_items_in_batch (loss scaled for accumulation)
    ("gpt2", 1, True, False),      # bf16 autocast on CPU, no accumulation
    ("plain", 3, False, True),     # Trainer divides the loss by the accumulation steps; watch(trainer)
])
def test_trainer_steps_and_loss_match_the_trainers_own_log(gw_server, tmp_path, run_name, model_kind,
                                                           accumulation, bf16, bind):
    model = tiny_gpt2() if model_kind == "gpt2" else PlainRegressor()
    max_steps = 5
    settings = dict(project="hf", run=run_name, server=gw_server.url, flush_interval=0.1)
    cb = settings if bind else GradwatchCallback(**settings)
    trainer, cb = train(model, tmp_path, accumulation=accumulation, bf16=bf16, max_steps=max_steps, callback=cb,
                        bind=bind)

    assert isinstance(cb, GradwatchCallback) and cb in trainer.callback_handler.callbacks
    assert trainer.state.global_step == max_steps
    assert cb.monitor is None, "the monitor is closed when training ends"
    assert "training_step" not in trainer.__dict__, "the training_step wrapper is removed after train()"

    # the final batch (status finished) may still be on its way on a loaded machine: wait, do not race it
    run = wait_until(lambda: (r := run_of(gw_server, "hf", run_name))["status"] == "finished" and r, timeout=20,
                     what="the run's final batch")
    loss = series(gw_server, run["id"], "loss")
    # one gradwatch step per optimizer step, numbered from 0, however many micro-batches each had
    assert sorted(loss) == list(range(max_steps))
    assert run["last_step"] == max_steps - 1

    steps = sorted(loss)
    assert_close([loss[s] for s in steps], framework_log(trainer, "loss"), what="loss")
    grad_norm = series(gw_server, run["id"], "grad_norm")
    assert_close([grad_norm[s] for s in steps], framework_log(trainer, "grad_norm"), rel=1e-4, what="grad_norm")
    lr = series(gw_server, run["id"], "lr")
    assert_close([lr[s] for s in steps], framework_log(trainer, "learning_rate"), what="learning rate")
    clip = series(gw_server, run["id"], "clip_max_norm")
    assert set(clip.values()) == {1.0}, "the Trainer's max_grad_norm is seen as the clipping threshold"
    status, detail = gw_server.get(f"/api/v1/runs/{run['id']}")
    assert status == 200
    assert detail["param_names"] == [n for n, p in trainer.model.named_parameters() if p.requires_grad]


def test_a_run_resumed_from_a_checkpoint_continues_its_steps(gw_server, tmp_path, run_name):
    def trainer_for(max_steps: int):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=max_steps, learning_rate=5e-3, logging_steps=1, report_to=[], save_strategy="steps",
            save_steps=3, use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
        cb = GradwatchCallback(project="hf", run=run_name, server=gw_server.url, flush_interval=0.1)
        return transformers.Trainer(model=PlainRegressor(), args=args, train_dataset=TokenDataset(64),
                                    callbacks=[cb])

    trainer_for(3).train()
    resumed = trainer_for(5)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert resumed.state.global_step == 5

    run = run_of(gw_server, "hf", run_name)
    loss = series(gw_server, run["id"], "loss")
    assert sorted(loss) == [0, 1, 2, 3, 4], "the resumed steps follow the first ones instead of replacing them"
    resumed_log = [e["loss"] for e in resumed.state.log_history if "loss" in e and e.get("step", 0) > 3]
    assert_close([loss[3], loss[4]], resumed_log, what="resumed loss")
    # the Trainer restores optimizer, scheduler and model: no resume rule (G1-G5) speaks (docs/resume.md)
    _, body = gw_server.get(f"/api/v1/alerts?run={run['id']}")
    assert [a["rule"] for a in body["alerts"] if a["rule"].startswith("G")] == []
    _, body = gw_server.get(f"/api/v1/runs/{run['id']}/events?kind=resume_state")
    resume = [e for e in body["events"] if e["step"] == 3]
    assert len(resume) == 1 and resume[0]["data"]["before"]["step"] == 2 and resume[0]["data"]["step_origin"] == "given"


def test_agent_import_does_not_import_the_frameworks(tmp_path):
    import subprocess

    code = ("import sys; import gradwatch.agent.integrations; "
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
