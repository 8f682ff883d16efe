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
    """[mean, std, abs-max, non-finite count] of one output, float32, on its device."""
    x = local_tensor(out.detach())   # a DTensor output (tensor parallel): this rank's shard, no collective
    if x.dtype != torch.float32:
        x = x.float()
    std, mean = torch.std_mean(x, correction=0)
    absmax = torch.linalg.vector_norm(x, float("inf"))
    nonfinite = x.numel() - torch.isfinite(x).sum()
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
