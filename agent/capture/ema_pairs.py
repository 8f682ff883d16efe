"""EMA divergence ||θ_ema − θ|| / ||θ|| for the EMA forms users have.

Accepted forms: a dict name → tensor (the checklist's ``EMA.shadow``), an
object with a ``.shadow`` dict, ``torch.optim.swa_utils.AveragedModel``, an
object with a ``.module`` (timm's ``ModelEmaV2``), or a plain ``nn.Module``
copy of the model.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from gradwatch.agent.capture.shards import local_tensors
from gradwatch.agent.capture.norms import tensor_norms


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


def ema_divergence(ema: Any, names: Sequence[str], params: Sequence[torch.Tensor],
                   matcher: Optional["EmaMatcher"] = None, per_param: bool = False):
    """(||θ_ema − θ||, ||θ||) as two 0-d device tensors over the matched parameters, or None.
    ``per_param`` (sharded runs): also the per-tensor norms of this rank's pieces and the indices of the
    matched parameters, ``(num, den, diff_norms, weight_norms, index)``, for the server to combine the
    ranks' pieces into the full parameters' divergence (server/storage/ranks.py).

    ``matcher`` (one per monitor) remembers which EMA tensor goes with which parameter, so
    that a sampled step whose EMA holds the same tensor objects as last time skips the
    per-name lookup and checks."""
    source = ema_tensors(ema)
    if not source:
        return None
    if matcher is None:
        matcher = EmaMatcher(names, params)
    matched = matcher.match(source)
    if matched is None:
        return None
    try:
        out = _divergence(*matched)
    except RuntimeError:   # a remembered tensor changed shape, device or dtype in place: match afresh
        matched = matcher.match(source, fresh=True)
        if matched is None:
            return None
        out = _divergence(*matched)
    return out + (matcher.index,) if per_param else out[:2]


def _divergence(shadows: list, live: list, cast: bool):
    # sharded (DTensor) weights and EMA: this rank's pieces, never a collective (a rank's own ratio)
    shadows, live = local_tensors(shadows), local_tensors(live)
    if cast:
        shadows = [s.to(q.dtype) for s, q in zip(shadows, live)]
    diffs = torch._foreach_sub(shadows, live)
    diff_norms, weight_norms = tensor_norms(diffs), tensor_norms(live)
    return (torch.linalg.vector_norm(diff_norms), torch.linalg.vector_norm(weight_norms), diff_norms,
            weight_norms)


class EmaMatcher:
    """EMA tensor ↔ parameter pairs, matched by name, shape and device; re-matched when the
    EMA holds other tensor objects than at the last match (EMA classes that replace their
    tensors), else taken as they were."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor]):
        self.names, self.params = names, params
        self._keys: Optional[list] = None   # the source key of each matched parameter
        self.index: list[int] = []          # the position in ``params`` of each matched parameter
        self._ids: list[int] = []
        self._source_id = 0
        self._live: list = []
        self._cast = False

    def match(self, source: dict, fresh: bool = False):
        keys = self._keys
        if keys is not None and not fresh and id(source) == self._source_id:
            try:
                shadows = [source[k] for k in keys]
            except KeyError:
                shadows = None
            if shadows is not None and list(map(id, shadows)) == self._ids:
                return shadows, self._live, self._cast
        shadows, live, keys, index = [], [], [], []
        for i, (name, p) in enumerate(zip(self.names, self.params)):
            key = _key(source, name)
            t = source.get(key) if key is not None else None
            if isinstance(t, torch.Tensor) and t.shape == p.shape and t.device == p.device:
                shadows.append(t)      # the caller holds torch.no_grad(): no detach() per tensor needed
                live.append(p)
                keys.append(key)
                index.append(i)
        if not live:
            self._keys = None
            return None
        self._keys, self._ids, self._source_id, self._live = keys, [id(t) for t in shadows], id(source), live
        self.index = index
        self._cast = any(s.dtype != q.dtype for s, q in zip(shadows, live))
        return shadows, live, self._cast


def _key(source: dict, name: str):
    if name in source:
        return name
    if name.startswith("module.") and name[7:] in source:
        return name[7:]
    if "module." + name in source:
        return "module." + name
    return None
