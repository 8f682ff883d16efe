"""EMA divergence ||θ_ema − θ|| / ||θ|| for the EMA forms users have.

Accepted forms: a dict name → tensor (the checklist's ``EMA.shadow``), an
object with a ``.shadow`` dict, ``torch.optim.swa_utils.AveragedModel``, an
object with a ``.module`` (timm's ``ModelEmaV2``), or a plain ``nn.Module``
copy of the model.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from agent.capture.norms import tensor_norms


def ema_tensors(ema: Any) -> Optional[dict[str, torch.Tensor]]:
    """Name → tensor view of the EMA weights; looked up again at every use (EMA classes
    often replace their tensors instead of updating them in place)."""
    if isinstance(ema, dict):
        return ema
    shadow = getattr(ema, "shadow", None)
    if isinstance(shadow, dict):
        return shadow
    if isinstance(shadow, torch.nn.Module):
        return dict(shadow.named_parameters())
    inner = getattr(ema, "module", None)  # AveragedModel, timm ModelEmaV2
    if isinstance(inner, torch.nn.Module):
        return dict(inner.named_parameters())
    if isinstance(ema, torch.nn.Module):
        return dict(ema.named_parameters())
    return None


def check_ema(ema: Any) -> None:
    if ema_tensors(ema) is None:
        raise ValueError(
            f"ema={type(ema).__name__}: pass a dict of tensors, an object with a .shadow dict, "
            "torch.optim.swa_utils.AveragedModel, or an nn.Module holding the averaged weights"
        )


def _lookup(source: dict, name: str):
    t = source.get(name)
    if t is None and name.startswith("module."):
        t = source.get(name[7:])
    if t is None:
        t = source.get("module." + name)
    return t


def ema_divergence(ema: Any, names: Sequence[str], params: Sequence[torch.Tensor]):
    """(||θ_ema − θ||, ||θ||) as two 0-d device tensors over the matched parameters, or None."""
    source = ema_tensors(ema)
    if not source:
        return None
    shadows, live = [], []
    for name, p in zip(names, params):
        t = _lookup(source, name)
        if isinstance(t, torch.Tensor) and t.shape == p.shape and t.device == p.device:
            shadows.append(t)      # the caller holds torch.no_grad(): no detach() per tensor needed
            live.append(p)
    if not live:
        return None
    if any(s.dtype != q.dtype for s, q in zip(shadows, live)):
        shadows = [s.to(q.dtype) for s, q in zip(shadows, live)]
    diffs = torch._foreach_sub(shadows, live)
    num = torch.linalg.vector_norm(tensor_norms(diffs))
    den = torch.linalg.vector_norm(tensor_norms(live))
    return num, den
