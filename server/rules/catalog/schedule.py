"""The learning-rate schedule: a learning rate stuck at zero (B4), an abrupt jump of it (H10)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, streaks
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt


@register
class LrZero(BatchRule):
    id, name, severity, checklist = "B4", "lr_zero", "critical", "7.1 / 8.B"
    failure_noun = "the LR reaching 0"
    family = "B"
    fires_when = "learning rate is 0 for {steps} consecutive steps after step 0"
    diagnosis = "The learning rate is zero: nothing is being learned."
    actions = {
        "scheduler": "Check the LR scheduler (a schedule that decays to 0, a warmup that never starts, wrong "
                     "total_steps).",
        "scaler": "Check that GradScaler is not halving the scale to nothing (see B3).",
    }
    params = {"steps": Int(10)}
    needs = ("lr",)

    def evaluate(self, batch, state, cfg):
        lr_all = batch.values("lr")
        judged = np.flatnonzero(batch.measured("lr") & (batch.step != 0))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        lr, steps = lr_all[judged], batch.step[judged]
        zero = lr == 0
        run = streaks(zero, int(state.get("streak", 0)))
        out.clear[judged[~zero]] = True
        # the peak so far, before each step (a NaN LR leaves it as it is)
        peak0 = state.get("peak")
        nonzero = np.where(zero, np.nan, lr)
        peaks = np.fmax.accumulate(np.concatenate(([0.0 if peak0 is None else peak0], nonzero)))
        has_peak = (peak0 is not None) | (np.cumsum(~zero) > 0)
        begin = np.arange(len(lr)) - run + 1
        for k in np.flatnonzero(zero & (run >= cfg["steps"])).tolist():
            since = int(steps[begin[k]]) if begin[k] >= 0 else state.get("since")
            n = int(run[k])
            peak = float(peaks[k]) if (peak0 is not None or k and has_peak[k - 1]) else None
            out.hits[int(judged[k])] = Hit({"lr": float(lr[k]), "steps_at_zero": n, "since_step": since, "peak_lr": peak},
                                           f"Learning rate is 0 for {n} steps (since step {since})")
        if (~zero).any():
            state["peak"] = float(peaks[-1])
        state["streak"] = int(run[-1])
        if run[-1]:
            b = int(begin[-1])
            state["since"] = int(steps[b]) if b >= 0 else state.get("since")
        else:
            state.pop("since", None)
        return out


# schedulers whose own cycle restarts the learning rate at its peak: their jumps are declared, not abrupt
_RESTARTING = ("CosineAnnealingWarmRestarts", "CyclicLR")
# float rounding of a schedule's arithmetic (timm's warm-up end: warmup_lr_init + t * step, not exactly the base)
_ROUNDING = 1.0 + 1e-6


@register
class LrJump(BatchRule):
    id, name, severity, checklist = "H10", "lr_jump", "warning", "7.1 / 8.C"
    family = "H"
    fires_when = ("the learning rate rises >= {factor:g}x from one step to the next (from a non-zero LR) to above the "
                  "LR the run configured (the largest of param group 0's LR at attach and at the first step, and "
                  "the initial_lr / max_lr its scheduler was built with, from the run_setup event; without one, any "
                  "such rise); not where the run declared a scheduler that restarts its cycle, nor within "
                  "{settle_steps} steps of a process's start: a resume's LR is G2's and G5's")
    diagnosis = ("An abrupt learning-rate increase beyond what the run was configured with: every update is that many "
                 "times larger from one step to the next, with Adam's moments and the model tuned to the old rate; a "
                 "gradient or loss explosion tends to follow within a few steps (checklist 7.1: an LR too large; "
                 "8.C: lower it). A schedule's own rises stay within the configured LR (a warm-up by step or by "
                 "epoch reaching its target, a cosine or step schedule, OneCycleLR's peak, a return to initial_lr); "
                 "a jump past it is usually a scheduler bug, a resumed scheduler whose state was not restored, or a "
                 "manual param_group edit.")
    actions = {
        "check_schedule": "If it was not meant: check the scheduler (its lambda or factors, its state after a resume, "
                          "its step count), and any code that writes param_group['lr'].",
        "ramp": "If the new LR is meant: configure it (the optimizer's lr, the scheduler's peak) and reach it with a "
                "warm-up over a few hundred steps instead of one step, and clip gradients (max_norm=1.0) meanwhile.",
    }
    params = {"factor": Float(5.0), "settle_steps": Int(5, zero_ok=True)}
    needs = ("lr",)
    # State: "last" [step, lr] of the last measured finite LR; "restarting": the run declared a restarting scheduler;
    # "quiet_until": the last step of a resumed process's first settle_steps, not judged; "configured": the
    # configured LR of the latest process's run_setup event (absent: none said).

    @staticmethod
    def _setups(ctx) -> list[tuple[int, dict]]:
        """This batch's run_setup events (one per process, with its first step), oldest first."""
        by_step = ctx.events.get("run_setup") or {}
        return [(int(k), v) for k, v in sorted(by_step.items(), key=lambda kv: int(kv[0])) if isinstance(v, dict)]

    @staticmethod
    def _restarting(setups) -> bool:
        """A setup event declares a scheduler that restarts its cycle."""
        for _, setup in setups:
            sched = setup.get("scheduler")
            if isinstance(sched, dict) and any(r in f"{sched.get('class', '')} {sched.get('within', '')}"
                                               for r in _RESTARTING):
                return True
        return False

    @staticmethod
    def _configured(setups) -> Optional[float]:
        """The LR the latest process was configured with (agent/setup.py ``lr_part``: ``lr.configured``)."""
        for _, setup in reversed(setups):
            lr = setup.get("lr")
            value = lr.get("configured") if isinstance(lr, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
                return float(value)
        return None

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        setups = self._setups(batch.ctx)
        if state.get("restarting") or self._restarting(setups):
            state["restarting"] = True
            return out
        configured = self._configured(setups)
        if configured is not None:
            state["configured"] = configured
        configured = state.get("configured")
        ceiling = math.inf if configured is None else configured * _ROUNDING
        lr_all = batch.values("lr")
        judged = np.flatnonzero(batch.measured("lr") & np.isfinite(lr_all))
        last = state.get("last")
        factor = cfg["factor"]
        # a process that attached anew (a resume: its resume_state event) starts its own LR history; an LR that
        # differs from the schedule's after a resume is G5's (lr_restarted), with the resume as its cause
        # (and its first settle_steps steps: an optimizer built fresh and a scheduler restored after it set the LR
        # twice, the warm-up's first value, then the restored schedule's: G2 / G5 name that cause)
        restarts = sorted(int(k) for k in (batch.ctx.events.get("resume_state") or {}).keys())
        settle = int(cfg["settle_steps"])
        quiet_until = state.get("quiet_until", -1)
        for i in judged.tolist():
            lr, step = float(lr_all[i]), int(batch.step[i])
            began = [r for r in restarts if r <= step]
            if began:
                quiet_until = max(quiet_until, began[-1] + settle)
            if step <= quiet_until:
                out.clear[i] = True
                last = [step, lr]
                continue
            if last is not None and last[1] > 0 and lr >= factor * last[1] and not (configured and lr <= ceiling):
                beyond = "" if configured is None else f", above the {fmt(configured)} the run was configured with"
                said = {} if configured is None else {"configured_lr": configured}
                out.hits[i] = Hit({"lr_before": last[1], "lr": lr, "ratio": lr / last[1], "step_before": last[0],
                                   **said},
                                  f"Learning rate jumped {lr / last[1]:.3g}x, from {fmt(last[1])} at step {last[0]} to "
                                  f"{fmt(lr)} at step {step}{beyond}")
            else:
                out.clear[i] = True
            last = [step, lr]
        if last is not None:
            state["last"] = last
        state["quiet_until"] = quiet_until
        return out
