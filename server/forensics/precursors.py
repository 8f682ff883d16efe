"""Precursor timeline: what left its normal band first, before a critical alert.

When a critical alert is raised (A1, A2, B3, C3 escalated, F1, …: any alert of severity ``critical``
that an ingest batch notifies), ``attach_precursors`` reads a bounded slice of the run's stored history
*before the alert's first step* (it is all there: the batch's own steps are written before the rules
run) and records, in the alert's evidence and its diagnosis, which per-step signals and which layers'
statistics had left their normal band, from which step, and how many steps before the failure::

    evidence.precursors = [
      {"signal": "layers.grad_norm", "layer": "blocks.3.attn.out_proj.weight", "from_step": 2304,
       "lead_steps": 96, "ratio": 8.1, "peak_step": 2399, "baseline": 0.41, "z": 31.0},
      {"signal": "loss_scale", "event": "halved", "step": 2350, "lead_steps": 50, "from": 65536.0, "to": 32768.0},
    ]
    evidence.precursor_summary = "blocks.3.attn.out_proj.weight grad norm 8.1× its median from step 2,304, "
                                 "96 steps before the NaN loss; loss scale halved at 2,350"

The method (decided here; docs/incidents.md explains it with an example):

- Windows are counted back from the failure step F. The *search window* is the ``search_steps``
  (512) steps before F; the *baseline* is the ``baseline_steps`` (512) steps before the search window.
  A statistic sampled every k > 32 steps (activations, weight norms: every 100 by default) gets both
  windows widened to 16·k steps, capped at ``max_window_steps``, so that it has enough samples.
- Normal band: the baseline's median and MAD (scaled to σ), on the log scale for magnitudes (grad
  norms, activations, update ratios, LR: a ratio is what matters), linear for the loss; σ is floored
  (5 % on the log scale, 1 % of |median| linear) so that a constant signal (a flat LR) is not "out of
  band" at its first wobble. A fixed baseline before the search window, not a trailing one: a signal
  that grows smoothly drags a trailing median along with it and is never out of its band.
- Out of band (high): robust z > ``z_high`` (6) *and* the value at least ``min_ratio`` × its median
  (3×; 2× for the LR, 1.5× for weight norms). Only upward excursions count: a falling loss or grad norm
  is training, not a precursor. Non-finite values are left out (they are the failure, or skipped fp16
  steps, which the loss-scale events below cover).
- A precursor is an excursion still open at the failure: the last high sample is among the last
  ``open_samples`` (3) samples before F. Its onset (``from_step``) is found by hysteresis: walking
  back from there, the excursion starts after the last ``settle_samples`` (3) consecutive samples
  back inside z ≤ ``z_low`` (2) or, on the log scale, within √min_ratio of the median — the step where the signal began to rise, not where it crossed the
  high threshold (a growth over 96 steps crosses 3× only half-way); a ramp's line is followed back to
  the median. An excursion must hold at least 2 high samples (1 if it is far out, z ≥ 2·z_high, or
  for a signal with fewer than 8 samples in the search window) and spend at least 60 % of its
  samples out of the band: one noisy sample is no precursor.
- Loss-scale halvings in the search window are listed as events (context, not a band excursion: a
  healthy fp16 run halves now and then). With no excursion the summary says none was found, and
  ``evidence.precursors`` holds only those events, if any.

Cost: one indexed range read of ``steps`` and one of ``layer_stats`` per watched statistic, at most
``baseline_steps + search_steps`` rows each (or 32 samples of a sampled statistic), decoded with
numpy; computed once per critical alert (again only if a later rank takes the alert's lead with an
earlier step). ``bench/precursors.py`` measures it on a large run (docs/incidents.md, "Cost").
"""
from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from gradwatch.agent.signals import layer_stat
from gradwatch.server.storage.models import Alert, LayerStat, Run, Step
from gradwatch.server.wire.numbers import null_mask
from gradwatch.server.queries._shared import _fetch_blobs
from gradwatch.server.rules import registry as rule_registry
from gradwatch.server.rules.stats import MAD_TO_SIGMA, enc

log = logging.getLogger("gradwatch.forensics")

