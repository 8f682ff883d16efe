"""Gradients: explosion (A2), vanishing (B1), parameters without gradient (B5), underflow to zero (B6),
clipping saturation (C2)."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from gradwatch.server.rules.batch import Batch, layer_array, layer_list
from gradwatch.server.rules.catalog._grad_spikes import LossHistory, SpikeTrack
from gradwatch.server.rules.catalog._shared import SETUP_EVENT, VANISHING_GRAD_NORM, already_clipped, clip_max_norm
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import (NAN_EVIDENCE, BatchRule, Outcome, nan_late_evidence, name_of, pack_f8, streaks,
                               top_grad_norms, unpack_f8)
from gradwatch.server.rules.spec import SEVERITY_RANK, Float, Hit, Int
from gradwatch.server.rules.stats import enc, fmt
from gradwatch.server.rules.windows import RobustWindow


@register
class GradExplosion(BatchRule):
    id, name, severity, checklist = "A2", "grad_explosion", "critical", "8.A"
    failure_noun = "the grad explosion"
    family = "A"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = ("pre-clip grad norm > {factor:g}x its rolling median over {window} steps (one spike: a warning; "
                  "critical at {critical_spikes} spikes within {spike_steps} steps, at one lasting {sustained_steps} "
                  "steps, or when the loss is {loss_factor:g}x its median of {loss_window} steps at the spike and "
                  "the step after it), or non-finite with no scaler to skip the step (critical)")
    diagnosis = "The gradient norm exploded (a precursor of NaN)."
    # checklist 3.5: grad-norm peaks that recur are an explosion, and 6.x: an explosion goes on to Inf. A healthy
    # run can take one spike and train on (the no-attention controls of docs/early-warning.md: CNNs and GRUs
    # with a 12-25x spike), so one spike is a warning; a second within spike_steps, or one that lasts
    # sustained_steps, escalates the same alert to critical. A spike is a run of consecutive flagged steps: the
    # step after a bad update often has a large gradient too, and that is still the one spike. A spike whose loss
    # is loss_factor x its median at its step and still at the next is critical: the run broke with it (a
    # poisoned batch lifts the loss at its own step only). On the tuning halves of the early-warning benchmark,
    # the healthy controls' A2 hits had the loss at most 2.6x its median of 50 steps; 15 of the divergent runs'
    # had it at 3-8x (docs/early-warning.md, "A2 on healthy runs")
    single_diagnosis = ("A single grad-norm spike, with the loss below {loss_factor:g}x its median. A run often "
                        "recovers from one; spikes that recur or last are an explosion (checklist 3.5), and this "
                        "alert turns critical if another comes within {spike_steps} steps, this one lasts "
                        "{sustained_steps} steps, or the loss rises to {loss_factor:g}x its median and stays there "
                        "a step.")
    loss_diagnosis = ("A grad-norm spike with the loss at {ratio:.1f}x its median at the same step. A bad batch does "
                      "this, and the run recovers; so does a model the spike broke. This alert turns critical if the "
                      "loss is still up at the next step, if another spike comes within {spike_steps} steps, or if "
                      "this one lasts {sustained_steps} steps.")
    actions = {
        "clip": "Enable gradient clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0), after "
                "scaler.unscale_(optimizer).",
        "lower_lr": "Lower the learning rate.",
        "largest_params": "Look at the parameters with the largest grad norms (evidence.top_grad_norms): an embedding "
                          "or one layer blowing up points at its init or its inputs.",
    }
    # min_history 50 (was 20): a network leaving its initialisation raises its grad norm 10-30x over its first
    # tens of steps, and a median of the first 20 is the init's. The no-attention space's CNN controls climb from
    # 0.1 to 1-4 by steps 20-30, and A2 called that an explosion (docs/early-warning.md, "A2 on healthy runs")
    params = {"factor": Float(10.0), "window": Int(200), "min_history": Int(50, zero_ok=True),
              "critical_spikes": Int(2), "spike_steps": Int(50), "sustained_steps": Int(3),
              "loss_factor": Float(3.0), "loss_window": Int(50)}
    needs = ("grad_norm", "loss")      # the loss's median is kept on batches without a grad norm too
    evidence_events = NAN_EVIDENCE + (SETUP_EVENT,)
    REFRESH = 8

    def _actions(self, batch: Batch, i: int) -> Optional[list[str]]:
        """The catalogue's actions, or on a run that already clips, that fact in place of "enable clipping"."""
        max_norm = clip_max_norm(batch, i)
        if max_norm is None:
            return None
        return [already_clipped(max_norm), *self.spec.action("largest_params")]

    def late_evidence(self, ctx):
        return nan_late_evidence(ctx)

    def _single(self, loss_up: bool) -> str:
        """The diagnosis of a spike that is not (yet) an explosion: with the loss up at its step, or not."""
        return self.loss_diagnosis if loss_up else self.single_diagnosis

    def evaluate(self, batch: Batch, state: dict, cfg: dict) -> Outcome:
        gn, measured = batch.values("grad_norm"), batch.measured("grad_norm")
        fin = np.isfinite(gn)
        arrivals = np.flatnonzero(fin)
        factor = cfg["factor"]
        win = RobustWindow(state, "gn", int(cfg["window"]), refresh=self.REFRESH, min_len=cfg["min_history"])
        s = win.screen(gn[arrivals], np.ones(len(arrivals), dtype=bool),
                       lambda x, med, mad: (med > 0) & (x > factor * med),
                       monotone=True)
        win.save()
        # non-finite with no scaler there to skip the step (bf16 / fp32): a hit; with one, A5 / A1 territory
        unskipped = measured & ~fin & ~batch.true("overflow") & ~batch.measured("loss_scale")
        # the loss against its median: a spike whose loss is up at its step and at the next one is critical (the
        # model broke); a loss up at the spike's step alone is a bad batch (a poisoned batch: one spike, a warning)
        losses = LossHistory(state, batch.values("loss"), int(cfg["loss_window"]), float(cfg["loss_factor"]))
        clear = np.zeros(batch.n, dtype=bool)
        clear[arrivals[~s.flagged]] = True
        out = Outcome(clear)
        track = SpikeTrack.load(state)
        flagged = set(arrivals[s.flagged].tolist())
        for i in flagged:
            losses.judge(i)
        # the steps to look at: the spikes, and the step after each spike whose loss was up (here or carried over)
        after = [st + 1 for st in ([track.pending] if track.pending is not None else [])
                 + [int(batch.step[i]) for i in flagged if losses.up[i]]]
        nxt = np.searchsorted(batch.step, after)
        todo = sorted(flagged | {int(j) for j, st in zip(nxt, after) if j < batch.n and batch.step[j] == st})
        for i in set(todo) - flagged:
            losses.judge(i)
        for i in todo:
            step = int(batch.steps[i]["step"])
            stays = track.loss_stays(step, bool(losses.up[i]))
            if i in flagged:
                n, length = track.flag(step, int(cfg["spike_steps"]), bool(losses.up[i]))
                out.hits[i] = self._spike_hit(batch, i, step, float(s.med[np.searchsorted(arrivals, i)]), n, length,
                                              losses, stays, cfg)
            elif stays:                            # the grad norm is back, the loss is not: the spike broke the run
                out.hits[i] = self._loss_stayed_hit(batch, i, step, track, losses)
        track.close_batch(int(batch.step[-1]) if batch.n else None)
        track.save(state)
        for i in np.flatnonzero(unskipped).tolist():
            out.hits[i] = self._unscaled_hit(batch, i)
        return out

    def _spike_hit(self, batch: Batch, i: int, step: int, med: float, n: int, length: int, losses: LossHistory,
                   stays: bool, cfg: dict) -> Hit:
        """A flagged step, the ``n``-th spike within spike_steps and ``length`` steps long: one spike is a warning
        (at most), an explosion is the rule's own severity."""
        span, need, lasting = int(cfg["spike_steps"]), int(cfg["critical_spikes"]), int(cfg["sustained_steps"])
        g = float(batch.values("grad_norm")[i])
        loss_up = bool(losses.up[i])
        ev = {"grad_norm": g, "median": med, "ratio": g / med, "clip_max_norm": clip_max_norm(batch, i),
              "top_grad_norms": top_grad_norms(batch.ctx, batch.steps[i]), "spikes": n, "spike_steps": length}
        if loss_up:
            ev["loss_ratio"] = losses.ratio(i)
        names = ", ".join(p[0] for p in (ev["top_grad_norms"] or [])[:3])
        clipped = (f" (clipped to {fmt(ev['clip_max_norm'])})" if ev["clip_max_norm"] is not None
                   and g > ev["clip_max_norm"] else "")
        repeated = n >= need or length >= lasting or stays
        # a single spike is at most a warning: below a configured severity of critical, the configured one
        configured = cfg.get("severity", self.severity)
        single = "warning" if SEVERITY_RANK.get(configured, 0) > SEVERITY_RANK["warning"] else None
        return Hit(ev, f"Grad norm {fmt(g)} at step {step} is {g / med:.0f}x its median {fmt(med)}"
                       + clipped + (f"; {n} spikes in {span} steps" if n > 1 else "")
                       + (f"; {length} steps in a row" if length > 1 else "")
                       + (f"; the loss is {ev['loss_ratio']:.1f}x its median" if loss_up else "")
                       + (f"; largest: {names}" if names else ""),
                   severity=None if repeated else single,
                   diagnosis=None if repeated else self._single(loss_up).format(
                       spike_steps=span, sustained_steps=lasting, loss_factor=losses.factor,
                       ratio=ev.get("loss_ratio", 0.0)),
                   actions=self._actions(batch, i))

    def _loss_stayed_hit(self, batch: Batch, i: int, step: int, track: SpikeTrack, losses: LossHistory) -> Hit:
        """The step after a spike whose loss was up, with the loss still up: the explosion broke the run."""
        loss, ratio = float(losses.loss[i]), losses.ratio(i)
        return Hit({"loss": loss, "loss_median": float(losses.median[i]), "loss_ratio": ratio,
                    "after_spike": step - 1, "spikes": len(track.spikes), "spike_steps": track.length},
                   f"The loss stayed up after the grad-norm spike at step {step - 1}: "
                   f"{fmt(loss)} at step {step} is {ratio:.1f}x its median",
                   actions=self._actions(batch, i))

    def _unscaled_hit(self, batch: Batch, i: int) -> Hit:
        """A non-finite grad norm with no GradScaler to skip the step: the update went in."""
        st, g = batch.steps[i], float(batch.values("grad_norm")[i])
        ev = {"grad_norm": enc(g), "no_scaler": True, "top_grad_norms": top_grad_norms(batch.ctx, st)}
        if batch.ctx.remembered.get("nan_origin"):
            ev["nan_origin"] = batch.ctx.remembered["nan_origin"]
        return Hit(ev, f"Grad norm is {fmt(g)} at step {st['step']} and no GradScaler skipped the step",
                   actions=self._actions(batch, i))


