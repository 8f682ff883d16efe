"""Early-warning scenarios for H2 (attention-logit growth) and its healthy qk-layernorm control; H3
(output-logit divergence) has none yet.

Both instabilities are the ones Wortsman et al. (2023, "Small-scale proxies for large-scale Transformer
training instabilities", arXiv:2309.14322) reproduce in small models:

* without qk-layernorm, at a high learning rate, the queries' and keys' weights grow, the largest
  attention logit q·k/√d grows with them until the softmax turns one-hot, and the loss diverges;
  the same model with qk-layernorm (a LayerNorm on each head's queries and keys) at the same LR
  trains on. The high LR is on the q/k projections only (0.12; the rest of the model at 0.01, a
  400-step warm-up, 500 steps, seed 5): at 0.05 on every parameter the qk-layernorm run was no healthy run — the
  catalogue rightly called that LR too high for the rest of the model (E3's update ratio 0.011-0.016,
  E1, A2, C3) — and at 0.02 on the rest it still raised A2 / C3 (a loss spike at step ~240) and E3
  (0.0105); at 0.01 every rule stays quiet (H4 did fire, on the output growth while the model learns,
  until it learned to wait for a loss that has stopped falling), so the control is a healthy scenario.
  The collapse must be far past the onset test on any machine: this chaotic run's trajectory follows
  the float rounding of its kernels (with the agent's GradScaler it left the plain run's by 1 ulp at
  step 118 on one machine), and the earlier settings (0.08, a 200-step warm-up, seed 0; then 0.1, a
  300-step warm-up, seed 2) rose too little or too early on the next machine (onset 190 there: the
  bare 50 steps of lead asserted). Across seeds 0-11 (the stand-in for machines: another machine's
  rounding is another trajectory) this setting's plain run has its onset at 206-342, never none, so
  H2 at 140 leads by >= 66 on each (seed 5: onset 223 in the dry run, 247 in the agent's; on the
  machine of 2026-12-04 evening the agent's run had its onset at 205, a lead of 65: the closest yet);
* without z-loss, the output logits' log-partition log Z drifts (the softmax is blind to a shift of
  all logits, Adam is not), and once the logits are large, bf16 rounds away their differences and
  the loss jumps; z-loss 1e-4 · log²Z holds log Z near 0. No setting tried so far made log Z drift on
  CPU (Markov-chain or copy LM, bf16 autocast, no weight decay, an output bias or a learned output
  scale at lr 0.1-1.0, tied embeddings, 64-512 classes of which 16 used, 400-800 steps; later a copy
  task with Adam eps 1e-15, no final LayerNorm, 4,096 classes, up to 2,100 steps): it settles at 6-15
  and the loss trains on, so H3 has no fault scenario here (docs/early-warning-logits.md says why); the
  trial run is
  ``--dry output_logit_trial`` (``lm_loss(z_loss=)`` and the ``head_bias`` / ``out_scale`` /
  ``lr_head`` / ``tie`` knobs are kept for one).

Each fault run must warn ``min_lead`` steps before the loss shows it (:func:`loss_rise_onset`: the
first step where the mean loss of the last 20 is non-finite or twice the lowest such mean before; an
attention collapse degrades the loss over hundreds of steps, which ``loss_onset``'s single-step test
misses). Show the pathology with plain PyTorch, no agent::

    python -m tests.scenarios.early_logits --dry                  # every scenario
    python -m tests.scenarios.early_logits --dry attention_logit_growth
    python -m tests.scenarios.early_logits --dry attention_logit_growth --set lr=0.02   # a trial setting
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.scenarios.training import Loop, Scenario, loss_onset

PROJECT = "scenarios"


# --------------------------------------------------------------------------- the model

class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections (the HF naming: q_proj, k_proj, v_proj,
    o_proj, num_heads) and, with ``qk_norm``, a LayerNorm on each head's queries and keys (q_norm,
    k_norm): the form the agent recognises and reads its logits from."""

    def __init__(self, d: int, heads: int, qk_norm: bool):
        super().__init__()
        self.num_heads = heads
        self.head_dim = d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, qk_norm: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, qk_norm)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, qk_norm: bool,
                 head_bias: bool = False, out_scale: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, qk_norm) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=head_bias)
        # out_scale: a learned scalar multiplying the logits (a learned inverse temperature)
        self.out_scale = nn.Parameter(torch.ones(())) if out_scale else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        out = self.head(self.ln_f(x))
        return out * self.out_scale if self.out_scale is not None else out