# Where the sentence starts inside an alert's diagnosis: a recomputation replaces what follows it.
DIAGNOSIS_MARK = "\n\nWhat deviated first: "


@dataclass(frozen=True)
class Watch:
    """One statistic the search looks at: ``signal`` is a step signal or ``layers.<stat>``."""
    signal: str
    label: str
    log_scale: bool = True        # compare ratios (positive magnitudes); False: the loss, linear
    min_ratio: float = 3.0        # also required of a log-scale excursion, × the baseline median


# The statistics that move before a failure. Throughput, memory, counters and booleans are left out:
# they tell how fast, not whether the numbers are going wrong.
STEP_WATCHES: tuple[Watch, ...] = (
    Watch("grad_norm", "grad norm"),
    Watch("loss", "loss", log_scale=False, min_ratio=1.0),
    Watch("lr", "learning rate", min_ratio=2.0),
    Watch("ema_divergence", "EMA divergence"),
)
LAYER_WATCHES: tuple[Watch, ...] = (
    Watch("layers.grad_norm", "grad norm"),
    Watch("layers.update_ratio", "update ratio"),
    Watch("layers.act_absmax", "activation max |x|"),
    Watch("layers.act_std", "activation std"),
    Watch("layers.weight_norm", "weight norm", min_ratio=1.5),
)


# Excursions starting at the same step are listed cause first: the LR (a knob someone turned), then the
# gradients, then what the gradients move (updates, activations, weights), then the loss.
_TIE_ORDER = {name: i for i, name in enumerate((
    "lr", "layers.grad_norm", "grad_norm", "layers.update_ratio", "layers.act_absmax", "layers.act_std",
    "layers.weight_norm", "ema_divergence", "loss"))}


@dataclass(frozen=True)
class PrecursorConfig:
    search_steps: int = 512
    baseline_steps: int = 512
    max_window_steps: int = 4096      # a sampled statistic's windows are never wider than this
    z_high: float = 6.0
    z_low: float = 2.0
    open_samples: int = 3
    settle_samples: int = 3
    min_out_fraction: float = 0.6
    min_baseline_samples: int = 8
    max_items: int = 10               # excursions kept in the evidence (the earliest first)
    max_halvings: int = 5


DEFAULT_CONFIG = PrecursorConfig()


@dataclass
class Excursion:
    signal: str
    label: str
    layer: Optional[str]
    from_step: int
    peak_step: int
    last_step: int
    ratio: float          # peak value / baseline median (log scale and a positive median; else None)
    z: float              # peak robust z
    baseline: float       # the baseline median, in the signal's units
    peak: float
    open_start: bool      # the excursion reaches back to the search window's start: the lead is at least this

    def item(self, failure_step: int) -> dict[str, Any]:
        out = {"signal": self.signal, "from_step": self.from_step, "lead_steps": failure_step - self.from_step,
               "ratio": _round(self.ratio), "z": _round(self.z), "baseline": _round(self.baseline, 4),
               "peak": _round(self.peak, 4), "peak_step": self.peak_step}
        if self.layer is not None:
            out["layer"] = self.layer
        if self.open_start:
            out["open_start"] = True
        return out


def _round(x: Optional[float], digits: int = 2) -> Optional[float]:
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits + 2}g}") if abs(x) < 1 else round(x, digits)


# --------------------------------------------------------------------------- the band test (pure)

