"""A: NaN / Inf — a non-finite loss (A1), where it started (A3), non-finite inputs (A4)."""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from gradwatch.server.rules.batch import Batch
from gradwatch.server.rules.catalog._shared import (BF16_ACTION, SETUP_EVENT, already_clipped, clip_max_norm,
                                                    setup_max_norm)
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import NAN_EVIDENCE, BatchRule, Outcome, nan_late_evidence, top_grad_norms
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import enc, fmt
from gradwatch.server.rules.windows import RobustWindow


@register
class LossNonfinite(BatchRule):
    id, name, severity, checklist = "A1", "loss_nonfinite", "critical", "8.A"
    failure_noun = "the NaN loss"
    family = "A"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = "the loss is NaN/Inf (whether or not the scaler then skipped the step)"
    diagnosis = "The loss became NaN/Inf."
    actions = {
        "loss_computation": "Grad norm was normal before the NaN: check the loss computation itself (log(0) in BCE / "
                            "cross-entropy; torch.log(torch.sigmoid(logit)) instead of "
                            "F.binary_cross_entropy_with_logits; division by zero in a normalisation).",
        "clip_first": "Grad norm exploded first: enable gradient clipping (max_norm=1.0) and lower the learning rate.",
        "bf16": BF16_ACTION,
        "check_inputs": "Check the inputs: add `assert not torch.isnan(x).any()` after data loading.",
    }
    # the actions a cause gets: each true of it (issue 42: "grad norm was normal" never beside "grad norm
    # exploded first"); neutral texts where the cause is not known
    check_loss = ("Check the loss computation (log(0) in BCE / cross-entropy; torch.log(torch.sigmoid(logit)) "
                  "instead of F.binary_cross_entropy_with_logits; division by zero in a normalisation).")
    clip_unknown = ("If the grad norm grows before NaNs: enable gradient clipping (max_norm=1.0, after "
                    "scaler.unscale_) and lower the learning rate.")
    params = {"explode_factor": Float(10.0), "clear_steps": Int(10)}
    needs = ("loss",)
    evidence_events = NAN_EVIDENCE + (SETUP_EVENT,)
    # under DDP the all-reduce spreads one rank's NaN to every rank a step later: one alert, led by
    # the rank that went first
    one_alert_across_ranks = True
    # the grad norms before the NaN tell its causes apart: a window of the last 50 (spikes left out)
    HISTORY, REFRESH, MIN_HISTORY = 50, 4, 5

    def late_evidence(self, ctx):
        return nan_late_evidence(ctx)

    def evaluate(self, batch: Batch, state: dict, cfg: dict) -> Outcome:
        loss, loss_m = batch.values("loss"), batch.measured("loss")
        gn, gn_m = batch.values("grad_norm"), batch.measured("grad_norm")
        ok = np.isfinite(loss)
        bad = loss_m & ~ok
        gn_ok = np.isfinite(gn)
        arrivals = np.flatnonzero((ok & gn_ok) | bad)        # a judged grad norm, or a NaN loss (judged only)
        factor = cfg["explode_factor"]
        win = RobustWindow(state, "gn", self.HISTORY, refresh=self.REFRESH, min_len=self.MIN_HISTORY)
        xs = np.where(ok[arrivals], gn[arrivals], np.nan)
        s = win.screen(xs, ok[arrivals], lambda x, med, mad: x > factor * med,
                       monotone=not bad.any())
        win.save()
        # the grad norm seen last before each step: finite, "NaN" / "Inf" (as stored), or the state's
        seen = ok & gn_m
        prev = state.get("prev_gn")
        out = Outcome(ok & loss_m)
        if bad.any():
            last = np.maximum.accumulate(np.where(seen, np.arange(batch.n), -1))
            med_at = dict(zip(arrivals.tolist(), s.med.tolist()))
            for i in np.flatnonzero(bad).tolist():
                j = int(last[i - 1]) if i else -1
                before = (float(gn[j]) if gn_ok[j] else fmt(float(gn[j]))) if j >= 0 else prev
                med = med_at[i]
                out.hits[i] = self._hit(batch, i, before, None if math.isnan(med) else med, cfg)
        if seen.any():
            j = int(np.flatnonzero(seen)[-1])
            state["prev_gn"] = float(gn[j]) if gn_ok[j] else fmt(float(gn[j]))
        return out

    def _hit(self, batch: Batch, i: int, before: Any, med, cfg: dict) -> Hit:
        st, ctx = batch.steps[i], batch.ctx
        loss, gn = float(batch.values("loss")[i]), batch.values("grad_norm")[i]
        gn = float(gn) if batch.measured("grad_norm")[i] else None
        scale = float(batch.values("loss_scale")[i]) if batch.measured("loss_scale")[i] else None
        ev: dict[str, Any] = {"loss": enc(loss), "grad_norm": enc(gn), "grad_norm_before": before,
                              "grad_norm_median": med, "overflow": st.get("overflow"), "loss_scale": enc(scale)}
        spec, factor = self.spec, cfg["explode_factor"]
        max_norm = clip_max_norm(batch, i)
        if max_norm is not None:
            ev["clip_max_norm"] = max_norm
        clip = already_clipped(max_norm) if max_norm is not None else self.clip_unknown
        actions = [self.check_loss, clip, *spec.action("bf16", "check_inputs")]
        inputs = batch.values("input_nonfinite")[i]
        if inputs > 0:
            ev["input_nonfinite"] = st.get("input_nonfinite")
            cause = "inputs"
            diagnosis = ("The loss became NaN/Inf at a step whose input batch held non-finite values: "
                         "the data pipeline, not the model, produced it.")
            actions = [*spec.action("check_inputs"), self.check_loss, *spec.action("bf16")]
        elif before in NONFINITE or (isinstance(before, float) and math.isfinite(before) and med is not None
                                 and before > factor * med):
            cause = "grad_explosion_first"
            ratio = fmt(before / med) if isinstance(before, float) and med else "non-finite"
            diagnosis = (f"The gradient norm exploded first (last grad norm {fmt(_num(before))}, "
                         f"{ratio}x its median {fmt(med)}), then the loss became NaN/Inf.")
            clip = already_clipped(max_norm) if max_norm is not None else spec.action("clip_first")[0]
            actions = [clip, *spec.action("bf16"), self.check_loss, *spec.action("check_inputs")]
        elif med is not None:
            cause = "loss_computation"
            diagnosis = (f"The loss became NaN/Inf while the grad norm was normal (last {fmt(_num(before))}, "
                         f"median {fmt(med)}): the loss computation itself produced it.")
            actions = spec.action("loss_computation", "bf16", "check_inputs")
        else:
            cause = "unknown"
            diagnosis = "The loss became NaN/Inf before a grad-norm history was available."
        ev["cause"] = cause
        origin = ctx.remembered.get("nan_origin")
        if origin:
            ev["nan_origin"] = origin
        top = top_grad_norms(ctx, st)
        if top:
            ev["top_grad_norms"] = top
        skipped = " (the scaler skipped the step)" if st.get("overflow") else ""
        return Hit(ev, f"Loss is {fmt(loss)} at step {st['step']}{skipped}; cause: {cause.replace('_', ' ')}",
                   diagnosis=diagnosis, actions=actions)


