"""What more than one rule of the catalogue uses (not a rule module: the registry skips it)."""
from __future__ import annotations

# grad norm below this is "vanishing": B1's default threshold, and B2's test of a normal grad norm
VANISHING_GRAD_NORM = 1e-7

BF16_ACTION = ("On fp16, switch autocast to bf16 (torch.autocast(..., dtype=torch.bfloat16)) if the hardware "
               "supports it, or keep GradScaler's dynamic loss scaling on.")