def excursion(steps: np.ndarray, values: np.ndarray, *, split: int, watch: Watch,
              cfg: PrecursorConfig = DEFAULT_CONFIG) -> Optional[tuple[int, int, int, float, float, float, float, bool]]:
    """The open excursion of one series before the failure, or None.

    ``steps``/``values``: the series in step order (all before the failure); samples before ``split`` are
    the baseline, the others the search window. Returns (from_step, peak_step, last_step, ratio, z,
    baseline, peak, open_start).
    """
    ok = np.isfinite(values)
    if watch.log_scale:
        ok &= values > 0
    steps, values = steps[ok], values[ok]
    x = np.log(values) if watch.log_scale else values
    base = steps < split
    xb, xa, sa, va = x[base], x[~base], steps[~base], values[~base]
    if len(xb) < cfg.min_baseline_samples or len(xa) < 1:
        return None
    med = float(np.median(xb))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(xb - med)))
    sigma = max(sigma, 0.05) if watch.log_scale else max(sigma, 0.01 * abs(med), 1e-12)
    z = (xa - med) / sigma
    if watch.log_scale:
        ratio = np.exp(xa - med)
        high = (z > cfg.z_high) & (ratio >= watch.min_ratio)
    else:
        ratio = xa / med if med > 0 else np.full(len(xa), np.nan)
        high = z > cfg.z_high
    if not high.any():
        return None
    n = len(xa)
    last_high = int(np.flatnonzero(high)[-1])
    if last_high < n - cfg.open_samples:
        return None                       # it came back into its band before the failure
    inside = z <= cfg.z_low
    if watch.log_scale:
        # back in the band also when barely above the median (a run's activations drift up 1.5× over
        # training while its baseline's MAD is small: z 4 is drift, not the start of the blow-up); the
        # hysteresis of the ratio, as of z: high at min_ratio, settled at its square root
        inside |= ratio <= math.sqrt(watch.min_ratio)
    onset, run, open_start = None, 0, False
    for i in range(last_high, -1, -1):
        if inside[i]:
            run += 1
            if run >= cfg.settle_samples:
                onset = i + run
                break
        else:
            run = 0
    if onset is None:
        outside = np.flatnonzero(~inside[:last_high + 1])
        onset, open_start = int(outside[0]), True
    seg = slice(onset, last_high + 1)
    # one high sample is noise unless it is far out (z ≥ 2·z_high: an LR ×100 the step before, a 50×
    # grad norm); a series with few samples in the window (a sampled statistic) has no second one
    need = 2 if n >= 8 and float(z[seg].max()) < 2 * cfg.z_high else 1
    if int(high[seg].sum()) < need or float((~inside[seg]).mean()) < cfg.min_out_fraction:
        return None
    start_step = int(sa[onset])
    first_high = onset + int(np.argmax(high[seg]))
    if not open_start and first_high - onset >= 3:
        # A ramp: the hysteresis onset is late by z_low·σ / slope (a noisy layer grows for a while before
        # it leaves z ≤ 2). The ramp's least-squares line, back to where it meets the median, is where
        # the growth began; never later than the hysteresis onset nor before the search window.
        t = sa[onset:last_high + 1].astype(np.float64)
        slope, icept = np.polyfit(t, xa[onset:last_high + 1], 1)
        if slope > 0:
            met = (med - icept) / slope
            start_step = int(max(sa[0], min(start_step, math.ceil(met))))
    peak = onset + int(np.argmax(z[seg]))
    baseline = float(math.exp(med)) if watch.log_scale else med
    r = float(ratio[peak]) if math.isfinite(float(ratio[peak])) else None
    return (start_step, int(sa[peak]), int(sa[last_high]), r, float(z[peak]), baseline, float(va[peak]),
            open_start)


def halvings(steps: np.ndarray, scale: np.ndarray, *, since: int) -> list[tuple[int, float, float]]:
    """(step, from, to) where the loss scale fell, at or after ``since``: the step whose scale is lower
    than the previous measured one (the scaler halved after the step before it overflowed)."""
    ok = np.isfinite(scale) & (scale > 0)
    steps, scale = steps[ok], scale[ok]
    if len(scale) < 2:
        return []
    fell = np.flatnonzero(scale[1:] < scale[:-1]) + 1
    return [(int(steps[i]), float(scale[i - 1]), float(scale[i])) for i in fell if steps[i] >= since]


# --------------------------------------------------------------------------- reads (bounded)

def _step_rows(session: Session, run_id: int, rank: int, lo: int, hi: int):
    cols = [getattr(Step, w.signal) for w in STEP_WATCHES] + [Step.loss_scale]
    rows = session.execute(select(Step.step, *cols).where(
        Step.run_id == run_id, Step.rank == rank, Step.step >= lo, Step.step <= hi).order_by(Step.step)).all()
    steps = np.array([r[0] for r in rows], dtype=np.int64)
    # NULL (not measured, or NaN on SQLite) -> NaN: both are left out of the band test
    values = np.array([[np.nan if v is None else float(v) for v in r[1:]] for r in rows], dtype=np.float64)
    return steps, values.reshape(len(rows), len(cols))