@register
class VanishingGrad(BatchRule):
    id, name, severity, checklist = "B1", "vanishing_grad", "warning", "8.B"
    family = "B"
    fires_when = "grad norm < {threshold:g} for {steps} consecutive steps"
    diagnosis = "Vanishing gradients: the model barely receives a training signal."
    actions = {
        "saturation": "Check the activation functions for saturation (sigmoid / tanh driven to their flat ends).",
        "init": "Check the initialisation.",
        "detach": "Look for a stray .detach() (or an in-place op) that cuts the gradient off.",
    }
    params = {"threshold": Float(VANISHING_GRAD_NORM), "steps": Int(20)}
    needs = ("grad_norm",)

    def evaluate(self, batch, state, cfg):
        gn = batch.values("grad_norm")
        judged = np.flatnonzero(np.isfinite(gn) & ~batch.true("overflow"))   # a skipped step says nothing
        threshold = cfg["threshold"]
        below = gn[judged] < threshold
        run = streaks(below, int(state.get("streak", 0)))
        clear = np.zeros(batch.n, dtype=bool)
        clear[judged[~below]] = True
        out = Outcome(clear)
        if not len(judged):
            return out
        steps = batch.step[judged]
        # where each step's run began: inside the batch, or before it (the state's "since")
        begin = np.arange(len(judged)) - run + 1
        since = [(int(steps[b]) if b >= 0 else state.get("since")) if r else None
                 for b, r in zip(begin.tolist(), run.tolist())]
        for k in np.flatnonzero(below & (run >= cfg["steps"])).tolist():
            g = float(gn[judged[k]])
            n = int(run[k])
            out.hits[int(judged[k])] = Hit({"grad_norm": g, "steps_below": n, "since_step": since[k],
                                            "threshold": threshold},
                                           f"Grad norm {fmt(g)} < {threshold:g} for {n} steps")
        state["streak"] = int(run[-1])
        if run[-1]:
            state["since"] = since[-1]
        else:
            state.pop("since", None)
        return out


