"""H5-H9: configuration advice at step 0 (checklist sections 6.1, 9 and 10) — the earliest warning.

The agent sends one ``run_setup`` event per process with its first step (``agent/setup.py``): the
device and whether it has native bf16, the first forward's autocast dtype, whether a GradScaler is
on, whether the model is a Transformer, the ``clip_grad_norm_`` calls of the first step with the
GradScaler stage at each, the EMA's decay and a cosine schedule's base and final LRs. Each rule here
reads one part and, where the setup departs from the checklist's defaults, raises a note that cites
the section and the fix. Advice is ``info``; where the checklist is firm (6.1: unscale before clip)
the note is a ``warning``. A part the agent could not read (no CUDA device, no scheduler given,
a dict EMA without a decay) says nothing; a setup that follows the checklist clears the rule's
open note (``clear_steps`` 1: the next process got it right). docs/early-warning-advice.md.

The H family is "early warning": H1-H4 are step-signal rules (early_adam.py, early_logits.py).
"""
from __future__ import annotations

import math
import re
from typing import Iterator, Optional

from gradwatch.server.rules.batch import Batch
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt, num

KIND = "run_setup"
# a note per process's setup, cleared by the next process that follows the checklist; never by steps
_LIFECYCLE = {"clear_steps": Int(1), "cooldown_steps": Int(0, zero_ok=True)}


class SetupRule(BatchRule):
    """A verdict per ``run_setup`` event: a Hit, False (the setup follows the checklist), or None (the
    part this rule reads is unknown or does not apply)."""

    family = "H"
    severity = "info"
    params = _LIFECYCLE
    # ``needs``: the step signal whose panel shows what the note is about (the note itself reads the event)

    def applies(self, ctx) -> bool:
        return bool(ctx.events.get(KIND))

    @staticmethod
    def setups(batch: Batch) -> Iterator[tuple[int, dict]]:
        for step, data in sorted(batch.ctx.events.get(KIND, {}).items()):
            if isinstance(data, dict):
                yield step, data

    def judge(self, step: int, setup: dict, cfg: dict):
        raise NotImplementedError

    def evaluate(self, batch: Batch, state: dict, cfg: dict) -> Outcome:
        out = Outcome.quiet(batch.n)
        for step, setup in self.setups(batch):
            verdict = self.judge(step, setup, cfg)
            if verdict is not None:
                out.before.append((step, verdict))
        return out


def _part(setup: dict, key: str) -> Optional[dict]:
    value = setup.get(key)
    return value if isinstance(value, dict) else None


# checklist 10's row "RTX 3090 / 4090: FP16 (no native BF16 support, emulated: not recommended)": torch counts
# these consumer cards (sm 8.6 / 8.9) as bf16-capable, the checklist keeps them on fp16, so H5 leaves them be
_CHECKLIST_FP16 = re.compile(r"GeForce", re.IGNORECASE)


@register
class Fp16WhereBf16(SetupRule):
    id, name, checklist = "H5", "fp16_on_bf16_hardware", "10 / 9.2"
    fires_when = ("the run trains with fp16 autocast (or an enabled GradScaler) on a CUDA device with native "
                  "bf16 (A100 / H100 class: torch.cuda.is_bf16_supported(including_emulation=False)), other than "
                  "the GeForce RTX cards checklist 10 keeps on fp16")
    diagnosis = ("fp16 with loss scaling on hardware that has native bf16: the checklist (section 10) recommends bf16 "
                 "there. bf16 has fp32's exponent range, so it neither overflows nor underflows where fp16 does, "
                 "and needs no GradScaler (no skipped steps, no scale to tune).")
    actions = {"use_bf16": "Train under `torch.autocast('cuda', dtype=torch.bfloat16)` and drop the GradScaler "
                           "(or `GradScaler(enabled=False)`); checklist 10: A100 → BF16, H100 → BF16 (+ FP8), 9.2's "
                           "Transformer config uses bf16 when the hardware supports it."}
    needs = ("loss_scale",)

    def judge(self, step, setup, cfg):
        hw = _part(setup, "hardware")
        if hw is None or not hw.get("bf16_native") or _CHECKLIST_FP16.search(str(hw.get("name") or "")):
            return None
        ac = _part(setup, "autocast") or {}
        fp16 = ac.get("dtype") == "float16" if ac.get("enabled") else False
        scaled = bool(setup.get("scaler_enabled"))
        if not (fp16 or scaled):
            return False
        cap = hw.get("capability") or []
        sm = f"sm {cap[0]}.{cap[1]}" if len(cap) == 2 else "native bf16"
        how = " and ".join(w for w, on in (("fp16 autocast", fp16), ("a GradScaler", scaled)) if on)
        return Hit({"device": hw.get("name"), "capability": cap, "autocast_dtype": ac.get("dtype"),
                    "scaler_enabled": scaled},
                   f"{how} on {hw.get('name')} ({sm}), which has native bf16: checklist 10 recommends bf16 there "
                   f"(autocast dtype=torch.bfloat16, no GradScaler)")


