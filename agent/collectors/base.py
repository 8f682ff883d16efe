"""The collector protocol, and :class:`Watched`: what a monitor watches.

Leaf of the collectors: imports torch, :mod:`agent.capture.activation_stats`, :mod:`agent.capture.shards` and
:mod:`agent.nonfinite` only.

A collector is one kind of measurement. It declares

* ``name``: its switch (an exception in it turns that name off, see :mod:`agent.guard`);
* ``order``: its place among the collectors (:data:`agent.collectors.DEFAULT`, by ``order`` then
  ``name``, :mod:`agent.plugins`): the order the monitor composes them in and their tensors take in
  a step record; the built-ins declare 10, 20, ... 170, and a collector that declares none comes after them;
* ``emits``: the names it writes into the step record (``rec.add(name, tensor)`` or
  ``rec.host[name]``), the signal table's own (:mod:`agent.signals`): a step signal's name, or
  ``"layers."`` + a per-layer statistic's, or an input of a derived signal. Checked when the monitor
  composes it (:func:`check_emits`, at attach); :mod:`agent.wire` sends each part as the table declares it;
* ``needs``: which of the monitor's objects it needs — ``"optimizer"`` (an
  optimizer, or a scaler whose ``step()`` hands one over), ``"scaler"``, ``"ema"``,
  ``"batchnorm"`` (a BatchNorm module with running statistics); a monitor without
  them does not compose it;
* ``reports``: of the names it writes, those a loop may report through ``monitor.log``
  (:data:`agent.owners.LOOP_REPORTS`): the report is handed to it (:meth:`Collector.report`), the
  signal's one writer. No two collectors (nor the step builder, nor the sealer) write one name:
  checked when the monitor composes them (:func:`agent.owners.check_owners`);
* ``every``: the :class:`~agent.config.AgentConfig` field with its sampling
  interval K (sampled on steps divisible by K; 0 is off), or None for every step;
  ``while_hunting``: sampled on every step while a NaN hunt is on, too;

and overrides the hook points it uses (the step builder calls only those):

* :meth:`Collector.on_first_forward` — the step's first training forward, with
  its inputs, when the collector is due;
* :meth:`Collector.before_optimizer_step` — right before the optimizer changes the weights;
* :meth:`Collector.grads_final` — the step's grads are final (unscaled, not yet clipped), possibly
  more than once a step;
* :meth:`Collector.before_scaler_update` — right before the GradScaler's ``update()``;
* :meth:`Collector.end_step` — the step ended: add its tensors to the record
  (``rec.add(key, tensor)``; host values into ``rec.host``) and forget the step;
* :meth:`Collector.at_seal` — the record is being sealed (after the post-step
  EMA update), on the training thread or, for a step left open past
  ``seal_grace``, on the sender thread.

Each hook starts with a cheap early return (``self.due(step)``,
``self.guards.on(self.name)``) and wraps its work in ``self.guards.guard(self.name)``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch.nn.modules import module as _torch_module   # the global module hooks live here

from gradwatch.agent.capture.activation_stats import CONTAINERS
from gradwatch.agent.capture.shards import forward_swaps_weights, local_grads, local_tensors, shard_layout
from gradwatch.agent.nonfinite import NULL_F32_BITS  # the wire's "not measured" float32 (docs/wire-format.md)
from gradwatch.agent.signals import unknown_record_names


class Watched:
    """The model's trainable parameters and modules, and the objects given to ``attach``.

    ``optimizer`` may be filled in later: a scaler's ``step(optimizer)`` hands it over.
    """

    def __init__(self, model: torch.nn.Module, scaler: Any, optimizer: Any, ema: Any, config: Any, hunt: Any):
        self.model, self.scaler, self.optimizer, self.ema = model, scaler, optimizer, ema
        self.config, self.hunt = config, hunt
        seen: set[int] = set()
        self.param_names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.param_names.append(name)
                self.params.append(p)
        self.param_ids = seen
        # (index, count) per parameter when some are sharded or DTensors (FSDP1/FSDP2, HSDP), else None:
        # then every measurement reads the local shards, and the server combines the ranks' values.
        self.layout = shard_layout(model, self.params)
        self.local = self.layout is not None
        # FSDP1: the forward swaps the weights' storage, so only the training thread may read them
        self.forward_swaps_weights = self.local and forward_swaps_weights(model)
        self.param_id_list = [id(p) for p in self.params]
        self.all_index = list(range(len(self.params)))   # grad_index when every parameter has a grad (never modified)
        self.modules = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, CONTAINERS)]
        self.bns = [(n, m) for n, m in model.named_modules()
                    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]

    def grads(self) -> Optional[list]:
        """The grads to measure: None for ``p.grad`` as they are, else this rank's local shards."""
        return local_grads(self.params) if self.local else None

    def present_grads(self) -> list:
        """Each parameter's grad as measured (this rank's local shard when sharded), None where it has none."""
        return self.grads() or [p.grad for p in self.params]

    def weights(self) -> list:
        """The weights to measure: this rank's local shards when sharded."""
        return local_tensors(self.params) if self.local else self.params

    def has(self, need: str) -> bool:
        if need == "optimizer":
            return self.optimizer is not None or self.scaler is not None
        if need == "batchnorm":
            return bool(self.bns)
        return getattr(self, need) is not None


