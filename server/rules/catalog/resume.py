"""G: resume sanity (checklist 7.3) — what a run resumed from a checkpoint forgot to restore.

The agent sends one ``resume_state`` event per process (``agent/resume.py``): the scaler's scale and
growth tracker, the optimizer's state and step counters, whether the EMA shadow equals the weights,
the BatchNorm layers at their init values, the LR and a hash of the RNG state, all as they were right
after the checkpoint was loaded. Ingest adds the run's stored state before it (``data["before"]``,
``server/ingest/resume.py``). Each rule compares one part and names what was forgotten with the checklist's
fix; a process whose run has nothing stored before it (a fresh run) is no resume and says nothing.
A clean resume clears the rule's open alert (``clear_steps`` 1): the next resume got it right.

G5 also reads the first steps after the resume: a scheduler that was not restored often shows only
at its first ``step()`` (the LR was restored with the optimizer, the schedule starts over).
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

from gradwatch.server.rules.batch import Batch
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt, num

KIND = "resume_state"
# an alert per forgotten state, cleared by the next clean resume; never by the steps in between
_LIFECYCLE = {"clear_steps": Int(1), "cooldown_steps": Int(0, zero_ok=True)}


def _close(a: Optional[float], b: Optional[float], rel: float) -> bool:
    return a is not None and b is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-30)


class ResumeRule(BatchRule):
    """A verdict per ``resume_state`` event: a Hit, False (restored), or None (nothing to compare).

    ``needs``: the stored signal each rule compares the snapshot with (``server/ingest/resume.py`` reads it)."""

    family = "G"
    checklist = "7.3"
    params = _LIFECYCLE

    def applies(self, ctx) -> bool:
        return bool(ctx.events.get(KIND))

    def resumes(self, batch: Batch) -> Iterator[tuple[int, dict, dict]]:
        """(step, the snapshot, the stored state before it) of each resume with a stored past."""
        for step, data in sorted(batch.ctx.events.get(KIND, {}).items()):
            before = data.get("before")
            if isinstance(before, dict) and before.get("steps"):
                yield step, data, before

    def judge(self, step: int, snap: dict, before: dict, cfg: dict, batch: Batch):
        raise NotImplementedError

    def evaluate(self, batch: Batch, state: dict, cfg: dict) -> Outcome:
        out = Outcome.quiet(batch.n)
        for step, snap, before in self.resumes(batch):
            verdict = self.judge(step, snap, before, cfg, batch)
            if verdict is not None:
                out.before.append((step, verdict))
        return out

    @staticmethod
    def resumed(step: int, before: dict) -> str:
        return f"resumed at step {step} after step {before.get('step')}"


@register
class ScalerNotRestored(ResumeRule):
    id, name, severity = "G1", "scaler_not_restored", "warning"
    fires_when = ("after a resume the loss scale is not the one the run's last stored step left (× growth, "
                  "× backoff or as is) and the growth tracker is back at 0")
    diagnosis = ("The GradScaler state was not restored: the loss scale restarts at its init value and has to "
                 "find its level again through overflows (skipped steps) or thousands of steps of growth.")
    actions = {"load_scaler": "Save `scaler.state_dict()` in the checkpoint and call `scaler.load_state_dict(...)` "
                              "when resuming (checklist 7.3: the AMP loss scaling factor must be restored)."}

    needs = ("loss_scale",)
    def judge(self, step, snap, before, cfg, batch):
        sc = snap.get("scaler")
        last = num(before.get("loss_scale"))
        if not isinstance(sc, dict) or last is None or not math.isfinite(last):
            return None
        scale = num(sc.get("scale"))
        expected = [last, last * float(sc.get("growth_factor") or 2.0), last * float(sc.get("backoff_factor") or 0.5)]
        if any(_close(scale, e, 1e-6) for e in expected) or sc.get("growth_tracker"):
            return False
        first = num(before.get("first_loss_scale"))
        at_init = " (its init value, as at the run's first step)" if _close(scale, first, 1e-6) else ""
        return Hit({"loss_scale": scale, "loss_scale_before": last, "first_loss_scale": first,
                    "growth_tracker": sc.get("growth_tracker"), "before_step": before.get("step")},
                   f"GradScaler not restored: loss scale {fmt(scale)}{at_init} at the resume, the run had "
                   f"{fmt(last)} ({self.resumed(step, before)})")


@register
class OptimizerNotRestored(ResumeRule):
    id, name, severity = "G2", "optimizer_not_restored", "warning"
    fires_when = "after a resume the optimizer state is empty or its step counters are 0, while the run had updated"
    diagnosis = ("The optimizer state was not restored: Adam's moments (momentum and variance) restart from zero, "
                 "so the update trajectory forks from the one before the checkpoint (bias correction starts over; "
                 "a loss spike often follows).")
    actions = {"load_optimizer": "Save `optimizer.state_dict()` in the checkpoint and call "
                                 "`optimizer.load_state_dict(...)` when resuming; Adam's moments must match the ones "
                                 "before the checkpoint exactly (checklist 7.3)."}

    needs = ("overflow",)
    def judge(self, step, snap, before, cfg, batch):
        opt = snap.get("optimizer")
        if not isinstance(opt, dict) or opt.get("stateless"):
            return None
        updates = int(before.get("steps") or 0) - int(before.get("skipped_steps") or 0)
        if updates < 1:
            return None
        empty = not opt.get("state_entries")
        counter = opt.get("step")
        if not empty and counter != 0:
            return False
        what = "empty" if empty else "step counters at 0"
        return Hit({"optimizer": opt.get("class"), "state_entries": opt.get("state_entries"), "step_counter": counter,
                    "updates_before": updates, "before_step": before.get("step")},
                   f"Optimizer state not restored: {opt.get('class')} state {what} at the resume, after "
                   f"{updates} updates ({self.resumed(step, before)})")


@register
class EmaNotRestored(ResumeRule):
    id, name, severity = "G3", "ema_not_restored", "warning"
    fires_when = "after a resume the EMA shadow equals the model's weights exactly"
    diagnosis = ("The EMA shadow was not restored: it was re-initialised from the current weights, so the average "
                 "of everything before the checkpoint is gone and the EMA model evaluates like the raw weights.")
    actions = {"load_ema": "Save the EMA shadow in the checkpoint (`ema.shadow` / `ema_model.state_dict()`) and load it "
                           "when resuming (checklist 7.3's checkpoint holds 'ema_shadow')."}

    needs = ("ema_divergence",)
    def judge(self, step, snap, before, cfg, batch):
        ema = snap.get("ema")
        if not isinstance(ema, dict) or not ema.get("compared"):
            return None
        if not ema.get("equal_to_weights"):
            return False
        div = num(before.get("ema_divergence_max"))
        if div is not None and div == 0:      # the EMA never left the weights before either (decay 0)
            return None
        return Hit({"tensors_compared": ema.get("compared"), "ema_divergence_before": div,
                    "before_step": before.get("step")},
                   f"EMA not restored: its shadow equals the weights at the resume ({self.resumed(step, before)})")


@register
class BatchNormStatsReset(ResumeRule):
    id, name, severity = "G4", "bn_stats_reset", "warning"
    fires_when = "after a resume a BatchNorm layer's running statistics are at their init values (mean 0, var 1, " \
                 "no batch tracked) while the run had trained it"
    diagnosis = ("BatchNorm running statistics were reset: the buffers (running_mean / running_var / "
                 "num_batches_tracked) were not loaded, so evaluation right after the resume normalises with the "
                 "wrong statistics and its results jump.")
    actions = {"load_buffers": "Restore the buffers with the model: `model.load_state_dict(ckpt['model_state_dict'])` "
                               "(strict=True) loads running_mean / running_var; do not rebuild BatchNorm layers after "
                               "loading (checklist 7.3)."}

    needs = ("layers.bn_mean_norm",)
    def judge(self, step, snap, before, cfg, batch):
        bn = snap.get("batchnorm")
        if not isinstance(bn, dict) or not bn.get("layers"):
            return None
        names = list(bn.get("at_init_names") or [])
        if not bn.get("at_init"):
            return False
        stored = before.get("bn_mean_norm")
        if isinstance(stored, list) and batch.ctx.bn_names:
            # only the layers the run had moved: a layer frozen in eval mode stays at init legitimately
            index = {n: i for i, n in enumerate(batch.ctx.bn_names)}
            moved = [n for n in names if n in index and index[n] < len(stored)
                     and (num(stored[index[n]]) or 0.0) > 0.0]
            if not moved:
                return False
            names = moved
        return Hit({"layers": names, "at_init": bn.get("at_init"), "bn_layers": bn.get("layers"),
                    "before_step": before.get("step")},
                   f"BatchNorm running statistics reset at the resume in {len(names)} layer(s) "
                   f"({', '.join(names[:3])}{', …' if len(names) > 3 else ''}; {self.resumed(step, before)})")


@register
class LrRestarted(ResumeRule):
    id, name, severity = "G5", "lr_restarted", "warning"
    fires_when = ("in the first {window} steps after a resume the LR takes values of the run's first steps on two "
                  "steps in a row, away from the LR before the resume (more than {tolerance} relative)")
    diagnosis = ("The LR schedule restarted: the scheduler's state was not restored, so the LR is back at the start "
                 "of the schedule (warm-up or peak) instead of where the run left it.")
    actions = {"load_scheduler": "Save `scheduler.state_dict()` in the checkpoint and call "
                                 "`scheduler.load_state_dict(...)` when resuming (or pass `last_epoch=` the step "
                                 "reached); the LR after the resume must be the schedule's value at that step."}
    params = {**_LIFECYCLE, "window": Int(4), "tolerance": Float(0.01, at_most=1)}
    needs = ("lr",)

    def applies(self, ctx) -> bool:
        return bool(ctx.events.get(KIND)) or "lr" in ctx.present

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        for step, snap, before in self.resumes(batch):
            first = [num(x) for x in before.get("first_lrs") or [] if num(x) is not None]
            prev = num(before.get("lr"))
            if first and prev is not None:
                state["pending"] = {"step": step, "left": int(cfg["window"]), "streak": 0, "first": first,
                                    "prev": prev, "before_step": before.get("step")}
        p = state.get("pending")
        if not p:
            return out
        lr, measured = batch.values("lr"), batch.measured("lr")
        for i in np.flatnonzero(measured & (batch.step >= p["step"])).tolist():
            x = float(lr[i])
            # the schedule's own values again, away from where the run was: a restart. Two steps in a row:
            # one alone is the optimizer's LR as a fresh scheduler set it (G2's case), the schedule goes on
            restart = (math.isfinite(x) and any(_close(x, f, 1e-6) for f in p["first"])
                       and not _close(x, p["prev"], cfg["tolerance"]))
            p["streak"] = p["streak"] + 1 if restart else 0
            p["left"] -= 1
            step = int(batch.step[i])
            if p["streak"] >= 2:
                out.hits[i] = Hit({"lr": x, "lr_before": p["prev"], "first_lrs": p["first"],
                                   "before_step": p["before_step"], "resume_step": p["step"]},
                                  f"LR schedule restarted: lr {fmt(x)} at step {step}, a value of the run's first "
                                  f"steps; it was {fmt(p['prev'])} at step {p['before_step']} before the resume")
                state.pop("pending", None)
                return out
            if p["left"] <= 0:
                out.clear[i] = True
                state.pop("pending", None)
                return out
        return out


@register
class RngNotRestored(ResumeRule):
    id, name, severity = "G6", "rng_not_restored", "warning"
    fires_when = "the RNG state at the resume differs from the one the agent recorded at the step before it"
    diagnosis = ("The RNG state was not restored: random augmentation, dropout and sampling after the resume differ "
                 "from what the uninterrupted run would have drawn, so the resumed run is not a continuation of it.")
    actions = {"load_rng": "Save `torch.get_rng_state()` and `torch.cuda.get_rng_state_all()` in the checkpoint and "
                           "restore them (`torch.set_rng_state`, `torch.cuda.set_rng_state_all`) right before "
                           "attaching and resuming the loop (checklist 7.3)."}

    needs = ("rng_hash",)
    def judge(self, step, snap, before, cfg, batch):
        mine, theirs = snap.get("rng_hash"), before.get("rng_hash")
        if mine is None or theirs is None:
            return None
        if int(mine) == int(theirs):
            return False
        return Hit({"rng_hash": int(mine), "rng_hash_before": int(theirs), "before_step": before.get("step")},
                   f"RNG state not restored: it differs from the one at step {before.get('step')} "
                   f"({self.resumed(step, before)})")
