"""The run's setup as the checklist's sections 6.1, 9 and 10 judge it: one ``run_setup`` event per process.

The earliest warning a run can get is at step 0, before any signal has a history: the configuration
itself. The agent looks once, at attach and during the first step, and sends what it saw as one
event with the first step's number; the server's rules H5-H9 (``server/rules/catalog/setup_advice.py``)
turn it into notes on the run page (docs/early-warning-advice.md). What is read:

* ``hardware`` (a CUDA model only): the device's name, compute capability and whether it has native
  bf16 (``torch.cuda.is_bf16_supported(including_emulation=False)``'s test, for the model's device) —
  host queries, once;
* ``autocast``: whether the first training forward ran under autocast, and its dtype
  (``torch.is_autocast_enabled`` / ``torch.get_autocast_dtype`` of the model's device type, read in a
  forward pre-hook that removes itself after that forward); ``scaler_enabled``: a GradScaler is on;
* ``model``: the trainable parameter count (``numel``, metadata only) and whether the model is a
  Transformer: it holds a :data:`TRANSFORMER_TYPES` module, a module whose class name says attention
  (``LlamaAttention``, ``BertSelfAttention``, nanoGPT's ``CausalSelfAttention``), or a child named
  ``attn`` / ``self_attn`` / ``attention`` / ``self_attention``;
* ``clip``: the ``clip_grad_norm_`` calls on the model's parameters during the first step, their
  ``max_norm`` and the GradScaler stage at the call (a call with ``max_norm=inf``, which only computes
  the norm — the HF Trainer's logged ``grad_norm`` without ``max_grad_norm`` — is counted apart, as no clip) (``scaler._per_optimizer_states[id(opt)]["stage"]``:
  ``ready`` = the grads are still scaled, ``unscaled`` = after ``scaler.unscale_``, ``stepped`` = after
  ``scaler.step``). Seen through the agent's ``clip_grad_norm_`` patch (``agent/capture/clip.py``), as
  an observer that never clips and unregisters after the first step;
* ``ema``: the EMA object's class and decay (``ema.decay``, as the checklist's EMA and timm's
  ``ModelEmaV2/V3`` keep it; for ``torch.optim.swa_utils.AveragedModel`` built with
  ``get_ema_multi_avg_fn(decay)`` the ``decay`` its function closes over);
* ``scheduler`` (``attach(scheduler=...)``; the HF and Lightning callbacks pass theirs): for a cosine
  schedule, its base LRs and the LRs it ends at (:func:`scheduler_part`);
* ``lr``: the learning rates the user configured for param group 0 (the group whose LR the ``lr``
  signal carries), whatever the scheduler: its LR at attach and at the first step's end, and the
  ``initial_lr`` a PyTorch, timm or HF scheduler writes into the group when it is built (the LR
  it was given: a warm-up's target, the value a cosine or step schedule starts from and a restart
  returns to), and ``max_lr`` (OneCycleLR's and CyclicLR's peak) (:func:`lr_part`). Rule H10
  (``lr_jump``) reads the largest as the run's configured LR: a rise up to it is the schedule's own;
* ``optimizer``: its class, under any wrapper (:func:`optimizer_part`). Rule H13
  (``attention_logit_runaway``) sets its doubling-time limit by the optimizer's family.

Cost: a few microseconds at attach and one forward pre-hook call and one observer call per clip in
the first step; nothing after it. No device sync: every value read is host metadata or a Python
attribute.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Any, Optional

import torch

from gradwatch.agent.capture import clip as clip_capture
from gradwatch.agent.unwrap import scaler_enabled

KIND = "run_setup"

TRANSFORMER_TYPES: tuple[type, ...] = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                                       torch.nn.TransformerDecoderLayer, torch.nn.Transformer)
# class names of attention modules in the usual libraries (HF, timm, nanoGPT); a child's own name
_ATTENTION_CLASS = re.compile(r"attention", re.IGNORECASE)
_ATTENTION_CHILD = re.compile(r"^(self_)?(attn|attention)$", re.IGNORECASE)
_MAX_NAMES = 5


def transformer_part(model: torch.nn.Module, params: list) -> dict:
    """The parameter count and the modules that make the model a Transformer (at most 5 named)."""
    found: list[str] = []
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, TRANSFORMER_TYPES) or _ATTENTION_CLASS.search(type(m).__name__) \
                or (leaf and _ATTENTION_CHILD.match(leaf)):
            found.append(f"{name or '(model)'}: {type(m).__name__}")
            if len(found) >= _MAX_NAMES:
                break
    return {"params": int(sum(p.numel() for p in params)), "transformer": bool(found), "attention": found}


def hardware_part(params: list) -> Optional[dict]:
    """The CUDA device of the model's first parameter: name, capability, native bf16; None off CUDA."""
    p = params[0] if params else None
    if p is None or p.device.type != "cuda":
        return None
    index = p.device.index if p.device.index is not None else torch.cuda.current_device()
    # torch.cuda.is_bf16_supported(including_emulation=False)'s test, for the model's device rather than
    # the current one: ROCm, or compute capability 8.0 and up (a V100 only emulates bf16)
    native = bool(torch.version.hip) or torch.cuda.get_device_properties(index).major >= 8
    return {"name": torch.cuda.get_device_name(index), "capability": list(torch.cuda.get_device_capability(index)),
            "bf16_native": native}


