"""Early-warning scenarios for H1 (adam_stale) and H4 (linear_output_growth): the warning comes before the loss.

``stale_adam_second_moment`` (H1, scenario (c) of issue 18): an MLP whose input layer's gradients are
shrunk 1000x by the GLM-130B gradient-shrink trick, ``h * α + h.detach() * (1 - α)`` with α = 1e-3 — the
forward is unchanged, only the gradient is scaled, and Adam being scale-invariant the layer trains as
usual, with a second moment v̂ a million times smaller. At step 200 the trick is removed (α = 1): the
forward, so the loss of that step, is the same, but the layer's gradients are 1000x what v̂ remembers
(β2 = 0.999), its updates m̂ / (√v̂ + ε) jump ~10x, and the loss spikes a few steps later. H1 warns at
step 200 itself (g² / v̂ ~ 1e5); the onset is :func:`~tests.scenarios.training.loss_onset` (the first loss
above 3x the median of the 50 before it). The global grad norm hardly moves (the layer's share of it
was 1e-3), so A2 stays quiet: this is the case only the per-layer Adam ratio sees.

``lr_warmup_never_capped`` (H4): a small pre-norm Transformer whose LR "warmup" multiplies the LR by
1.03 every step and never stops (a schedule bug; an LR range test run as training). The FC2 output
RMS of the first block rises sample after sample long before the loss diverges; H4 reads the agent's
default ``linear_every`` = 10 samples.

Run standalone, with plain PyTorch and no agent, to see the pathology::

    python -m tests.scenarios.early_adam --dry [stale_adam_second_moment | lr_warmup_never_capped]
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.scenarios.training import AGENT_CONFIG, Loop, Scenario, loss_onset, regression_data

PROJECT = "scenarios"
STALE_AT = 200          # the step the gradient shrink is removed
LR_GROWTH = 1.03        # per step, never capped


class ShrunkInputMLP(nn.Module):
    """MLP regression whose input layer's gradient is scaled by ``alpha`` (forward unchanged)."""

    def __init__(self, d_in: int = 8, hidden: int = 32, alpha: float = 1e-3):
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.alpha = alpha

    def forward(self, x):
        h = self.inp(x)
        h = h * self.alpha + h.detach() * (1.0 - self.alpha)
        return self.body(h)


def stale_adam() -> Loop:
    torch.manual_seed(0)
    model = ShrunkInputMLP()

    def remove_shrink(step: int, loop: Loop) -> None:
        if step == STALE_AT:
            loop.model.alpha = 1.0

    return Loop(model, torch.optim.AdamW(model.parameters(), lr=5e-2, betas=(0.9, 0.999)), regression_data(0),
                F.mse_loss, steps=STALE_AT + 40, ema_decay=None, before_step=remove_shrink,
                agent_config=dict(AGENT_CONFIG, adam_every=1))   # every step: H1's full lead


def lr_never_capped() -> Loop:
    from gradwatch.agent.demo import TinyLM, make_batch

    torch.manual_seed(22)
    g = torch.Generator().manual_seed(22)
    model = TinyLM(vocab=32, d=32, layers=2, heads=2, seq=16)
    return Loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0),
                lambda s: make_batch(g, 8, 16, 32),
                lambda out, y: F.cross_entropy(out.reshape(-1, 32), y.reshape(-1)),
                steps=260, ema_decay=None, schedule=lambda s: LR_GROWTH ** s)


SCENARIOS = [
    Scenario("stale_adam_second_moment", "H1", PROJECT, stale_adam,
             f"input layer's gradient shrink (x1e-3) removed at step {STALE_AT}: Adam's v̂ stale",
             onset=loss_onset, min_lead=1),
    Scenario("lr_warmup_never_capped", "H4", PROJECT, lr_never_capped,
             f"Transformer, LR x{LR_GROWTH} per step, never capped", onset=loss_onset, min_lead=10),
]


# --------------------------------------------------------------------------- standalone: the pathology, no agent

def dry(name: str) -> None:
    """Train the scenario with plain PyTorch (the same loop: scale, unscale_, clip, step) and print the loss
    with the pathology: the input layer's g² / v̂ and update RMS (H1), the Linear output RMS (H4)."""
    scenario = next(s for s in SCENARIOS if s.name == name)
    loop = scenario.build()
    model, opt = loop.model, loop.optimizer
    torch.set_num_threads(1)
    base = [g["lr"] for g in opt.param_groups]
    rms: dict[str, float] = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for n, m in linears:
        m.register_forward_hook(lambda m, a, out, n=n: rms.__setitem__(n, float(out.detach().pow(2).mean().sqrt())))
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    print(f"{scenario.name}: {scenario.what}")
    for step in range(loop.steps):
        if loop.schedule is not None:
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * loop.schedule(step)
        if loop.before_step is not None:
            loop.before_step(step, loop)
        x, y = loop.batch(step)
        opt.zero_grad(set_to_none=True)
        loss = loop.loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip)
        line = f"step {step:4d} loss {float(loss):10.4f}"
        if scenario.target == "H1":
            p = model.inp.weight
            st = opt.state.get(p)
            if st:
                beta2 = opt.param_groups[0]["betas"][1]
                v_hat = st["exp_avg_sq"] / (1 - beta2 ** float(st["step"]))
                line += f"  inp.weight g²/v̂ {float(p.grad.pow(2).mean() / v_hat.mean()):10.3g}"
            before = p.detach().clone()
            scaler.step(opt)
            update_rms = float((p.detach() - before).pow(2).mean().sqrt())
            line += f"  update RMS / lr {update_rms / opt.param_groups[0]['lr']:6.2f}"
        else:
            scaler.step(opt)
            line += f"  lr {opt.param_groups[0]['lr']:.3g}  " + " ".join(
                f"{n}={rms[n]:.3g}" for n, _ in linears if n in rms and ("mlp.2" in n or n == "head"))
        scaler.update()
        losses.append(float(loss))
        print(line)
    print(f"loss onset (loss_onset): step {loss_onset(losses)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="train with plain PyTorch, no agent, and print")
    parser.add_argument("name", nargs="*", default=[s.name for s in SCENARIOS])
    args = parser.parse_args()
    if not args.dry:
        parser.error("only --dry runs here; the scenarios with the agent run in tests/scenarios/test_scenarios.py")
    for n in args.name:
        dry(n)
    sys.exit(0)
