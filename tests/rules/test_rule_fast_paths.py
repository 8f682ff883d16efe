"""Every rule's batch fast path against its own step-by-step walk.

The engine calls ``Rule.fast`` on a batch when the rule is not firing; True means "no step of this batch
holds a hit, and the state is updated as the walk would have updated it", False means "walk the steps"
with the state untouched. These tests hold each rule to that: the same run, cut into batches of varied
sizes, goes once through fast (falling back to ``observe`` on False, exactly as the engine does) and once
through ``observe`` alone. The states after each batch (as stored: through JSON) and the verdicts must be
the same, and a fast path that declines must leave the state as it found it.

Steps are built as production builds them: the wire dict is validated by ``StepIn`` and turned into the
rules' step dict by ingest's ``_wire_step`` (layers as a ``_LayerView`` over the packed float32 blobs).
"""
from __future__ import annotations

import base64
import functools
import json
import math
import random
from typing import Any, Optional

import numpy as np
import pytest

from server.ingest import _wire_step
from server.rules.alerts import Hit
from server.rules.catalogue import RULES_BY_ID
from server.rules.checks import (RULE_CLASSES, Context, EmaDivergence, GradExplosion, LossNonfinite, LossSpike, Rule,
                                  WeightNormGrowth, Window, _Refreshes, _pack_f8, keys_present)
from server.schemas import StepIn

LAYERS = 24        # parameters: grad_norm, weight_norm, update_ratio
MODULES = 10       # act_std, act_mean
BN = 6             # bn_var_norm
PARAM_NAMES = [f"blocks.{i // 4}.{('fc.weight', 'fc.bias', 'norm.weight', 'proj.weight')[i % 4]}"
               for i in range(LAYERS - BN)] + [f"bn{k}.weight" for k in range(BN)]
MODULE_NAMES = [f"blocks.{i}.mlp" for i in range(MODULES)]
BN_NAMES = [f"bn{k}" for k in range(BN)]

FAST_RULES = [cls for cls in RULE_CLASSES if cls.fast is not Rule.fast]

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
}
SEEDS = (0, 1)


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
        "B5": {"steps": 10},
        "C1": {"window": 50, "min_history": 20, "spread_ratio": 0.05},
        "C2": {"window": 30, "fraction": 0.2},
        "C3": {"mad_factor": 3.0, "window": 30, "min_history": 5},
        "D1": {"window": 60, "lr_fraction": 0.5, "min_rise": 0.0},
        "D2": {"factor": 1.5, "window": 30, "min_history": 5},
        "E1": {"factor": 2.0, "history": 6, "min_history": 2},
        "E2": {"growth": 0.05, "window": 200, "min_samples": 3},
        "E3": {"high": 2e-3, "window": 30, "min_samples": 2},
    }.get(rule_id)
    return [base] + ([{**base, **tight}] if tight else [])


# --------------------------------------------------------------------------- the two walks

def _verdict(v) -> Any:
    if isinstance(v, Hit):
        return ("hit", json.dumps([v.evidence, v.message, v.diagnosis, v.actions, v.severity], sort_keys=True,
                                  default=str))
    assert v is None or v is False, v
    return v


def _windows(rule: Rule) -> dict:
    return {k: list(v.values) for k, v in vars(rule).items() if isinstance(v, Window)}


def walk(cls: type[Rule], cfg: dict, batches: list[tuple], present: list[frozenset], *,
         use_fast: bool) -> tuple[list, list, int]:
    """The engine's loop for one rule on one run: (stored state after each batch, verdicts, fast batches)."""
    state: dict = {}
    states, verdicts = [], []
    firing, clear, fast_batches = False, 0, 0
    for batch, keys in zip(batches, present):
        steps = [_wire_step(s) for s in batch]          # fresh layer views: nothing decoded carries over
        ctx = Context(run_id=1, rank=0, world_size=1, param_names=PARAM_NAMES, module_names=MODULE_NAMES,
                      bn_names=BN_NAMES, present=keys)
        rule = cls()
        if not rule.applies(steps, ctx):
            states.append(None)
            continue
        rule.begin(ctx, state, cfg)
        assert rule.event_hits(ctx, state, cfg) == []
        took_fast = False
        if use_fast and not firing:
            before, windows = json.dumps(state, sort_keys=True), _windows(rule)
            took_fast = rule.fast(ctx, state, cfg, steps)
            assert took_fast in (True, False)
            if not took_fast:
                assert json.dumps(state, sort_keys=True) == before, "fast declined but changed the state"
                assert _windows(rule) == windows, "fast declined but changed a window"
        if took_fast:
            fast_batches += 1
            verdicts.extend((st["step"], "quiet") for st in steps)
        else:
            for st in steps:
                v = _verdict(rule.observe(ctx, state, cfg, st))
                verdicts.append((st["step"], v))
                # the alert lifecycle as far as it decides whether the engine tries fast (alerts.Episode)
                if isinstance(v, tuple):
                    firing, clear = True, 0
                elif v is False and firing:
                    clear += 1
                    if clear >= cfg["clear_steps"]:
                        firing, clear = False, 0
        rule.end(ctx, state, cfg)
        state = json.loads(json.dumps(state))           # as stored in rule_states and read back
        states.append(json.dumps(state, sort_keys=True))
    return states, verdicts, fast_batches


