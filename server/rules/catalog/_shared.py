"""What more than one rule of the catalogue uses (not a rule module: the registry skips it)."""
from __future__ import annotations

# grad norm below this is "vanishing": B1's default threshold, and B2's test of a normal grad norm
VANISHING_GRAD_NORM = 1e-7

BF16_ACTION = ("On fp16, switch autocast to bf16 (torch.autocast(..., dtype=torch.bfloat16)) if the hardware "
               "supports it, or keep GradScaler's dynamic loss scaling on.")

# The run's own configuration, as the agent reports it at attach (the ``run_setup`` event: clipping and its
# max_norm, the scaler, the EMA …). A rule that tailors its advice to it lists this kind in its
# ``evidence_events``, so that the engine keeps the run's latest one in ``ctx.remembered`` (issue 42: no
# advice to do what the run already does).
SETUP_EVENT = "run_setup"


def clip_max_norm(batch, i: int):
    """The max_norm the run clips its gradients to at row ``i`` of ``batch``: the step's own
    ``clip_max_norm`` when measured, else the ``run_setup`` event's; None when it does not clip."""
    import math

    v = batch.steps[i].get("clip_max_norm")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v)
    return setup_max_norm(batch.ctx)


def setup_max_norm(ctx):
    """The max_norm of the clip_grad_norm_ call the agent saw at attach (``run_setup``), or None."""
    clip = (ctx.remembered.get(SETUP_EVENT) or {}).get("clip") or {}
    m = clip.get("max_norm") if isinstance(clip, dict) else None
    return float(m) if isinstance(m, (int, float)) and not isinstance(m, bool) and m > 0 else None


def setup_optimizer(ctx):
    """The optimizer class the agent reported at attach (``run_setup``'s ``optimizer.class``), or None."""
    opt = (ctx.remembered.get(SETUP_EVENT) or {}).get("optimizer")
    name = opt.get("class") if isinstance(opt, dict) else None
    return name if isinstance(name, str) else None


def already_clipped(max_norm: float) -> str:
    """The action that replaces "enable gradient clipping" on a run that clips."""
    return (f"The run already clips its gradients (max_norm={max_norm:g}): clipping bounds each update, not what "
            f"drives the gradient up; lower the learning rate (or lengthen its warm-up) and look at the batch and "
            f"the layers with the largest gradient norms.")
