"""The loss: a plateau (B2), oscillation (C1), spikes (C3), late divergence after the LR decayed (D1)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from gradwatch.server.rules.catalog._shared import VANISHING_GRAD_NORM
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import (BatchRule, Outcome, chunks_of, mads, medians, pack_f8, streaks, unpack_f8,
                               window_slices)
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import MAD_TO_SIGMA, fmt, median, median_mad
from gradwatch.server.rules.windows import RobustWindow


@register
class LossPlateau(BatchRule):
    id, name, severity, checklist = "B2", "loss_plateau", "warning", "8.B"
    family = "B"
    fires_when = ("loss median of the last quarter of {window} steps not {min_improvement:.0%} below the first "
                  "quarter's, while the grad norm is normal (and the loss has not yet fallen {converged_drop:.0%} "
                  "below its first level: a converged run is not stuck)")
    diagnosis = "The loss does not go down although gradients are normal."
    actions = {
        "raise_lr": "The learning rate may be too low: raise it.",
        "wiring": "Check the model's wiring: a layer without gradient (see B5) or a wrong output head.",
        "loss_config": "Check the loss function's configuration (targets, reduction, class weights).",
    }
    params = {"window": Int(500), "min_improvement": Float(0.01, zero_ok=True),
              "converged_drop": Float(0.5, zero_ok=True)}
    needs = ("loss",)
    CHUNKS = 20

    def evaluate(self, batch, state, cfg):
        loss, gn = batch.values("loss"), batch.values("grad_norm")
        judged = np.flatnonzero(np.isfinite(loss))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        # grad norm "normal": finite and not vanishing (the level B1 calls vanishing)
        with np.errstate(invalid="ignore"):
            bad = batch.measured("grad_norm")[judged] & ~(np.isfinite(gn[judged]) & (gn[judged] >= VANISHING_GRAD_NORM))
        xs = loss[judged].tolist()
        chunk_len = max(1, int(cfg["window"]) // self.CHUNKS)
        buf = list(state.get("buf") or ())
        chunks = state.get("chunks")
        first = state.get("first")
        gn_bad = bool(state.get("gn_bad"))
        rest = 0
        for chunk, pos, end in chunks_of(buf, xs, chunk_len):     # a chunk completes at each chunk_len-th value
            gn_bad = gn_bad or bool(bad[pos:end].any())
            chunks = list(chunks or ())
            chunks.append([median(chunk), gn_bad])
            gn_bad, rest = False, end
            if first is None:
                first = chunks[0][0]
            if len(chunks) > self.CHUNKS:
                del chunks[: len(chunks) - self.CHUNKS]
            if len(chunks) >= self.CHUNKS:
                i = int(judged[end - 1])
                hit = self._plateau(chunks, first, cfg)
                if hit is None:
                    out.clear[i] = True
                else:
                    out.hits[i] = hit
        gn_bad = gn_bad or bool(bad[rest:].any())
        state["buf"] = buf
        if chunks is not None:
            state["chunks"] = chunks
        if first is not None:
            state["first"] = first
        if gn_bad:
            state["gn_bad"] = True
        else:
            state.pop("gn_bad", None)
        return out

    def _plateau(self, chunks: list, first: float, cfg: dict) -> Optional[Hit]:
        # the first and the last quarter of the window, each as the median of its chunk medians
        quarter = self.CHUNKS // 4
        start, end = median(c[0] for c in chunks[:quarter]), median(c[0] for c in chunks[-quarter:])
        improvement = (start - end) / abs(start) if start else 0.0
        gn_normal = not any(bad for _, bad in chunks)
        converged = abs(end) < (1.0 - cfg["converged_drop"]) * abs(first)
        if improvement < cfg["min_improvement"] and gn_normal and not converged:
            ev = {"loss_median_start": start, "loss_median_end": end, "improvement": improvement,
                  "window": int(cfg["window"]), "first_loss_median": first}
            return Hit(ev, f"Loss median {fmt(end)} improved {improvement:.1%} over the last {int(cfg['window'])} "
                           f"steps (needs {cfg['min_improvement']:.0%}); grad norm is normal")
        return None


@register
class LossOscillation(BatchRule):
    id, name, severity, checklist = "C1", "loss_oscillation", "warning", "8.C"
    family = "C"
    fires_when = ("robust spread (MAD) of the loss over {window} steps > {spread_ratio:g}x its median, with no "
                  "downward trend, while the loss is still above {converged_fraction:.0%} of its starting level")
    diagnosis = "The loss oscillates without converging."
    actions = {
        "lower_lr": "Lower the learning rate 5-10x.",
        "batch_size": "Increase the batch size (or the gradient-accumulation steps).",
        "schedule": "Use a gentler LR schedule (cosine decay, or a slower step decay).",
    }
    params = {"window": Int(200), "spread_ratio": Float(0.5), "min_history": Int(100, zero_ok=True),
              "converged_fraction": Float(0.2, zero_ok=True)}
    needs = ("loss",)
    EVERY = 10          # judged every 10th value
    START = 20          # the run's starting level: the median of its first 20 values

    def evaluate(self, batch, state, cfg):
        loss = batch.values("loss")
        judged = np.flatnonzero(np.isfinite(loss))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        size = int(cfg["window"])
        stored = unpack_f8(state.get("loss"))[-size:] if size > 0 else np.empty(0)
        xs = loss[judged]
        n0, nv, m = int(state.get("n", 0)), len(stored), len(xs)
        start0 = list(state.get("start") or ())
        starts = start0 + xs[: max(0, self.START - n0)].tolist()
        arr = np.concatenate((stored, xs))
        k = np.arange(m)
        lens = np.minimum(nv + k + 1, size)
        check = np.flatnonzero(((n0 + k + 1) % self.EVERY == 0) & (lens >= cfg["min_history"]))
        if len(check):
            # spread = MAD / |median| <= 1.4826 (max - min) / min for positive values: no window the checks
            # look at can oscillate when the values they cover lie closer together than that
            seen = arr[max(0, nv + int(check[0]) + 1 - size): nv + int(check[-1]) + 1]
            low = float(seen.min())
            if low > 0 and MAD_TO_SIGMA * (float(seen.max()) - low) / low <= cfg["spread_ratio"]:
                out.clear[judged[check]] = True
                check = check[:0]
        if len(check):
            hi = nv + check + 1
            lo = np.maximum(hi - size, 0)
            med, mad, first, last = (np.full(len(check), np.nan) for _ in range(4))
            for rows, w in window_slices(arr, lo, hi):
                n = w.shape[1]
                third = n // 3
                if third == 0:        # fewer than 3 values: the thirds as Python slices give them
                    for r in np.arange(len(check))[rows]:
                        vals = arr[lo[r]:hi[r]].tolist()
                        med[r], mad[r] = median_mad(vals)
                        first[r], last[r] = median(vals[:0]), median(vals)
                    continue
                med[rows] = mw = medians(w)
                mad[rows] = mads(w, mw)
                first[rows] = medians(w[:, :third])
                last[rows] = medians(w[:, n - third:])
            start_med = np.array([median(starts[: min(len(starts), len(start0) + max(0, min(int(c) + 1,
                                                                                     self.START - n0)))])
                                  for c in check])
            with np.errstate(divide="ignore", invalid="ignore"):
                spread = np.where(med != 0, mad / np.abs(med), np.inf)
                falling = last < first - 0.5 * mad
                converged = np.abs(med) < cfg["converged_fraction"] * np.abs(start_med)
            hit = (spread > cfg["spread_ratio"]) & ~falling & ~converged
            for r in range(len(check)):
                i = int(judged[check[r]])
                if not hit[r]:
                    out.clear[i] = True
                    continue
                ev = {"loss_median": float(med[r]), "loss_mad": float(mad[r]), "spread_ratio": float(spread[r]),
                      "first_third_median": float(first[r]), "last_third_median": float(last[r]),
                      "window": int(hi[r] - lo[r]), "start_loss_median": float(start_med[r])}
                out.hits[i] = Hit(ev, f"Loss oscillates: robust spread {ev['spread_ratio']:.2f}x its median "
                                      f"{fmt(ev['loss_median'])}, no downward trend ({fmt(ev['first_third_median'])} "
                                      f"-> {fmt(ev['last_third_median'])}), still at "
                                      f"{abs(ev['loss_median']) / abs(ev['start_loss_median']):.0%} of its start")
        state["loss"] = pack_f8(arr[-size:] if size > 0 else arr[:0])
        state["n"] = n0 + m
        state["start"] = starts
        return out


@register
class LossSpike(BatchRule):
    id, name, severity, checklist = "C3", "loss_spike", "warning", "8.C / 7.2"
    failure_noun = "the loss spikes"
    family = "C"
    rollback_advice = True   # a critical alert names the checkpoint to restart from
    fires_when = ("loss > median + {mad_factor:g}*MAD of the last {window} steps (MAD scaled to sigma); critical "
                  "after {critical_consecutive} consecutive spikes")
    diagnosis = "The loss spiked far above its recent level."
    actions = {
        "rollback": "A single spike: consider rolling back to the checkpoint before it and skipping that batch.",
        "lower_lr": "Repeated spikes: lower the learning rate and check the data near those steps.",
    }
    params = {"mad_factor": Float(6.0), "window": Int(200), "min_history": Int(20, zero_ok=True),
              "critical_consecutive": Int(5), "clear_steps": Int(10)}
    needs = ("loss",)
    REFRESH = 8

    def evaluate(self, batch, state, cfg):
        loss = batch.values("loss")
        arrivals = np.flatnonzero(np.isfinite(loss))
        factor = cfg["mad_factor"]

        def limit(med, mad):
            # the MAD floored at 1% of the median: a flat loss does not turn every wobble into a spike
            return med + factor * np.maximum(np.maximum(mad, 0.01 * np.abs(med)), 1e-12)

        win = RobustWindow(state, "loss", int(cfg["window"]), refresh=self.REFRESH, min_len=cfg["min_history"],
                           want_mad=True)
        xs = loss[arrivals]
        s = win.screen(xs, np.ones(len(xs), dtype=bool), lambda x, med, mad: x > limit(med, mad),
                       monotone=True)
        win.save()
        run = streaks(s.flagged, int(state.get("consecutive", 0)))
        skipped = batch.true("overflow")
        clear = np.zeros(batch.n, dtype=bool)
        clear[arrivals[~s.flagged]] = True
        out = Outcome(clear)
        for k in np.flatnonzero(s.flagged).tolist():
            i, x, med = int(arrivals[k]), float(xs[k]), float(s.med[k])
            mad = max(float(s.mad[k]), 0.01 * abs(med), 1e-12)
            lim = med + factor * mad
            n = int(run[k])
            ev = {"loss": x, "median": med, "mad": mad, "limit": lim, "consecutive": n, "z": (x - med) / mad}
            step = batch.steps[i]["step"]
            diagnosis = actions = None
            if skipped[i]:
                # the loss scaler skipped this step (its gradients overflowed): the weights never took the
                # update, so a rollback undoes nothing (issue 42)
                ev["skipped"] = True
                diagnosis = (f"The loss spiked far above its recent level at step {step}, and its gradients "
                             f"overflowed: the loss scaler skipped the step, so the weights never took that update.")
                actions = [f"Nothing to roll back for step {step}: the loss scaler skipped it. If spikes recur, look "
                           f"at the batches at those steps (outliers, broken labels).",
                           self.spec.action("lower_lr")[0]]
            out.hits[i] = Hit(ev, f"Loss spike {fmt(x)} at step {step} (median {fmt(med)}, "
                                  f"{(x - med) / mad:.0f} MADs above)" + (f"; {n} in a row" if n > 1 else "")
                                  + ("; the loss scaler skipped the step" if skipped[i] else ""),
                              severity="critical" if n >= cfg["critical_consecutive"] else None,
                              diagnosis=diagnosis, actions=actions)
        if len(arrivals):
            state["consecutive"] = int(run[-1])
        return out


@register
class LateDivergence(BatchRule):
    id, name, severity, checklist = "D1", "late_divergence", "warning", "8.D / 9.2"
    family = "D"
    fires_when = "loss rising over {window} steps after the LR fell below {lr_fraction:.0%} of its peak"
    diagnosis = "Training diverges late, after the learning rate decayed."
    actions = {
        "end_lr": "The end learning rate of the schedule is too low (cosine decay to ~0): keep the final LR around "
                  "base_lr / 10.",
        "schedule": "Or make the schedule less aggressive.",
    }
    params = {"window": Int(500), "lr_fraction": Float(0.1), "min_rise": Float(0.05, zero_ok=True)}
    needs = ("lr",)
    CHUNKS = 10

    def evaluate(self, batch, state, cfg):
        lr_all, loss = batch.values("lr"), batch.values("loss")
        judged = np.flatnonzero(np.isfinite(lr_all))
        out = Outcome.quiet(batch.n)
        if not len(judged):
            return out
        lr = lr_all[judged]
        peaks = np.maximum.accumulate(np.concatenate(([state.get("peak", 0.0)], lr)))[1:]
        high = (peaks <= 0) | (lr >= cfg["lr_fraction"] * peaks)
        out.clear[judged[high]] = True
        state["peak"] = float(peaks[-1])
        low = np.flatnonzero(~high & np.isfinite(loss[judged]))
        if not high.any() and not len(low):
            return out
        chunk_len = max(1, int(cfg["window"]) // self.CHUNKS)
        buf, chunks = state.get("buf"), state.get("chunks")
        # a high LR resets the history: segments of low-LR losses between the resets
        resets = np.cumsum(high)
        for seg in np.unique(resets[low]).tolist() if len(low) else []:
            members = low[resets[low] == seg]
            if seg > 0 and (chunks or buf):
                chunks, buf = [], []
            values = loss[judged[members]].tolist()
            buf = [] if buf is None else list(buf)
            for chunk, _, end in chunks_of(buf, values, chunk_len):
                chunks = list(chunks or ())
                chunks.append(median(chunk))
                if len(chunks) > self.CHUNKS:
                    del chunks[: len(chunks) - self.CHUNKS]
                if len(chunks) >= self.CHUNKS:
                    k = int(members[end - 1])
                    rising = self._rising(chunks, cfg)
                    if rising is None:
                        out.clear[judged[k]] = True
                    else:
                        x, peak, rise = float(lr[k]), float(peaks[k]), rising[1]
                        out.hits[int(judged[k])] = Hit(
                            {"lr": x, "peak_lr": peak, "loss_median_start": chunks[0], "loss_median_end": chunks[-1],
                             "rise": rise, "window": int(cfg["window"])},
                            f"Loss rose {rise:.0%} over {int(cfg['window'])} steps after the LR fell to "
                            f"{fmt(x)} ({x / peak:.1%} of its peak {fmt(peak)})")
        if high.any() and (not len(low) or resets[low[-1]] < resets[-1]) and (chunks or buf):
            chunks, buf = [], []      # a reset after the last low-LR loss
        if buf is not None:
            state["buf"] = buf
        if chunks is not None:
            state["chunks"] = chunks
        return out

    def _rising(self, chunks: list, cfg: dict) -> Optional[tuple[int, float]]:
        ups = sum(1 for a, b in zip(chunks, chunks[1:]) if b > a)
        rise = (chunks[-1] - chunks[0]) / abs(chunks[0]) if chunks[0] else 0.0
        if rise > cfg["min_rise"] and ups >= 0.7 * (self.CHUNKS - 1):
            return ups, rise
        return None
