"""Configuration-advice scenarios (H6-H9, docs/early-warning-advice.md): setups that depart from the checklist.

Each trains a few steps of the checklist's 9.1 loop (``tests/advice/setup_loop.py``) through the real
agent; its note is raised at step 0, from the ``run_setup`` event. H5 (fp16 on native-bf16 hardware)
needs a CUDA device and is tested by feeding the event (tests/advice). Standalone, without the agent,
``python -m tests.scenarios.early_setup --dry [NAME]`` shows what each departure does:

* ``setup_clip_scaled_grads`` (H9): ``clip_grad_norm_`` before ``unscale_`` sees the norm times the
  loss scale, so ``max_norm=1.0`` shrinks the true gradient by that factor;
* ``setup_transformer_unclipped`` (H6): the grad norms an unclipped Transformer applies;
* ``setup_cosine_to_zero`` (H8): the LR a ``CosineAnnealingLR(eta_min=0)`` ends at;
* ``setup_ema_decay_0.5`` (H7): how closely a decay-0.5 EMA follows the raw weights.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tests.advice.setup_loop import mlp, train
from tests.scenarios.training import Scenario

PROJECT = "scenarios"   # test_scenarios.DEFAULT (not imported: that module imports this one)
STEPS = 5


@dataclass
class SetupRun:
    """A scenario's ``build()`` result: ``run()`` trains ``tests/advice/setup_loop.train`` with ``setup``."""
    setup: dict = field(default_factory=dict)

    def run(self, *, server: str, project: str, run: str) -> dict:
        train(server, run, project=project, steps=STEPS, **self.setup)
        return {"steps": STEPS}


def _cosine_to_zero(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100, eta_min=0.0)


SCENARIOS = [
    Scenario("setup_clip_scaled_grads", "H9", PROJECT, lambda: SetupRun({"order": "clip_without_unscale"}),
             "clip_grad_norm_ before scaler.unscale_ (clips the scaled grads)"),
    Scenario("setup_transformer_unclipped", "H6", PROJECT, lambda: SetupRun({"transformer": True, "clip": None}),
             "Transformer LM without gradient clipping"),
    Scenario("setup_cosine_to_zero", "H8", PROJECT, lambda: SetupRun({"scheduler": _cosine_to_zero}),
             "CosineAnnealingLR(eta_min=0): ends below base_lr / 10"),
    Scenario("setup_ema_decay_0.5", "H7", PROJECT, lambda: SetupRun({"ema": 0.5}),
             "EMA decay 0.5 on a small model (window ~2 steps)"),
]


def _dry(name: str) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "setup_clip_scaled_grads":
        model = mlp()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        for step in range(STEPS):
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(model(x), x[:, :1] * 2)
            model.zero_grad()
            scaler.scale(loss).backward()
            true = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])) / scaler.get_scale()
            seen = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))   # no unscale_ first
            print(f"step {step}: loss {loss.item():.4f}  true grad norm {true:.4f}  clip saw {seen:.1f} "
                  f"(x{scaler.get_scale():.0f}): the grads are clipped to a norm of {min(1.0, 1.0 / seen) * true.item():.2e} "
                  f"instead of {min(1.0, true.item()):.4f}")
    elif name == "setup_transformer_unclipped":
        from gradwatch.agent.demo import TinyLM, make_batch

        model = TinyLM(vocab=32, d=16, layers=1, heads=2, seq=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(STEPS):
            x, y = make_batch(g, 4, 8, 32)
            loss = F.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            opt.step()
            print(f"step {step}: loss {loss.item():.4f}  grad norm {norm:.4f} applied unclipped "
                  f"(checklist 9.2 clips at 1.0)")
    elif name == "setup_cosine_to_zero":
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        sched = _cosine_to_zero(opt)
        for step in range(101):
            if step in (0, 50, 90, 99, 100):
                print(f"step {step}: lr {opt.param_groups[0]['lr']:.3e}  (floor base/10 = 1.000e-04)")
            opt.step()
            sched.step()
    elif name == "setup_ema_decay_0.5":
        from gradwatch.agent.demo import EMA

        model = mlp()
        ema = EMA(model, 0.5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(model(x), x[:, :1] * 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ema.update(model)
            gap = math.sqrt(sum(float((ema.shadow[n] - p.detach()).pow(2).sum()) for n, p in model.named_parameters()))
            w = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in model.parameters()))
            print(f"step {step}: loss {loss.item():.4f}  ||ema - w|| / ||w|| = {gap / w:.2e}: the EMA averages "
                  f"~{1 / (1 - ema.decay):.0f} steps, it barely smooths")
    else:
        raise SystemExit(f"unknown scenario {name!r}: one of {', '.join(s.name for s in SCENARIOS)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry", action="store_true", help="plain PyTorch, no agent: show each departure")
    parser.add_argument("name", nargs="?", help="one scenario (default: all)")
    args = parser.parse_args()
    if not args.dry:
        parser.error("run the scenarios through pytest (tests/scenarios); --dry shows them without the agent")
    for s in SCENARIOS:
        if args.name in (None, s.name):
            print(f"== {s.name} ({s.target}): {s.what}")
            _dry(s.name)


if __name__ == "__main__":
    main()
