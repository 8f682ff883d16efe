"""Randomised runs for the rule tests: healthy runs of random shapes with faults planted in them.

Steps are built as production builds them: the wire dict is validated by ``StepIn`` and turned into the
rules' step dict by ingest's ``_wire_step`` (layers as a ``_LayerView`` over the packed float32 blobs).
"""
from __future__ import annotations

import functools
import math
import random
from typing import Any

from gradwatch.server.rules.catalogue import RULES_BY_ID
from gradwatch.server.schemas import StepIn

LAYERS = 24        # parameters: grad_norm, weight_norm, update_ratio
MODULES = 10       # act_std, act_mean
BN = 6             # bn_var_norm
PARAM_NAMES = [f"blocks.{i // 4}.{('fc.weight', 'fc.bias', 'norm.weight', 'proj.weight')[i % 4]}"
               for i in range(LAYERS - BN)] + [f"bn{k}.weight" for k in range(BN)]
MODULE_NAMES = [f"blocks.{i}.mlp" for i in range(MODULES)]
BN_NAMES = [f"bn{k}" for k in range(BN)]

FAULTS = ("nan_loss", "nan_tail", "gn_spike", "gn_decline", "gn_nonfinite_no_scaler", "overflow_storm", "vanish",
          "plateau", "scale_collapse", "lr_zero", "dead", "oscillate", "clip_saturation", "loss_spike",
          "late_divergence", "ema", "layer_faults", "bad_inputs", "gaps")
# each rule's own faults and the ones that disturb its inputs; every rule also sees a healthy run, one
# with gaps (missing and non-finite values, a step sent twice) and one with four faults at once
RELEVANT = {
    "A1": ("nan_loss", "nan_tail", "gn_spike", "gn_decline", "vanish", "overflow_storm"),
    "A2": ("gn_spike", "gn_decline", "gn_nonfinite_no_scaler", "vanish", "overflow_storm"),
    "A4": ("bad_inputs", "nan_loss"),
    "A5": ("overflow_storm", "scale_collapse", "nan_loss"),
    "B1": ("vanish", "overflow_storm", "gn_decline", "gn_nonfinite_no_scaler"),
    "B2": ("plateau", "vanish", "nan_loss", "loss_spike", "oscillate"),
    "B3": ("scale_collapse", "overflow_storm", "nan_tail"),
    "B4": ("lr_zero", "late_divergence"),
    "B5": ("dead", "overflow_storm"),
    "C1": ("oscillate", "plateau", "loss_spike", "nan_loss"),
    "C2": ("clip_saturation", "gn_spike", "overflow_storm"),
    "C3": ("loss_spike", "plateau", "nan_loss", "oscillate"),
    "D1": ("late_divergence", "lr_zero", "loss_spike", "oscillate"),
    "D2": ("ema",),
    "D3": ("layer_faults",),
    "E1": ("layer_faults",),
    "E2": ("layer_faults",),
    "E3": ("layer_faults", "overflow_storm"),
    "B6": ("grad_underflow", "scale_collapse"),
    "H1": ("adam_stale", "overflow_storm", "dead", "gn_nonfinite_no_scaler"),
    "H4": ("linear_growth", "layer_faults"),
    "H2": ("attn_growth", "layer_faults"),
    "H12": ("attn_growth", "layer_faults"),
    "H3": ("logz_drift", "nan_loss"),
    # lr_jump is not among FAULTS (the other rules' random runs stay as they were): H10's own runs only
    "H10": ("lr_jump", "lr_zero", "late_divergence"),
    # mem_leak is not among FAULTS either: D4's own runs only
    "D4": ("mem_leak",),
}


# --------------------------------------------------------------------------- runs