NONFINITE = {"NaN": math.nan, "Inf": math.inf, "-Inf": -math.inf}   # a non-finite grad norm, as fmt writes it


def _num(x: Any):
    return NONFINITE.get(x, math.nan) if isinstance(x, str) else x


# What the agent's replay of the failing step (agent/capture/replay.py, `cause`) says, in the checklist's
# words (section 6.2, the sources of NaN / Inf), and the named action that fixes it.
NAN_CAUSES = {
    "softmax_overflow": ("softmax / exp overflow: its input reached {in_max} (exp overflows {dtype} past "
                         "{limit}), so exp(x) became Inf and Inf/Inf NaN", "stable_softmax"),
    "log_of_nonpositive": ("log of a value <= 0: its input held {in_nonpositive} values <= 0 and the output "
                           "-Inf/NaN", "guard_log"),
    "division_by_zero": ("division by zero: {in_zeros} zeros in its input, or a denominator inside it (a "
                         "normalisation's std or sum) that reached 0 on this batch", "guard_division"),
    "fp16_overflow": ("fp16 overflow: values past the float16 range (65504); its finite input reached "
                      "|x| = {in_absmax}", "bf16"),
    "nonfinite_input": ("its input was already non-finite: the batch (or a non-module op before it) carried "
                        "NaN/Inf", "check_inputs"),
    "grad_explosion": ("its backward overflowed from finite values (gradient explosion)", "clip"),
    "loss_computation": ("the model's output was finite: the loss computation (or its backward) made the NaN/Inf",
                         "guard_log"),
}


