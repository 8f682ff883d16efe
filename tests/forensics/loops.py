"""Real tiny training loops with a known precursor (or none) before a NaN loss at a known step.

The loop is tests/scenarios' (autocast-free fp32 here, GradScaler, Adam, the real agent). The precursor
is a gradient hook on one parameter that multiplies its gradient by a gain growing 8 % a step from
``grow_from`` on (a layer whose backward amplifies, as an attention block with growing logits does);
Adam normalises the update, so training goes on while that layer's grad norm climbs. At ``nan_at`` the
loss goes NaN (the failure; the truth the test knows). Without ``grow_from`` the run is healthy until
the sudden NaN.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from tests.scenarios.training import Loop, mlp, regression_data

GROWTH = 1.08
GROWING_PARAM = "2.weight"          # the middle Linear of mlp(depth=2): Linear, Tanh, Linear, Tanh, Linear


def precursor_loop(*, nan_at: int, grow_from: Optional[int], steps: Optional[int] = None, seed: int = 40) -> Loop:
    torch.manual_seed(seed)
    model = mlp()
    clock = {"step": 0}

    def gain(grad):
        s, start = clock["step"], grow_from
        return grad if start is None or s < start else grad * GROWTH ** (s - start + 1)

    dict(model.named_parameters())[GROWING_PARAM].register_hook(gain)

    def tick(step, loop):
        clock["step"] = step

    def loss(out, y):
        value = F.mse_loss(out, y)
        return value * math.nan if clock["step"] == nan_at else value

    return Loop(model, torch.optim.Adam(model.parameters(), lr=1e-3), regression_data(seed), loss,
                steps=steps or nan_at + 5, clip=None, ema_decay=None, before_step=tick)