def _segment(rng: random.Random, n: int, lo: int, hi: int, earliest: int = 50) -> tuple[int, int]:
    length = rng.randint(lo, hi)
    start = min(earliest, n // 4)
    a = rng.randint(start, max(start, n - length - 1))
    return a, a + length


def wire_run(scenario: str, seed: int, short: bool = False, calm: int = 3) -> list[dict]:
    """A run's steps in wire format: a healthy run of a random shape, with ``scenario``'s faults.
    ``short``: 80 steps from step 0, often a scaler calibrating at the start, layer statistics on every
    step, and the faults from step ``calm`` on."""
    rng = random.Random(f"{scenario}/{seed}/{short}/{calm}")
    n = 80 if short else rng.choice([600, 900, 1200])
    first = 0 if short else rng.choice([0, 0, 0, 5000])
    # "mixed": four faults at once; "a+b+c": those faults at once
    faults = set(rng.sample(FAULTS, 4)) if scenario == "mixed" else set(scenario.split("+")) - {"healthy"}
    segment = functools.partial(_segment, earliest=calm if short else 50)

    loss0, floor = rng.uniform(0.5, 5.0), rng.choice([0.0, 0.1, 1.0])
    decay_t, decay_p = rng.uniform(100, 3000), rng.uniform(0.05, 0.7)
    noise = rng.choice([0.002, 0.002, 0.01, 0.03] if short else [0.002, 0.01, 0.03, 0.1])
    gn0 = rng.choice([0.05, 0.5, 3.0])
    clip = rng.choice([None, 1.0, gn0 * 1.05])
    amp = rng.random() < 0.7 or faults & {"overflow_storm", "scale_collapse"}
    if "gn_nonfinite_no_scaler" in faults:
        amp = False
    growth_interval = rng.choice([100, 300, 2000])
    overflow_rate = rng.choice([0.0005, 0.002, 0.01])
    calibration = rng.choice([0, 6] if short else [0, 0, 6])          # GradScaler's start: halving from too high an init scale
    reports_overflow = rng.random() < 0.85
    peak_lr = rng.choice([1e-3, 3e-4])
    warmup = rng.choice([0, 0, 50, 300])
    schedule = rng.choice(["const", "cosine", "cosine_to_zero", "step"])
    if "late_divergence" in faults:
        schedule = "cosine_to_zero"
    has_ema = rng.random() < 0.6 or "ema" in faults
    ema0 = rng.choice([1e-3, 0.2])
    layers_every = rng.choice([1, 1, 3]) if rng.random() < 0.9 or "dead" in faults else 0
    stats_every = rng.choice([1, 10, 50, 100])
    if short:
        layers_every, stats_every = 1, rng.choice([1, 3])
    levels = {"grad_norm": [gn0 * rng.uniform(0.1, 2.0) for _ in range(LAYERS)],
              "weight_norm": [rng.uniform(1, 50) for _ in range(LAYERS)],
              "update_ratio": [rng.uniform(3e-4, 3e-3) for _ in range(LAYERS)],
              "act_std": [rng.uniform(0.5, 2.0) for _ in range(MODULES)],
              "act_mean": [rng.uniform(-0.5, 0.5) for _ in range(MODULES)],
              "bn_var_norm": [rng.uniform(1, 10) for _ in range(BN)]}

    seg: dict[str, tuple[int, int]] = {}
    nan_steps: set[int] = set()
    spikes: dict[int, float] = {}
    gn_spikes: dict[int, float] = {}
    overflows: set[int] = set()
    halve_at: set[int] = set()
    if "nan_loss" in faults:
        nan_steps = {rng.randrange(n) for _ in range(rng.randint(1, 4))}
    if "nan_tail" in faults:
        seg["nan_tail"] = (rng.randrange(n // 3, n), n)
    if "gn_spike" in faults:
        # some far above the 10x limit, some right at it
        gn_spikes = {rng.randrange(n): rng.choice([rng.uniform(9.0, 11.0), rng.uniform(11, 200)])
                     for _ in range(rng.randint(2, 8))}
    if "gn_decline" in faults:
        seg["gn_decline"] = segment(rng, n, 150, 400)
    if "gn_nonfinite_no_scaler" in faults:
        gn_spikes = {rng.randrange(n): math.inf for _ in range(rng.randint(1, 3))}
    if "overflow_storm" in faults:
        a, b = segment(rng, n, 3, 40)
        overflows = set(range(a, b))
    if "vanish" in faults:
        seg["vanish"] = segment(rng, n, 5, 60)
    if "scale_collapse" in faults:
        a, b = segment(rng, n, 10, 400)
        halve_at = set(range(a, b, rng.choice([1, 3, 20, 150])))
    if "lr_zero" in faults:
        seg["lr_zero"] = segment(rng, n, 1, 40)
    if "lr_jump" in faults:
        seg["lr_jump"] = segment(rng, n, 1, 40)         # the LR x10 over a stretch: a jump up, then back down
    if "dead" in faults:
        # a few episodes of parameters without gradients (0.0, or null: no .grad), some long enough to fire
        dead = [(*segment(rng, n, 5, 150), rng.sample(range(LAYERS), rng.randint(1, 4)), rng.random() < 0.5)
                for _ in range(rng.randint(2, 5))]
        dead_forever = rng.sample(range(LAYERS), 1) if rng.random() < 0.3 else []
    if "oscillate" in faults:
        seg["oscillate"] = segment(rng, n, 100, 600)
    bursts: list[tuple[int, int]] = []
    if "clip_saturation" in faults:
        bursts = [segment(rng, n, *rng.choice([(3, 30), (30, 400)])) for _ in range(rng.randint(1, 4))]
        clip = clip or 1.0
    if "loss_spike" in faults:
        for _ in range(rng.randint(1, 5)):
            s = rng.randrange(n)
            for k in range(rng.choice([1, 1, 2, 6])):
                # some just above a spike limit (a few % over a quiet loss), some far above it
                spikes[s + k] = rng.choice([rng.uniform(1.03, 1.12), rng.uniform(1.05, 1.5), rng.uniform(2, 50)])
    if "late_divergence" in faults:
        seg["late_divergence"] = (rng.randrange(n // 2, 3 * n // 4), n)
    if "ema" in faults:
        seg["ema_osc"] = segment(rng, n, 60, 200)
        ema_spikes = {rng.randrange(n) for _ in range(rng.randint(1, 4))}
    if "layer_faults" in faults:
        seg["bn_drift"] = segment(rng, n, 10, 300)
        seg["act_jump"] = segment(rng, n, 1, 200)
        seg["weight_growth"] = segment(rng, n, 300, 800)
        seg["update_high"] = segment(rng, n, 150, 400)
        stats_every = rng.choice([1, 10])
    gaps = "gaps" in faults
    gap_rate = rng.choice([0.02, 0.08, 0.2])
    if gaps:
        warmup = 300                             # a NaN LR while the LR (and its peak) still grows
    plateau = "plateau" in faults

    # the zero-gradient shares draw from their own generator, so adding them left every other run as it was
    zrng = random.Random(f"{scenario}/{seed}/{short}/{calm}/zeros")
    zero_levels = [zrng.choice([0.0, 0.0, zrng.uniform(0, 0.04), zrng.uniform(0.2, 0.6)]) for _ in range(LAYERS)]
    if "grad_underflow" in faults:
        length = zrng.randint(10, 300)
        a = zrng.randint(min(calm if short else 50, n // 4), max(calm, n - length - 1))
        seg["underflow"] = (a, a + length)
        underflowing = [k for k in range(LAYERS) if zero_levels[k] < 0.1][: zrng.randint(1, 6)]

    # the early-warning arrays (H1 Adam g² / v̂, H4 Linear output RMS) draw from their own generator as well
    erng = random.Random(f"{scenario}/{seed}/{short}/{calm}/early")
    adam_levels = [erng.uniform(0.3, 2.0) for _ in range(LAYERS)]
    rms_levels = [erng.uniform(0.2, 3.0) for _ in range(MODULES)]
    stale: dict[int, tuple[list[int], float]] = {}
    if "adam_stale" in faults:
        # some just around the default ratio of 100, some far past it, on one to three parameters
        stale = {erng.randrange(n): (erng.sample(range(LAYERS), erng.randint(1, 3)),
                                     erng.choice([erng.uniform(60, 160), erng.uniform(1e3, 1e6)]))
                 for _ in range(erng.randint(1, 5))}
    if "linear_growth" in faults:
        seg["linear_growth"] = _segment(erng, n, 40, 300, earliest=calm if short else 50)
        growing = erng.sample(range(MODULES), erng.randint(1, 3))
        growth_rate = erng.choice([1.01, 1.03, 1.08])

    # H2 attention logits per module, H3 the output's log Z: a generator of their own too
    lrng = random.Random(f"{scenario}/{seed}/{short}/{calm}/logits")
    logit_levels = [lrng.uniform(3.0, 30.0) for _ in range(MODULES)]
    log_z0 = lrng.uniform(-3.0, 8.0)
    if "attn_growth" in faults:
        seg["attn_growth"] = _segment(lrng, n, 40, 300, earliest=calm if short else 50)
        attn_growing = lrng.sample(range(MODULES), lrng.randint(1, 2))
        attn_rate = lrng.choice([1.02, 1.05, 1.15])
    if "logz_drift" in faults:
        seg["logz_drift"] = _segment(lrng, n, 40, 300, earliest=calm if short else 50)
        logz_rate = lrng.choice([-1.0, 0.3, 2.0])

    # D4 peak device memory: a generator of its own (the other runs stay as they were); a CPU run has none
    mrng = random.Random(f"{scenario}/{seed}/{short}/{calm}/memory")
    mem_base = mrng.choice([None, 2e9, 3e10]) if "mem_leak" not in faults else mrng.choice([2e9, 3e10])
    mem_jitter = mrng.choice([0.02, 0.15, 0.4])          # the peak moves with each batch's shapes
    if "mem_leak" in faults:
        seg["mem_leak"] = _segment(mrng, n, 30 if short else 200, 70 if short else n - 60,
                                   earliest=calm if short else 50)
        mem_rate = mrng.choice([2e-4, 1e-3, 5e-3])      # per step: +10 %, +50 %, +250 % over 500 steps

    def inside(name: str, i: int) -> bool:
        return name in seg and seg[name][0] <= i < seg[name][1]

    out = []
    scale, good_since = 65536.0 * (32 if calibration else rng.choice([1, 32])), 0
    gn_level = gn0
    weight_scale = [1.0] * LAYERS
    for i in range(n):
        s = first + i
        g = rng.gauss(0, 1)
        loss = (loss0 * (1 + noise * g) if plateau else
                loss0 * (1 + i / decay_t) ** -decay_p * (1 + noise * g) + floor)
        if inside("oscillate", i):
            loss *= 1.0 + 0.8 * (-1) ** i
        if inside("late_divergence", i):
            loss *= 1.0 + 0.002 * (i - seg["late_divergence"][0])
        loss *= spikes.get(i, 1.0)
        if inside("gn_decline", i):
            a, b = seg["gn_decline"]
            gn_level = gn0 * 1e-3 ** ((i - a) / (b - a))
        elif "gn_decline" in seg and i >= seg["gn_decline"][1]:
            gn_level = gn0 * 1e-3 * (1 if i % 97 else 30)
        gn = gn_level * (1 + 0.1 * abs(rng.gauss(0, 1))) * gn_spikes.get(i, 1.0)
        if inside("vanish", i):
            gn = 1e-9
        overflow = None
        if amp:
            overflow = (i in overflows or i in halve_at or i < calibration
                        or (rng.random() < overflow_rate and not halve_at))
            if overflow:
                scale /= 2
                good_since = 0
                gn = math.inf
            else:
                good_since += 1
                if good_since >= growth_interval and not halve_at:
                    scale *= 2
                    good_since = 0
        if i in nan_steps or inside("nan_tail", i):
            loss, gn = rng.choice([math.nan, math.inf]), math.nan
            if amp:
                overflow = True
        if schedule == "const":
            lr = peak_lr
        elif schedule == "step":
            lr = peak_lr * 0.1 ** (i * 3 // n)
        else:
            end = 0.0 if schedule == "cosine_to_zero" else 0.05 * peak_lr
            lr = end + (peak_lr - end) * 0.5 * (1 + math.cos(math.pi * i / n))
        if warmup and i < warmup:
            lr = peak_lr * (i + 1) / warmup
        if inside("lr_zero", i):
            lr = 0.0
        if inside("lr_jump", i):
            lr *= 10.0
        st: dict[str, Any] = {"step": s, "time": 1.7e9 + s * 0.05, "loss": loss, "grad_norm": gn,
                              "clip_max_norm": clip, "clipped": None if clip is None else bool(gn > clip),
                              "loss_scale": scale if amp else None,
                              "overflow": overflow if reports_overflow else None,
                              "overflow_count": int(i in overflows) if amp else None, "lr": lr,
                              "input_nonfinite": None}
        if s % 10 == 0 or "bad_inputs" in faults and i % 3 == 0:
            st["input_nonfinite"] = 3 if "bad_inputs" in faults and rng.random() < 0.05 else 0
        if any(a <= i < b for a, b in bursts):
            st["clipped"] = rng.random() < 0.7
        if has_ema:
            ema = ema0 * (1 + 0.2 * rng.gauss(0, 1))
            if "ema" in faults:
                if inside("ema_osc", i):
                    ema = ema0 * (0.05 if i % 2 else 2.2)
                if i in ema_spikes:
                    ema *= rng.choice([2.5, 3.5, 20.0])
            st["ema_divergence"] = abs(ema)
        layers: dict[str, list] = {}
        if layers_every and i % layers_every == 0:
            values: list = [v * (1 + 0.05 * rng.gauss(0, 1)) * gn / max(gn0, 1e-30) if math.isfinite(gn) else gn
                            for v in levels["grad_norm"]]
            if rng.random() < 0.01:
                values[rng.randrange(LAYERS)] = math.nan
            if "dead" in faults:
                for k in dead_forever:
                    values[k] = None
                for a, b, layers_off, as_null in dead:
                    if a <= i < b:
                        for k in layers_off:
                            values[k] = None if as_null else 0.0
            layers["grad_norm"] = values
            ratios: list = [v * math.exp(0.4 * erng.gauss(0, 1)) if math.isfinite(gn) else math.nan
                            for v in adam_levels]
            for k in stale.get(i, ((), 1.0))[0]:
                ratios[k] *= stale[i][1]
            for k, g in enumerate(values):
                if g is None:
                    ratios[k] = None             # no grad, no Adam update: not measured
            layers["adam_g2_over_v"] = ratios
        if stats_every and i % stats_every == 0:
            for k in range(LAYERS):
                weight_scale[k] *= 1.02 if inside("weight_growth", i) and k % 3 == 0 else 1.0 + 0.001 * rng.gauss(0, 1)
            layers["weight_norm"] = [v * w for v, w in zip(levels["weight_norm"], weight_scale)]
            if rng.random() < 0.1:             # a parameter not measured at this sample, or at 0
                layers["weight_norm"][rng.randrange(LAYERS)] = rng.choice([None, 0.0])
            layers["update_ratio"] = [v * (30 if inside("update_high", i) else 1) * (1 + 0.1 * rng.gauss(0, 1))
                                      for v in levels["update_ratio"]]
            layers["act_std"] = [v * (15 if inside("act_jump", i) and k == 3 else 1) * (1 + 0.05 * rng.gauss(0, 1))
                                 for k, v in enumerate(levels["act_std"])]
            layers["act_mean"] = [v + 0.01 * rng.gauss(0, 1) for v in levels["act_mean"]]
            layers["bn_var_norm"] = [v * (1 + (20 * (i - seg["bn_drift"][0]) / 300 if inside("bn_drift", i) and k < 2
                                               else 0.02 * rng.gauss(0, 1)))
                                     for k, v in enumerate(levels["bn_var_norm"])]
            if rng.random() < 0.05:
                layers["act_std"][rng.randrange(MODULES)] = None
            zeros = [min(1.0, max(0.0, z + 0.02 * zrng.gauss(0, 1))) if z else 0.0 for z in zero_levels]
            if inside("underflow", i):
                for k in underflowing:
                    zeros[k] = zrng.choice([zrng.uniform(0.45, 0.55), zrng.uniform(0.8, 1.0)])
            if zrng.random() < 0.05:
                zeros[zrng.randrange(LAYERS)] = zrng.choice([None, math.nan])
            layers["grad_zero_fraction"] = zeros
            rms = [v * (1 + 0.03 * erng.gauss(0, 1)) for v in rms_levels]
            if inside("linear_growth", i):
                for k in growing:
                    rms[k] *= growth_rate ** (i - seg["linear_growth"][0])
            if erng.random() < 0.05:
                rms[erng.randrange(MODULES)] = erng.choice([None, math.nan])
            layers["linear_out_rms"] = rms
            logits = [v * (1 + 0.05 * lrng.gauss(0, 1)) for v in logit_levels]
            if inside("attn_growth", i):
                for k in attn_growing:
                    logits[k] *= attn_rate ** (i - seg["attn_growth"][0])
            if lrng.random() < 0.05:
                logits[lrng.randrange(MODULES)] = lrng.choice([None, math.nan])
            layers["attn_logit_max"] = logits
            z = log_z0 + 0.3 * lrng.gauss(0, 1)
            if inside("logz_drift", i):
                z += logz_rate * (i - seg["logz_drift"][0])
            st["output_log_z"] = z if lrng.random() > 0.03 else lrng.choice([None, math.nan])
        if mem_base is not None:
            held = mem_base * (0.6 if i < 2 else 1.0)   # the first steps, before the optimizer's state exists
            if "mem_leak" in seg and i >= seg["mem_leak"][0]:
                held *= 1 + mem_rate * (min(i, seg["mem_leak"][1]) - seg["mem_leak"][0])
            st["mem_peak"] = held * (1 + mem_jitter * mrng.random()) if mrng.random() > 0.02 else None
        st["layers"] = layers
        if gaps:
            for key in ("loss", "grad_norm", "lr", "loss_scale", "overflow", "clipped", "ema_divergence"):
                if rng.random() < gap_rate:
                    st[key] = None
            if rng.random() < gap_rate / 2:
                st["loss"] = math.nan
            if rng.random() < gap_rate / 2:
                st["lr"] = math.nan
            if rng.random() < gap_rate / 2:
                st["loss_scale"] = math.inf
            if rng.random() < gap_rate / 4:
                st["overflow"] = True            # a skipped step whose grad norm is finite
        out.append({k: _wire(v) for k, v in st.items()})
        if gaps and rng.random() < 0.01:
            out.append(dict(out[-1]))          # the same step twice in a row, as a resend can deliver it
    return out


def _wire(v):
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: [_wire(x) for x in xs] for k, xs in v.items()}
    return v


@functools.lru_cache(maxsize=None)
def validated_run(scenario: str, seed: int, short: bool = False, calm: int = 3) -> tuple:
    return tuple(StepIn.model_validate(st) for st in wire_run(scenario, seed, short, calm))


def batches_of(steps: tuple, rng: random.Random, small: bool = False) -> list[tuple]:
    """The run cut into batches: of the sizes agents send, or (``small``) mostly of 1 to 8 steps, which puts a
    batch boundary next to nearly every step where a rule starts to fire."""
    out, i = [], 0
    while i < len(steps):
        if small:
            size = rng.randint(1, 8) if rng.random() < 0.85 else rng.randint(9, 40)
        else:
            size = rng.choice([1, 2, 5, 13, 50, 100, 178, 178, 178, 250, 700])
        out.append(steps[i:i + size])
        i += size
    return out


# --------------------------------------------------------------------------- configs

def configs(rule_id: str) -> list[dict]:
    """The defaults, and tighter settings under which more steps sit near a threshold."""
    base = RULES_BY_ID[rule_id].defaults()
    tight = {
        "A2": {"factor": 3.0, "window": 30, "min_history": 5},
        "A5": {"consecutive": 3, "window": 50},
        "B1": {"threshold": 1e-3, "steps": 5},
        "B2": {"window": 100, "min_improvement": 0.05},
        "B3": {"halvings": 2, "window": 300, "min_scale": 4096.0},
        "B4": {"steps": 3},
        "D4": {"window": 50, "windows": 3, "growth": 0.1},
        "B5": {"steps": 10},
        "C1": {"window": 50, "min_history": 20, "spread_ratio": 0.05},
        "C2": {"window": 30, "fraction": 0.2},
        "C3": {"mad_factor": 3.0, "window": 30, "min_history": 5},
        "D1": {"window": 60, "lr_fraction": 0.5, "min_rise": 0.0},
        "D2": {"factor": 1.5, "window": 30, "min_history": 5},
        "E1": {"factor": 2.0, "history": 6, "min_history": 2},
        "E2": {"growth": 0.05, "window": 200, "min_samples": 3},
        "E3": {"high": 2e-3, "window": 30, "min_samples": 2},
        "B6": {"share": 0.3, "baseline": 0.25, "history": 5, "min_samples": 2},
        "H1": {"ratio": 20.0, "sigma": 3.0, "window": 30, "min_history": 5},
        "H4": {"factor": 1.5, "growth": 1.1, "rising": 3, "history": 10, "min_samples": 4},
        "H2": {"factor": 2.0, "sigmas": 3.0, "min_logit": 20.0, "consecutive": 3, "window": 50, "min_history": 5},
        "H3": {"min_abs_log_z": 10.0, "min_drift": 4.0, "sigmas": 3.0, "consecutive": 3, "window": 50,
               "min_history": 5},
        "H12": {"min_logit": 20.0, "danger": 200.0, "horizon": 100, "level": 100.0, "consecutive": 1},
    }.get(rule_id)
    return [base] + ([{**base, **tight}] if tight else [])



# settings under which a rule's windows fill, slide and expire within a short run
TINY = {
    "A2": {"factor": 3.0, "window": 20, "min_history": 3},
    "A5": {"consecutive": 3, "window": 20, "fraction": 0.1},
    "B1": {"threshold": 1e-3, "steps": 3},
    "B2": {"window": 40, "min_improvement": 0.05},
    "B3": {"halvings": 2, "window": 20, "min_scale": 4096.0},
    "B4": {"steps": 2},
    "D4": {"window": 5, "windows": 3, "growth": 0.1},
    "B5": {"steps": 10},
    "C1": {"window": 20, "min_history": 10, "spread_ratio": 0.05},
    "C2": {"window": 10, "fraction": 0.3},
    "C3": {"mad_factor": 3.0, "window": 15, "min_history": 4},
    "D1": {"window": 20, "lr_fraction": 0.5, "min_rise": 0.0},
    "D2": {"factor": 1.5, "window": 15, "min_history": 4},
    "E1": {"factor": 2.0, "history": 4, "min_history": 2},
    "E2": {"growth": 0.02, "window": 30, "min_samples": 3},
    "E3": {"high": 2e-3, "window": 10, "min_samples": 2},
    "B6": {"share": 0.3, "baseline": 0.25, "history": 4, "min_samples": 2},
    "H1": {"ratio": 20.0, "window": 8, "min_history": 3},
    "H4": {"factor": 1.5, "growth": 1.1, "rising": 2, "history": 5, "min_samples": 3},
    "H2": {"factor": 2.0, "sigmas": 3.0, "min_logit": 20.0, "consecutive": 2, "window": 12, "min_history": 3},
    "H3": {"min_abs_log_z": 10.0, "min_drift": 4.0, "sigmas": 3.0, "consecutive": 2, "window": 12,
           "min_history": 3},
    "H12": {"min_logit": 20.0, "danger": 200.0, "horizon": 100, "level": 100.0, "span": 3, "max_span": 20,
            "consecutive": 1},
}
