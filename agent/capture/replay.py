"""Exact-step NaN origin: replay the failing step with every module hooked (docs/nan-origin.md).

A step whose loss went non-finite under a ``GradScaler`` is skipped by the scaler: the
weights are those the step's forward saw. So, right after ``scaler.step()`` skipped it,
the step can be run again on the same inputs, with the RNG states of its forwards
restored (dropout draws the same masks) and its autocast state, with a forward hook on
every module and a grad hook on every module output and parameter. The first module
whose output (forward) or gradient (backward) goes non-finite *in that step* is the
origin, found even when the bad batch never comes back.

What a healthy step pays: a reference to each forward's arguments (no copy), the CPU
RNG state (``torch.get_rng_state()``, a 5 KB host copy; the CUDA generator's seed and
offset when CUDA is in use, also host-side) and the autocast flags. No device sync: that
a step was skipped is read on the host (the optimizer's step pre-hook did not run inside
``scaler.step()``; the scaler itself already synced to decide it). Only a skipped step
then reads its loss (one sync, on a step that did not train anyway) and, when that loss
is non-finite, replays once per incident.

Without a scaler (bf16 / fp32) the optimizer has already changed the weights by the time
the sender thread sees the NaN; the opt-in ``nan_guard=True`` reads the global grad norm
at the optimizer's step pre-hook (one sync per step) and replays before the weights move.

The replay leaves the loop as it found it: the RNG streams (``torch.random.fork_rng``),
the parameters' ``.grad`` tensors (set aside and put back), every buffer (BatchNorm's
running statistics are copied and restored), the optimizer (never called). Its forwards
are invisible to the agent's own hooks (:attr:`StepReplay.replaying`).

Imports torch and :mod:`agent.capture.activation_stats` only.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from gradwatch.agent.capture.activation_stats import first_tensor

FP16_MAX = 65504.0
# exp(x) overflows past these: ln(max) of the dtype (softmax without max-subtraction, checklist 6.2)
EXP_LIMITS = {torch.float16: math.log(FP16_MAX), torch.bfloat16: math.log(torch.finfo(torch.bfloat16).max),
              torch.float32: math.log(torch.finfo(torch.float32).max)}
# A step with gradient accumulation keeps a reference to every micro-batch's arguments; beyond this many
# forwards in one step the rest are not kept (a replay then stops after the kept ones).
MAX_CALLS = 256


class _Call:
    __slots__ = ("args", "kwargs", "rng_cpu", "rng_cuda", "autocast")

    def __init__(self, args, kwargs, rng_cpu, rng_cuda, autocast):
        self.args, self.kwargs, self.rng_cpu, self.rng_cuda, self.autocast = args, kwargs, rng_cpu, rng_cuda, autocast


if hasattr(torch, "get_autocast_dtype"):      # torch >= 2.4: one API for every device type
    def _autocast_state() -> tuple:
        """(device, enabled, dtype) for the CPU, and CUDA when in use: the replay runs under the same."""
        out = [("cpu", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))]
        if torch.cuda.is_initialized():
            out.append(("cuda", torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
        return tuple(out)
else:                                          # torch 2.3 (the oldest the agent supports)
    def _autocast_state() -> tuple:
        out = [("cpu", torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype())]
        if torch.cuda.is_initialized():
            out.append(("cuda", torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()))
        return tuple(out)


class StepReplay:
    """The step in progress as far as a replay needs it, and the replay itself.

    The step builder calls :meth:`record` at each training forward, :meth:`closure`
    for ``monitor.replayable(fn)``, :meth:`optimizer_seen` / :meth:`after_scaler_step`
    around ``scaler.step()``, :meth:`check_before_step` at the optimizer's pre-hook
    (no scaler, ``nan_guard``), and :meth:`clear` at the step's end.
    """

    def __init__(self, watched: Any, module_names: list[str]):
        self.watched = watched
        self.module_names = module_names
        self.calls: list[_Call] = []
        self.closures: list[Callable[[], Any]] = []
        self.replaying = False          # the agent's hooks ignore the replay's forwards and scale() calls
        self.stepped = True             # the optimizer's step pre-hook ran inside the last scaler.step()
        self.in_incident = False        # replayed already; cleared by the next step that trains
        self._hooked: dict[int, Any] = {}

    # ------------------------------------------------------------------ healthy steps

    def record(self, args: tuple, kwargs: dict) -> None:
        if len(self.calls) < MAX_CALLS:
            cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
            self.calls.append(_Call(args, kwargs, torch.get_rng_state(), cuda, _autocast_state()))

    def closure(self, fn: Callable[[], Any]) -> None:
        if len(self.closures) < MAX_CALLS:
            self.closures.append(fn)

    def clear(self) -> None:
        if self.calls:
            self.calls = []
        if self.closures:
            self.closures = []

    def optimizer_seen(self, optimizer: Any) -> None:
        """Before ``scaler.step(optimizer)``: arm the host-side "did it step" flag."""
        self.stepped = False
        if id(optimizer) not in self._hooked and hasattr(optimizer, "register_step_pre_hook"):
            self._hooked[id(optimizer)] = optimizer.register_step_pre_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, optimizer, args, kwargs):
        self.stepped = True
        return None

    def detach(self) -> None:
        for h in self._hooked.values():
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._hooked = {}
        self.clear()

    # ------------------------------------------------------------------ deciding to replay

    def after_scaler_step(self, optimizer: Any, loss: Any, scale: Callable[[Any], Any]) -> Optional[dict]:
        """After ``scaler.step()``: a skipped step with a non-finite loss is replayed (once per incident)."""
        if self.stepped and getattr(optimizer, "_step_supports_amp_scaling", False):
            # A fused / capturable optimizer (AdamW(fused=True)) takes found_inf on the device and is
            # always called: it skips there, so the host learns nothing without a sync. On the CPU
            # reading the loss is no device sync; on CUDA the replay does not run (the hunt remains).
            if not isinstance(loss, torch.Tensor) or loss.device.type != "cpu":
                return None
            if bool(torch.isfinite(loss).all()):
                self.in_incident = False
                return None
            return None if self.in_incident else self._replay_once(scale)
        if self.stepped or not hasattr(optimizer, "register_step_pre_hook"):
            if self.stepped:
                self.in_incident = False
            return None
        self.stepped = True   # a scaler.step() without our optimizer_seen (another optimizer) decides nothing
        if self.in_incident or not isinstance(loss, torch.Tensor):
            return None
        if bool(torch.isfinite(loss).all()):   # the one sync, on a skipped step only
            return None   # a finite loss with overflowing fp16 grads: the scaler doing its job, no incident
        return self._replay_once(scale)

    def check_before_step(self, grad_norm: Any, loss: Any) -> Optional[dict]:
        """``nan_guard`` without a scaler: at the optimizer's step pre-hook (one sync), before the weights move."""
        bad = False
        for t in (grad_norm, loss):
            if isinstance(t, torch.Tensor) and not bool(torch.isfinite(t).all()):
                bad = True
        if not bad:
            self.in_incident = False
            return None
        if self.in_incident:
            return None
        return self._replay_once(lambda x: x)

    def _replay_once(self, scale: Callable[[Any], Any]) -> Optional[dict]:
        self.in_incident = True
        if not self.calls or self.watched.local:   # nothing seen, or sharded parameters (not replayed)
            return None
        return self.replay(scale)

    # ------------------------------------------------------------------ the replay

    def replay(self, scale: Callable[[Any], Any]) -> dict:
        """Run the step again with every module hooked; return what went non-finite first, where and why.

        The result is a host dict (it goes into the step's record, then into the ``nan_origin``
        event): ``found`` (bool), ``module``, ``where`` (``"activation"``, ``"grad"``, ``"loss"``,
        ``"input"``), ``cause`` (:func:`classify`), ``input`` / ``output`` / ``grad_output`` /
        ``grad`` statistics (:func:`tensor_stats`) and ``micro_batch``.
        """
        w = self.watched
        model, modules, params = w.model, w.modules, w.params
        closures = self.closures
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Only this rank replays: DDP's own forward would broadcast buffers and a closure calling
            # it would all-reduce in backward, collectives the other ranks never join. The wrapped
            # module runs the same computation without them (its hooks are the watched modules').
            model, closures = model.module, []
        # and no backward under DDP: its reducer's hooks sit on the parameters (forward origin only)
        backward = closures is self.closures
        saved_grads = [p.grad for p in params]
        saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
        seen: dict[int, tuple] = {}            # module index -> (inputs, output) of its first call, this micro-batch
        forward_bad: list[tuple[int, Any, torch.Tensor]] = []
        arrivals: list[tuple[str, int, Any]] = []   # backward order: ("out"|"param", index, grad)
        handles: list[Any] = []
        param_owner = _owners(w.param_names, self.module_names)

        def forward_hook(index: int):
            def hook(module, args, output):
                t = first_tensor(output)
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    return None
                if index not in seen:
                    seen[index] = (args, t)
                if not forward_bad and not bool(torch.isfinite(t).all()):
                    forward_bad.append((index, args, t))
                if t.requires_grad and not forward_bad:
                    t.register_hook(lambda g, i=index: arrivals.append(("out", i, g)) and None)
                return None
            return hook

        for i, (_, m) in enumerate(modules):
            handles.append(m.register_forward_hook(forward_hook(i)))
        for k, p in enumerate(params):
            handles.append(p.register_hook(lambda g, k=k: arrivals.append(("param", k, g)) and None))
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        result: dict = {"found": False, "method": "replay", "forwards": len(self.calls)}
        losses_seen = 0
        self.replaying = True
        try:
            for p in params:
                p.grad = None
            with torch.random.fork_rng(devices=devices):
                for k, call in enumerate(self.calls):
                    torch.set_rng_state(call.rng_cpu)
                    if call.rng_cuda is not None:
                        torch.cuda.set_rng_state(call.rng_cuda)
                    closure = closures[k] if k < len(closures) else None
                    seen.clear()
                    with torch.enable_grad(), _autocast(call.autocast):
                        if closure is None:
                            # a model that computes its own loss (Hugging Face models given labels)
                            # returns it: then the loss and the backward are replayed too
                            out = model(*call.args, **call.kwargs)
                            loss = _model_loss(out) if backward else None
                        else:
                            loss = closure()
                    if forward_bad:
                        result.update(self._forward_origin(*forward_bad[0]))
                        result["micro_batch"] = k
                        return result
                    if loss is None:
                        continue
                    loss_t = loss if isinstance(loss, torch.Tensor) else getattr(loss, "loss", None)
                    if not isinstance(loss_t, torch.Tensor):
                        continue
                    losses_seen += 1
                    if not bool(torch.isfinite(loss_t).all()):
                        result.update({"found": True, "where": "loss", "module": "(loss function)",
                                       "cause": "loss_computation", "loss": tensor_stats(loss_t)})
                        result["micro_batch"] = k
                        return result
                    arrivals.clear()
                    scale(loss_t).backward()
                    found = _backward_origin(arrivals, seen, param_owner)
                    if found is not None:
                        result.update(self._grad_origin(*found, seen))
                        result["micro_batch"] = k
                        return result
            if not closures and not losses_seen:
                # The model's forward was finite on every kept micro-batch: the NaN came from the loss
                # or the backward, which only a monitor.replayable(fn) closure can replay.
                result["note"] = ("the model's forward was finite on replay; the loss or the backward made the "
                                  "NaN (give monitor.replayable(...) to replay them)")
            else:
                result["note"] = "forward, loss and backward were finite on replay (a non-deterministic NaN)"
            return result
        finally:
            self.replaying = False
            for h in handles:
                h.remove()
            for p, g in zip(params, saved_grads):
                p.grad = g
            with torch.no_grad():
                for b, copy in saved_buffers:
                    b.copy_(copy)

    def _forward_origin(self, index: int, args: tuple, out: torch.Tensor) -> dict:
        x = _first_float(args)
        inp = tensor_stats(x) if x is not None else None
        outp = tensor_stats(out)
        if inp is not None and inp["nonfinite"] > 0:
            where = "input"
        else:
            where = "activation"
        return {"found": True, "module": self.module_names[index], "where": where,
                "cause": classify(inp, outp, backward=False, nan_at_negative=nan_only_at_negative_inputs(x, out)),
                "input": inp, "output": outp}

    def _grad_origin(self, index: int, grad_output: Any, bad_grad: Any, seen: dict) -> dict:
        if index < 0:
            return {"found": True, "module": "(loss function)", "where": "grad", "cause": "loss_computation",
                    "grad": tensor_stats(bad_grad)}
        inputs, out = seen.get(index, ((), None))
        x = _first_float(inputs)
        inp = tensor_stats(x) if x is not None else None
        return {"found": True, "module": self.module_names[index], "where": "grad",
                "cause": classify(inp, tensor_stats(bad_grad), backward=True), "input": inp,
                "output": tensor_stats(out) if out is not None else None,
                "grad_output": tensor_stats(grad_output) if grad_output is not None else None,
                "grad": tensor_stats(bad_grad)}