@register
class TransformerUnclipped(SetupRule):
    id, name, checklist = "H6", "transformer_unclipped", "9.2 / 3.5"
    fires_when = "the model is a Transformer and its first step called no clip_grad_norm_ on its parameters"
    diagnosis = ("A Transformer trained without gradient clipping: one rare large gradient (an attention-logit or "
                 "loss spike) moves the weights far in one step. The checklist's Transformer default is "
                 "clip_grad_norm_(max_norm=1.0) (section 9.2, table 3.5; detection models 10.0, section 9.3). "
                 "The agent sees torch.nn.utils.clip_grad_norm_ as looked up at call time; a function imported "
                 "with `from torch.nn.utils import clip_grad_norm_` before attach is not seen.")
    actions = {"clip": "After `scaler.unscale_(optimizer)` and before `scaler.step(optimizer)`, call "
                       "`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)` (checklist 9.2; HF "
                       "Trainer: `max_grad_norm=1.0`; Lightning: `gradient_clip_val=1.0`)."}
    needs = ("grad_norm",)

    def judge(self, step, setup, cfg):
        model, clip = _part(setup, "model"), _part(setup, "clip")
        if model is None or clip is None or not model.get("transformer"):
            return None
        if clip.get("calls") or clip.get("max_norm") is not None:
            return False
        found = list(model.get("attention") or [])
        return Hit({"attention_modules": found, "params": model.get("params")},
                   f"Transformer without gradient clipping ({', '.join(found[:2])}{', …' if len(found) > 2 else ''}):"
                   f" no clip_grad_norm_ in its first step; checklist 9.2 clips at max_norm=1.0")


def _window(decay: float) -> float:
    """The EMA's averaging window in steps, 1 / (1 - decay) (the checklist's 4.1: 0.999 ≈ 1000 steps)."""
    return math.inf if decay >= 1 else 1.0 / (1.0 - decay) if decay > 0 else 1.0


@register
class EmaDecayOffRange(SetupRule):
    id, name, checklist = "H7", "ema_decay_off_range", "9.2 / 4.1 / 8"
    fires_when = ("the EMA decay's window 1/(1-decay) is more than {slack}x outside the checklist's range for the "
                  "model's size: 0.9999-0.99999 at {large_params} parameters and more (9.2), 0.99-0.9999 below (4.1's "
                  "0.999 ≈ 1000 steps; 8: lower it when the EMA is too slow for the task)")
    diagnosis = ("An EMA decay far from the checklist's range: too low and the EMA averages over a few steps only (it "
                 "follows the raw weights and smooths nothing); too high and it averages over more steps than the run "
                 "has, so the EMA model stays near its initial weights. The checklist: 0.9999-0.99999 for large "
                 "models, closer to 1 the more parameters (9.2); 0.999 averages about 1000 steps (4.1).")
    actions = {"decay": "Set the decay in the checklist's range for the model: `EMA(model, decay=0.9999)` for a large "
                        "Transformer (9.2), 0.999 (≈ 1000 steps) for a small model or a short run (4.1, 8)."}
    params = {**_LIFECYCLE, "large_params": Int(100_000_000), "slack": Float(10.0)}
    needs = ("ema_divergence",)

    def judge(self, step, setup, cfg):
        ema, model = _part(setup, "ema"), _part(setup, "model") or {}
        decay = num((ema or {}).get("decay"))
        if decay is None or not math.isfinite(decay):
            return None
        params = int(model.get("params") or 0)
        large = params >= int(cfg["large_params"])
        low, high = (0.9999, 0.99999) if large else (0.99, 0.9999)
        w, slack = _window(decay), float(cfg["slack"])
        if _window(low) / slack <= w <= _window(high) * slack:
            return False
        side = "too low: it averages" if w < _window(low) else "too high: it averages"
        return Hit({"decay": decay, "window_steps": w, "params": params, "range": [low, high], "large": large},
                   f"EMA decay {decay:g} {side} over ~{fmt(w)} steps; the checklist's range for a "
                   f"{'large' if large else 'small'} model ({params:,} parameters) is {low:g}-{high:g}")