def ema_decay(ema: Any) -> Optional[float]:
    """The EMA's decay: its ``decay`` attribute, or the ``decay`` an AveragedModel's averaging function
    closes over (``get_ema_multi_avg_fn(decay)``); None when the EMA form does not say (a dict shadow)."""
    value = getattr(ema, "decay", None) if not isinstance(ema, dict) else None
    if value is None:
        for fn_name in ("multi_avg_fn", "avg_fn"):
            fn = getattr(ema, fn_name, None)
            for _ in range(3):   # through decorators (torch.no_grad() wraps ema_update and closes over it as func)
                if not callable(fn):
                    break
                try:
                    free = inspect.getclosurevars(fn).nonlocals
                except (TypeError, ValueError):
                    break
                value = free.get("decay")
                if value is not None:
                    break
                fn = getattr(fn, "__wrapped__", None) or free.get("func")
            if value is not None:
                break
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        value = value.item()
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _last_scheduler(scheduler: Any) -> Any:
    """The scheduler in charge at the end: the last of a SequentialLR / ChainedScheduler (warm-up, then cosine)."""
    inner = getattr(scheduler, "_schedulers", None)
    while isinstance(inner, (list, tuple)) and inner:
        scheduler = inner[-1]
        inner = getattr(scheduler, "_schedulers", None)
    return scheduler


def _floats(values) -> list:
    return [float(v) for v in values]


def scheduler_part(scheduler: Any) -> Optional[dict]:
    """What a cosine schedule ends at: ``{"class", "cosine", "base_lrs", "final_lrs", "how"}``.

    * ``CosineAnnealingLR`` / ``CosineAnnealingWarmRestarts``: ``eta_min`` (a cycle's floor) against ``base_lrs``;
    * ``OneCycleLR`` with ``anneal_strategy="cos"``: each group's ``min_lr`` against its ``max_lr``;
    * a ``LambdaLR`` built by HF's ``get_cosine_*schedule_with_warmup`` (a ``functools.partial`` of a
      function named like cosine, with ``num_training_steps``): the lambda at ``num_training_steps``;
    * inside a ``SequentialLR`` / ``ChainedScheduler``: the last one.

    Any other scheduler: ``cosine`` False and no LRs. Pure Python on the scheduler's attributes.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> part = scheduler_part(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100, eta_min=0.01))
    >>> part["final_lrs"], part["base_lrs"]
    ([0.01], [0.1])
    """
    if scheduler is None:
        return None
    outer = type(scheduler).__name__
    s = _last_scheduler(scheduler)
    out: dict[str, Any] = {"class": type(s).__name__, "cosine": False}
    if s is not scheduler:
        out["within"] = outer
    sched = torch.optim.lr_scheduler
    base = getattr(s, "base_lrs", None)
    if isinstance(s, (sched.CosineAnnealingLR, sched.CosineAnnealingWarmRestarts)) and base:
        out.update(cosine=True, base_lrs=_floats(base), final_lrs=[float(s.eta_min)] * len(base), how="eta_min")
    elif isinstance(s, sched.OneCycleLR) and getattr(s, "_anneal_func_type", "cos") == "cos":
        groups = s.optimizer.param_groups
        out.update(cosine=True, base_lrs=_floats(g["max_lr"] for g in groups),
                   final_lrs=_floats(g["min_lr"] for g in groups), how="min_lr")
    elif isinstance(s, sched.LambdaLR) and base:
        finals = []
        for fn, lr in zip(s.lr_lambdas, base):
            if not (isinstance(fn, functools.partial) and "cosine" in getattr(fn.func, "__name__", "")
                    and "num_training_steps" in fn.keywords):
                return out
            factor = float(fn(int(fn.keywords["num_training_steps"])))
            finals.append(float(lr) * factor)
        out.update(cosine=True, base_lrs=_floats(base), final_lrs=finals, how="lr_lambda(num_training_steps)",
                   lambda_name=s.lr_lambdas[0].func.__name__)
    for key in ("base_lrs", "final_lrs"):
        if key in out and not all(math.isfinite(v) for v in out[key]):
            out.pop(key)
            out["cosine"] = False
    return out


