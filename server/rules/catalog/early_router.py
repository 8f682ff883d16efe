"""A mixture of experts' router running away (H14): the spread of one token's router logits doubling fast.

A router's softmax turns one-hot as the spread of a token's logits (max - min over the experts) grows; routing then
collapses onto few experts, and ST-MoE's router z-loss was made against this growth (Zoph et al. 2022). On the
early-warning benchmark's mixture-of-experts space (docs/early-warning.md, "A mixture of experts: the router"),
the spread of the runs that went on to diverge doubled in under 12 steps 50-200 steps ahead, where no attention
rule can warn a model with no attention, and no healthy control's did. The agent measures the spread where the
router's softmax is computed (agent/capture/attention.py, ``router_logit_spread``); the condition is H13's, on
this figure (:func:`~server.rules.catalog.early_forecast.runaway_step`).
"""
from __future__ import annotations

from gradwatch.server.rules.catalog.early_forecast import worst_module, runaway_step
from gradwatch.server.rules.registry import register
from gradwatch.server.rules.rule import BatchRule, Outcome, name_of
from gradwatch.server.rules.spec import Float, Hit, Int
from gradwatch.server.rules.stats import fmt


@register
class RouterLogitRunaway(BatchRule):
    id, name, severity, checklist = "H14", "router_logit_runaway", "warning", "5.2 / 6.2"
    family = "H"
    fires_when = ("a router's logit spread (the largest max - min of one token's logits over the experts) is "
                  ">= {min_spread:g} and has doubled in at most {doubling:g} steps since a sample {span}-2x{span} "
                  "steps earlier; {consecutive} samples in a row")
    diagnosis = ("Router runaway: the router logits of this mixture of experts grow fast enough that its softmax turns "
                 "one-hot and the tokens collapse onto few experts; on the early-warning benchmark the runs it warned "
                 "diverged 50-200 steps later (docs/early-warning.md). Check: (1) is a router z-loss (or a load-"
                 "balancing loss) used? (2) is the learning rate high for the router? (3) is the router computed in "
                 "float32?")
    actions = {
        "router_z_loss": "Add a router z-loss, 1e-3 x mean(logsumexp(router logits)^2) (ST-MoE, Zoph et al. 2022), "
                         "and a load-balancing loss (Switch Transformer).",
        "lower_lr": "Lower the learning rate (÷2-÷10), or the router's own in a param group of its own.",
        "fp32_router": "Compute the router's logits and softmax in float32 under autocast.",
    }
    # Chosen on the MoE space's tuning half only (bench/early_warning/router.py, 19 cases, sampled every 25 steps):
    # a doubling within 10-15 steps and a floor of 1-16 all warn no control and 7-9 twins >= 50 steps ahead; 20 steps
    # warns 1-3 controls (AdamW routers sharpen fast when healthy too). 12 and 8 sit inside that plateau.
    params = {"min_spread": Float(8.0), "doubling": Float(12.0), "span": Int(25), "consecutive": Int(1)}
    needs = ("layers.router_logit_spread",)
    # State per module j: "r<j>" runaway_step's memory (the samples of the last 2 x span steps, the run of hits).

    def evaluate(self, batch, state, cfg):
        out = Outcome.quiet(batch.n)
        step_cfg = {"min_logit": cfg["min_spread"], "span": cfg["span"], "consecutive": cfg["consecutive"]}
        judge = lambda mem, step, x: runaway_step(mem, step, x, step_cfg, cfg["doubling"])   # noqa: E731
        for i, worst in worst_module(batch, state, "r", judge, rank=lambda hit: hit["doubling_steps"],
                                      stat="router_logit_spread"):
            if worst is not None:
                j, hit, x = worst
                module = name_of(batch.ctx.module_names, j)
                out.hits[i] = Hit({"module": module, "router_logit_spread": x, **hit},
                                  f"Router logit spread of {module} is {fmt(x)}, up from {fmt(hit['reference'][1])} "
                                  f"at step {hit['reference'][0]}: doubling every {fmt(hit['doubling_steps'])} steps "
                                  f"(a healthy router takes more than {fmt(cfg['doubling'])}); its routing is turning "
                                  f"one-hot: add a router z-loss, lower the LR or compute the router in float32")
            else:   # some router measured, none holds the condition
                out.clear[i] = True
        return out
