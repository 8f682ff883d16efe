"""The learning-rate schedule: a learning rate stuck at zero (B4)."""
from __future__ import annotations

import numpy as np

from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, streaks
from gradwatch.server.rules.spec import Hit, Int


@register
class LrZero(BatchRule):
    id, name, severity, checklist = "B4", "lr_zero", "critical", "7.1 / 8.B"
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
