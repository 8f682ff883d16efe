"""Early warning (issue 18): Adam's second moment going stale (H1), linear layers' outputs growing (H4).

Both judge per-layer arrays against each layer's *own* history (median / MAD over a window of its
past values), so a layer that always reads high is not flagged for being itself
(docs/early-warning-adam.md).

H1 reads ``layers.adam_g2_over_v`` (agent/collectors/adam.py): per parameter, this step's mean(g²) over
Adam's bias-corrected second moment from before the step. A healthy layer sits near 1; when a layer's
gradients jump past what v̂ remembers (β2 = 0.999 remembers ~1000 steps) the update m̂ / (√v̂ + ε) grows
with them, and the loss spikes "consistently 1-8 iterations after" (Wortsman et al. 2023,
arXiv:2304.13013).

H4 reads ``layers.linear_out_rms`` (agent/collectors/linear_outputs.py): the output RMS of each
``nn.Linear`` module, sampled. Rising sample after sample to several times its own median comes
before a divergence (the QKV / projection / FC2 output norms of arXiv:2410.16682).
"""
from __future__ import annotations

import base64
import math
import warnings
from typing import Optional

import numpy as np

from gradwatch.server.rules.batch import layer_array
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, name_of
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import MAD_TO_SIGMA, fmt


def _f32(x: np.ndarray) -> np.ndarray:
    """Values as the state stores them (float32), so a batch judges with what a later batch reads back."""
    return x.astype(np.float32).astype(np.float64)


def _save_history(state: dict, hist: np.ndarray) -> None:
    """(rows × layers) float32 in base64: a window of every layer's values stays small in the state."""
    state["w"] = int(hist.shape[1])
    state["h"] = base64.b64encode(np.ascontiguousarray(hist, dtype="<f4").tobytes()).decode("ascii")


def _load_history(state: dict, width: int) -> np.ndarray:
    """The stored history widened (NaN columns) or cut to ``width`` layers; empty when none is stored."""
    w, raw = state.get("w"), state.get("h")
    if not w or not raw:
        return np.empty((0, width))
    flat = np.frombuffer(base64.b64decode(raw), dtype="<f4").astype(np.float64)
    if len(flat) % w:
        return np.empty((0, width))
    return _fit(flat.reshape(-1, w), width)


def _fit(hist: np.ndarray, width: int) -> np.ndarray:
    if hist.shape[1] == width:
        return hist
    out = np.full((hist.shape[0], width), np.nan)
    k = min(width, hist.shape[1])
    out[:, :k] = hist[:, :k]
    return out