def _backward_origin(arrivals: list, seen: dict, param_owner: list) -> Optional[tuple]:
    """(module index, its finite output grad, the first non-finite grad) from the backward's arrivals.

    Grads arrive in backward order. The first non-finite one was made by the backward of the
    module whose output grad arrived last before it, finite (it consumed that grad); a parameter
    grad names its own module. A first arrival already non-finite came from the loss (handled by
    the caller: the loss was finite, so it is its backward): index -1.
    """
    last_ok: Optional[tuple[int, Any]] = None
    for kind, index, g in arrivals:
        ok = bool(torch.isfinite(g).all())
        if kind == "out":
            if ok:
                last_ok = (index, g)
                continue
            if last_ok is not None:
                return last_ok[0], last_ok[1], g
            return -1, None, g   # the grad the loss's backward handed to the model
        if not ok:   # a parameter's grad
            owner = param_owner[index]
            if owner is not None:
                return owner, (last_ok[1] if last_ok and last_ok[0] == owner else None), g
            if last_ok is not None:
                return last_ok[0], last_ok[1], g
    return None


def _model_loss(output: Any) -> Optional[torch.Tensor]:
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _owners(param_names: list[str], module_names: list[str]) -> list[Optional[int]]:
    position = {n: i for i, n in enumerate(module_names)}
    return [position.get(n.rsplit(".", 1)[0]) if "." in n else None for n in param_names]


