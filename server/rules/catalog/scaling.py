"""Loss scaling (fp16 GradScaler): skipped-step storms (A5), the scale collapsing (B3)."""
from __future__ import annotations

import numpy as np

from gradwatch.server.rules.catalog._shared import SETUP_EVENT, already_clipped, clip_max_norm
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, streaks
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import enc, fmt


@register
class OverflowStorm(BatchRule):
    id, name, severity, checklist = "A5", "overflow_storm", "warning", "8.A / 8.B / 7.1"
    family = "A"
    fires_when = ">= {consecutive} consecutive skipped (overflow) steps, or > {fraction:.0%} of the last {window} steps skipped"
    diagnosis = ("The loss scaler (GradScaler, DeepSpeed's fp16 scaler) keeps skipping steps: loss scaling is "
                 "misconfigured, or the values really overflow the fp16 range.")
    actions = {
        "setup": "Check the loss-scaling setup (init_scale, the order scale -> backward -> unscale_ -> clip -> step -> "
                 "update).",
        "bf16": "Switch autocast to bf16 (same exponent range as fp32, no overflow) if the hardware supports it.",
        "clip": "If the overflows are real, clip gradients and lower the learning rate.",
    }
    params = {"consecutive": Int(5), "fraction": Float(0.05, zero_ok=True, at_most=1), "window": Int(200)}
    needs = ("overflow",)
    evidence_events = (SETUP_EVENT,)    # a run that clips is not told to clip

    def evaluate(self, batch, state, cfg):
        judged = np.flatnonzero(batch.measured("overflow"))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        window = int(cfg["window"])
        skip = batch.true("overflow")[judged]
        steps = batch.step[judged]
        run = streaks(skip, int(state.get("consecutive", 0)))
        stored = np.asarray(state.get("skipped") or [], dtype=np.int64)
        skipped = np.concatenate((stored, steps[skip]))
        upto = len(stored) + np.cumsum(skip)                  # skipped steps known at each judged step
        cutoff = steps - window
        gone = np.minimum(np.searchsorted(skipped, cutoff, "right"), upto)
        in_window = upto - gone
        hit = (run >= cfg["consecutive"]) | (in_window > cfg["fraction"] * window)
        out.clear[judged[~hit]] = True
        scale, count = batch.values("loss_scale"), batch.raw("overflow_count")
        for k in np.flatnonzero(hit).tolist():
            i, c, n = int(judged[k]), int(run[k]), int(in_window[k])
            ls = float(scale[i]) if batch.measured("loss_scale")[i] else None
            max_norm = clip_max_norm(batch, i)
            actions = None if max_norm is None else [*self.spec.action("setup", "bf16"), already_clipped(max_norm)]
            # the numbers name the step they describe (issue 42): the alert's message is written when it opens
            out.hits[i] = Hit({"consecutive_skipped": c, "skipped_in_window": n, "window": window,
                               "loss_scale": enc(ls), "overflow_count": count[i]},
                              f"{c} consecutive skipped steps, {n} of the last {window}; loss scale {fmt(ls)} at "
                              f"step {int(batch.step[i])}", actions=actions)
        state["consecutive"] = int(run[-1])
        state["skipped"] = skipped[gone[-1]:].tolist()
        return out


@register
class LossScaleCollapse(BatchRule):
    id, name, severity, checklist = "B3", "loss_scale_collapse", "critical", "8.B"
    failure_noun = "the loss-scale collapse"
    family = "B"
    fires_when = "loss scale < {min_scale:g}, or halved {halvings} times with no growth in {window} steps"
    diagnosis = "The loss scaler keeps halving the loss scale: the effective update shrinks towards nothing."
    actions = {
        "bf16": "Switch autocast to bf16 (dtype=torch.bfloat16), which needs no loss scaling.",
        "raise_init_scale": "Or raise GradScaler's init_scale, and find the op that overflows (see A3 / A5).",
    }
    params = {"min_scale": Float(1.0), "halvings": Int(3), "window": Int(2000)}
    needs = ("loss_scale",)

    def evaluate(self, batch, state, cfg):
        scale_all = batch.values("loss_scale")
        judged = np.flatnonzero(np.isfinite(scale_all))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        window, need, min_scale = int(cfg["window"]), cfg["halvings"], cfg["min_scale"]
        scale, steps = scale_all[judged], batch.step[judged]
        # the scaler's start-up calibration (halving from too high an init_scale) is not a collapse: halvings
        # count once a step went through (overflow False), from the next step on
        went_through = batch.false("overflow")[judged]
        settled = bool(state.get("settled")) | (np.cumsum(went_through) - went_through > 0)
        prev0 = state.get("prev")
        prev = np.concatenate(([np.nan if prev0 is None else prev0], scale[:-1]))
        halved = (scale < prev) & settled
        grew = scale > prev
        idx = np.arange(len(scale))
        growth = np.maximum.accumulate(np.where(grew, idx, -1))     # the last growth at or before each step
        n_halved = np.cumsum(halved)                                  # halvings up to each step
        halved_steps = steps[halved]
        before_growth = np.where(growth >= 0, n_halved[np.maximum(growth, 0)], 0)
        cutoff = steps - window
        expired = np.searchsorted(halved_steps, cutoff, "right")
        count = n_halved - np.maximum(before_growth, expired)
        carried = np.asarray(state.get("halvings") or [], dtype=np.int64)
        carried_live = np.where(growth < 0, len(carried) - np.searchsorted(carried, cutoff, "right"), 0)
        count = count + carried_live
        low = scale < min_scale
        hit = low | (count >= need)
        out.clear[judged[~hit]] = True

        def halvings_at(k: int) -> list[int]:
            g = int(growth[k])
            start = max(int(before_growth[k]), int(expired[k]))
            own = halved_steps[start:int(n_halved[k])].tolist()
            return ([] if g >= 0 else carried[carried > cutoff[k]].tolist()) + own

        for k in np.flatnonzero(hit).tolist():
            i, sc = int(judged[k]), float(scale[k])
            if low[k]:
                out.hits[i] = Hit({"loss_scale": sc, "min_scale": min_scale, "halvings": int(count[k])},
                                  f"Loss scale fell to {fmt(sc)} (< {min_scale:g}) at step {int(steps[k])}")
            else:
                h = halvings_at(k)
                out.hits[i] = Hit({"loss_scale": sc, "halvings": len(h), "halved_at": h[-10:], "window": window},
                                  f"Loss scale halved {len(h)} times with no growth: loss scale {fmt(sc)} at step "
                                  f"{int(steps[k])}")
        state["prev"] = float(scale[-1])
        state["halvings"] = halvings_at(len(scale) - 1)
        if settled[-1] or went_through[-1]:
            state["settled"] = True
        return out