@register
class NanOrigin(BatchRule):
    id, name, severity, checklist = "A3", "nan_origin", "warning", "8.A"
    family = "A"
    fires_when = "the agent located the first module whose activation or gradient went non-finite"
    diagnosis = "The NaN/Inf started in one layer: its activations or gradients overflowed."
    actions = {
        "inspect_layer": "Inspect that layer: check its weight initialisation, make sure nothing divides by zero "
                         "(normalisation denominators), and look for overflow (fp16 range, softmax on very large "
                         "logits).",
        "bf16": BF16_ACTION,
        "stable_softmax": "Subtract the row max before exp (or use torch.softmax / torch.logsumexp, which do), "
                          "and compute the softmax in float32.",
        "guard_log": "Keep log's argument positive: torch.log(x.clamp_min(eps)), log_softmax instead of "
                     "log(softmax), F.binary_cross_entropy_with_logits instead of log(sigmoid).",
        "guard_division": "Add an epsilon to the denominator (x / (norm + 1e-6), std + eps) or mask rows that are "
                          "constant / padding.",
        "check_inputs": "Check the inputs: add `assert torch.isfinite(x).all()` after data loading.",
        "clip": "Enable gradient clipping (max_norm=1.0) and lower the learning rate.",
    }
    needs = ("loss",)
    evidence_events = (SETUP_EVENT,)    # a run that clips is not told to enable clipping

    def applies(self, ctx):
        return bool(ctx.events.get("nan_origin"))

    def evaluate(self, batch, state, cfg):
        out = Outcome(np.isfinite(batch.values("loss")))
        for step, origin in sorted(batch.ctx.events.get("nan_origin", {}).items()):
            module = origin.get("module", "?")
            where = origin.get("where", "activation")
            diagnosis, actions = self._diagnosis(module, where, origin)
            max_norm = setup_max_norm(batch.ctx)
            if max_norm is not None:
                clip = self.spec.action("clip")[0]
                actions = [already_clipped(max_norm) if a == clip else a
                           for a in (actions if actions is not None else self.spec.actions)]
            out.before.append((step, Hit({"module": module, "where": where,
                                          **{k: enc(v) for k, v in origin.items() if k not in ("module", "where")}},
                                         f"First non-finite {where} at step {step} in module {module}"
                                         + (f" ({origin['cause'].replace('_', ' ')})" if origin.get("cause") else ""),
                                         diagnosis=diagnosis, actions=actions)))
        return out

    def _diagnosis(self, module: str, where: str, origin: dict) -> tuple[str, Optional[list]]:
        cause = origin.get("cause")
        if cause not in NAN_CAUSES:   # the hunt's answer (a later step), or an agent without the replay
            return (f"The NaN/Inf started in `{module}` ({where}): that layer's activations or gradients "
                    f"overflowed."), None
        text, action = NAN_CAUSES[cause]
        inp = origin.get("input") if isinstance(origin.get("input"), dict) else {}
        dtype = str(inp.get("dtype") or (origin.get("output") or {}).get("dtype") or "float32")
        limit = {"float16": 11.09, "bfloat16": 88.72}.get(dtype, 88.72)
        text = text.format(in_max=fmt(inp.get("max")), in_nonpositive=inp.get("nonpositive", "?"),
                           in_zeros=inp.get("zeros", "?"), in_absmax=fmt(inp.get("absmax")), dtype=dtype,
                           limit=limit)
        stage = {"activation": "forward output", "grad": "gradient", "input": "input", "loss": "loss"}.get(where, where)
        replayed = " (the failing step replayed with every module hooked)" if origin.get("method") == "replay" else ""
        names = [action] + [n for n in ("inspect_layer", "bf16") if n != action]
        return (f"The NaN/Inf started in `{module}`'s {stage}{replayed}: {text} (checklist 6.2).",
                self.spec.action(*names))


@register
class InputNonfinite(BatchRule):
    id, name, severity, checklist = "A4", "input_nonfinite", "critical", "8.A"
    failure_noun = "the non-finite input"
    family = "A"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = "a non-finite value in the batch fed to the model"
    diagnosis = "The input batch contains NaN/Inf: the data pipeline produced it, the model did not."
    actions = {"fix_pipeline": "Fix the data pipeline; add `assert torch.isfinite(x).all()` after data loading to "
                               "find the sample."}
    params = {"clear_steps": Int(5)}
    needs = ("input_nonfinite",)

    def evaluate(self, batch, state, cfg):
        n, measured = batch.values("input_nonfinite"), batch.measured("input_nonfinite")
        bad = n > 0
        out = Outcome(measured & ~bad)
        for i in np.flatnonzero(bad).tolist():
            k = int(n[i])
            out.hits[i] = Hit({"input_nonfinite": k},
                              f"{k} non-finite values in the input batch at step {batch.steps[i]['step']}")
        return out
