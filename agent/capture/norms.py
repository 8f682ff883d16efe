"""Fused norms over lists of tensors (one ``torch._foreach_norm`` call per list)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def grad_norms(params: Sequence[torch.Tensor]) -> Optional[tuple[torch.Tensor, list[int], torch.Tensor]]:
    """Per-parameter L2 grad norms, which parameters had a grad, and the global norm.

    The global norm is computed exactly as ``clip_grad_norm_`` does it (the norm
    of the stacked per-tensor norms), so it equals the value clipping sees.

    >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.full((2,), 3.0)
    >>> per, index, total = grad_norms([w, torch.nn.Parameter(torch.ones(1))])
    >>> index, round(float(total), 4)
    ([0], 4.2426)
    """
    grads = [p.grad for p in params]   # one pass over the parameters (this runs every step)
    if any(g is None for g in grads):
        index = [i for i, g in enumerate(grads) if g is not None]
        if not index:
            return None
        grads = [grads[i] for i in index]
    else:
        index = list(range(len(grads)))
    norms = torch._foreach_norm(grads, 2)
    per = torch.stack([n.to(torch.float32) for n in norms]) if _mixed(norms) else torch.stack(norms)
    return per, index, torch.linalg.vector_norm(per, 2)


def tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stacked L2 norms of each tensor, float32."""
    with torch.no_grad():
        norms = torch._foreach_norm(list(tensors), 2)
    return torch.stack([n.to(torch.float32) for n in norms]) if _mixed(norms) else torch.stack(norms)


def _mixed(norms) -> bool:
    first = norms[0].dtype
    return first != torch.float32 or any(n.dtype != first for n in norms)
