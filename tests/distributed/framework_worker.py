"""One rank of a framework's own distributed launch under ``torchrun`` (gloo, CPU), with gradwatch's
callback: ``hf`` (``transformers.Trainer``, DDP) or ``lightning`` (``strategy="ddp"``).

Each rank writes what the framework itself computed to ``<out>/rank<r>.json`` (torchrun interleaves
stdout): the Trainer's ``log_history`` (its logged loss is the mean over ranks, its grad norm the
all-reduced gradients' norm), or the loss each Lightning ``training_step`` returned on this rank and
the grad norm of Lightning's ``grad_norm`` utility before each optimizer step.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB, SEQ = 64, 16


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run_hf(args, out: Path, rank: int) -> dict:
    import transformers

    from gradwatch.agent.integrations.hf import GradwatchCallback

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    targs = transformers.TrainingArguments(
        output_dir=str(out / "hf-out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=5e-3, max_grad_norm=1.0, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=True, ddp_backend="gloo", seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    stop = {"stop_on": "critical", "stop_agree_every": 5} if args.nan_step is not None else {}
    cb = GradwatchCallback(project="dist", run=args.run_name, server=args.server, flush_interval=0.1, **stop)

    class Poisoned(transformers.Trainer):
        """--nan-step: this rank's loss is NaN from that optimizer step on (rank --nan-rank only), and
        every step sleeps --step-sleep s, so that the alerts reach the ranks while they train."""

        def compute_loss(self, model, inputs, *a, **kw):
            loss = super().compute_loss(model, inputs, *a, **kw)
            if args.nan_step is not None:
                time.sleep(args.step_sleep)
                if rank == args.nan_rank and self.state.global_step >= args.nan_step:
                    loss = loss * torch.tensor(float("nan"))
            return loss

    trainer = Poisoned(model=model, args=targs, train_dataset=TokenDataset(4096), callbacks=[cb])
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    return {"global_step": trainer.state.global_step, "world_size": trainer.args.world_size,
            "loss": [e["loss"] for e in logged], "grad_norm": [e["grad_norm"] for e in logged],
            "lr": [e["learning_rate"] for e in logged],
            "stopped_by": cb.stopped_by.rule if cb.stopped_by is not None else None,
            "stopped_by_other_rank": cb.stopped_by_other_rank}


def run_lightning(args, out: Path, rank: int) -> dict:
    import lightning.pytorch as L

    from gradwatch.agent.integrations.lightning import GradwatchCallback

    class TinyModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.losses: list[tuple[int, float]] = []
            self.grad_norms: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if args.nan_step is not None:      # as for hf: a poisoned rank, slowed steps
                time.sleep(args.step_sleep)
                if rank == args.nan_rank and self.trainer.global_step >= args.nan_step:
                    loss = loss * torch.tensor(float("nan"))
            self.losses.append((self.trainer.global_step, loss.detach().item()))
            return loss

        def on_before_optimizer_step(self, optimizer):
            from lightning.pytorch.utilities import grad_norm

            self.grad_norms.append(float(grad_norm(self.net, norm_type=2)["grad_2.0_norm_total"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    n = 96 if args.nan_step is None else 8 * args.steps      # enough batches for every step on each rank
    x = torch.randn(n, 8, generator=g)
    y = x[:, :1] * 2.0 + 0.1 * torch.randn(n, 1, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)
    torch.manual_seed(0)
    module = TinyModule()
    stop = {"stop_on": "critical", "stop_agree_every": 5} if args.nan_step is not None else {}
    cb = GradwatchCallback(project="dist", run=args.run_name, server=args.server, flush_interval=0.1, **stop)
    trainer = L.Trainer(accelerator="cpu", devices=args.world, num_nodes=1, strategy="ddp", max_steps=args.steps,
                        gradient_clip_val=1.0, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out / "pl-out"))
    trainer.fit(module, data)    # Lightning's sampler gives each rank its own share of the batches
    return {"global_step": trainer.global_step, "world_size": trainer.world_size,
            "loss": [loss for _, loss in module.losses], "grad_norm": module.grad_norms,
            "stopped_by": cb.stopped_by.rule if cb.stopped_by is not None else None,
            "stopped_by_other_rank": cb.stopped_by_other_rank}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("framework", choices=("hf", "lightning"))
    ap.add_argument("out")
    ap.add_argument("--server", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--nan-step", type=int, default=None, help="poison a rank's loss from this step on; the callbacks stop_on critical")
    ap.add_argument("--nan-rank", type=int, default=1)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    args = ap.parse_args()
    out = Path(args.out)
    rank = int(os.environ["RANK"])
    record = (run_hf if args.framework == "hf" else run_lightning)(args, out, rank)
    record["rank"] = rank
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
