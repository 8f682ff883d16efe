"""Worker of test_deepspeed_bf16_loss.py: a real DeepSpeed engine (bf16, ZeRO 2, 3 micro-batches per
step) whose loss is computed in bf16, as a bf16 model's loss is unless the script converts it; writes
the exact per-step loss (each micro-batch's bf16 loss in float64, / 3, summed) to OUT/rank0.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ACCUM, STEPS = 3, 4


def main(out: Path, server: str, run: str) -> None:
    import deepspeed

    from gradwatch.agent.integrations.deepspeed import watch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": ACCUM,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    monitor = watch(engine, project="stacks", run=run, server=server, flush_interval=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, current = [], 0.0
    for _ in range(STEPS * ACCUM):
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        y = (torch.randn(8, 4, generator=gen) * 3.7).to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(engine(x), y)          # a bf16 loss
        assert loss.dtype == torch.bfloat16
        boundary = engine.is_gradient_accumulation_boundary()
        engine.backward(loss)
        current += float(loss.float().item()) / ACCUM
        engine.step()
        if boundary:
            losses.append(current)
            current = 0.0
    monitor.close()
    (out / "rank0.json").write_text(json.dumps({"steps": len(losses), "loss": losses}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