def _col_median_mad(hist: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``cols``: (finite count, median, MAD scaled to a standard deviation) over the rows."""
    w = hist[:, cols]
    count = np.isfinite(w).sum(axis=0)
    if not len(w):
        nan = np.full(len(cols), np.nan)
        return count, nan, nan
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)   # "All-NaN slice": a layer without history, not judged
        med = np.nanmedian(w, axis=0)
        mad = MAD_TO_SIGMA * np.nanmedian(np.abs(w - med), axis=0)
    return count, med, mad


@register
class AdamStale(BatchRule):
    id, name, severity, checklist = "H1", "adam_stale", "warning", "7.2"
    family = "H"
    fires_when = ("a parameter's mean(g²) / mean(v̂) (this step's squared gradient over Adam's second moment) is "
                  ">= {ratio:g} and, in log10, > {sigma:g} MADs above its own median over the last {window} steps "
                  "(after {min_history} steps of history)")
    diagnosis = ("Adam's second-moment estimate is out of date for these layers: their gradients jumped far past "
                 "what v̂ remembers, so this step's update m̂ / (√v̂ + ε) spikes; a loss spike typically follows "
                 "within ~1-8 steps (Wortsman et al. 2023). Check: did the LR just rise (warmup end, restart)? "
                 "did these layers' inputs or gradients change (a frozen layer unfrozen, a gradient-scaling trick "
                 "removed, new data)? is β2 long (0.999 / 0.9999) for this run?")
    actions = {
        "lower_lr": "Lower the learning rate, or warm up longer (and again after a change like this one).",
        "adam_eps_beta2": "Make Adam less sensitive to a stale v̂: a larger eps (e.g. 1e-6 instead of 1e-8) or a "
                          "lower beta2 (0.95 / 0.98 instead of 0.999), which forgets old gradients faster.",
        "clip": "Clip: gradient clipping (clip_grad_norm_ after unscale_), or update clipping as in AdaFactor / "
                "StableAdamW (the update divided by max(1, RMS(g²/v̂)^0.5)).",
    }
    params = {"ratio": Float(100.0), "sigma": Float(6.0), "window": Int(100), "min_history": Int(20)}
    needs = ("layers.adam_g2_over_v",)
    # MAD floor, in log10: a layer whose ratio barely moves (MAD ~ 0) still needs to be > 10^(6 * 0.05) = 2x
    # its median, on top of the absolute `ratio`
    MAD_FLOOR = 0.05
    # State: "h" the last `window` judged steps' log10 ratios (rows × "w" layers; NaN: not measured or flagged).

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("adam_g2_over_v")
        if not carriers:
            return out
        window, min_history = int(cfg["window"]), int(cfg["min_history"])
        floor, sigma = math.log10(cfg["ratio"]), float(cfg["sigma"])
        overflow = batch.true("overflow")
        gn = batch.values("grad_norm")
        gn_measured = batch.measured("grad_norm")
        hist: Optional[np.ndarray] = None
        for i in carriers:
            # a step the scaler skipped (or whose grads are not finite) is A2 / A5's: v̂ does not move
            if overflow[i] or (gn_measured[i] and not math.isfinite(gn[i])):
                continue
            r = layer_array(batch.steps[i], "adam_g2_over_v")
            with np.errstate(all="ignore"):
                x = _f32(np.where(np.isfinite(r) & (r > 0), np.log10(np.where(r > 0, r, 1.0)), np.nan))
            if hist is None:
                hist = _load_history(state, len(x))
            elif hist.shape[1] < len(x):
                hist = _fit(hist, len(x))
            if len(x) < hist.shape[1]:
                x = np.concatenate((x, np.full(hist.shape[1] - len(x), np.nan)))
            with np.errstate(invalid="ignore"):
                cand = np.flatnonzero(x >= floor)
            flagged = np.zeros(0, dtype=np.int64)
            if len(cand):
                count, med, mad = _col_median_mad(hist, cand)
                with np.errstate(invalid="ignore"):
                    bad = (count >= min_history) & (x[cand] > med + sigma * np.maximum(mad, self.MAD_FLOOR))
                flagged = cand[bad]
                if len(flagged):
                    out.hits[i] = self._hit(x, flagged, med[bad], batch.ctx.param_names, cfg)
            if i not in out.hits:
                out.clear[i] = True
            pushed = x.copy()
            pushed[flagged] = np.nan          # a spike does not raise its own baseline
            hist = np.vstack((hist, pushed[None, :]))[-window:]
        if hist is not None:
            _save_history(state, hist)
        return out

    def _hit(self, x: np.ndarray, flagged: np.ndarray, med: np.ndarray, names: list[str], cfg: dict) -> Hit:
        order = np.argsort(-x[flagged], kind="stable")
        top = flagged[order]
        layers = [[name_of(names, int(j)), float(10 ** x[j]), float(10 ** m)]
                  for j, m in zip(top[:10].tolist(), med[order][:10].tolist())]
        first, ratio, median = layers[0]
        more = f" (and {len(top) - 1} more)" if len(top) > 1 else ""
        return Hit({"params": [l[0] for l in layers], "count": int(len(top)), "g2_over_v": ratio,
                    "median_g2_over_v": median, "layers": layers, "threshold": cfg["ratio"],
                    "expect_loss_spike_within_steps": [1, 8]},
                   f"Adam's second moment is stale on {first}{more}: g² is {fmt(ratio)}x its v̂ (its median "
                   f"{fmt(median)}x); an update spike, and a loss spike within ~1-8 steps, tend to follow")


@register
class LinearOutputGrowth(BatchRule):
    id, name, severity, checklist = "H4", "linear_output_growth", "warning", "5.2"
    family = "H"
    fires_when = ("a Linear module's output RMS rose on each of its last {rising} samples, by >= {growth:g}x over "
                  "them, to > {factor:g}x its own median over the last {history} samples (after {min_samples} "
                  "samples), while the mean loss at those samples fell by less than {loss_drop:g} of its mean "
                  "at the {rising} samples before them and is >= (1 + {loss_rise:g}) x the lowest such mean so far")
    diagnosis = ("The outputs of these linear layers (QKV / attention projection / FC2 in a Transformer) grow "
                 "sample after sample: the signal is being amplified, which comes before a divergence "
                 "(arXiv:2410.16682). Check: is the learning rate too high for this model (or still rising)? "
                 "is the init scale of these layers right (e.g. the residual projections scaled by 1/sqrt(2·layers))? "
                 "is there weight decay?")
    actions = {
        "lower_lr": "Lower the learning rate (or cap the warmup); the growth usually stops with it.",
        "check_init": "Check these layers' init (std ~0.02, residual projections scaled down with depth) and add "
                      "QK-layernorm / weight decay if they keep growing.",
    }
    # growth 2.5 and loss_drop 0.05 (2026-12-02, measured on the scenarios' runs, docs/early-warning-adam.md):
    # a model that is learning grows its layers' outputs too (the qk-layernorm control's o_proj 0.24 -> 1.13
    # in four samples while its loss fell 4.0 -> 2.3; its FC2 1.7 -> 3.4 later, at a slowing rate), while the
    # growth before a divergence compounds (lr_warmup_never_capped's FC2 0.84 -> 4.0, 1.5-2x a sample) with a
    # loss that has stopped falling (0.32 -> 0.86).
    # loss_rise 0.2 (issue 33): a healthy model's outputs also grow while its loss sits on a plateau — the copy
    # task's unigram plateau before the attention circuit forms, the LR still warming up (the hand-written
    # decoder's qk-layernorm control in tests/scenarios/early_heldout.py: output RMS x4.2 over four samples at step
    # 100, its loss flat at ~3.0); before a divergence the loss has already left its best (lr_warmup_never_capped
    # at step 140: the mean of the last four sampled losses 0.61 against a best four-sample mean of 0.35).
    params = {"factor": Float(3.0), "growth": Float(2.5), "rising": Int(4), "history": Int(30),
              "min_samples": Int(8), "loss_drop": Float(0.05), "loss_rise": Float(0.2, zero_ok=True)}
    needs = ("layers.linear_out_rms",)
    # State: "h" the last `history` samples' RMS values (rows × "w" modules; NaN: not measured there);
    # "l" the loss at the last 2 × `rising` samples' steps (None: not finite or not sent), for the loss gate.

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        carriers = batch.carriers("linear_out_rms")
        if not carriers:
            return out
        size = max(int(cfg["history"]), int(cfg["rising"]) + 1)
        rising, growth, factor, min_samples = int(cfg["rising"]), cfg["growth"], cfg["factor"], int(cfg["min_samples"])
        hist: Optional[np.ndarray] = None
        losses = list(state.get("l", []))
        best = state.get("lb")           # the lowest mean loss of `rising` consecutive samples so far
        loss = batch.values("loss")
        for i in carriers:
            v = layer_array(batch.steps[i], "linear_out_rms")
            with np.errstate(invalid="ignore"):
                v = _f32(np.where(np.isfinite(v) & (v > 0), v, np.nan))
            if hist is None:
                hist = _load_history(state, len(v))
            elif hist.shape[1] < len(v):
                hist = _fit(hist, len(v))
            if len(v) < hist.shape[1]:
                v = np.concatenate((v, np.full(hist.shape[1] - len(v), np.nan)))
            measured = np.flatnonzero(np.isfinite(v))
            if not len(measured):
                continue
            sample_loss = float(loss[i]) if math.isfinite(loss[i]) else None
            hit = None
            if len(hist) >= rising:
                recent = np.vstack((hist[-rising:, measured], v[None, measured]))   # rising + 1 samples
                with np.errstate(invalid="ignore", divide="ignore"):
                    up = (np.diff(recent, axis=0) > 0).all(axis=0) & (recent[-1] >= growth * recent[0])
                cand = measured[up]
                if len(cand):
                    count, med, _ = _col_median_mad(hist, cand)
                    with np.errstate(invalid="ignore"):
                        bad = (count >= min_samples) & (v[cand] > factor * med)
                    recent = losses + [sample_loss]
                    if bad.any() and not self._learning(recent, rising, cfg["loss_drop"]) and \
                            self._left_its_best(recent, best, rising, cfg["loss_rise"]):
                        hit = self._hit(v, cand[bad], med[bad], hist[-rising, cand[bad]], batch.ctx.module_names,
                                        rising)
            if hit is None:
                out.clear[i] = True
            else:
                out.hits[i] = hit
            hist = np.vstack((hist, v[None, :]))[-size:]
            losses = (losses + [sample_loss])[-2 * rising:]
            window = losses[-rising:]
            if len(window) == rising and None not in window:
                mean = sum(window) / rising
                best = mean if best is None else min(best, mean)
        if hist is not None:
            _save_history(state, hist)
            state["l"] = losses
            if best is not None:
                state["lb"] = best
        return out

    @staticmethod
    def _left_its_best(losses: list, best, rising: int, rise: float) -> bool:
        """The mean loss of the last ``rising`` samples is at least (1 + ``rise``) times the lowest such mean so
        far (``best``, this window included): the loss has begun to leave what the model had reached. Unknown
        (no loss, too short a history): True, the growth alone decides.

        >>> LinearOutputGrowth._left_its_best([0.5, 0.6, 0.7, 0.6], 0.4, 4, 0.2)
        True
        >>> LinearOutputGrowth._left_its_best([3.0, 3.1, 2.9, 3.0], 2.95, 4, 0.2)
        False
        """
        recent = losses[-rising:]
        if best is None or len(recent) < rising or None in recent or best <= 0:
            return True
        mean = sum(recent) / rising
        return mean >= (1.0 + rise) * min(best, mean)

    @staticmethod
    def _learning(losses: list, rising: int, drop: float) -> bool:
        """The loss at the last ``rising`` samples fell by more than ``drop`` of its mean at the ``rising``
        samples before them: the model is learning, and its outputs growing is its features forming.
        Unknown (no loss, or too short a history): not learning, the growth alone decides.

        The loss of the sampled steps only: the engine hands a rule only the batches that carry what it
        needs, so the steps between samples are not all seen (and a verdict must not depend on the cuts)."""
        recent, before = losses[-rising:], losses[-2 * rising:-rising]
        if len(before) < rising:
            return False
        recent, before = [x for x in recent if x is not None], [x for x in before if x is not None]
        if not recent or not before:
            return False
        b = sum(before) / len(before)
        return b > 0 and sum(recent) / len(recent) < (1.0 - drop) * b

    @staticmethod
    def _hit(v, flagged, med, start, names, rising) -> Hit:
        ratio = v[flagged] / med
        order = np.argsort(-ratio, kind="stable")
        layers = [[name_of(names, int(flagged[k])), float(v[flagged[k]]), float(med[k]), float(start[k])]
                  for k in order[:10].tolist()]
        first, value, median, began = layers[0]
        more = f" (and {len(flagged) - 1} more)" if len(flagged) > 1 else ""
        return Hit({"modules": [l[0] for l in layers], "count": int(len(flagged)), "linear_out_rms": value,
                    "median": median, "rms_samples_ago": began, "samples": rising, "layers": layers},
                   f"Output RMS of {first}{more} rose {rising} samples in a row, {fmt(began)} -> {fmt(value)}, "
                   f"{value / median:.1f}x its median {fmt(median)}: a divergence may follow")
