"""One rank of a tiny mixture-of-experts language model's training job, for tests/distributed (torchrun, gloo, CPU).

``python -m torch.distributed.run --standalone --nproc_per_node=N moe_worker.py MODE OUT_DIR [options]``

The agent finds attention and a router where they are computed (agent/capture/attention.py: a 4-D softmax
over the last dimension, a 2-D softmax whose output ``topk`` routes by), not by names, so the model here is
written the way people write them, by hand: two blocks, each an attention module (``q @ kᵀ / √d``, a causal
mask, ``torch.softmax`` over a 4-D tensor) and a Mixtral-style mixture of experts (``F.softmax`` of the gate's
logits over the flattened tokens in float32, ``torch.topk``, the weights renormalised, four expert Linears).

The model records the ground truth itself, in plain PyTorch and in float64, at every forward: per block the
largest unmasked attention logit (the entries on and below the diagonal of ``scores``) and the router spread
(over the tokens, the largest max - min of one token's gate logits). Every rank trains on its own data, so the
ranks' numbers differ, and writes them to ``OUT_DIR/rank<k>.json`` with the names its modules have (as the
wrapped model's ``named_modules`` give them: DDP's ``module.`` prefix kept; ``fully_shard`` adds none); with
``--count`` also every collective issued by this process, so a run with the agent and one without can be
compared (worker.py's counter).

MODE: ``ddp`` (DistributedDataParallel) or ``fsdp2`` (``fully_shard`` on each block and the root).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root

from tests.distributed.worker import CollectiveCounter, count_the_sender, finish  # noqa: E402

VOCAB, WIDTH, HEADS, SEQ, BATCH, EXPERTS, TOP = 16, 16, 2, 8, 4, 4, 2


class Attention(torch.nn.Module):
    """Causal self-attention with its softmax written out; keeps the largest unmasked logit of each forward."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.truth: list[float] = []

    def forward(self, x):
        b, t, c = x.shape
        d = c // HEADS
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d).permute(2, 0, 3, 1, 4)   # each [b, heads, t, d]
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        above = torch.ones(t, t, dtype=torch.bool).triu(1)
        with torch.no_grad():   # the entries the softmax keeps, picked out (not filled): float64, no agent code
            self.truth.append(float(scores.detach().double()[:, :, ~above].amax()))
        probs = torch.softmax(scores.masked_fill(above, float("-inf")), dim=-1)
        return self.proj((probs @ v).transpose(1, 2).reshape(b, t, c))


class MoE(torch.nn.Module):
    """Mixtral's sparse mixture of experts (top 2 of 4); keeps the router spread of each forward."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.truth: list[float] = []

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.gate(flat)
        with torch.no_grad():
            lg = logits.detach().double()
            self.truth.append(float((lg.amax(dim=-1) - lg.amin(dim=-1)).amax()))
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        w, chosen = torch.topk(probs, TOP, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            # every expert runs, on no rows at worst: its parameters always get a grad (DDP needs every one)
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(flat[rows]) * w[rows, slot, None])
        return out.reshape(x.shape)


class Block(torch.nn.Module):
    """A pre-norm block. Attention and the experts are modules of their own, inside it: the agent credits each
    figure to the innermost module whose forward calls the softmax, so each has exactly one right owner."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.attn, self.moe = Attention(), MoE()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class TinyLM(torch.nn.Module):
    """Token and position embeddings, two blocks, an output head: a Transformer as the agent's setup checks see one."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Embedding(SEQ, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.ln_f = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("ddp", "fsdp2"))
    ap.add_argument("out")
    ap.add_argument("--server", default=None)
    ap.add_argument("--run-name", default="moe")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--count", action="store_true", help="count collectives (the training loop runs inside)")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    lm = TinyLM()
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(lm)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in lm.blocks:
            fully_shard(block)
        model = fully_shard(lm)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    monitor = None
    sender_counter = CollectiveCounter() if args.count else None
    if not args.no_agent:
        from gradwatch import agent
        if sender_counter is not None:
            count_the_sender(sender_counter)
        monitor = agent.attach(model, None, optimizer=opt, run=args.run_name, server=args.server,
                               mode="online" if args.server else "offline", attn_logits_every=1,
                               flush_interval=0.1, seal_grace=5.0, spool_dir=os.path.join(args.out, "spool"))
    counter = CollectiveCounter() if args.count else None
    if counter is not None:
        counter.wrap()
        counter.__enter__()
    g = torch.Generator().manual_seed(100 + rank)
    records = []
    for step in range(args.steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        for block in lm.blocks:
            block.attn.truth.clear()
            block.moe.truth.clear()
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if monitor is not None:
            monitor.log(loss=loss)
        # one forward a step: one value per block
        records.append({"step": step, "loss": float(loss.detach()),
                        "attn": [b.attn.truth[0] for b in lm.blocks if len(b.attn.truth) == 1],
                        "router": [b.moe.truth[0] for b in lm.blocks if len(b.moe.truth) == 1]})
    if counter is not None:
        counter.__exit__(None, None, None)
    if monitor is not None:
        monitor.flush(timeout=20)
        monitor.close(timeout=20)
    if counter is not None:
        counter.unwrap()
    named = list(model.named_modules())
    finish(args.out, {"rank": rank, "world_size": world, "mode": args.mode, "steps": records,
                      "module_names": [n for n, _ in named],
                      "attn_modules": [n for n, m in named if isinstance(m, Attention)],
                      "moe_modules": [n for n, m in named if isinstance(m, MoE)]}, monitor, counter, sender_counter)


if __name__ == "__main__":
    main()