_CONFIGURED_LR_KEYS = ("initial_lr", "max_lr")


def lr_part(optimizer: Any, at_attach: Optional[float] = None) -> Optional[dict]:
    """Param group 0's configured LRs: ``{"at_attach", "at_first_step", "initial_lr", "max_lr",
    "configured"}`` (each where it is a finite float; ``configured``: the largest of them). Tensor LRs
    are left out (no device read).

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    >>> lr_part(opt, at_attach=0.001)
    {'at_attach': 0.001, 'at_first_step': 0.001, 'initial_lr': 0.1, 'configured': 0.1}
    """
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    g = groups[0]
    out: dict[str, float] = {}
    for key, value in (("at_attach", at_attach), ("at_first_step", g.get("lr")),
                       *((k, g.get(k)) for k in _CONFIGURED_LR_KEYS)):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    if not out:
        return None
    out["configured"] = max(out.values())
    return out


def optimizer_part(optimizer: Any) -> Optional[dict]:
    """The optimizer's class, under any wrappers (accelerate's ``.optimizer``, Lightning's ``._optimizer``):
    H13 (server/rules/catalog/early_forecast.py) sets its doubling-time limit by the optimizer's family.

    >>> optimizer_part(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    {'class': 'SGD'}
    """
    if optimizer is None:
        return None
    inner = optimizer
    for _ in range(4):
        nxt = getattr(inner, "optimizer", None) or getattr(inner, "_optimizer", None)
        if nxt is None or nxt is inner or not hasattr(nxt, "param_groups"):
            break
        inner = nxt
    out = {"class": type(inner).__name__}
    if inner is not optimizer:
        out["wrapped_in"] = type(optimizer).__name__
    return out


def _first_lr(optimizer: Any) -> Optional[float]:
    groups = getattr(optimizer, "param_groups", None)
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _stage(scaler: Any, optimizer: Any) -> Optional[str]:
    """The GradScaler's stage for ``optimizer`` ("ready": grads still scaled; "unscaled"; "stepped"), or
    for whichever optimizer it knows when ``optimizer`` is not known yet; None without an enabled scaler."""
    if not scaler_enabled(scaler):
        return None
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return None
    if optimizer is not None:
        st = states.get(id(optimizer))   # .get: the defaultdict must not grow an entry here
        stages = [st["stage"]] if st else []
    else:
        stages = [st.get("stage") for st in states.values()]
    names = {getattr(s, "name", str(s)).lower() for s in stages}
    for name in ("unscaled", "stepped"):
        if name in names:
            return name
    return "ready"   # no entry: unscale_ was not called since the last update()


def _safely(read, *args):
    """A part that cannot be read (an odd scheduler or EMA class) is left out; the others still go."""
    try:
        return read(*args)
    except Exception:  # noqa: BLE001 - never hurt the host, and never lose the whole event to one part
        return None