@register
class CosineFloorTooLow(SetupRule):
    id, name, checklist = "H8", "cosine_floor_too_low", "9.2 / 8"
    fires_when = "the LR scheduler is a cosine schedule whose final LR is below base_lr / {ratio} (any param group)"
    diagnosis = ("A cosine schedule that decays below base_lr / 10: the checklist's 9.2 keeps the final LR at no "
                 "less than base_lr / 10, and its troubleshooting table (8) names an end LR that is too low as a "
                 "cause of divergence after the decay (the run stops adapting, then drifts).")
    actions = {"floor": "Give the schedule a floor of base_lr / 10: `CosineAnnealingLR(opt, T_max, eta_min=base_lr / "
                        "10)`; HF: `get_cosine_with_min_lr_schedule_with_warmup(..., min_lr_rate=0.1)`; OneCycleLR: "
                        "`final_div_factor` so that max_lr / (div_factor * final_div_factor) >= max_lr / 10."}
    params = {**_LIFECYCLE, "ratio": Float(10.0)}
    needs = ("lr",)

    def judge(self, step, setup, cfg):
        s = _part(setup, "scheduler")
        if s is None or not s.get("cosine"):
            return None
        base, final = s.get("base_lrs") or [], s.get("final_lrs") or []
        pairs = [(num(b), num(f)) for b, f in zip(base, final)]
        pairs = [(b, f) for b, f in pairs if b is not None and f is not None and b > 0]
        if not pairs:
            return None
        ratio = float(cfg["ratio"])
        # a floor set to exactly base / 10 (computed in floating point) is the checklist's floor, not below it
        low = [(i, b, f) for i, (b, f) in enumerate(pairs) if f < (b / ratio) * (1 - 1e-9)]
        if not low:
            return False
        i, b, f = min(low, key=lambda t: t[2] / t[1])
        name = s.get("class", "scheduler") + (f" in {s['within']}" if s.get("within") else "")
        return Hit({"scheduler": name, "base_lr": b, "final_lr": f, "group": i, "how": s.get("how")},
                   f"{name} ends at lr {fmt(f)} from {fmt(b)}: below base_lr / {ratio:g} = {fmt(b / ratio)} "
                   f"(checklist 9.2 keeps the cosine's end at base_lr / 10 or more)")


@register
class ClipBeforeUnscale(SetupRule):
    id, name, severity, checklist = "H9", "clip_before_unscale", "warning", "6.1"
    fires_when = ("clip_grad_norm_ is called while the GradScaler's grads are still scaled (stage READY: no "
                  "scaler.unscale_(optimizer) before it), or after scaler.step() (stage STEPPED)")
    diagnosis = ("Clipping scaled gradients: without `scaler.unscale_(optimizer)` first, clip_grad_norm_ sees the "
                 "gradients multiplied by the loss scale (65536 at the start), so max_norm=1.0 clips at 1/65536 of "
                 "the intended norm: every step is clipped to almost nothing and the threshold moves with the scale "
                 "(checklist 6.1). Clipping after scaler.step() clips gradients the update has already used.")
    actions = {"unscale_first": "Order the step as checklist 6.1 does: `scaler.scale(loss).backward()`, "
                                "`scaler.unscale_(optimizer)`, `clip_grad_norm_(model.parameters(), max_norm)`, "
                                "`scaler.step(optimizer)`, `scaler.update()`."}
    needs = ("clip_max_norm",)

    def judge(self, step, setup, cfg):
        clip = _part(setup, "clip")
        if clip is None or not setup.get("scaler_enabled") or not clip.get("calls"):
            return None
        stages = set(clip.get("stages") or [])
        if not stages:
            return None
        if not stages & {"ready", "stepped"}:
            return False
        max_norm = clip.get("max_norm")
        at = f" (max_norm={max_norm:g})" if isinstance(max_norm, (int, float)) else ""
        if "ready" in stages:
            message = (f"clip_grad_norm_{at} clips the scaled gradients: no scaler.unscale_(optimizer) before it "
                       f"(checklist 6.1: unscale, then clip)")
        else:
            message = (f"clip_grad_norm_{at} is called after scaler.step(): the update already used the unclipped "
                       f"gradients (checklist 6.1: unscale, clip, then step)")
        return Hit({"stages": sorted(stages), "max_norm": max_norm}, message)
