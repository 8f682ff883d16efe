"""Per-module activation statistics and input checks, from hooks installed only on sampled steps."""
from __future__ import annotations

from typing import Any, Optional

import torch

from gradwatch.agent.capture.shards import local_tensor

CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential, torch.nn.ParameterList,
              torch.nn.ParameterDict)


def first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    if isinstance(value, dict):
        for v in value.values():
            if isinstance(v, torch.Tensor):
                return v
    return getattr(value, "last_hidden_state", None) if hasattr(value, "last_hidden_state") else None


def activation_stats(out: torch.Tensor) -> torch.Tensor:
    """[mean, std, abs-max, non-finite count] of one output, float32, on its device.

    >>> activation_stats(torch.tensor([1.0, -3.0, float("nan")])).tolist()[3]
    1.0
    >>> [round(v, 4) for v in activation_stats(torch.tensor([[1.0, -3.0], [2.0, 4.0]])).tolist()]
    [1.0, 2.5495, 4.0, 0.0]
    """
    x = local_tensor(out.detach())   # a DTensor output (tensor parallel): this rank's shard, no collective
    if x.dtype != torch.float32:
        x = x.float()
    if x.device.type != "cpu":   # one launch each: the fewest kernels
        std, mean = torch.std_mean(x, correction=0)
        absmax = torch.linalg.vector_norm(x, float("inf"))
        nonfinite = x.numel() - torch.isfinite(x).sum()
    else:
        # On CPU, torch's std_mean is a scalar Welford loop (~6 ns an element on the 2-core reference
        # machine), vector_norm(inf) ~3 ns and isfinite().sum() ~2 ns: ~210 us a module of the
        # overhead bench's loop, 90 modules every 100 steps. Two passes (mean, then the cascade sum of
        # the squared deviations: as exact as std_mean, 1e-8 relative on 33M elements, where an fp32
        # vector_norm of the deviations was off by 2e-3), aminmax and a NaN test of x * 0 (NaN exactly
        # where x is NaN or infinite) do the same in a fifth of the time (docs/performance.md). Only
        # with a non-finite value present do the results differ: an infinite mean stays infinite here
        # where std_mean gives NaN.
        mean = x.mean()
        std = (torch.square(x - mean).sum() / x.numel()).sqrt()
        lo, hi = torch.aminmax(x)
        absmax = torch.maximum(hi, -lo)
        nonfinite = torch.isnan(x * 0).sum()
    return torch.stack([mean, std, absmax, nonfinite])   # stack promotes the int64 count to float32


def count_nonfinite(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """Non-finite values over the floating-point tensors of a forward call's inputs."""
    total = None
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (tuple, list)) else (value.values() if isinstance(value, dict) else (value,))
        for t in items:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                n = t.numel() - torch.isfinite(t.detach()).sum()
                total = n if total is None else total + n
    return total


def batch_shape(args: tuple, kwargs: dict) -> tuple[int, int]:
    """(samples, tokens) of one forward call, from shapes only (host metadata, no sync).
    Tokens are counted for an integer 2-D input (token ids)."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:   # the usual call: model(x)
        t = args[0]
        return t.shape[0], (t.numel() if (t.dim() == 2 and not t.is_floating_point()) else 0)
    for value in list(args) + list(kwargs.values()):
        t = value if isinstance(value, torch.Tensor) else first_tensor(value)
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            samples = t.shape[0]
            tokens = t.numel() if (t.dim() == 2 and not t.is_floating_point()) else 0
            return samples, tokens
    return 0, 0
