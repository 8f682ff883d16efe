"""The rule catalogue: every rule's id, name, default thresholds and texts.

Leaf module (imports nothing internal). The diagnosis and action texts are
the troubleshooting checklist's (``shared/seed/stability-checklist.zh.txt``
section 8, with 6.2 / 7.1 / 9 where they say more), in English. Thresholds
are the defaults of the table in DESIGN.md; every one of them can be
overridden per project (see ``server.rules.config``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "critical")
SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}

# Keys every rule understands besides its own thresholds.
COMMON_PARAMS: dict[str, Any] = {
    "enabled": True,
    # steps the condition must stay clear before a firing alert resolves
    "clear_steps": 20,
    # a new episode within this many steps of the last one reopens that alert
    # instead of creating (and notifying) a new one
    "cooldown_steps": 50,
}


@dataclass(frozen=True)
class RuleSpec:
    id: str
    name: str
    severity: str
    checklist: str
    fires_when: str          # the condition, in words, with {placeholders} for thresholds
    diagnosis: str
    actions: tuple[str, ...]
    params: dict[str, Any] = field(default_factory=dict)

    def defaults(self) -> dict[str, Any]:
        out = dict(COMMON_PARAMS)
        out["severity"] = self.severity
        out.update(self.params)
        return out


_BF16 = "On fp16, switch autocast to bf16 (torch.autocast(..., dtype=torch.bfloat16)) if the hardware supports it, or keep GradScaler's dynamic loss scaling on."

RULES: tuple[RuleSpec, ...] = (
    RuleSpec(
        "A1", "loss_nonfinite", "critical", "8.A",
        "the loss is NaN/Inf (whether or not the scaler then skipped the step)",
        "The loss became NaN/Inf.",
        (
            "Grad norm was normal before the NaN: check the loss computation itself (log(0) in BCE / cross-entropy; "
            "torch.log(torch.sigmoid(logit)) instead of F.binary_cross_entropy_with_logits; division by zero in a normalisation).",
            "Grad norm exploded first: enable gradient clipping (max_norm=1.0) and lower the learning rate.",
            _BF16,
            "Check the inputs: add `assert not torch.isnan(x).any()` after data loading.",
        ),
        {"explode_factor": 10.0, "clear_steps": 10},
    ),
    RuleSpec(
        "A2", "grad_explosion", "critical", "8.A",
        "pre-clip grad norm > {factor:g}x its rolling median over {window} steps, or non-finite with no scaler to skip the step",
        "The gradient norm exploded (a precursor of NaN).",
        (
            "Enable gradient clipping: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0), after scaler.unscale_(optimizer).",
            "Lower the learning rate.",
            "Look at the parameters with the largest grad norms (evidence.top_grad_norms): an embedding or one layer blowing up points at its init or its inputs.",
        ),
        {"factor": 10.0, "window": 200, "min_history": 20},
    ),
    RuleSpec(
        "A3", "nan_origin", "warning", "8.A",
        "the agent located the first module whose activation or gradient went non-finite",
        "The NaN/Inf started in one layer: its activations or gradients overflowed.",
        (
            "Inspect that layer: check its weight initialisation, make sure nothing divides by zero (normalisation denominators), "
            "and look for overflow (fp16 range, softmax on very large logits).",
            _BF16,
        ),
        {},
    ),
    RuleSpec(
        "A4", "input_nonfinite", "critical", "8.A",
        "a non-finite value in the batch fed to the model",
        "The input batch contains NaN/Inf: the data pipeline produced it, the model did not.",
        (
            "Fix the data pipeline; add `assert torch.isfinite(x).all()` after data loading to find the sample.",
        ),
        {"clear_steps": 5},
    ),
    RuleSpec(
        "A5", "overflow_storm", "warning", "8.A / 8.B / 7.1",
        ">= {consecutive} consecutive skipped (overflow) steps, or > {fraction:.0%} of the last {window} steps skipped",
        "GradScaler keeps skipping steps: loss scaling is misconfigured, or the values really overflow the fp16 range.",
        (
            "Check the loss-scaling setup (init_scale, the order scale -> backward -> unscale_ -> clip -> step -> update).",
            "Switch autocast to bf16 (same exponent range as fp32, no overflow) if the hardware supports it.",
            "If the overflows are real, clip gradients and lower the learning rate.",
        ),
        {"consecutive": 5, "fraction": 0.05, "window": 200},
    ),
    RuleSpec(
        "B1", "vanishing_grad", "warning", "8.B",
        "grad norm < {threshold:g} for {steps} consecutive steps",
        "Vanishing gradients: the model barely receives a training signal.",
        (
            "Check the activation functions for saturation (sigmoid / tanh driven to their flat ends).",
            "Check the initialisation.",
            "Look for a stray .detach() (or an in-place op) that cuts the gradient off.",
        ),
        {"threshold": 1e-7, "steps": 20},
    ),
    RuleSpec(
        "B2", "loss_plateau", "warning", "8.B",
        "loss median of the last quarter of {window} steps not {min_improvement:.0%} below the first quarter's, while the grad norm is normal "
        "(and the loss has not yet fallen {converged_drop:.0%} below its first level: a converged run is not stuck)",
        "The loss does not go down although gradients are normal.",
        (
            "The learning rate may be too low: raise it.",
            "Check the model's wiring: a layer without gradient (see B5) or a wrong output head.",
            "Check the loss function's configuration (targets, reduction, class weights).",
        ),
        {"window": 500, "min_improvement": 0.01, "converged_drop": 0.5},
    ),
    RuleSpec(
        "B3", "loss_scale_collapse", "critical", "8.B",
        "loss scale < {min_scale:g}, or halved {halvings} times with no growth in {window} steps",
        "GradScaler keeps halving the loss scale: the effective update shrinks towards nothing.",
        (
            "Switch autocast to bf16 (dtype=torch.bfloat16), which needs no loss scaling.",
            "Or raise GradScaler's init_scale, and find the op that overflows (see A3 / A5).",
        ),
        {"min_scale": 1.0, "halvings": 3, "window": 2000},
    ),
    RuleSpec(
        "B4", "lr_zero", "critical", "7.1 / 8.B",
        "learning rate is 0 for {steps} consecutive steps after step 0",
        "The learning rate is zero: nothing is being learned.",
        (
            "Check the LR scheduler (a schedule that decays to 0, a warmup that never starts, wrong total_steps).",
            "Check that GradScaler is not halving the scale to nothing (see B3).",
        ),
        {"steps": 10},
    ),
    RuleSpec(
        "B5", "dead_params", "warning", "8.B",
        "a trainable parameter has had no or zero gradient for {steps} steps",
        "Some trainable parameters receive no gradient: a branch is detached or unused.",
        (
            "Look for a manual .detach() on the path to those parameters.",
            "Look for in-place operations that break the graph, or modules that are built but never called in forward().",
        ),
        {"steps": 50, "max_names": 5},
    ),
    RuleSpec(
        "C1", "loss_oscillation", "warning", "8.C",
        "robust spread (MAD) of the loss over {window} steps > {spread_ratio:g}x its median, with no downward trend, "
        "while the loss is still above {converged_fraction:.0%} of its starting level",
        "The loss oscillates without converging.",
        (
            "Lower the learning rate 5-10x.",
            "Increase the batch size (or the gradient-accumulation steps).",
            "Use a gentler LR schedule (cosine decay, or a slower step decay).",
        ),
        {"window": 200, "spread_ratio": 0.5, "min_history": 100, "converged_fraction": 0.2},
    ),
    RuleSpec(
        "C2", "clip_saturation", "warning", "8.C",
        "gradient clipping active on > {fraction:.0%} of the last {window} steps",
        "Gradient clipping is active most of the time: the grad norm is usually above max_norm.",
        (
            "Lower the learning rate together with max_norm.",
            "If the grad norm is large only at the start of training, a warmup is the usual remedy.",
        ),
        {"fraction": 0.5, "window": 200},
    ),
    RuleSpec(
        "C3", "loss_spike", "warning", "8.C / 7.2",
        "loss > median + {mad_factor:g}*MAD of the last {window} steps (MAD scaled to sigma); critical after {critical_consecutive} consecutive spikes",
        "The loss spiked far above its recent level.",
        (
            "A single spike: consider rolling back to the checkpoint before it and skipping that batch.",
            "Repeated spikes: lower the learning rate and check the data near those steps.",
        ),
        {"mad_factor": 6.0, "window": 200, "min_history": 20, "critical_consecutive": 5, "clear_steps": 10},
    ),
    RuleSpec(
        "D1", "late_divergence", "warning", "8.D / 9.2",
        "loss rising over {window} steps after the LR fell below {lr_fraction:.0%} of its peak",
        "Training diverges late, after the learning rate decayed.",
        (
            "The end learning rate of the schedule is too low (cosine decay to ~0): keep the final LR around base_lr / 10.",
            "Or make the schedule less aggressive.",
        ),
        {"window": 500, "lr_fraction": 0.1, "min_rise": 0.05},
    ),
    RuleSpec(
        "D2", "ema_divergence", "warning", "8.D",
        "EMA divergence ||theta_ema - theta|| / ||theta|| > {factor:g}x its rolling median over {window} steps, or oscillating",
        "The EMA weights drift away from the model's weights.",
        (
            "The EMA decay is too large for this task: try 0.999 or 0.99.",
        ),
        {"factor": 3.0, "window": 200, "min_history": 50},
    ),
    RuleSpec(
        "D3", "bn_drift", "warning", "8.D",
        "a BatchNorm layer's running_var changes > {factor:g}x within {window} steps (after the first {warmup_steps} steps)",
        "BatchNorm running statistics drift: the data the model sees changed.",
        (
            "When fine-tuning on new data, recompute the BatchNorm statistics on it (a pass in train mode without updates), "
            "or freeze BN layers.",
        ),
        {"factor": 10.0, "window": 100, "warmup_steps": 100},
    ),
    RuleSpec(
        "E1", "activation_jump", "warning", "7.1",
        "a module's activation std >= {factor:g}x the median of its last {history} samples",
        "A layer amplifies its signal: its activation variance jumped.",
        (
            "Inspect that layer (weights, normalisation, residual scaling); pre-norm or a normalisation after it controls the variance.",
            "Lower the learning rate if its weights grew quickly (see E2).",
        ),
        {"factor": 10.0, "history": 20, "min_history": 5},
    ),
    RuleSpec(
        "E2", "weight_norm_growth", "warning", "7.1",
        "a weight norm grows monotonically by > {growth:.0%} over {window} steps",
        "A weight norm keeps growing fast: the learning rate is too large.",
        (
            "Lower the learning rate; add or raise weight decay.",
        ),
        {"growth": 0.5, "window": 1000, "min_samples": 5},
    ),
    RuleSpec(
        "E3", "update_ratio", "warning", "—",
        "median per-layer update ratio ||dtheta|| / ||theta|| of the weights (not biases / norm gains) over {window} steps "
        "> {high:g} or < {low:g} (healthy ~1e-3)",
        "The size of the updates relative to the weights is far from the healthy ~1e-3.",
        (
            "Above 1e-2: the learning rate is far too high; lower it.",
            "Below 1e-6: the learning rate is far too low (or zero, or steps are skipped); raise it.",
        ),
        {"high": 1e-2, "low": 1e-6, "window": 100, "min_samples": 5},
    ),
    RuleSpec(
        "F1", "rank_divergence", "critical", "—",
        "one rank's loss is non-finite while the others' is finite, or > {factor:g}x the median of the others for {consecutive} steps",
        "One rank differs from the others: a bad node or a bad data shard.",
        (
            "Check that rank's data shard (NaN or corrupt samples) and its node (hardware errors, a different software version).",
        ),
        {"factor": 3.0, "consecutive": 5, "clear_steps": 10},
    ),
    RuleSpec(
        "F2", "run_stalled", "warning", "—",
        "no data from a running run for {timeout_s:g} s",
        "The run stopped sending data: the job hung or died.",
        (
            "Check the job: is the process alive, stuck in a collective (NCCL timeout), out of memory, or waiting on I/O?",
        ),
        {"timeout_s": 300.0},
    ),
)

RULES_BY_ID: dict[str, RuleSpec] = {r.id: r for r in RULES}
RULES_BY_NAME: dict[str, RuleSpec] = {r.name: r for r in RULES}


def find_rule(key: str) -> RuleSpec:
    """A rule by id ("A2", case-insensitive) or name ("grad_explosion")."""
    spec = RULES_BY_ID.get(key.upper()) or RULES_BY_NAME.get(key.lower())
    if spec is None:
        known = ", ".join(f"{r.id} {r.name}" for r in RULES)
        raise ValueError(f"unknown rule {key!r}; known rules: {known}")
    return spec


def describe(spec: RuleSpec, cfg: dict[str, Any]) -> str:
    """The rule's condition with the thresholds in ``cfg`` filled in."""
    try:
        return spec.fires_when.format(**cfg)
    except (KeyError, ValueError, IndexError):
        return spec.fires_when
