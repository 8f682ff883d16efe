"""What ``attach`` is given, unwrapped to what it can hook: the training stacks' wrappers, and the rest.

Training stacks hand the user wrappers rather than the objects they wrap. ``attach`` takes either;
this module finds the object inside (at attach, once; nothing here runs per step):

* optimizers: Accelerate's ``AcceleratedOptimizer`` (``.optimizer``, public), Lightning's
  ``LightningOptimizer`` and Fabric's ``_FabricOptimizer`` (``.optimizer``, a public property over
  their private ``._optimizer``, Lightning 2.x; ``._optimizer`` is read only where a wrapper has no
  ``.optimizer``), DeepSpeed's engine and its ZeRO / bf16 / fp16 optimizers (``.optimizer``: the
  engine's optimizer, then the torch optimizer DeepSpeed steps). A wrapper may subclass
  ``torch.optim.Optimizer`` without running its ``__init__`` (``AcceleratedOptimizer`` does): then it
  lacks the hook dictionaries ``register_step_pre_hook`` needs, so the test for "hookable" is
  torch's own private ``_optimizer_step_pre_hooks`` / ``_optimizer_step_post_hooks`` (torch >= 2.0),
  read with ``getattr``;
* models: Fabric's ``_FabricModule`` (``._forward_module``, private, Lightning 2.x: what Fabric calls,
  the user's module or its DDP wrapper; Fabric has no public name for it) and DeepSpeed's engine
  (``.module``, public). DDP and FSDP are left as they are: they are the modules the agent knows (a
  DDP model's parameter names keep their ``module.`` prefix, as they always had; FSDP1's own
  ``clip_grad_norm_`` is watched on the FSDP module). Any other object that is not an
  ``nn.Module``: its ``.module`` / ``.model``, or the one ``nn.Module`` among its attributes;
* scalers: a ``torch.amp.GradScaler`` (or anything with its four methods) as it is; an object
  holding one in ``.scaler`` (a precision plugin) unwrapped.

What cannot be unwrapped is dropped, with what it costs said once (one warning per ``attach``):
an optimizer gradwatch cannot hook gives no step boundaries (the scaler's ``update()`` ends a step,
else each ``monitor.log(loss=...)``) and no learning rate; a scaler it does not know (DeepSpeed's
``DynamicLossScaler``) gives no loss scale and no overflow flags from the agent's own hooks.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

# attribute names of the object a wrapper holds, tried in order (public ones first)
_OPTIMIZER_INNER = ("optimizer", "_optimizer")
_MODEL_INNER = ("_forward_module", "module", "model")
_SCALER_METHODS = ("scale", "unscale_", "step", "update")
_DEPTH = 6


def hookable_optimizer(obj: Any) -> bool:
    """Whether torch's step pre-/post-hooks can be registered on ``obj`` and it has param groups.

    The hook dictionaries must be the instance's own (``Optimizer.__init__`` ran on it): Fabric's
    ``_FabricOptimizer`` forwards unknown attributes to the optimizer it wraps (``__getattr__``), so
    ``getattr`` alone would call a wrapper hookable and hook it through the wrapped one's dicts."""
    try:
        own = vars(obj)
    except TypeError:
        return False
    return (isinstance(obj, torch.optim.Optimizer)
            and isinstance(own.get("_optimizer_step_pre_hooks"), dict)
            and isinstance(own.get("_optimizer_step_post_hooks"), dict)
            and isinstance(getattr(obj, "param_groups", None), list))