def compare(cls: type[Rule], cfg: dict, batches: list[tuple]) -> tuple[int, int]:
    """Both walks of one run; returns (batches the fast path took, hits)."""
    present = [keys_present([_wire_step(s) for s in batch]) for batch in batches]
    fast_states, fast_verdicts, fast_batches = walk(cls, cfg, batches, present, use_fast=True)
    slow_states, slow_verdicts, _ = walk(cls, cfg, batches, present, use_fast=False)
    assert len(fast_verdicts) == len(slow_verdicts)
    for (step, f), (_, s) in zip(fast_verdicts, slow_verdicts):
        if f == "quiet":
            assert s is None or s is False, f"the fast path passed over a hit at step {step}: {s}"
        else:
            assert f == s, f"verdicts differ at step {step}: {f} != {s}"
    for k, (f, s) in enumerate(zip(fast_states, slow_states)):
        assert f == s, f"states differ after batch {k} (steps {batches[k][0].step}..{batches[k][-1].step})"
    return fast_batches, sum(1 for _, v in slow_verdicts if isinstance(v, tuple))


@pytest.mark.parametrize("cls", FAST_RULES, ids=lambda c: c.id)
def test_fast_path_matches_the_step_walk(cls):
    fast = hits = 0
    for scenario in ("healthy", *RELEVANT[cls.id], "gaps", "mixed"):
        for seed in SEEDS:
            cfgs = configs(cls.id)
            cfg = cfgs[seed % len(cfgs)]
            batches = batches_of(validated_run(scenario, seed), random.Random(f"batches/{scenario}/{seed}/{cls.id}"),
                                 small=seed == 1)
            try:
                f, h = compare(cls, cfg, batches)
            except AssertionError as e:
                raise AssertionError(f"{cls.id}, run {scenario!r} seed {seed}, "
                                     f"{'tight' if cfg is not cfgs[0] else 'default'} settings: {e}") from None
            fast, hits = fast + f, hits + h
    # the runs reach both paths: the fast path is taken, and the rule fires, so the walk's hits and the
    # batches around them are compared too
    assert fast > 0
    assert hits > 0


@pytest.mark.parametrize("cls", FAST_RULES, ids=lambda c: c.id)
def test_fast_path_at_every_batch_boundary(cls):
    """A short run (the scaler calibrating, windows filling, then the rule's fault) cut in two at every step,
    under the tight settings: a fast path off by one step where the rule starts to fire, or wrong about a
    run's first batches, shows here even where the random cuts above miss it."""
    cfg = configs(cls.id)[-1]
    for scenario in (RELEVANT[cls.id][0],):
        steps = validated_run(scenario, 0, short=True, calm=20)
        for k in range(1, len(steps)):
            try:
                compare(cls, cfg, [steps[:k], steps[k:]])
            except AssertionError as e:
                raise AssertionError(f"{cls.id}, short run {scenario!r} cut after {k} steps: {e}") from None


# settings under which a rule's windows fill, slide and expire within a short run
TINY = {
    "A2": {"factor": 3.0, "window": 20, "min_history": 3},
    "A5": {"consecutive": 3, "window": 20, "fraction": 0.1},
    "B1": {"threshold": 1e-3, "steps": 3},
    "B2": {"window": 40, "min_improvement": 0.05},
    "B3": {"halvings": 2, "window": 20, "min_scale": 4096.0},
    "B4": {"steps": 2},
    "B5": {"steps": 10},
    "C1": {"window": 20, "min_history": 10, "spread_ratio": 0.05},
    "C2": {"window": 10, "fraction": 0.3},
    "C3": {"mad_factor": 3.0, "window": 15, "min_history": 4},
    "D1": {"window": 20, "lr_fraction": 0.5, "min_rise": 0.0},
    "D2": {"factor": 1.5, "window": 15, "min_history": 4},
    "E1": {"factor": 2.0, "history": 4, "min_history": 2},
    "E2": {"growth": 0.02, "window": 30, "min_samples": 3},
    "E3": {"high": 2e-3, "window": 10, "min_samples": 2},
}


