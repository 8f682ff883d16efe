"""The demo training job behind ``gradwatch demo``: healthy for a while, then it goes bad.

A small pre-norm Transformer language model learns a synthetic sequence task
with the checklist's standard loop (section 9.1): autocast (fp32, bf16 or
fp16), a real ``GradScaler``, unscale → clip at 1.0 → step → update, and an
EMA. At chosen steps it injects the failures the checklist is about, so that
the rules fire where a user can watch them:

* ``--bad-batch-at``  one batch whose loss is 1000× too large → a grad-norm spike (A2)
* ``--lr-jump-at``    the learning rate jumps 100× for 50 steps → unstable loss (C-rules)
* ``--nan-at``        the loss turns NaN for ``--nan-steps`` steps, like ``log(0)`` would:
                      the scaler skips every step (A1, A5) and halves its scale
                      below 1 (B3)

Run it alone against a server::

    python -m gradwatch.agent.demo --server http://127.0.0.1:8470 --run my-demo

Only torch, the standard library and the agent are used here.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gradwatch import agent
class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln(x)), x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, heads: int = 4, seq: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.embed(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln_f(x))


class EMA:
    """The checklist's EMA (section 4.4): a ``shadow`` dict of tensors."""

    def __init__(self, model: nn.Module, decay: float = 0.999):
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


def make_batch(gen: torch.Generator, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod vocab: learnable, so a healthy loss falls."""
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    seq_ids = (start + stride * torch.arange(seq + 1)) % vocab
    return seq_ids[:, :-1], seq_ids[:, 1:]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gradwatch.agent.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", default=None, help="gradwatch server URL (default: $GRADWATCH_SERVER)")
    p.add_argument("--project", default="demo")
    p.add_argument("--run", default=None, help="run name (default: generated)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps to train")
    p.add_argument("--amp", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="autocast dtype; fp16/bf16 on a CPU are ~20x slower than fp32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bad-batch-at", type=int, default=250, help="step of one 1000x-loss batch (-1: never)")
    p.add_argument("--lr-jump-at", type=int, default=-1, help="step where LR jumps 100x for 50 steps (-1: never)")
    p.add_argument("--nan-at", type=int, default=400, help="first step of a NaN loss (-1: never)")
    p.add_argument("--nan-steps", type=int, default=25, help="how many steps the loss stays NaN")
    p.add_argument("--step-delay", type=float, default=0.05,
                   help="seconds to sleep per step so a person can watch it live (0: full speed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; a model this small runs fastest on one, and the server shares the CPU")
    args = p.parse_args(argv)
    if args.steps <= 0:
        p.error("--steps must be positive")
    if args.nan_steps < 0 or args.step_delay < 0:
        p.error("--nan-steps and --step-delay must not be negative")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    vocab, seq, batch = 64, 32, 16
    model = TinyLM(vocab=vocab, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    # A real GradScaler even in fp32: it scales, unscales, checks for inf/NaN
    # and skips steps exactly as it does on a GPU.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ema = EMA(model, decay=0.999)

    # announce=False: `gradwatch demo` prints the run page and echoes each alert itself
    monitor = agent.attach(model, scaler, optimizer=optimizer, ema=ema, project=args.project,
                           run=args.run, server=args.server, announce=False)
    print(f"[demo] training run {monitor.config.run!r} for {args.steps} steps", flush=True)
    try:
        for step in range(args.steps):
            lr = args.lr * (100.0 if 0 <= args.lr_jump_at <= step < args.lr_jump_at + 50 else 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = make_batch(gen, batch, seq, vocab)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                logits = model(x)
                loss = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
            if step == args.bad_batch_at:
                loss = loss * 1000.0                      # a poisoned batch: huge gradients once
            if 0 <= args.nan_at <= step < args.nan_at + args.nan_steps:
                loss = loss * math.nan                    # what log(0) in a loss does
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            ema.update(model)
            if step % 100 == 0:
                print(f"[demo] step {step}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
    finally:
        monitor.close()
    print(f"[demo] finished run {monitor.config.run!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