def markov_data(seed: int, vocab: int, batch: int, seq: int, used: Optional[int] = None):
    """Sequences from a fixed random sparse Markov chain over the first ``used`` tokens: learnable,
    fresh batches each step."""
    used = used or vocab
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(used, used, generator=g) * 3.0
    probs = torch.softmax(logits, dim=1)

    def make(step: int):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, used, (batch,), generator=g)
        for i in range(seq):
            x[:, i + 1] = torch.multinomial(probs[x[:, i]], 1, generator=g).squeeze(1)
        return x[:, :-1], x[:, 1:]
    return make


def copy_data(seed: int, vocab: int, batch: int, seq: int, used: Optional[int] = None, period: int = 4):
    """A random prefix of ``period`` tokens, repeated: predicting the repeats needs attention to one
    precise earlier position, which is what drives its logits up (and a learned model's loss is low,
    ~period/seq of the random one, so an attention collapse shows as a loss spike)."""
    used = used or vocab
    g = torch.Generator().manual_seed(seed)
    half = period

    def make(step: int):
        a = torch.randint(0, used, (batch, half), generator=g)
        x = a.repeat(1, (seq + period) // period + 1)[:, :seq + 1]
        return x[:, :-1], x[:, 1:]
    return make


def lm_loss(vocab: int, z_loss: float = 0.0) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(out.reshape(-1, vocab), y.reshape(-1))
        if z_loss:
            ce = ce + z_loss * out.logsumexp(-1).pow(2).mean()
        return ce
    return loss


def loss_rise_onset(losses: list[float], *, factor: float = 2.0, window: int = 20, start: int = 50) -> Optional[int]:
    """The first step, from ``start`` on, whose mean loss over the last ``window`` steps is non-finite or above
    ``factor`` times the lowest such mean before it. None: the loss never rose so.

    An attention collapse degrades the loss over a few hundred steps rather than in one spike, so
    :func:`loss_onset`'s "3x the median of the 50 before" misses it (each step is only a little worse
    than the last); this finds where the trained loss has doubled.

    >>> loss_rise_onset([1.0] * 60 + [3.0] * 40, window=5)
    62
    """
    best = math.inf
    for i in range(window - 1, len(losses)):
        w = losses[i - window + 1:i + 1]
        if not all(math.isfinite(v) for v in w):
            return i if i >= start else None
        m = sum(w) / window
        if i >= start and m > factor * best:
            return i
        best = min(best, m)
    return None


# --------------------------------------------------------------------------- the runs

SETTINGS = {
    "attn": dict(vocab=64, d=64, layers=2, heads=4, seq=32, batch=16, lr=0.12, steps=500, seed=5, amp=None,
                 warmup=400, used=None, wd=0.0, data="copy", period=4, clip=0, lr_rest=0.01),
    "z": dict(vocab=64, d=64, layers=2, heads=4, seq=32, batch=16, lr=1e-2, steps=600, seed=0, amp=torch.bfloat16,
              warmup=50, used=None, wd=0.0, data="markov", period=4, clip=0, lr_rest=0, lr_head=0.1,
              head_bias=1, out_scale=0, qk_norm=1),
}


def build_loop(kind: str, *, qk_norm: bool = False, z_loss: float = 0.0, **over) -> Loop:
    s = {**SETTINGS[kind], **over}
    torch.manual_seed(s["seed"])
    model = LM(s["vocab"], s["d"], s["layers"], s["heads"], s["seq"], qk_norm or bool(s.get("qk_norm")),
               bool(s.get("head_bias")), bool(s.get("out_scale")))
    if s.get("tie"):
        model.head.weight = model.tok.weight
    # lr_rest: the learning rate of every parameter but the queries' and keys' (0: the same lr; a trial knob);
    # lr_head: that of the output layer (head, out_scale; 0: the same as the rest)
    def group(n: str) -> str:
        return "qk" if ".q_proj." in n or ".k_proj." in n else "head" if n.startswith(("head.", "out_scale")) else "rest"
    lrs = {"qk": s["lr"], "rest": s["lr_rest"] or s["lr"]}
    lrs["head"] = s.get("lr_head") or lrs["rest"]
    params = {g: [p for n, p in model.named_parameters() if group(n) == g] for g in lrs}
    opt = torch.optim.AdamW([{"params": params[g], "lr": lrs[g]} for g in lrs if params[g]], weight_decay=s["wd"])
    warmup = s["warmup"]
    data = {"copy": copy_data, "markov": markov_data}[s["data"]]
    extra = {"period": s["period"]} if s["data"] == "copy" else {}
    return Loop(model, opt, data(s["seed"], s["vocab"], s["batch"], s["seq"], s["used"], **extra),
                lm_loss(s["vocab"], z_loss), steps=s["steps"], amp=s["amp"], clip=s["clip"] or None, ema_decay=None,
                schedule=(lambda step: min(1.0, (step + 1) / warmup)) if warmup else None)


def attention_logit_growth() -> Loop:
    return build_loop("attn")


def attention_qk_norm() -> Loop:
    return build_loop("attn", qk_norm=True)


def output_logit_divergence() -> Loop:
    """The H3 trial (no scenario yet): log Z settles near 7-13 in every setting tried (docs/early-warning-logits.md)."""
    return build_loop("z")




SCENARIOS = [
    Scenario("attention_logit_growth", "H2", PROJECT, attention_logit_growth,
             "Transformer LM (copy task), AdamW lr 0.12 on q/k, 0.01 on the rest, no qk-layernorm",
             onset=loss_rise_onset, min_lead=50),
    # The healthy control (no target: nothing above info may fire). Max attention logit ~6, loss ~0.40.
    # Until 2026-12-02 H4 fired on it at step 80: the outputs of blocks.1.attn.o_proj and three more Linears
    # grew 0.24 -> 1.13 while the model learned (loss 4.0 -> 2.3); H4 now stays quiet while the loss falls
    # (its loss_drop) and wants x2.5 over its rising samples (docs/early-warning-adam.md).
    Scenario("attention_qk_norm", None, PROJECT, attention_qk_norm,
             "the attention_logit_growth run with qk-layernorm (q_norm / k_norm), same LRs"),
]

# Shown by --dry only, not in the confusion table: the H3 trial run (no fault scenario yet; see the module
# docstring). Its settings are SETTINGS["z"]; --set head_bias=, out_scale=, lr_head=, tie=, used=, vocab= try others.
CONTROLS = [
    Scenario("output_logit_trial", None, PROJECT, output_logit_divergence,
             "H3 trial: Markov-chain LM, bf16 autocast, an output bias at lr 0.1, no weight decay, no z-loss"),
]


# --------------------------------------------------------------------------- --dry: plain PyTorch, no agent

def max_attention_logit(attn: Attention, x: torch.Tensor) -> float:
    """max over heads and position pairs of q·k/√d for the module's input x (plain PyTorch)."""
    b, t, d = x.shape
    q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, t, attn.num_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.float().transpose(1, 2), k.float().transpose(1, 2)
    return float((q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)).amax())