@pytest.mark.parametrize("cls", FAST_RULES, ids=lambda c: c.id)
def test_fast_path_on_many_short_runs(cls):
    """Many short runs, each with two faults, in batches of mostly 1 to 8 steps, with settings of small windows: every kind of batch boundary (a window filling, sliding, a value expiring, the first
    hit) falls somewhere, with both default and tight settings."""
    rng = random.Random(f"short/{cls.id}")
    cfgs = [*configs(cls.id), {**configs(cls.id)[0], **TINY.get(cls.id, {})}]
    for k in range(24):
        # one of the rule's faults and one other: the rule fires, and stops firing, so both paths are taken
        faults = {rng.choice(RELEVANT[cls.id]), rng.choice(FAULTS)}
        if k % 2:
            faults.add("gaps")
        scenario = "+".join(sorted(faults))
        cfg = cfgs[k % len(cfgs)]
        try:
            compare(cls, cfg, batches_of(validated_run(scenario, k, short=True), rng, small=True))
        except AssertionError as e:
            raise AssertionError(f"{cls.id}, short run {scenario!r} seed {k}, settings {cfg}: {e}") from None


def test_refreshes_are_the_statistics_the_walk_takes():
    """``_Refreshes`` (the windowed rules' fast paths) against a ``Window`` fed one value at a time, asked for
    its statistics before each push once it holds ``min_len`` values: bit for bit, refresh cadence included."""
    rng = random.Random("refreshes")
    for _ in range(400):
        size, refresh = rng.choice([1, 3, 8, 15, 50, 200]), rng.choice([1, 4, 8])
        min_len, n0, m = rng.choice([0, 1, 5, 20, 60]), rng.randint(0, 220), rng.randint(1, 60)
        draw = rng.choice([lambda: rng.gauss(3, 1), lambda: round(rng.gauss(0, 1), 1), lambda: rng.expovariate(1)])
        stored, xs = [draw() for _ in range(n0)], [draw() for _ in range(m)]
        raw = _pack_f8(stored) if rng.random() < 0.5 else list(stored)      # as stored, or an older state
        r = _Refreshes(Window({"w": raw}, "w", size, refresh), xs, min_len)
        walk, expected = Window({"w": raw}, "w", size, refresh), []
        for x in xs:
            if len(walk) >= min_len:
                expected.append(walk.stats())
            walk.push(x)
        if not r.ok:
            # left to the walk: a window shrunk by a new setting, or the median of an empty one
            assert n0 > size or (n0 == 0 and min_len == 0)
            continue
        assert r.first == m - len(expected)
        if expected:
            med, mad = r.per_value(r.med), r.per_value(r.mad(np.ones(r.count, dtype=bool)))
            assert [(float(a), float(b)) for a, b in zip(med, mad)] == expected


# the threshold a value faces in the walk, where observe takes the window's statistics (and only there:
# asking the window at any other point would change when it refreshes)
PROBES = {
    "A1": (LossNonfinite, "grad_norm",
           lambda rule, cfg, st: (cfg["explode_factor"] * rule.gn.stats()[0]
                                  if _finite(st.loss) and _finite(st.grad_norm) and len(rule.gn) >= 5 else None)),
    "A2": (GradExplosion, "grad_norm",
           lambda rule, cfg, st: (cfg["factor"] * rule.win.stats()[0]
                                  if _finite(st.grad_norm) and len(rule.win) >= cfg["min_history"] else None)),
    "C3": (LossSpike, "loss",
           lambda rule, cfg, st: (_spike_limit(*rule.win.stats(), cfg)
                                  if _finite(st.loss) and len(rule.win) >= cfg["min_history"] else None)),
    "D2": (EmaDivergence, "ema_divergence",
           lambda rule, cfg, st: (cfg["factor"] * rule.win.stats()[0]
                                  if _finite(st.ema_divergence) and len(rule.win) >= cfg["min_history"] else None)),
}


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _spike_limit(med: float, mad: float, cfg: dict) -> float:
    return med + cfg["mad_factor"] * max(mad, 0.01 * abs(med), 1e-12)