def _inner(obj: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        try:
            # the instance's own attributes and properties, not __getattr__ delegation (Fabric's and
            # Lightning's optimizer wrappers forward unknown names to the optimizer they wrap)
            value = getattr(obj, name) if _declared(obj, name) else None
        except Exception:  # noqa: BLE001 - a property that raises: not a wrapper of this kind
            value = None
        if value is not None and value is not obj:
            return value
    return None


def _declared(obj: Any, name: str) -> bool:
    try:
        if name in vars(obj):
            return True
    except TypeError:
        pass
    return any(name in vars(k) for k in type(obj).__mro__)


def unwrap_optimizer(optimizer: Any) -> tuple[Any, Optional[str]]:
    """The hookable torch optimizer in ``optimizer`` (or None) and, when none, why (for the warning)."""
    if optimizer is None:
        return None, None
    seen: set[int] = set()
    obj = optimizer
    for _ in range(_DEPTH):
        if hookable_optimizer(obj):
            return obj, None
        seen.add(id(obj))
        inner = _inner(obj, _OPTIMIZER_INNER)
        if inner is None or id(inner) in seen:
            break
        obj = inner
    return None, (f"optimizer {type(optimizer).__name__} is not a torch.optim.Optimizer gradwatch can hook "
                  f"(nor does it hold one in .optimizer): no learning rate, and steps end at scaler.update() "
                  f"or at each monitor.log(loss=...) instead of at the optimizer's step")


def unwrap_model(model: Any) -> tuple[Any, Optional[str]]:
    """The ``nn.Module`` to watch (Fabric's and DeepSpeed's wrappers unwrapped; DDP/FSDP kept) and,
    for a DeepSpeed engine, what a plain ``attach`` misses (for the warning)."""
    obj, note = model, None
    for _ in range(_DEPTH):
        if isinstance(obj, torch.nn.Module):
            inner = None
            if _is_deepspeed_engine(obj):
                note = ("a DeepSpeed engine keeps the grad norm, the loss scale and the skipped steps itself "
                        "(under ZeRO 1/2 no p.grad is left to measure): "
                        "gradwatch.agent.integrations.deepspeed.watch(engine) records them")
            if _is_fabric_module(obj) or _is_deepspeed_engine(obj):
                inner = _inner(obj, _MODEL_INNER)
            if not isinstance(inner, torch.nn.Module):
                return obj, note
            obj = inner
            continue
        inner = _inner(obj, _MODEL_INNER)
        if not isinstance(inner, torch.nn.Module):
            modules = []
            try:
                modules = [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)]
            except TypeError:
                pass
            inner = modules[0] if len(modules) == 1 else None
        if inner is None:
            return model, None     # nothing inside: attach says what it needs
        obj = inner
    return obj, note


def _is_fabric_module(obj: Any) -> bool:
    return type(obj).__name__ == "_FabricModule" and "_forward_module" in vars(obj).get("_modules", {})


def _is_deepspeed_engine(obj: Any) -> bool:
    return any(k.__name__ == "DeepSpeedEngine" for k in type(obj).__mro__) and isinstance(
        vars(obj).get("_modules", {}).get("module"), torch.nn.Module)


def scaler_enabled(scaler: Any, unknown: bool = False) -> bool:
    """Whether ``scaler`` is a GradScaler that scales: ``GradScaler(enabled=False)`` (the usual switch of an
    fp16 / bf16 script) keeps its methods but does nothing. Read from its private ``_enabled`` (the
    public ``is_enabled()`` is the same flag, absent from older scalers and from look-alikes); a
    scaler-like object without it counts as ``unknown``.

    >>> scaler_enabled(None), scaler_enabled(torch.amp.GradScaler("cpu", enabled=False)), scaler_enabled(object(), True)
    (False, False, True)
    """
    return scaler is not None and bool(getattr(scaler, "_enabled", unknown))


def scaler_found_inf(scaler: Any, optimizer: Any = None, device: Any = None) -> Optional[torch.Tensor]:
    """A GradScaler's overflow flag of the step: its private ``found_inf_per_device`` tensors (the public
    reading syncs), summed over devices, > 0 when ``step()`` skipped the update; None before any. Read
    before ``update()`` clears them; no sync. ``optimizer``: that optimizer's only (else every one's);
    ``device``: where several devices' flags are summed (else the first flag's). The one reader of
    the flag: the loss-scale collector (the step's ``overflow``) and the skip guard both call it.

    >>> scaler_found_inf(torch.amp.GradScaler("cpu")) is None
    True
    """
    states = getattr(scaler, "_per_optimizer_states", None) or {}
    if optimizer is not None:
        state = states.get(id(optimizer))
        states = {id(optimizer): state} if state else {}
    if len(states) == 1:   # one optimizer (the usual case): no nested comprehension
        for state in states.values():
            found = list((state.get("found_inf_per_device") or {}).values())
    else:
        found = [f for state in states.values() for f in (state.get("found_inf_per_device") or {}).values()]
    if len(found) == 1:
        return found[0]   # update() only adds into it when there are several
    if not found:
        return None
    dev = device if device is not None else found[0].device
    return torch.stack([f.to(dev, non_blocking=True).reshape(()) for f in found]).sum()


def unwrap_scaler(scaler: Any) -> tuple[Any, Optional[str]]:
    """The GradScaler-like object in ``scaler`` (or None) and, when none, why."""
    if scaler is None:
        return None, None
    obj = scaler
    for _ in range(_DEPTH):
        if all(callable(getattr(obj, m, None)) for m in _SCALER_METHODS):
            return obj, None
        inner = _inner(obj, ("scaler", "loss_scaler"))
        if inner is None:
            break
        obj = inner
    return None, (f"scaler {type(scaler).__name__} is not a torch.amp.GradScaler: its loss scale and "
                  f"overflow (skipped-step) flags are not measured by the agent's hooks")