class SetupWatch:
    """The facts of the ``run_setup`` event: read at attach, completed during the first step.

    ``install()`` adds a one-shot forward pre-hook and registers as a ``clip_grad_norm_`` observer;
    ``event(step)`` (at the first step's end) builds the event and removes both."""

    def __init__(self, watched: Any, scheduler: Any = None):
        w = self.watched = watched
        self.data: dict[str, Any] = {
            "device": w.params[0].device.type if w.params else None,
            "hardware": _safely(hardware_part, w.params),
            "scaler_enabled": scaler_enabled(w.scaler),
            "model": transformer_part(w.model, w.params),
            "ema": None if w.ema is None else {"class": type(w.ema).__name__, "decay": _safely(ema_decay, w.ema)},
            "scheduler": _safely(scheduler_part, scheduler),
        }
        self.lr_at_attach = _safely(_first_lr, w.optimizer)
        self.autocast: Optional[dict] = None
        self.clips: list[dict] = []
        self.norm_only = 0
        self._handle: Any = None
        self._registered = False

    def install(self) -> None:
        self._handle = self.watched.model.register_forward_pre_hook(self._on_forward)
        clip_capture.register(self)
        self._registered = True

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        if self._registered:
            clip_capture.unregister(self)
            self._registered = False

    def _on_forward(self, module, args) -> None:
        if self.autocast is not None or not torch.is_grad_enabled():
            return None    # an evaluation pass says nothing about training's precision
        device = self.data["device"] or "cpu"
        try:
            on = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if on else None
        except Exception:  # noqa: BLE001 - a device type autocast does not know: no autocast
            on, dtype = False, None
        self.autocast = {"enabled": bool(on), "dtype": str(dtype).replace("torch.", "") if dtype else None,
                         "device": device}
        try:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
        except Exception:  # noqa: BLE001 - never hurt the host: the hook stays, and returns at once
            pass
        return None

    def on_clip(self, parameters, max_norm, norm_type, error_if_nonfinite, foreach, original):
        """The ``clip_grad_norm_`` patch's owner protocol: note the call, never handle it."""
        try:
            w = self.watched
            if parameters and id(parameters[0]) in w.param_ids and len(self.clips) < 8:
                value = None if isinstance(max_norm, torch.Tensor) else float(max_norm)
                if value is not None and not math.isfinite(value):
                    self.norm_only += 1   # max_norm=inf: the norm computed for a log (HF's grad_norm), no clip
                    return False, None
                self.clips.append({"max_norm": value, "stage": _stage(w.scaler, w.optimizer)})
        except Exception:  # noqa: BLE001 - never hurt the host: the call goes on to be clipped as usual
            pass
        return False, None

    def on_clip_with_norm(self, parameters, max_norm) -> None:
        """The ``clip_grads_with_norm_`` patch's observer protocol (accelerate's clip): note the call."""
        self.on_clip(parameters, max_norm, 2.0, False, None, None)

    def event(self, step: int, module_clip: Optional[float] = None) -> dict:
        """The event, with the first step's number. ``module_clip``: the ``max_norm`` the grad-norm
        collector saw the model's own ``clip_grad_norm_`` (FSDP1) called with, which the patch does not see."""
        self.remove()
        if not self.clips and module_clip is not None and math.isfinite(module_clip):
            self.clips.append({"max_norm": float(module_clip), "stage": _stage(self.watched.scaler,
                                                                             self.watched.optimizer)})
        data = {**self.data, "autocast": self.autocast,
                "lr": _safely(lr_part, self.watched.optimizer, self.lr_at_attach),
                "optimizer": _safely(optimizer_part, self.watched.optimizer),
                "clip": {"calls": len(self.clips), "max_norm": self.clips[0]["max_norm"] if self.clips else None,
                         "stages": sorted({c["stage"] for c in self.clips if c["stage"]}),
                         **({"norm_only_calls": self.norm_only} if self.norm_only else {})}}
        return {"step": int(step), "kind": KIND, "data": {k: v for k, v in data.items() if v is not None}}