def _sample_interval(session: Session, run_id: int, rank: int, stat: str, before: int) -> Optional[int]:
    """The stat's sampling interval near the failure: the median gap of its last few stored steps."""
    recent = session.scalars(select(LayerStat.step).where(
        LayerStat.run_id == run_id, LayerStat.stat == stat, LayerStat.rank == rank, LayerStat.step < before)
        .order_by(LayerStat.step.desc()).limit(9)).all()
    if len(recent) < 2:
        return None
    return max(1, int(np.median(-np.diff(np.array(recent)))))


def _layer_rows(session: Session, run_id: int, rank: int, stat: str, lo: int, hi: int):
    # queries' (int, bytes) reader: binary results on PostgreSQL (bytea as text is hex, twice the bytes
    # and a parse: 1,024 rows of 1,000 layers took 0.5 s that way)
    rows = _fetch_blobs(session, select(LayerStat.step, LayerStat.values).where(
        LayerStat.run_id == run_id, LayerStat.stat == stat, LayerStat.rank == rank,
        LayerStat.step >= lo, LayerStat.step <= hi).order_by(LayerStat.step))
    if not rows:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))
    width = max(len(bytes(b)) // 4 for _, b in rows)
    mat = np.full((len(rows), width), np.nan, dtype=np.float64)
    for i, (_, blob) in enumerate(rows):
        arr = np.frombuffer(bytes(blob), dtype="<f4")
        vals = arr.astype(np.float64)
        vals[null_mask(arr)] = np.nan
        mat[i, :len(vals)] = vals
    return np.array([r[0] for r in rows], dtype=np.int64), mat


def _layer_names(run: Run, stat: str) -> list[str]:
    decl = layer_stat(stat)
    over = decl.over if decl is not None else "params"
    return list((run.module_names if over == "modules" else run.bn_names if over == "bn" else run.param_names)
                or [])


# --------------------------------------------------------------------------- the search

@dataclass
class PrecursorReport:
    failure_step: int
    rank: int
    excursions: list[Excursion]
    halvings: list[tuple[int, float, float]]
    searched_from: int
    series: int               # how many series (signals × layers) were tested

    def items(self, cfg: PrecursorConfig = DEFAULT_CONFIG) -> list[dict[str, Any]]:
        out = [e.item(self.failure_step) for e in self.excursions[:cfg.max_items]]
        out += [{"signal": "loss_scale", "event": "halved", "step": s, "lead_steps": self.failure_step - s,
                 "from": a, "to": b} for s, a, b in self.halvings[-cfg.max_halvings:]]
        return out


def _candidates(steps: np.ndarray, mat: np.ndarray, *, split: int, watch: Watch, cfg: PrecursorConfig) -> list[int]:
    """The layers worth the exact test: any sample of the search window high against the layer's baseline,
    computed for every layer at once (a run has thousands of parameters; a healthy one has almost none
    out of band, so ``excursion`` then runs on a handful of columns instead of every one)."""
    x = np.where(np.isfinite(mat) & (mat > 0), mat, np.nan) if watch.log_scale else np.where(np.isfinite(mat), mat, np.nan)
    if watch.log_scale:
        x = np.log(x)
    base, search = x[steps < split], x[steps >= split]
    if len(base) < cfg.min_baseline_samples or not len(search):
        return []
    # np.median (a partition) when every baseline value is there, the usual case; nanmedian goes through
    # masked arrays and costs ~10x (240 ms on 1,024 steps × 1,000 layers)
    median = np.median if not np.isnan(base).any() else np.nanmedian
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)        # all-NaN columns: not measured, no candidate
        med = median(base, axis=0)
        sigma = MAD_TO_SIGMA * median(np.abs(base - med), axis=0)
    floor = 0.05 if watch.log_scale else np.maximum(0.01 * np.abs(med), 1e-12)
    sigma = np.maximum(np.nan_to_num(sigma, nan=0.0), floor)
    z = (search - med) / sigma
    high = z > cfg.z_high
    if watch.log_scale:
        high &= (search - med) >= math.log(watch.min_ratio)
    return np.flatnonzero(np.nan_to_num(high, nan=False).any(axis=0)).tolist()


