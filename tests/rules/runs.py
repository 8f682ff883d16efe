"""Randomised runs for the rule tests: healthy runs of random shapes with faults planted in them, and each
rule's row saying which of them it is tested on.

Steps are built as production builds them: the wire dict is validated by ``StepIn`` and turned into the
rules' step dict by ingest's ``_wire_step`` (layers as a ``_LayerView`` over the packed float32 blobs).
The generator is declared, not written as one function: ``tests/rules/generator.py`` (the driver),
``tests/rules/channels.py`` (the healthy signals), ``tests/rules/faults.py`` (one class per fault). A new
batch rule adds its row to ``RULE_RUNS`` below, and a fault class if none of the existing faults shows it.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

import tests.rules.channels  # noqa: F401  (declares the channels)
import tests.rules.faults  # noqa: F401  (declares the faults)
from gradwatch.server.rules.catalogue import RULES_BY_ID
from gradwatch.server.wire.schemas import StepIn
from tests.rules.generator import (BN, BN_NAMES, FAULT_TYPES, LAYERS, MODULE_NAMES, MODULES,  # noqa: F401
                                   PARAM_NAMES, random_faults, wire_run)

FAULTS = random_faults()


@dataclass(frozen=True)
class RuleRuns:
    """A batch rule's runs. Every rule also sees a healthy run, one with gaps (missing and non-finite values,
    a step sent twice) and one with four random faults at once (``tests/rules/test_batch_cuts.py::cases``)."""
    faults: tuple[str, ...]                        # its own faults, and the ones that disturb its inputs
    tight: dict = field(default_factory=dict)      # settings under which more steps sit near a threshold
    tiny: dict = field(default_factory=dict)       # settings under which its windows fill, slide and expire
                                                   # within a short (80-step) run


RULE_RUNS: dict[str, RuleRuns] = {
    "A1": RuleRuns(("nan_loss", "nan_tail", "gn_spike", "gn_decline", "vanish", "overflow_storm")),
    "A2": RuleRuns(("gn_spike", "gn_decline", "gn_nonfinite_no_scaler", "vanish", "overflow_storm"),
                   tight={"factor": 3.0, "window": 30, "min_history": 5},
                   tiny={"factor": 3.0, "window": 20, "min_history": 3}),
    "A4": RuleRuns(("bad_inputs", "nan_loss")),
    "A5": RuleRuns(("overflow_storm", "scale_collapse", "nan_loss"),
                   tight={"consecutive": 3, "window": 50},
                   tiny={"consecutive": 3, "window": 20, "fraction": 0.1}),
    "B1": RuleRuns(("vanish", "overflow_storm", "gn_decline", "gn_nonfinite_no_scaler"),
                   tight={"threshold": 1e-3, "steps": 5},
                   tiny={"threshold": 1e-3, "steps": 3}),
    "B2": RuleRuns(("plateau", "vanish", "nan_loss", "loss_spike", "oscillate"),
                   tight={"window": 100, "min_improvement": 0.05},
                   tiny={"window": 40, "min_improvement": 0.05}),
    "B3": RuleRuns(("scale_collapse", "overflow_storm", "nan_tail"),
                   tight={"halvings": 2, "window": 300, "min_scale": 4096.0},
                   tiny={"halvings": 2, "window": 20, "min_scale": 4096.0}),
    "B4": RuleRuns(("lr_zero", "late_divergence"), tight={"steps": 3}, tiny={"steps": 2}),
    "B5": RuleRuns(("dead", "overflow_storm"), tight={"steps": 10}, tiny={"steps": 10}),
    "C1": RuleRuns(("oscillate", "plateau", "loss_spike", "nan_loss"),
                   tight={"window": 50, "min_history": 20, "spread_ratio": 0.05},
                   tiny={"window": 20, "min_history": 10, "spread_ratio": 0.05}),
    "C2": RuleRuns(("clip_saturation", "gn_spike", "overflow_storm"),
                   tight={"window": 30, "fraction": 0.2},
                   tiny={"window": 10, "fraction": 0.3}),
    "C3": RuleRuns(("loss_spike", "plateau", "nan_loss", "oscillate"),
                   tight={"mad_factor": 3.0, "window": 30, "min_history": 5},
                   tiny={"mad_factor": 3.0, "window": 15, "min_history": 4}),
    "D1": RuleRuns(("late_divergence", "lr_zero", "loss_spike", "oscillate"),
                   tight={"window": 60, "lr_fraction": 0.5, "min_rise": 0.0},
                   tiny={"window": 20, "lr_fraction": 0.5, "min_rise": 0.0}),
    "D2": RuleRuns(("ema",),
                   tight={"factor": 1.5, "window": 30, "min_history": 5},
                   tiny={"factor": 1.5, "window": 15, "min_history": 4}),
    "D3": RuleRuns(("layer_faults",)),
    "E1": RuleRuns(("layer_faults",),
                   tight={"factor": 2.0, "history": 6, "min_history": 2},
                   tiny={"factor": 2.0, "history": 4, "min_history": 2}),
    "E2": RuleRuns(("layer_faults",),
                   tight={"growth": 0.05, "window": 200, "min_samples": 3},
                   tiny={"growth": 0.02, "window": 30, "min_samples": 3}),
    "E3": RuleRuns(("layer_faults", "overflow_storm"),
                   tight={"high": 2e-3, "window": 30, "min_samples": 2},
                   tiny={"high": 2e-3, "window": 10, "min_samples": 2}),
    "B6": RuleRuns(("grad_underflow", "scale_collapse"),
                   tight={"share": 0.3, "baseline": 0.25, "history": 5, "min_samples": 2},
                   tiny={"share": 0.3, "baseline": 0.25, "history": 4, "min_samples": 2}),
    "H1": RuleRuns(("adam_stale", "overflow_storm", "dead", "gn_nonfinite_no_scaler"),
                   tight={"ratio": 20.0, "sigma": 3.0, "window": 30, "min_history": 5},
                   tiny={"ratio": 20.0, "window": 8, "min_history": 3}),
    "H4": RuleRuns(("linear_growth", "layer_faults"),
                   tight={"factor": 1.5, "growth": 1.1, "rising": 3, "history": 10, "min_samples": 4},
                   tiny={"factor": 1.5, "growth": 1.1, "rising": 2, "history": 5, "min_samples": 3}),
    "H2": RuleRuns(("attn_growth", "layer_faults"),
                   tight={"factor": 2.0, "sigmas": 3.0, "min_logit": 20.0, "consecutive": 3, "window": 50,
                          "min_history": 5},
                   tiny={"factor": 2.0, "sigmas": 3.0, "min_logit": 20.0, "consecutive": 2, "window": 12,
                         "min_history": 3}),
    "H12": RuleRuns(("attn_growth", "layer_faults"),
                    tight={"min_logit": 20.0, "danger": 200.0, "horizon": 100, "level": 100.0, "consecutive": 1,
                           "doubling_adaptive": 15.0},
                    tiny={"min_logit": 20.0, "danger": 200.0, "horizon": 100, "level": 100.0, "span": 3,
                          "max_span": 20, "consecutive": 1, "doubling_adaptive": 15.0}),
    "H13": RuleRuns(("attn_growth", "layer_faults"),
                    tight={"min_logit": 10.0, "doubling_adaptive": 15.0, "consecutive": 1},
                    tiny={"min_logit": 10.0, "span": 5, "doubling_adaptive": 15.0, "consecutive": 1}),
    "H14": RuleRuns(("router_growth", "layer_faults"),
                    tight={"min_spread": 2.0, "doubling_adaptive": 20.0},
                    tiny={"min_spread": 2.0, "span": 5, "doubling_adaptive": 20.0}),
    "H3": RuleRuns(("logz_drift", "nan_loss"),
                   tight={"min_abs_log_z": 10.0, "min_drift": 4.0, "sigmas": 3.0, "consecutive": 3, "window": 50,
                          "min_history": 5},
                   tiny={"min_abs_log_z": 10.0, "min_drift": 4.0, "sigmas": 3.0, "consecutive": 2, "window": 12,
                         "min_history": 3}),
    # lr_jump and mem_leak are not among the random faults (the other rules' runs stay as they were)
    "H10": RuleRuns(("lr_jump", "lr_zero", "late_divergence")),
    "D4": RuleRuns(("mem_leak",),
                   tight={"window": 50, "windows": 3, "growth": 0.1},
                   tiny={"window": 5, "windows": 3, "growth": 0.1}),
}
for _rule, _runs in RULE_RUNS.items():
    _unknown = set(_runs.faults) - set(FAULT_TYPES)
    assert not _unknown, f"{_rule}: no fault declared as {sorted(_unknown)}"

RELEVANT = {rule: runs.faults for rule, runs in RULE_RUNS.items()}
TINY = {rule: runs.tiny for rule, runs in RULE_RUNS.items() if runs.tiny}


def configs(rule_id: str) -> list[dict]:
    """The defaults, and tighter settings under which more steps sit near a threshold."""
    base = RULES_BY_ID[rule_id].defaults()
    tight = RULE_RUNS[rule_id].tight if rule_id in RULE_RUNS else {}
    return [base] + ([{**base, **tight}] if tight else [])


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