def dry(loop: Loop, every: int = 20) -> list[float]:
    """Train the loop with plain PyTorch (no agent, no scaler), printing the loss, the max attention logit
    over the modules and the output's mean log Z every ``every`` steps."""
    torch.set_num_threads(1)
    model, opt = loop.model, loop.optimizer
    inputs: dict[Attention, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, Attention):
            m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0].detach()))
    base = [g["lr"] for g in opt.param_groups]
    losses: list[float] = []
    for step in range(loop.steps):
        if loop.schedule is not None:
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * loop.schedule(step)
        x, y = loop.batch(step)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=loop.amp or torch.bfloat16, enabled=loop.amp is not None):
            out = model(x)
            if step % every == 0:
                with torch.no_grad():
                    attn = max(max_attention_logit(m, inputs[m]) for m in inputs)
        loss = loop.loss(out.float(), y)
        loss.backward()
        if loop.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip)
        opt.step()
        losses.append(float(loss.detach()))
        if step % every == 0:
            with torch.no_grad():
                o = out.float()
                print(f"step {step:5d}  loss {losses[-1]:9.4f}  max attn logit {attn:10.2f}  "
                      f"max out logit {float(o.amax()):10.2f}  mean log Z {float(o.logsumexp(-1).mean()):10.2f}",
                      flush=True)
    return losses


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry", action="store_true", help="train with plain PyTorch, no agent (the only mode)")
    p.add_argument("name", nargs="?", help="one scenario (default: all)")
    p.add_argument("--every", type=int, default=20, help="print every N steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of SETTINGS for a trial (lr=0.01, steps=800, amp=none|bf16)")
    args = p.parse_args(argv)
    for item in args.set:
        key, value = item.split("=", 1)
        parsed = ({"none": None, "bf16": torch.bfloat16}[value] if value in ("none", "bf16") else value
                  if value.isalpha() else float(value) if "." in value or "e" in value else int(value))
        for kind in SETTINGS.values():
            kind[key] = parsed
    if not args.dry:
        p.error("only --dry runs standalone; the agent runs are tests/scenarios/test_scenarios.py")
    chosen = [s for s in SCENARIOS + CONTROLS if args.name in (None, s.name)]
    if not chosen:
        p.error(f"unknown scenario {args.name!r}: one of {', '.join(s.name for s in SCENARIOS + CONTROLS)}")
    for s in chosen:
        print(f"== {s.name} (target {s.target or 'none'}): {s.what}")
        t0 = time.perf_counter()
        losses = dry(s.build(), args.every)
        onset = (s.onset or loss_onset)(losses)
        print(f"== {s.name}: loss onset {onset} ({time.perf_counter() - t0:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