@register
class DeadParams(BatchRule):
    id, name, severity, checklist = "B5", "dead_params", "warning", "8.B"
    family = "B"
    fires_when = "a trainable parameter has had no or zero gradient for {steps} steps"
    diagnosis = "Some trainable parameters receive no gradient: a branch is detached or unused."
    actions = {
        "detach": "Look for a manual .detach() on the path to those parameters.",
        "graph": "Look for in-place operations that break the graph, or modules that are built but never called in "
                 "forward().",
    }
    params = {"steps": Int(50), "max_names": Int(5)}
    needs = ("layers.grad_norm",)

    def evaluate(self, batch, state, cfg):
        # looked at every steps/10 steps (enough to time a 50-step silence), on steps not skipped
        out = Outcome.quiet(batch.n)
        every, steps_needed = max(1, int(cfg["steps"]) // 10), int(cfg["steps"])
        carriers = np.asarray(batch.carriers("grad_norm"), dtype=np.int64)
        carriers = carriers[~batch.true("overflow")[carriers]]
        at = batch.step[carriers]
        last = state.get("last", -10**12)
        zero_since = None
        picks = []
        j = int(np.searchsorted(at, last + every, "left"))
        while j < len(at):                   # the steps looked at: each the first at least `every` after the last
            picks.append(int(carriers[j]))
            j = int(np.searchsorted(at, at[j] + every, "left"))
        for i in picks:
            step = int(batch.step[i])
            last = step
            if zero_since is None:
                zero_since = dict(state.get("zero_since") or {})
            st = batch.steps[i]
            if layer_array(st, "grad_norm").min() > 0:      # every parameter has a gradient (a NaN fails this)
                zero_since.clear()
                out.clear[i] = True
                continue
            # None (no .grad) and 0.0 are falsy, NaN is not
            zero = {str(k) for k, v in enumerate(layer_list(st, "grad_norm")) if not v}
            for key in [k for k in zero_since if k not in zero]:
                del zero_since[key]
            for key in zero:
                zero_since.setdefault(key, step)
            dead = sorted(int(k) for k, s0 in zero_since.items() if step - s0 >= steps_needed)
            if not dead:
                out.clear[i] = True
                continue
            names = [name_of(batch.ctx.param_names, k) for k in dead]
            shown = ", ".join(names[: int(cfg["max_names"])]) + (" …" if len(names) > cfg["max_names"] else "")
            out.hits[i] = Hit({"params": names[:50], "count": len(dead), "steps": steps_needed},
                              f"{len(dead)} trainable parameter(s) without gradient for >= {steps_needed} steps: "
                              f"{shown}")
        if zero_since is not None:
            state["last"] = last
            state["zero_since"] = zero_since
        return out


@register
class GradUnderflow(BatchRule):
    id, name, severity, checklist = "B6", "grad_underflow", "warning", "2.1 / 8.B"
    family = "B"
    fires_when = ("a parameter's share of gradient elements that are exactly zero reaches {share:.0%} where its own "
                  "median over its last {history} samples was below {baseline:.0%}")
    diagnosis = ("Gradients underflow to zero: fp16 flushes values below ~6e-8 to 0, so these weights stop "
                 "learning (training stalls rather than going NaN). (The catalogue's text for an fp16 run with a "
                 "GradScaler; a run without one is told what zeros mean in its own precision.)")
    # a run without a GradScaler trains in bf16 or fp32, whose exponent range (~1e-38) does not flush a gradient:
    # its zeros have another cause, and the alert says so (issue 33: an fp32 run was told about fp16's 6e-8)
    diagnosis_unscaled = ("Most gradient elements of these parameters are exactly zero. This run has no GradScaler "
                          "(bf16 or fp32): their exponent range reaches ~1e-38, so this is not a number-format "
                          "underflow; the zeros come from the model: a dead branch, saturated activations (ReLU "
                          "units that never fire, a sigmoid / tanh at its flat end), a stray .detach(), or a loss "
                          "that masks these inputs out.")
    actions_unscaled = ["Check the named layers: a dead branch, saturated activations or a stray .detach() zero a "
                        "gradient; look at their activation statistics (E1) and their inputs.",
                        "If the layers are meant to be sparse (embeddings of unseen tokens, masked experts), raise "
                        "this rule's share for the project or turn it off."]
    actions = {
        "scale": "Keep the loss scaled: a GradScaler with a large init_scale (the default 65536), and check that the "
                 "scale is not collapsing (B3).",
        "bf16": "Switch autocast to bf16: fp32's exponent range, no underflow.",
        "layer": "Check the named layers: a dead branch, saturated activations or a stray .detach() also zero a "
                 "gradient.",
    }
    params = {"share": Float(0.5, at_most=1), "baseline": Float(0.1, at_most=1), "history": Int(20),
              "min_samples": Int(3)}
    needs = ("layers.grad_zero_fraction",)
    # State: the last `history` unflagged samples per parameter, "h" packed (samples x "w" parameters; NaN: no
    # value); a sample that is flagged stays out, so an underflow that persists keeps firing.

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("grad_zero_fraction")
        if not carriers:
            return out
        width = int(state.get("w", 0))
        hist = unpack_f8(state.get("h") or "").reshape(-1, width) if width else np.empty((0, 0))
        history, share, baseline = int(cfg["history"]), cfg["share"], cfg["baseline"]
        for i in carriers:
            x = layer_array(batch.steps[i], "grad_zero_fraction")
            if len(x) > hist.shape[1]:                    # more parameters than before: widen with "no value"
                hist = np.hstack([hist, np.full((hist.shape[0], len(x) - hist.shape[1]), np.nan)])
            x = np.concatenate([x, np.full(hist.shape[1] - len(x), np.nan)])
            counted = (~np.isnan(hist)).sum(axis=0)
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                # nanmedian warns for a parameter with no value yet: its median is NaN, as meant
                warnings.simplefilter("ignore", RuntimeWarning)
                med = np.nanmedian(hist, axis=0) if len(hist) else np.full(len(x), np.nan)
                flagged = (counted >= cfg["min_samples"]) & (med < baseline) & (x >= share)
            if flagged.any():
                worst = np.flatnonzero(flagged)[np.argsort(-x[flagged], kind="stable")][:5]
                names = batch.ctx.param_names
                top = [[name_of(names, int(k)), float(x[k]), float(med[k])] for k in worst.tolist()]
                scaled = batch.steps[i].get("loss_scale") is not None   # a GradScaler is on: fp16
                out.hits[i] = Hit({"params": top, "flagged": int(flagged.sum()), "share": float(x[worst[0]]),
                                   "median": float(med[worst[0]]), "grad_scaler": scaled},
                                  f"{int(flagged.sum())} parameter(s) with mostly zero gradients: {top[0][0]} "
                                  f"{top[0][1]:.0%} zero (its median {top[0][2]:.0%})",
                                  diagnosis=None if scaled else self.diagnosis_unscaled,
                                  actions=None if scaled else list(self.actions_unscaled))
            else:
                out.clear[i] = True
            hist = np.vstack([hist, np.where(flagged, np.nan, x)])[-history:]
        state["w"], state["h"] = int(hist.shape[1]), pack_f8(hist)
        return out


@register
class ClipSaturation(BatchRule):
    id, name, severity, checklist = "C2", "clip_saturation", "warning", "8.C"
    family = "C"
    fires_when = "gradient clipping active on > {fraction:.0%} of the last {window} steps"
    diagnosis = "Gradient clipping is active most of the time: the grad norm is usually above max_norm."
    actions = {
        "lower_lr": "Lower the learning rate together with max_norm.",
        "warmup": "If the grad norm is large only at the start of training, a warmup is the usual remedy.",
    }
    params = {"fraction": Float(0.5, zero_ok=True, at_most=1), "window": Int(200)}
    needs = ("clipped",)

    def evaluate(self, batch, state, cfg):
        window = int(cfg["window"])
        judged = np.flatnonzero(batch.measured("clipped") & ~batch.true("overflow"))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        new = batch.true("clipped")[judged]
        old = state.get("bits", "")
        bits = np.concatenate((np.frombuffer(old.encode("ascii"), dtype=np.uint8) == ord("1"), new))
        ones = np.concatenate(([0], np.cumsum(bits)))
        end = len(old) + 1 + np.arange(len(new))           # the window ends after each new bit
        start = np.maximum(end - window, 0)
        count = ones[end] - ones[start]
        full = end - start >= window
        hit = full & (count > cfg["fraction"] * window)
        out.clear[judged[full & ~hit]] = True
        gn = batch.values("grad_norm")
        for k in np.flatnonzero(hit).tolist():
            i, n = int(judged[k]), int(count[k])
            st = batch.steps[i]
            g = float(gn[i]) if batch.measured("grad_norm")[i] else None
            out.hits[i] = Hit({"clipped_steps": n, "window": window, "fraction": n / window, "grad_norm": enc(g),
                               "clip_max_norm": st.get("clip_max_norm")},
                              f"Clipping active on {n} of the last {window} steps ({n / window:.0%}); "
                              f"max_norm {st.get('clip_max_norm')}")
        state["bits"] = "".join("1" if b else "0" for b in bits[-window:].tolist())
        return out
