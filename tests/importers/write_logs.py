"""Write tests/importers/series.py's run with the real loggers: ``python write_logs.py tensorboard|wandb DIR``.

Run in a subprocess: wandb.init starts W&B's own service process and patches the
interpreter (excepthook, stdout), which a test process should not carry.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from series import STEPS, series  # noqa: E402


def write_tensorboard(out: Path, first: int = 0, end: int = STEPS) -> None:
    """Steps [first, end): a second call with the next range is the job resumed, a second event file."""
    from torch.utils.tensorboard import SummaryWriter

    data = series()
    w = SummaryWriter(str(out / "run-a"))
    for i in range(first, end):
        for tag, points in data.items():
            step, value = points[i]
            w.add_scalar(tag, value, step)
    w.close()


def write_wandb(out: Path) -> None:
    os.environ.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off"})
    import wandb

    data = series()
    run = wandb.init(dir=str(out), project="wb-project", name="wb-run",
                     settings=wandb.Settings(x_disable_stats=True, x_disable_meta=True))
    # a row before training, as HF Trainer's setup logs do: W&B's own _step runs one ahead of the
    # optimizer step from here, and train/global_step (what HF logs) is the step
    wandb.log({"train/epoch": 0.0})
    for i in range(STEPS):
        row = {tag: points[i][1] for tag, points in data.items()}
        row["train/global_step"] = i
        wandb.log(row)
    run.finish()


if __name__ == "__main__":
    kind, where, *steps = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
    where.mkdir(parents=True, exist_ok=True)
    {"tensorboard": write_tensorboard, "wandb": write_wandb}[kind](where, *steps)