@pytest.mark.parametrize("rule_id", sorted(PROBES))
def test_fast_path_at_the_threshold(rule_id):
    """Values exactly at the threshold the walk applies (its windowed median, refreshed every few pushes),
    and one float either side: a fast path that bounds the threshold too loosely, or takes it from the
    wrong window, passes over a hit or keeps a different window here."""
    cls, key, threshold = PROBES[rule_id]
    rng = random.Random(f"threshold/{rule_id}")
    for k, cfg in enumerate([{**configs(rule_id)[0], **TINY.get(rule_id, {})}, configs(rule_id)[-1]]):
        base = "ema" if rule_id == "D2" else "healthy"          # a run that reports the rule's signal
        steps = validated_run(f"{base}+gaps" if k else base, k, short=True)
        batches = batches_of(steps, rng, small=True)
        # the walk, noting the threshold each value faces
        faced: dict[int, float] = {}
        state: dict = {}
        i = 0
        for batch in batches:
            wire = [_wire_step(s) for s in batch]
            ctx = Context(run_id=1, rank=0, world_size=1, param_names=PARAM_NAMES, module_names=MODULE_NAMES,
                          bn_names=BN_NAMES, present=keys_present(wire))
            rule = cls()
            rule.begin(ctx, state, cfg)
            for s, st in zip(batch, wire):
                t = threshold(rule, cfg, s)
                if t is not None and math.isfinite(t):
                    faced[i] = t
                rule.observe(ctx, state, cfg, st)
                i += 1
            rule.end(ctx, state, cfg)
            state = json.loads(json.dumps(state))
        assert len(faced) > 20
        cuts = [len(b) for b in batches]
        for j in rng.sample(sorted(faced), 12):
            for value in (faced[j], math.nextafter(faced[j], math.inf), math.nextafter(faced[j], -math.inf)):
                probed = list(steps)
                probed[j] = probed[j].model_copy(update={key: value})
                cut, at = [], 0
                for size in cuts:
                    cut.append(tuple(probed[at:at + size]))
                    at += size
                try:
                    compare(cls, cfg, cut)
                except AssertionError as e:
                    raise AssertionError(f"{rule_id}, {key} {value!r} at step {j}, settings {cfg}: {e}") from None


def test_e2_reads_the_state_layout_it_wrote_before():
    """E2 once kept its samples as JSON lists ("vals", null for no value); it now packs them. A state in the
    earlier layout, holding the same samples, must carry on exactly as the packed one does."""
    cls, cfg = WeightNormGrowth, configs("E2")[-1]
    steps = validated_run("layer_faults", 1)
    batches = batches_of(steps, random.Random("e2-layout"))
    present = [keys_present([_wire_step(s) for s in batch]) for batch in batches]
    states, verdicts, _ = walk(cls, cfg, batches, present, use_fast=False)
    checked = 0
    for k in range(1, len(batches)):
        if states[k - 1] is None or "vb" not in json.loads(states[k - 1]):
            continue
        packed = json.loads(states[k - 1])
        lists = {key: v for key, v in packed.items() if key not in ("vb", "vn")}
        flat = np.frombuffer(base64.b64decode(packed["vb"]), dtype="<f8")
        rows = np.split(flat, np.cumsum(packed["vn"])[:-1].tolist()) if packed["vn"] else []
        lists["vals"] = [[None if math.isnan(x) else x for x in row.tolist()] for row in rows]
        for start in (packed, lists):
            rest_states, rest_verdicts, _ = walk_from(cls, cfg, batches[k:], present[k:], start)
            assert rest_states == states[k:]
            assert rest_verdicts == verdicts[len(verdicts) - len(rest_verdicts):]
        checked += 1
    assert checked >= 3


def walk_from(cls, cfg, batches, present, state):
    """``walk`` (observe only) from a given stored state."""
    state = json.loads(json.dumps(state))
    states, verdicts = [], []
    for batch, keys in zip(batches, present):
        steps = [_wire_step(s) for s in batch]
        ctx = Context(run_id=1, rank=0, world_size=1, param_names=PARAM_NAMES, module_names=MODULE_NAMES,
                      bn_names=BN_NAMES, present=keys)
        rule = cls()
        if not rule.applies(steps, ctx):
            states.append(None)
            continue
        rule.begin(ctx, state, cfg)
        verdicts.extend((st["step"], _verdict(rule.observe(ctx, state, cfg, st))) for st in steps)
        rule.end(ctx, state, cfg)
        state = json.loads(json.dumps(state))
        states.append(json.dumps(state, sort_keys=True))
    return states, verdicts, state


def test_the_rules_with_a_fast_path():
    assert {cls.id for cls in FAST_RULES} == set(RELEVANT)