def _first_float(args: Any) -> Optional[torch.Tensor]:
    items = args if isinstance(args, (tuple, list)) else (args,)
    for v in items:
        t = first_tensor(v)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


class _autocast:
    """Re-enters the autocast state a forward ran under (and nothing when none was on)."""

    def __init__(self, state: tuple):
        self.contexts = [torch.autocast(device, dtype=dtype, enabled=True) for device, on, dtype in state if on]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)
        return False


def tensor_stats(t: torch.Tensor) -> dict:
    """What the checklist's NaN sources (6.2) are told apart by, as host numbers.

    ``absmax`` / ``min`` / ``max`` are over the finite values (None when there are none);
    ``zeros`` and ``nonpositive`` count exact zeros (a denominator) and values <= 0 (a log's argument).

    >>> tensor_stats(torch.tensor([0.0, -1.0, float("inf")]))["posinf"]
    1
    """
    x = t.detach()
    if x.dtype not in (torch.float32, torch.float64):
        dtype = x.dtype
        x = x.float()
    else:
        dtype = x.dtype
    finite = torch.isfinite(x)
    n_finite = int(finite.sum())
    vals = x[finite]
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "shape": list(t.shape),
        "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == float("inf")).sum()),
        "neginf": int((x == float("-inf")).sum()),
        "nonfinite": int(x.numel() - n_finite),
        "absmax": float(vals.abs().max()) if n_finite else None,
        "min": float(vals.min()) if n_finite else None,
        "max": float(vals.max()) if n_finite else None,
        "zeros": int((x == 0).sum()),
        "nonpositive": int((x <= 0).sum()),
    }