def _split(steps: np.ndarray, split: int, failure_step: int) -> int:
    """Where the baseline ends. A run younger than both windows (a NaN at step 150) is cut in half: the
    first half of its history is the baseline, the second the search window."""
    if not len(steps):
        return split
    return max(split, (int(steps[0]) + failure_step + 1) // 2)


def find_precursors(session: Session, *, run: Run, rank: int, failure_step: int,
                    cfg: PrecursorConfig = DEFAULT_CONFIG) -> PrecursorReport:
    """Every open excursion before ``failure_step`` on ``rank``, the earliest first (ties: cause first, then
    the larger z)."""
    split = failure_step - cfg.search_steps
    lo = split - cfg.baseline_steps
    found: list[Excursion] = []
    series = 0
    steps, values = _step_rows(session, run.id, rank, max(0, lo), failure_step - 1)
    step_split = _split(steps, split, failure_step)
    for j, watch in enumerate(STEP_WATCHES):
        if len(steps) == 0:
            break
        series += 1
        got = excursion(steps, values[:, j], split=step_split, watch=watch, cfg=cfg)
        if got is not None:
            found.append(Excursion(watch.signal, watch.label, None, *got))
    scale_halvings = halvings(steps, values[:, -1], since=step_split) if len(steps) else []
    for watch in LAYER_WATCHES:
        stat = watch.signal.split(".", 1)[1]
        every = _sample_interval(session, run.id, rank, stat, failure_step)
        if every is None:
            continue
        s_split, s_lo = split, lo
        if every > 32:   # a sampled statistic: windows of 16 samples each, capped
            width = min(16 * every, cfg.max_window_steps)
            s_split, s_lo = failure_step - width, failure_step - 2 * width
        lsteps, mat = _layer_rows(session, run.id, rank, stat, max(0, s_lo), failure_step - 1)
        if not len(lsteps):
            continue
        names = _layer_names(run, stat)
        s_split = _split(lsteps, s_split, failure_step)
        series += mat.shape[1]
        for k in _candidates(lsteps, mat, split=s_split, watch=watch, cfg=cfg):
            got = excursion(lsteps, mat[:, k], split=s_split, watch=watch, cfg=cfg)
            if got is not None:
                found.append(Excursion(watch.signal, watch.label, names[k] if k < len(names) else f"#{k}", *got))
    found.sort(key=lambda e: (e.from_step, _TIE_ORDER.get(e.signal, len(_TIE_ORDER)), -e.z))
    return PrecursorReport(failure_step=failure_step, rank=rank, excursions=found, halvings=scale_halvings,
                           searched_from=max(0, step_split), series=series)


# --------------------------------------------------------------------------- the sentence

def format_ratio(r: Optional[float]) -> str:
    """"461×", "3.2×", "5e28×": how a ratio to the median is written (the sentence, the incident page)."""
    if r is None:
        return "far above"
    if r >= 1e4:                       # an activation that blew up to 1e28: its order of magnitude
        return f"{r:.0e}×".replace("e+0", "e").replace("e+", "e")
    return f"{r:.0f}×" if r >= 10 else f"{r:.1f}×"


def summary(report: PrecursorReport, *, noun: str = "the failure", cfg: PrecursorConfig = DEFAULT_CONFIG,
            earlier: Iterable[tuple[str, str, int]] = ()) -> str:
    """One sentence: the earliest excursions (three at most), then the loss-scale halvings, then the run's
    earlier alerts in the searched steps (``earlier``: (rule id, name, first step)).

    "Nothing drifted" is said only when it is true of the whole run page: with no excursion still open at
    the failure but an earlier alert in the searched steps (a one-step grad explosion 160 steps before, which
    had settled), the sentence says that no signal was still out of its band, and names that alert (issue 42:
    the incident's timeline lists it).
    """
    earlier = sorted(earlier, key=lambda a: (a[2], a[0]))
    parts = []
    shown = report.excursions[:3]
    for e in shown:
        who = f"{e.layer} {e.label}" if e.layer is not None else e.label
        lead = report.failure_step - e.from_step
        at_least = "at least " if e.open_start else ""
        if e.ratio is not None:
            size = f"{format_ratio(e.ratio)} its median"
        else:
            size = f"{e.z:.0f}σ above its median"
        parts.append(f"{who} {size} from step {e.from_step:,}, {at_least}{lead:,} step{'s' if lead != 1 else ''} "
                     f"before {noun}")
    more = len(report.excursions) - len(shown)
    if more:
        parts[-1] += f" (and {more} more series out of band)"
    span = report.failure_step - report.searched_from
    if not parts and earlier:
        parts.append(f"no signal was still out of its normal band when {noun} came (a sudden failure, with no "
                     f"slow drift into it)")
    elif not parts:
        parts.append(f"no signal left its normal band in the {span:,} steps "
                     f"before {noun} (a sudden failure: nothing drifted before it)")
    if report.halvings:
        steps = [f"{s:,}" for s, _, _ in report.halvings[-cfg.max_halvings:]]
        parts.append("loss scale halved at " + ", ".join(steps))
    if earlier:
        shown_alerts = [f"{rid} {name.replace('_', ' ')} at step {step:,}" for rid, name, step in earlier[:4]]
        more_alerts = f" and {len(earlier) - 4} more" if len(earlier) > 4 else ""
        parts.append(f"earlier alerts in the {span:,} steps before it: " + ", ".join(shown_alerts) + more_alerts)
    return "; ".join(parts)


# --------------------------------------------------------------------------- the raise site

def _earlier_alerts(session: Session, alert: Alert, *, run_id: int, since: int) -> list[tuple[str, str, int]]:
    """The run's warning and critical alerts (any rank) that started in the searched steps before ``alert``:
    (rule id, name, first step). One indexed read of the run's alerts."""
    with session.no_autoflush:
        rows = session.execute(select(Alert.id, Alert.rule, Alert.name, Alert.first_step).where(
            Alert.run_id == run_id, Alert.severity.in_(("warning", "critical")), Alert.first_step >= since,
            Alert.first_step < alert.first_step)).all()
    return [(r.rule, r.name, int(r.first_step)) for r in rows if r.id != alert.id]


def attach_precursors(session: Session, alerts: Iterable[Alert], *, run: Run,
                      cfg: PrecursorConfig = DEFAULT_CONFIG) -> None:
    """Give each critical alert of ``alerts`` its precursor timeline (evidence + diagnosis), once per
    (first step, rank). Called by ingest after the rules, before routing, so that the notification
    carries it. Never fails the batch: an error is logged and the alert goes out without it."""
    for alert in alerts:
        if alert.severity != "critical":
            continue
        ev = dict(alert.evidence or {})
        done = ev.get("precursor_search") or {}
        if done.get("failure_step") == alert.first_step and done.get("rank") == alert.rank:
            continue
        t0 = time.perf_counter()
        try:
            report = find_precursors(session, run=run, rank=alert.rank, failure_step=alert.first_step, cfg=cfg)
        except Exception:   # noqa: BLE001 - forensics must never cost the batch or its alert
            log.exception("precursor search failed for alert %s (run %s); the alert goes out without it",
                          alert.id, run.id)
            continue
        noun = rule_registry.failure_noun(alert.rule, alert.name)
        sentence = summary(report, noun=noun, cfg=cfg,
                           earlier=_earlier_alerts(session, alert, run_id=run.id, since=report.searched_from))
        ev.update(enc({"precursors": report.items(cfg), "precursor_summary": sentence,
                       "precursor_search": {"failure_step": alert.first_step, "rank": alert.rank,
                                            "from_step": report.searched_from, "series": report.series,
                                            "found": len(report.excursions)}}))
        alert.evidence = ev
        base = (alert.diagnosis or "").split(DIAGNOSIS_MARK, 1)[0]
        alert.diagnosis = f"{base}{DIAGNOSIS_MARK}{sentence}."
        log.debug("precursors for alert %s: %d series in %.1f ms", alert.id, report.series,
                  1e3 * (time.perf_counter() - t0))