class Collector:
    """Base class of the collectors; see the module docstring for the protocol.

    Example, a collector of the per-parameter weight norms every ``weights_every`` steps::

        class WeightNorms(Collector):
            name = "weights"
            every = "weights_every"          # or None: every step
            emits = ("layers.weight_norm",)  # the signal table's LayerStat "weight_norm"

            def end_step(self, step, rec):
                if not self.due(step) or not self.guards.on(self.name):
                    return
                with self.guards.guard(self.name):
                    rec.add("layers.weight_norm", tensor_norms(self.watched.params))
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 1000   # after every built-in: a new collector's tensors go last in a step record
    emits: ClassVar[tuple[str, ...]] = ()
    reports: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ()
    every: ClassVar[Optional[str]] = None
    while_hunting: ClassVar[bool] = False

    def __init__(self, watched: Watched, guards: Any):
        self.watched = watched
        self.guards = guards
        self.interval = getattr(watched.config, self.every) if self.every else 1

    def wanted(self) -> bool:
        """Composed into the monitor: its needs are met (subclasses add settings that turn it off)."""
        return all(self.watched.has(n) for n in self.needs)

    def due(self, step: int) -> bool:
        k = self.interval
        if k > 0 and step % k == 0:
            return True
        return self.while_hunting and self.watched.hunt.active

    # Hook points: the step builder calls the ones a subclass overrides.

    def on_first_forward(self, step: int, args: tuple, kwargs: dict) -> None:
        """The step's first training forward (called when due and on, inside the guard)."""

    def before_optimizer_step(self, step: int) -> None:
        """Right before the optimizer step."""

    def grads_final(self) -> None:
        """The step's grads are final: unscaled, before clipping and the optimizer step (called where the
        loop's events say so, possibly more than once a step)."""

    def before_scaler_update(self) -> None:
        """Right before the GradScaler's ``update()``: its scale and ``found_inf`` of the step are still there."""

    def end_step(self, step: int, rec: Any) -> None:
        """Add this step's tensors to ``rec``, then forget the step."""

    def measured(self, name: str) -> Any:
        """The value of ``name`` (a signal it writes) it measured in the step so far, before ``end_step``
        hands it to the record, or None: for what acts inside the step (the skip guard, the NaN replay,
        remediation)."""
        return None

    def report(self, key: str, value: Any, rec: Any, ended: bool) -> bool:
        """The loop's report of ``key`` (one of ``reports``, through ``monitor.log``; a float or a 0-d tensor,
        a copy) for the step of ``rec``: ``ended`` False while the step is going (held for its end, or kept
        by the collector), True once the step ended (the record holds the collector's own values). True:
        taken, or dropped; False: it stays a custom scalar (the collector's own measurement won)."""
        return False

    def at_seal(self, rec: Any, in_training_thread: bool, submit: Callable[[Any], None]) -> bool:
        """The record is being sealed. True: the collector took it over and calls ``submit(rec)`` itself."""
        return False

    def detach(self) -> None:
        """Remove whatever the collector installed (at ``close()``)."""