def nan_only_at_negative_inputs(x: Optional[torch.Tensor], out: torch.Tensor) -> bool:
    """An elementwise module's NaNs all sit where its input is < 0: log / sqrt / pow of a negative."""
    if x is None or x.shape != out.shape:
        return False
    nan = torch.isnan(out.detach())
    return bool(nan.any()) and bool((x.detach()[nan] < 0).all())


def classify(inp: Optional[dict], out: dict, backward: bool, nan_at_negative: bool = False) -> str:
    """Which of the checklist's NaN sources (6.2) the statistics point to.

    ``nonfinite_input`` (it arrived so), ``softmax_overflow`` (exp of an input beyond ln(max) of the
    output dtype), ``log_of_nonpositive`` (-inf from inputs <= 0, or NaNs exactly where the input is
    negative), ``fp16_overflow`` (fp16 values past 65504), ``division_by_zero`` (zeros in the input, or
    NaN/Inf out of finite, moderate inputs: a denominator inside the module, e.g. the std of a constant
    row), ``grad_explosion`` (a backward that overflowed from finite values).

    >>> classify({"nonfinite": 0, "max": 30.0, "min": -1.0, "zeros": 0, "nonpositive": 4, "dtype": "float16"},
    ...          {"nan": 3, "posinf": 0, "neginf": 0, "dtype": "float16", "absmax": 0.1}, backward=False)
    'softmax_overflow'
    """
    if inp is not None and inp.get("nonfinite", 0) > 0:
        return "nonfinite_input"
    dtype = getattr(torch, out.get("dtype", "float32"), torch.float32)
    if backward:
        if inp is not None and inp.get("zeros", 0) > 0:
            return "division_by_zero"   # a derivative like 1/x or 1/sqrt(x) taken at 0
        if dtype is torch.float16:
            return "fp16_overflow"
        return "grad_explosion"
    limit = EXP_LIMITS.get(dtype, EXP_LIMITS[torch.float32])
    if inp is not None and inp.get("nonpositive", 0) > 0 and out.get("neginf", 0) > 0 and not out.get("posinf"):
        return "log_of_nonpositive"   # log(0) = -inf
    if inp is not None and inp.get("max") is not None and inp["max"] > limit:
        return "softmax_overflow"
    if nan_at_negative:
        return "log_of_nonpositive"
    if dtype is torch.float16 and (out.get("posinf", 0) or out.get("neginf", 0)) and not (inp or {}).get("zeros"):
        return "fp16_overflow"
    return "division_by_zero"
