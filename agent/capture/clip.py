"""Sees ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grads_with_norm_``) while a monitor is attached.

The patch is installed when the first monitor attaches and removed when the
last one detaches. A call whose parameters belong to an attached model is
handed to that monitor, which computes the per-parameter norms once and clips
with them (so the norm is computed once, not twice); any other call goes to
torch unchanged. Code that did ``from torch.nn.utils import clip_grad_norm_``
before attaching keeps the original function: then the agent computes the
norms itself and ``clip_max_norm`` is null.

``torch.nn.utils.clip_grads_with_norm_`` (torch >= 2.6) is seen too, observe only: code that computes
the total norm itself with ``get_total_norm`` and clips with it (accelerate >= 1.16's DTensor-aware
``Accelerator.clip_grad_norm_``, used by the HF Trainer) never calls ``clip_grad_norm_``. The owners
hear ``on_clip_with_norm(parameters, max_norm)`` before the grads are scaled in place, so they can note
the threshold and measure the pre-clip grads.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.utils.clip_grad as _clip_module

_lock = threading.Lock()
_owners: list[Any] = []          # monitors, each with .owns_params(list) and .on_clip(...)
_original: dict[str, Callable] = {}


def _as_list(parameters) -> list:
    """The parameters as torch's clip functions take them (a tensor or an iterable), once, as a list."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    original = _original.get("fn") or _clip_module.clip_grad_norm_
    parameters = _as_list(parameters)
    for owner in list(_owners):
        handled, result = owner.on_clip(parameters, max_norm, norm_type, error_if_nonfinite, foreach, original)
        if handled:
            return result
    return original(parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                    foreach=foreach)


clip_grad_norm_.__doc__ = _clip_module.clip_grad_norm_.__doc__
clip_grad_norm_.__wrapped__ = _clip_module.clip_grad_norm_


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    original = _original.get("with_norm") or torch.nn.utils.clip_grads_with_norm_
    parameters = _as_list(parameters)
    for owner in list(_owners):
        note = getattr(owner, "on_clip_with_norm", None)
        if note is not None:
            try:
                note(parameters, max_norm)
            except Exception:  # noqa: BLE001 - an observer never stops the user's clip
                pass
    return original(parameters, max_norm, total_norm, foreach=foreach)


# torch >= 2.6. Only the public name is patched: torch's own clip_grad_norm_ calls the module's private
# _clip_grads_with_norm_, and that call is already seen through the clip_grad_norm_ patch.
_HAS_WITH_NORM = hasattr(torch.nn.utils, "clip_grads_with_norm_")
if _HAS_WITH_NORM:
    clip_grads_with_norm_.__doc__ = torch.nn.utils.clip_grads_with_norm_.__doc__
    clip_grads_with_norm_.__wrapped__ = torch.nn.utils.clip_grads_with_norm_


def register(owner: Any) -> None:
    with _lock:
        if not _owners:
            _original["fn"] = _clip_module.clip_grad_norm_
            _original["utils"] = torch.nn.utils.clip_grad_norm_
            torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
            _clip_module.clip_grad_norm_ = clip_grad_norm_
            if _HAS_WITH_NORM:
                _original["with_norm"] = torch.nn.utils.clip_grads_with_norm_
                torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
        if owner not in _owners:
            _owners.append(owner)


def unregister(owner: Any) -> None:
    with _lock:
        if owner in _owners:
            _owners.remove(owner)
        if not _owners and _original:
            _clip_module.clip_grad_norm_ = _original.pop("fn")
            torch.nn.utils.clip_grad_norm_ = _original.pop("utils")
            if "with_norm" in _original:
                torch.nn.utils.clip_grads_with_norm_ = _original.pop("with_norm")


def clip_with_norm(parameters, max_norm, total, foreach) -> None:
    """Clip with a norm the agent computed (torch's own function, not the observing patch)."""
    (_original.get("with_norm") or torch.nn.utils.clip_grads_with_norm_)(parameters, max_norm, total,
                                                                          foreach=foreach)