class OneForwardHooks(Collector):
    """A collector whose module hooks live for one forward: installed on a sampled step's first forward
    (:meth:`hook_this_forward`, from ``on_first_forward``) and removed by a model-level post hook when
    that forward returns, so the steps between samples run no hook of it (not even the post hook).

    Subclasses register their module hooks and hand the handles over; :meth:`forward_returned` is
    where they forget what only that forward needed::

        def on_first_forward(self, step, args, kwargs):
            self.hook_this_forward([m.register_forward_hook(self._hook(i)) for i, m in self.targets])
    """

    def __init__(self, watched: Watched, guards: Any):
        super().__init__(watched, guards)
        self.handles: list[Any] = []

    def hook_this_forward(self, handles: list) -> None:
        self.handles.append(self.watched.model.register_forward_hook(self._forward_returned))
        self.handles.extend(handles)

    def _forward_returned(self, module, args, output):
        handles, self.handles = self.handles, []
        for h in reversed(handles):   # last in, first out: a swapped forward put back over a stale one
            h.remove()
        self.forward_returned()
        return None

    def forward_returned(self) -> None:
        """The hooked forward returned (its hooks are removed)."""

    def detach(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001 - close() goes on whatever a hook handle does
                pass


_MISSING = object()


class _SwappedForward:
    """Removable like a hook handle: the module's instance ``forward`` put back as it was.

    Several collectors may wrap one module in one forward (a Linear's output RMS and its activation
    statistics) and be removed in any order: a removed wrapper is only switched off, and each
    removal unwinds the switched-off wrappers of the agent's from the top of the chain, so a
    wrapper a library set on top of one of them keeps working, over a pass-through."""

    __slots__ = ("module", "previous", "active")

    def __init__(self, module: torch.nn.Module, previous: Any):
        self.module, self.previous, self.active = module, previous, True

    def remove(self) -> None:
        self.active = False
        d = self.module.__dict__
        top = d.get("forward", _MISSING)
        while top is not _MISSING:
            swap = getattr(top, "_gradwatch_swap", None)
            if not isinstance(swap, _SwappedForward) or swap.active:
                return
            top = swap.previous
            if top is _MISSING:
                d.pop("forward", None)
            else:
                d["forward"] = top


def after_forward(module: torch.nn.Module, seen: Callable[[Any], None]) -> Any:
    """Call ``seen(output)`` each time ``module``'s forward returns, until the returned handle's ``remove()``.

    Why not ``register_forward_hook``: one forward hook sends every call of the module down
    ``Module._call_impl``'s hooked path, and registering and removing it builds a handle with weak
    references; for the 49 Linear modules of the reference model that was 0.55 ms of a sampled step,
    against 0.15-0.3 ms for a ``forward`` set on the instance (``_call_impl`` calls ``self.forward``;
    the module keeps its fast path). A module that already has hooks (tensor parallel's, FSDP's)
    gets a forward hook instead: those hooks may change what the caller receives, and a hook
    registered now runs after them, where the value is the one the model goes on with.

    ``seen`` runs with torch function handling off (``torch._C.DisableTorchFunction``): on a step
    that also samples the attention logits, the agent's own few tensor calls per module would
    otherwise each go through the attention mode's ``__torch_function__`` (about 2 µs a call; 1,500
    calls for the activation statistics of the reference model), and a user's torch function mode
    has no business seeing them either.

    >>> lin = torch.nn.Linear(2, 2); got = []
    >>> handle = after_forward(lin, got.append); _ = lin(torch.ones(1, 2)); handle.remove()
    >>> _ = lin(torch.ones(1, 2)); len(got), "forward" in lin.__dict__
    (1, False)
    >>> first, second = after_forward(lin, got.append), after_forward(lin, got.append)
    >>> first.remove(); _ = lin(torch.ones(1, 2)); second.remove(); len(got), "forward" in lin.__dict__
    (2, False)
    """
    if module._forward_hooks or module._forward_pre_hooks or _has_global_hooks():
        def hook(m, args, output):
            with _NO_TORCH_FUNCTION():
                seen(output)
        return module.register_forward_hook(hook)
    previous = module.__dict__.get("forward", _MISSING)
    inner = module.forward   # the instance's own (a wrapper some library set) or the class's, bound

    swap = _SwappedForward(module, previous)

    def forward(*args, **kwargs):
        output = inner(*args, **kwargs)
        if swap.active:
            with _NO_TORCH_FUNCTION():
                seen(output)
        return output
    forward._gradwatch_swap = swap
    module.__dict__["forward"] = forward
    return swap


# torch function modes and subclasses off (the agent's own measuring calls); a no-op where torch lacks it
_NO_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunction", contextlib.nullcontext)


def _has_global_hooks() -> bool:
    return bool(getattr(_torch_module, "_global_forward_hooks", None)
                or getattr(_torch_module, "_global_forward_pre_hooks", None))


# Index tensors on their devices, by (positions, device): a collector scatters the same positions step
# after step. Bounded: a model whose set of measured positions keeps changing refills it.
_INDEX_CACHE: dict[tuple, torch.Tensor] = {}
_INDEX_CACHE_MAX = 64


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device`` without a host sync: on CUDA through pinned memory,
    non-blocking (``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for
    the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def device_index(index: Sequence[int], device: torch.device) -> torch.Tensor:
    """``index`` as a long tensor on ``device``, without a host sync: on CUDA through pinned memory,
    non-blocking (``torch.tensor(index, device="cuda")`` copies from pageable memory, which waits for
    the stream). Cached per (index, device)."""
    key = (tuple(index), str(device))
    t = _INDEX_CACHE.get(key)
    if t is None:
        t = to_device(key[0], torch.long, device)
        if len(_INDEX_CACHE) >= _INDEX_CACHE_MAX:
            _INDEX_CACHE.clear()
        _INDEX_CACHE[key] = t
    return t


def scatter_measured(values: torch.Tensor, index: Sequence[int], n: int) -> torch.Tensor:
    """``values[k]`` of the slot ``index[k]`` (a parameter or a module) as one float32 array over all
    ``n`` slots, the rest the wire's "not measured" float32; on the values' device, no sync.

    >>> scatter_measured(torch.tensor([1.0, 2.0]), [2, 0], 3).tolist()[::2]
    [2.0, 1.0]
    """
    values = values.to(torch.float32)
    if len(index) == n and all(i == k for k, i in enumerate(index)):
        return values
    return place_measured(values, device_index(index, values.device), n)


def place_measured(values: torch.Tensor, where: torch.Tensor, n: int) -> torch.Tensor:
    """float32 ``values`` at the positions ``where`` (a long tensor on their device) of an array of ``n``,
    the rest the wire's "not measured" float32."""
    full = torch.full((n,), NULL_F32_BITS, dtype=torch.int32, device=values.device).view(torch.float32)
    return full.index_copy(0, where, values)


def check_emits(kinds) -> None:
    """Every name the collector classes ``kinds`` declare in ``emits`` is the signal table's: else
    ``ValueError`` naming it (at attach: a misnamed part fails there, never goes missing from a run)."""
    for kind in kinds:
        emits = getattr(kind, "emits", ())
        if isinstance(emits, str):
            raise ValueError(f"collector {kind.__name__}: emits must be a tuple of names, not the string {emits!r}")
        unknown = unknown_record_names(emits)
        if unknown:
            raise ValueError(
                f"collector {kind.__name__} emits {', '.join(map(repr, unknown))}, which the signal table "
                "(gradwatch.agent.signals) does not declare: name a StepSignal, \"layers.\" + a LayerStat, or an "
                "input of a derived signal, or declare the signal there (docs/architecture.md, \"Adding a signal\")")


def overrides(collector: Collector, hook: str) -> bool:
    return getattr(type(collector), hook) is not getattr(Collector, hook)
