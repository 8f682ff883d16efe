"""The collector protocol, and :class:`Watched`: what a monitor watches.

Leaf of the collectors: imports torch, :mod:`agent.capture.activations` and :mod:`agent.capture.shards` only.

A collector is one kind of measurement. It declares

* ``name``: its switch (an exception in it turns that name off, see :mod:`agent.guard`);
* ``needs``: which of the monitor's objects it needs — ``"optimizer"`` (an
  optimizer, or a scaler whose ``step()`` hands one over), ``"scaler"``, ``"ema"``,
  ``"batchnorm"`` (a BatchNorm module with running statistics); a monitor without
  them does not compose it;
* ``every``: the :class:`~agent.config.AgentConfig` field with its sampling
  interval K (sampled on steps divisible by K; 0 is off), or None for every step;
  ``while_hunting``: sampled on every step while a NaN hunt is on, too;

and overrides the hook points it uses (the step builder calls only those):

* :meth:`Collector.on_first_forward` — the step's first training forward, with
  its inputs, when the collector is due;
* :meth:`Collector.before_optimizer_step` — right before the optimizer changes the weights;
* :meth:`Collector.end_step` — the step ended: add its tensors to the record
  (``rec.add(key, tensor)``; host values into ``rec.host``) and forget the step;
* :meth:`Collector.at_seal` — the record is being sealed (after the post-step
  EMA update), on the training thread or, for a step left open past
  ``seal_grace``, on the sender thread.

Each hook starts with a cheap early return (``self.due(step)``,
``self.guards.on(self.name)``) and wraps its work in ``self.guards.guard(self.name)``.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional

import torch

from gradwatch.agent.capture.activations import CONTAINERS
from gradwatch.agent.capture.shards import local_grads, local_tensors, shard_layout


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
        self.param_id_list = [id(p) for p in self.params]
        self.all_index = list(range(len(self.params)))   # grad_index when every parameter has a grad (never modified)
        self.modules = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, CONTAINERS)]
        self.bns = [(n, m) for n, m in model.named_modules()
                    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]

    def grads(self) -> Optional[list]:
        """The grads to measure: None for ``p.grad`` as they are, else this rank's local shards."""
        return local_grads(self.params) if self.local else None

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

    Example, a collector of the global weight norm every 50 steps::

        class WeightNorm(Collector):
            name = "weight_norm"
            every = "weights_every"          # or None: every step

            def end_step(self, step, rec):
                if not self.due(step) or not self.guards.on(self.name):
                    return
                with self.guards.guard(self.name):
                    rec.add("custom:weight_norm", tensor_norms(self.watched.params).norm())
    """

    name: ClassVar[str] = ""
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

    def end_step(self, step: int, rec: Any) -> None:
        """Add this step's tensors to ``rec``, then forget the step."""

    def at_seal(self, rec: Any, in_training_thread: bool, submit: Callable[[Any], None]) -> bool:
        """The record is being sealed. True: the collector took it over and calls ``submit(rec)`` itself."""
        return False

    def detach(self) -> None:
        """Remove whatever the collector installed (at ``close()``)."""


# the wire's "not measured" float32 (docs/wire-format.md), for a parameter a per-parameter array has no value of
NULL_F32_BITS = 0x7FC0DEAD


def by_param(values: torch.Tensor, index: list, n: int) -> torch.Tensor:
    """``values`` of the parameters at ``index`` as one float32 array over all ``n`` parameters, the rest
    "not measured" (on the values' device: no sync)."""
    values = values.to(torch.float32)
    if len(index) == n:
        return values
    full = torch.full((n,), NULL_F32_BITS, dtype=torch.int32, device=values.device).view(torch.float32)
    full[torch.tensor(index, device=values.device)] = values
    return full


def overrides(collector: Collector, hook: str) -> bool:
    return getattr(type(collector), hook) is not getattr(Collector, hook)
