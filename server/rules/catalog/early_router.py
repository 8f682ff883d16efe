"""A mixture of experts' router running away (H14): the spread of one token's router logits doubling fast.

A router's softmax turns one-hot as the spread of a token's logits (max - min over the experts) grows; routing then
collapses onto few experts, and ST-MoE's router z-loss was made against this growth (Zoph et al. 2022). On the
early-warning benchmark's mixture-of-experts space (docs/early-warning.md, "A mixture of experts: the router
(H14)"), the spread of most runs that went on to diverge under AdamW or RMSprop doubled within 12 steps (some under
SGD within 25), 50-261 steps ahead, where no attention rule can warn a model with no attention; two healthy
controls' of 39 did. The agent measures the spread where the router's softmax is computed
(agent/capture/attention.py, ``router_logit_spread``); the condition is H13's, on this figure
(:func:`~server.rules.catalog.early_forecast.runaway_outcome`).
"""
from __future__ import annotations

from gradwatch.server.rules.catalog._shared import SETUP_EVENT
from gradwatch.server.rules.catalog.early_forecast import doubling_limit, runaway_outcome
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt


@register
class RouterLogitRunaway(BatchRule):
    id, name, severity, checklist = "H14", "router_logit_runaway", "warning", "5.2 / 6.2"
    family = "H"
    fires_when = ("a router's logit spread (the largest max - min of one token's logits over the experts) is "
                  ">= {min_spread:g} and has doubled in at most {doubling_adaptive:g} steps (SGD {doubling_sgd:g}, "
                  "RMSprop {doubling_rmsprop:g}: the run_setup event's optimizer) since a sample {span}-2x{span} "
                  "steps earlier; {consecutive} samples in a row")
    diagnosis = ("Router runaway: the router logits of this mixture of experts grow fast enough that its softmax turns "
                 "one-hot and the tokens collapse onto few experts; on the early-warning benchmark the runs it warned "
                 "diverged 5-261 steps later, most 50 or more, and it warned 2 healthy runs of 39 "
                 "(docs/early-warning.md). Check: (1) is a router z-loss (or a load-balancing loss) used? (2) is the "
                 "learning rate high for the router? (3) is the router computed in float32?")
    actions = {
        "router_z_loss": "Add a router z-loss, 1e-3 x mean(logsumexp(router logits)^2) (ST-MoE, Zoph et al. 2022), "
                         "and a load-balancing loss (Switch Transformer).",
        "lower_lr": "Lower the learning rate (÷2-÷10), or the router's own in a param group of its own.",
        "fp32_router": "Compute the router's logits and softmax in float32 under autocast.",
    }
    # Chosen on the MoE space's tuning half only (bench/early_warning/router.py, 19 cases, sampled every 25 steps).
    # One limit for every optimizer first: a doubling within 10-15 steps and a floor of 1-16 warn no control and 7-9
    # twins >= 50 steps ahead, 20 steps warns 1-3 controls (AdamW routers sharpen fast when healthy too); that one
    # limit (12, floor 8) caught no run under SGD, on either half. Then per optimizer family, as H13 does: SGD's
    # twins' spreads grow x4-5 in 50 steps and its controls' x1.5-1.8, so SGD takes 20-30 steps (25) with no
    # control warned, and a floor of 4 (a twin under SGD peaks at a spread of ~10): 12 of 19 twins >= 50 ahead,
    # no control. RMSprop had 3 tuning twins, too few for a limit of its own: it takes the adaptive one.
    params = {"min_spread": Float(4.0), "span": Int(25), "consecutive": Int(1), "doubling_adaptive": Float(12.0),
              "doubling_rmsprop": Float(12.0), "doubling_sgd": Float(25.0)}
    needs = ("layers.router_logit_spread",)
    evidence_events = (SETUP_EVENT,)   # the engine keeps the run's latest run_setup: its optimizer's class
    # State per module j: "r<j>" runaway_step's memory (the samples of the last 2 x span steps, the run of hits).

    def evaluate(self, batch, state, cfg):
        family, limit = doubling_limit(batch, cfg)
        step_cfg = {"min_logit": cfg["min_spread"], "span": cfg["span"], "consecutive": cfg["consecutive"]}

        def hit_of(module: str, x: float, hit: dict) -> Hit:
            return Hit({"module": module, "router_logit_spread": x, "optimizer_family": family, **hit},
                       f"Router logit spread of {module} is {fmt(x)}, up from {fmt(hit['reference'][1])} "
                       f"at step {hit['reference'][0]}: doubling every {fmt(hit['doubling_steps'])} steps "
                       f"(a healthy router with this optimizer, {family}, takes more than {fmt(limit)}); "
                       f"its routing is turning one-hot: add a router z-loss, lower the LR or compute the "
                       f"router in float32")
        return runaway_outcome(batch, state, step_cfg, limit, "router_logit_spread", hit_of)
