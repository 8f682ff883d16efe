"""Attention-logit forecast (H12): the growth of each attention module's max logit, forecast to a danger level.

H2 (early_logits.py) judges each sample against the module's own median, learned during the growth itself,
and so confirms late (issue 41: a median lead of 11 steps on runs written unlike the scenarios). H12 reads
what the growth says instead: the doubling time of the max attention logit between two samples, forecast to
the level where softmax attention is one-hot (Zhai et al. 2023; Wortsman et al. 2023), with an absolute
prior on the level (a healthy run's max logit sharpens quickly at first, then levels off below it).
The forecast itself is :func:`forecast_step`, used by the rule and by bench/early_warning/replay.py.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from gradwatch.server.rules.batch import layer_array
from gradwatch.server.rules.catalog._shared import SETUP_EVENT, setup_optimizer
from gradwatch.server.rules.catalog.early_logits import AttentionLogitGrowth
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, name_of
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt


def _recent(mem: dict, step: int, max_back: int, min_back: int) -> tuple[list, Optional[tuple]]:
    """A module's kept samples of the last ``max_back`` steps before ``step``, and the latest of them at least
    ``min_back`` steps back (None: none is)."""
    keep = [tuple(p) for p in mem.get("k", []) if step - p[0] <= max_back and p[0] < step]
    return keep, next((p for p in reversed(keep) if step - p[0] >= min_back), None)


def _confirm(mem: dict, keep: list, step: int, x: float, hit: Optional[dict], consecutive: int,
             thin: int) -> Optional[dict]:
    """Count ``hit`` into the module's run of hits, keep the sample (positive; ``thin`` steps after the last
    kept one), and return the hit once it has held ``consecutive`` samples in a row."""
    mem["n"] = int(mem.get("n", 0)) + 1 if hit is not None else 0
    if math.isfinite(x) and x > 0 and (not keep or step - keep[-1][0] >= thin):
        keep.append((int(step), float(x)))
    mem["k"] = [list(p) for p in keep]
    if hit is not None and mem["n"] >= consecutive:
        hit["samples_in_a_row"] = mem["n"]
        return hit
    return None


def worst_module(batch, state: dict, prefix: str, judge, rank, stat: str = "attn_logit_max"):
    """For each step of ``batch`` that measured some module's ``stat`` (the max attention logit; H14: a router's
    logit spread): (its index, the module whose hit ranks lowest by ``rank`` as (module index, hit, value), or
    None when no module's does). ``judge(mem, step, x)`` is the rule's condition on one sample; ``mem`` is
    ``state[prefix + str(j)]``."""
    for i in batch.carriers(stat):
        row = layer_array(batch.steps[i], stat)
        step = int(batch.step[i])
        worst, judged = None, False
        for j in np.flatnonzero(np.isfinite(row)).tolist():
            hit = judge(state.setdefault(f"{prefix}{j}", {}), step, float(row[j]))
            judged = True
            if hit is not None and (worst is None or rank(hit) < rank(worst[1])):
                worst = (j, hit, float(row[j]))
        if judged:
            yield i, worst


def forecast_step(mem: dict, step: int, x: float, cfg: dict) -> Optional[dict]:
    """Feed one sample (``step``, max logit ``x``) of one module; ``mem`` its state (a dict, JSON-safe).
    Returns the evidence when the module's condition holds at this sample, else None.

    The condition: the logit is at least ``min_logit``, grew over the last ``span``..``max_span`` steps
    (against the latest kept sample at least ``span`` steps back) at a rate that reaches ``danger`` within
    ``horizon`` steps, or is already past ``level`` and not falling; ``consecutive`` samples in a row.

    >>> cfg = dict(min_logit=20.0, danger=1000.0, horizon=300, level=200.0, span=10, max_span=120,
    ...            consecutive=2, thin=5)
    >>> mem = {}
    >>> [forecast_step(mem, s, v, cfg) is not None for s, v in [(0, 5.0), (50, 12.0), (100, 30.0), (150, 75.0)]]
    [False, False, False, True]
    """
    keep, ref = _recent(mem, step, cfg["max_span"], cfg["span"])
    hit = None
    if math.isfinite(x) and x >= cfg["min_logit"] and ref is not None and ref[1] > 0:
        rate = math.log(x / ref[1]) / (step - ref[0]) if x > 0 else -math.inf
        to_danger = 0.0 if x >= cfg["danger"] else (math.log(cfg["danger"] / x) / rate if rate > 0 else math.inf)
        growing = rate > 0 and to_danger <= cfg["horizon"]
        high = x >= cfg["level"] and rate >= 0
        if growing or high:
            hit = {"rate": rate, "doubling_steps": math.log(2) / rate if rate > 0 else None,
                   "steps_to_danger": to_danger, "reference": [int(ref[0]), float(ref[1])]}
    return _confirm(mem, keep, step, x, hit, cfg["consecutive"], cfg["thin"])


@register
class AttentionLogitForecast(BatchRule):
    id, name, severity, checklist = "H12", "attention_logit_forecast", "warning", "5.2"
    family = "H"
    fires_when = ("an attention module's max attention logit is >= {min_logit:g} and its growth since a sample "
                  "{span}-{max_span} steps earlier reaches {danger:g} within {horizon} steps, or it is >= {level:g} "
                  "and not falling; {consecutive} samples in a row. A doubling-time gate per optimizer family "
                  "(the run_setup event's), off at 0 (AdamW and others {doubling_adaptive:g}, SGD "
                  "{doubling_sgd:g}, RMSprop {doubling_rmsprop:g} steps): only a growth that doubles the logit "
                  "within that limit warns")
    diagnosis = ("Attention-logit growth, forecast: the max attention logit of this module grows fast enough to "
                 "turn its softmax one-hot (attention entropy collapse) within the forecast horizon; the loss "
                 "often diverges next, not always: a task that rewards one-hot attention can train on through it "
                 "(docs/early-warning.md). Check: (1) is qk-layernorm used? (2) is the learning rate high for this "
                 "model size? (3) is the warm-up short or absent?")
    actions = AttentionLogitGrowth.actions   # the same growth, seen earlier: the same three remedies
    # The doubling-time gate (issue 41), off by default: the balanced profile of docs/early-warning.md ("H12 gated
    # by the doubling time") sets H13's limits, 5 / 8 / 10, and H2 to info. Then only a hit whose growth doubles
    # the logit as fast as H13 calls a runaway warns. On the first space's held-out half that profile warned 8 of
    # 29 healthy controls instead of 17, but 23 of 29 runs >= 20 steps ahead instead of 26, and on the other
    # kinds (bf16, mixtures of experts) it lost more lead than it saved controls; so it is not the default.
    params = {"min_logit": Float(60.0), "danger": Float(1000.0), "horizon": Int(300), "level": Float(250.0),
              "span": Int(10), "max_span": Int(120), "consecutive": Int(2), "thin": Int(5),
              "doubling_adaptive": Float(0.0, zero_ok=True), "doubling_rmsprop": Float(0.0, zero_ok=True),
              "doubling_sgd": Float(0.0, zero_ok=True)}
    needs = ("layers.attn_logit_max",)
    evidence_events = (SETUP_EVENT,)   # the engine keeps the run's latest run_setup: its optimizer's class
    # State per module j: "f<j>" the forecast's memory (forecast_step: the kept samples, the run of hits).

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        family, limit = doubling_limit(batch, cfg)
        if limit:
            judge = lambda mem, step, x: fast_enough(forecast_step(mem, step, x, cfg), limit)   # noqa: E731
        else:                                                   # the gate is off (the default)
            judge = lambda mem, step, x: forecast_step(mem, step, x, cfg)   # noqa: E731
        for i, worst in worst_module(batch, state, "f", judge, rank=lambda hit: hit["steps_to_danger"]):
            if worst is not None:
                j, hit, x = worst
                module = name_of(batch.ctx.module_names, j)
                when = ("past it" if hit["steps_to_danger"] == 0 else
                        f"reaching {fmt(cfg['danger'])} in ~{fmt(hit['steps_to_danger'])} steps"
                        if math.isfinite(hit["steps_to_danger"]) else "not falling")
                dbl = f", doubling every {fmt(hit['doubling_steps'])} steps" if hit["doubling_steps"] else ""
                if limit:
                    dbl += f" (a healthy run with this optimizer, {family}, takes more than {fmt(limit)})"
                out.hits[i] = Hit({"module": module, "attn_logit_max": x, "optimizer_family": family, **hit},
                                  f"Max attention logit of {module} is {fmt(x)}, up from {fmt(hit['reference'][1])} "
                                  f"at step {hit['reference'][0]}{dbl}, {when}: add qk-layernorm, lower the LR or "
                                  f"lengthen the warm-up")
            else:   # some module measured, none holds the condition
                out.clear[i] = True
        return out


# H13's doubling-time limit per optimizer family (issue 41). An adaptive optimizer moves every weight at the
# pace its LR sets, whatever the gradient, so a healthy run's logits sharpen fast too: on the early-warning
# benchmark's tuning half the max logit of AdamW's healthy controls grew x2.4-7.8 in 25 steps where their
# divergent twins grew x46-881; SGD's controls x1.1-3.2, its twins x2.1-83. A class not named here (Adam, NAdam,
# Lion, Adafactor, an unknown or unreported optimizer) gets the adaptive limit, the strictest: fewer warnings.
OPTIMIZER_FAMILIES = {"SGD": "sgd", "RMSprop": "rmsprop"}


def fast_enough(hit: Optional[dict], max_doubling: float) -> Optional[dict]:
    """H12's gate: its confirmed ``hit`` if its growth doubles the logit within ``max_doubling`` steps, else None
    (the forecast's memory was fed all the same). Used by the rule and by bench/early_warning/replay.py.

    >>> fast_enough({"doubling_steps": 4.0}, 5.0) is not None, fast_enough({"doubling_steps": 40.0}, 5.0)
    (True, None)
    >>> fast_enough({"doubling_steps": None}, 5.0) is None      # past the level, not growing
    True
    """
    if hit is None or hit["doubling_steps"] is None or hit["doubling_steps"] > max_doubling:
        return None
    hit["limit_steps"] = max_doubling
    return hit


def doubling_limit(batch, cfg: dict) -> tuple[str, float]:
    """The run's optimizer family (its ``run_setup`` event's class; none reported: 'adaptive', the strictest) and
    the rule's doubling-time setting for it, ``cfg["doubling_<family>"]`` (H12's gate, H13, H14)."""
    family = optimizer_family(setup_optimizer(batch.ctx))
    return family, cfg[f"doubling_{family}"]


def optimizer_family(name: Optional[str]) -> str:
    """'sgd', 'rmsprop' or 'adaptive' for an optimizer class name (the ``run_setup`` event's).

    >>> optimizer_family("SGD"), optimizer_family("AdamW"), optimizer_family(None)
    ('sgd', 'adaptive', 'adaptive')
    """
    return OPTIMIZER_FAMILIES.get(name or "", "adaptive")


def runaway_step(mem: dict, step: int, x: float, cfg: dict, max_doubling: float) -> Optional[dict]:
    """Feed one sample (``step``, max logit ``x``) of one module to H13; ``mem`` its state (a dict, JSON-safe).
    Returns the evidence when the condition has held ``consecutive`` samples in a row, else None.

    The condition: the logit is at least ``min_logit`` and has doubled in at most ``max_doubling`` steps since
    the latest sample ``span`` to ``2 * span`` steps earlier. Used by the rule and by
    bench/early_warning/replay.py.

    >>> cfg = dict(min_logit=20.0, span=25, consecutive=2)
    >>> mem = {}
    >>> [runaway_step(mem, s, v, cfg, 5.0) is not None for s, v in [(0, 2.0), (25, 100.0), (50, 5e3), (75, 6e3)]]
    [False, False, True, False]
    """
    keep, ref = _recent(mem, step, 2 * cfg["span"], cfg["span"])
    hit = None
    if math.isfinite(x) and x >= cfg["min_logit"] and ref is not None and 0 < ref[1] < x:
        doubling = (step - ref[0]) * math.log(2) / math.log(x / ref[1])
        if doubling <= max_doubling:
            hit = {"doubling_steps": doubling, "limit_steps": max_doubling, "reference": [int(ref[0]), float(ref[1])]}
    return _confirm(mem, keep, step, x, hit, cfg["consecutive"], thin=1)   # every sample: the window is short


@register
class AttentionLogitRunaway(BatchRule):
    id, name, severity, checklist = "H13", "attention_logit_runaway", "warning", "5.2"
    family = "H"
    fires_when = ("an attention module's max attention logit is >= {min_logit:g} and has doubled in at most "
                  "{doubling_adaptive:g} steps (SGD {doubling_sgd:g}, RMSprop {doubling_rmsprop:g}: the run_setup "
                  "event's optimizer) since a sample {span}-2x{span} steps earlier; {consecutive} samples in a row")
    diagnosis = ("Attention-logit runaway: the max attention logit of this module doubles faster than a healthy run's "
                 "does with this optimizer, while its softmax turns one-hot; most runs it warned on the early-warning "
                 "benchmark diverged next, not all (21 of 26 on its held-out half: docs/early-warning.md). Check: "
                 "(1) is qk-layernorm used? (2) is the learning rate high for this model size? (3) is the warm-up "
                 "short or absent?")
    actions = AttentionLogitGrowth.actions   # the same growth: the same three remedies
    params = {"min_logit": Float(20.0), "span": Int(25), "consecutive": Int(2), "doubling_adaptive": Float(5.0),
              "doubling_rmsprop": Float(8.0), "doubling_sgd": Float(10.0)}
    needs = ("layers.attn_logit_max",)
    evidence_events = (SETUP_EVENT,)   # the engine keeps the run's latest run_setup: its optimizer's class
    # State per module j: "r<j>" runaway_step's memory (the samples of the last 2 x span steps, the run of hits).

    def evaluate(self, batch, state, cfg):
        family, limit = doubling_limit(batch, cfg)

        def hit_of(module: str, x: float, hit: dict) -> Hit:
            return Hit({"module": module, "attn_logit_max": x, "optimizer_family": family, **hit},
                       f"Max attention logit of {module} is {fmt(x)}, up from {fmt(hit['reference'][1])} "
                       f"at step {hit['reference'][0]}: doubling every {fmt(hit['doubling_steps'])} steps, "
                       f"faster than the {fmt(limit)} a healthy run with this optimizer ({family}) shows: "
                       f"add qk-layernorm, lower the LR or lengthen the warm-up")
        return runaway_outcome(batch, state, cfg, limit, "attn_logit_max", hit_of)


def runaway_outcome(batch, state: dict, step_cfg: dict, limit: float, stat: str, hit_of) -> Outcome:
    """H13's and H14's verdicts on ``batch``: at each step that measured some module's ``stat``, a hit when a
    module's value holds :func:`runaway_step` (``step_cfg``: its ``min_logit``, ``span`` and ``consecutive``;
    ``limit``: the doubling time), built by ``hit_of(module name, value, evidence)`` for the module doubling
    fastest; a clear when modules were measured and none holds it."""
    out = Outcome.quiet(batch.n)
    judge = lambda mem, step, x: runaway_step(mem, step, x, step_cfg, limit)   # noqa: E731
    for i, worst in worst_module(batch, state, "r", judge, rank=lambda hit: hit["doubling_steps"], stat=stat):
        if worst is not None:
            j, hit, x = worst
            out.hits[i] = hit_of(name_of(batch.ctx.module_names, j), x, hit)
        else:   # some module measured, none holds the condition
            out.clear[i] = True
    return out
