"""In-memory snapshots of the training state, for :mod:`agent.rewinder` (opt-in: ``remediate=Rewind()``).

A snapshot holds what a restart from a checkpoint would load: the model's
parameters and buffers, the optimizer's state and its param groups'
hyperparameters, the GradScaler's scale and growth tracker, the LR
scheduler's state, the torch RNG states (CPU, and CUDA when used) and the
EMA's tensors. Its ``step`` is the number of the step the run continues with
(the weights as they were before that step was applied), as a checkpoint's.

Cost, and why it is cheap:

* the buffers of each of the ``keep`` slots are allocated once and reused:
  a snapshot is one fused ``torch._foreach_copy_`` into them, no allocation
  (they are rebuilt only when the set of tensors changes, e.g. the
  optimizer's state appearing at its first step);
* on the CPU the copy runs on the training thread, every ``every`` steps;
  the state is checked first (one ``torch._foreach_norm`` over the tensors
  and the step's grad norm and loss): a non-finite state is never
  snapshotted, so a good slot is never overwritten with a poisoned one;
* on CUDA the buffers are pinned host memory and the copy is
  ``non_blocking`` on a side stream that waits for the training stream,
  with no host sync on the training thread; the finiteness flag is copied
  with it and read when the copy is known done (:meth:`SnapshotStore.usable`),
  so a poisoned snapshot is never restored (it may take a slot until then).

Reading never changes the training state: a healthy run with snapshots on
computes bitwise the same losses as without (tests/remediation/).

Sharded parameters (FSDP2 DTensors): the local shards are what is copied
(each rank its own: the parameters' and the optimizer state's
``_local_tensor``), never a gather, and restored with an in-place copy into
those same local shards. The ranks vouch for each copy together
(:meth:`SnapshotStore.take_unvouched`, :mod:`agent.rewind_agreement_fsdp`).

Imports torch and :mod:`agent.capture` (EMA tensors, local shards) only.
"""
from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch

from gradwatch.agent.capture.ema_pairs import ema_tensors
from gradwatch.agent.capture.shards import local_tensor

__all__ = ["SnapshotStore", "Snapshot"]


def _hyper(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


class Snapshot:
    """One slot: buffers for the named tensors, and the small host-side state beside them."""

    __slots__ = ("step", "names", "buffers", "extra", "flag", "event", "valid", "nbytes")

    def __init__(self) -> None:
        self.step: Optional[int] = None      # None: empty
        self.names: tuple = ()
        self.buffers: list[torch.Tensor] = []
        self.extra: dict = {}
        self.flag: Optional[torch.Tensor] = None   # CUDA: the state's finiteness, copied with it (pinned)
        self.event: Any = None                     # CUDA: the side stream's copy is done once it is
        self.valid: Optional[bool] = None          # None: not known yet (CUDA, copy in flight)
        self.nbytes = 0


class SnapshotStore:
    """The newest ``keep`` snapshots of one run's training state.

    ``take(step, grad_norm, loss)`` at a step's end, ``restore(snapshot)`` at a rewind,
    ``newest_before(step)`` to choose. ``watched`` is the monitor's view of the model,
    optimizer, scaler and EMA (:class:`agent.collectors.base.Watched`); ``scheduler``
    the LR scheduler, or None.
    """

    def __init__(self, watched: Any, scheduler: Any = None, *, keep: int):
        self.watched, self.scheduler, self.keep = watched, scheduler, int(keep)
        self.slots = [Snapshot() for _ in range(self.keep)]
        self.taken = 0
        self.skipped_nonfinite = 0
        self._stream: Any = None

    # ------------------------------------------------------------------ what a snapshot holds

    def live_tensors(self) -> tuple[tuple, list[torch.Tensor]]:
        """(names, tensors) of everything copied: model parameters and buffers, optimizer state,
        GradScaler scale and growth tracker, EMA tensors (local shards when sharded)."""
        w = self.watched
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()

        def add(name: str, t: Any) -> None:
            if isinstance(t, torch.Tensor) and id(t) not in seen and t.numel() > 0:
                seen.add(id(t))
                names.append(name)
                tensors.append(local_tensor(t).detach())
        for name, p in w.model.named_parameters():
            add("model." + name, p)
        for name, b in w.model.named_buffers():
            add("model." + name, b)
        opt = w.optimizer
        if opt is not None:
            for gi, group in enumerate(opt.param_groups):
                for pi, p in enumerate(group["params"]):
                    for key, t in opt.state.get(p, {}).items():
                        add(f"opt.{gi}.{pi}.{key}", t)
        scaler = w.scaler
        for key in ("_scale", "_growth_tracker"):
            add("scaler." + key, getattr(scaler, key, None) if scaler is not None else None)
        if w.ema is not None:
            for name, t in (ema_tensors(w.ema) or {}).items():
                add("ema." + name, t)
        return tuple(names), tensors

    def _extra(self) -> dict:
        """The host-side state: param groups' hyperparameters, non-tensor optimizer state, scheduler, RNG."""
        w = self.watched
        out: dict = {"rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            out["rng_cuda"] = torch.cuda.get_rng_state_all()
        opt = w.optimizer
        if opt is not None:
            out["groups"] = [{k: _hyper(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            out["opt_plain"] = {(gi, pi, key): copy.deepcopy(v)
                                for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
                                for key, v in opt.state.get(p, {}).items() if not isinstance(v, torch.Tensor)}
        if self.scheduler is not None and hasattr(self.scheduler, "state_dict"):
            out["scheduler"] = copy.deepcopy(self.scheduler.state_dict())
        return out

    # ------------------------------------------------------------------ taking

    @property
    def nbytes(self) -> int:
        """Bytes held by the snapshot buffers (every slot allocated so far)."""
        return sum(s.nbytes for s in self.slots)

    def take(self, step: int, grad_norm: Optional[torch.Tensor] = None, loss: Any = None) -> bool:
        """Snapshot the state the run continues with at ``step``; False when it was not taken (CPU: the
        state or the step's grad norm / loss is non-finite; try again at the next step)."""
        names, live = self.live_tensors()
        if not live:
            return False
        cuda = live[0].device.type == "cuda"
        if not cuda and not self._finite(live, grad_norm, loss):
            self.skipped_nonfinite += 1
            return False
        self._copy(step, names, live, grad_norm, loss)
        return True

    def take_unvouched(self, step: int, grad_norm: Any = None, loss: Any = None) -> Optional[bool]:
        """Sharded ranks (FSDP2, CPU): copy this rank's shards at ``step`` whatever they hold, unusable until
        :meth:`settle` says every rank's copy is finite; returns whether this rank's is (None: nothing to
        copy). Every rank copies at the same steps, so a shard finite here and not on another rank never
        makes the ranks keep different snapshots (agent/rewind_agreement_fsdp.py)."""
        names, live = self.live_tensors()
        if not live:
            return None
        finite = self._finite(live, grad_norm, loss)
        slot = self._copy(step, names, live, None, None)
        slot.valid = None                    # not usable until settled (no CUDA event: usable() says None)
        return finite

    def settle(self, step: int, ok: bool) -> None:
        """Every rank's copy at ``step`` is finite (``ok``): usable; else dropped (on every rank alike)."""
        for s in self.slots:
            if s.step == step and s.valid is None and s.event is None:
                if ok:
                    s.valid = True
                else:
                    s.step = None
                    self.taken -= 1
                    self.skipped_nonfinite += 1

    def _copy(self, step: int, names: tuple, live: list, grad_norm: Any, loss: Any) -> Snapshot:
        cuda = live[0].device.type == "cuda"
        slot = self._slot_to_write()
        if slot.names != names or len(slot.buffers) != len(live) or any(
                b.shape != t.shape or b.dtype != t.dtype for b, t in zip(slot.buffers, live)):
            slot.buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda) for t in live]
            slot.names = names
            slot.nbytes = sum(b.numel() * b.element_size() for b in slot.buffers)
        slot.extra = self._extra()
        slot.step = int(step)
        with torch.no_grad():
            if cuda:
                self._take_cuda(slot, live, grad_norm, loss)
            else:
                torch._foreach_copy_(slot.buffers, live)
                slot.valid, slot.event, slot.flag = True, None, None
        self.taken += 1
        return slot

    def _finite(self, live: list, grad_norm: Any, loss: Any) -> bool:
        for v in (grad_norm, loss):
            if isinstance(v, torch.Tensor):
                if not bool(torch.isfinite(v.detach().float()).all()):
                    return False
            elif isinstance(v, float) and not math.isfinite(v):
                return False
        floats = [t for t in live if t.is_floating_point()]
        if not floats:
            return True
        with torch.no_grad():
            norms = torch._foreach_norm([t.float() if t.dtype not in (torch.float32, torch.float64) else t
                                         for t in floats])
            return bool(torch.isfinite(torch.stack(norms)).all())

    def _take_cuda(self, slot: Snapshot, live: list, grad_norm: Any, loss: Any) -> None:
        """Non-blocking copies into pinned buffers on a side stream; the finiteness flag travels with them."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=live[0].device)
        main = torch.cuda.current_stream(live[0].device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            floats = [t for t in live if t.is_floating_point()]
            parts = [torch.stack([n.float() for n in torch._foreach_norm(floats)]).sum()] if floats else []
            for v in (grad_norm, loss):
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    parts.append(v.detach().float().sum())
            flag = torch.isfinite(torch.stack(parts)).all() if parts else torch.ones((), dtype=torch.bool,
                                                                                   device=live[0].device)
            if slot.flag is None:
                slot.flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            slot.flag.copy_(flag, non_blocking=True)
            for b, t in zip(slot.buffers, live):
                b.copy_(t, non_blocking=True)
                t.record_stream(self._stream)
            slot.event = torch.cuda.Event()
            slot.event.record(self._stream)
        slot.valid = None

    def _slot_to_write(self) -> Snapshot:
        """An empty slot, else one known poisoned, else the oldest."""
        for s in self.slots:
            if s.step is None:
                return s
        for s in self.slots:
            if self.usable(s) is False:
                return s
        return min(self.slots, key=lambda s: s.step)

    # ------------------------------------------------------------------ choosing and restoring

    def usable(self, slot: Snapshot, wait: bool = False) -> Optional[bool]:
        """True: a good snapshot; False: empty or poisoned; None: its CUDA copy is still in flight
        (``wait=True`` waits for it: at a rewind, not on a healthy step)."""
        if slot.step is None:
            return False
        if slot.valid is None and slot.event is not None:
            if not (wait or slot.event.query()):
                return None
            slot.event.synchronize()
            slot.valid = bool(slot.flag.item())
        return slot.valid

    def newest_before(self, step: int) -> Optional[Snapshot]:
        """The newest good snapshot whose step is at or before ``step`` (its weights never saw step ``step``)."""
        good = [s for s in self.slots if s.step is not None and s.step <= step and self.usable(s, wait=True)]
        return max(good, key=lambda s: s.step) if good else None

    def steps(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)

    def forget_after(self, step: int) -> None:
        """Drop the snapshots newer than ``step`` (after a rewind to it: they hold the abandoned stretch)."""
        for s in self.slots:
            if s.step is not None and s.step > step:
                s.step, s.valid = None, None

    def restore(self, slot: Snapshot) -> list[str]:
        """Put ``slot`` back into the live objects, in place; returns the names it could not restore
        (a tensor that appeared or changed shape since)."""
        names, live = self.live_tensors()
        by_name = dict(zip(slot.names, slot.buffers))
        missing = []
        dst, src = [], []
        for name, t in zip(names, live):
            b = by_name.get(name)
            if b is None or b.shape != t.shape or b.dtype != t.dtype:
                missing.append(name)
                continue
            dst.append(t)
            src.append(b)
        with torch.no_grad():
            if dst:
                if dst[0].device.type == "cuda":
                    for d, s in zip(dst, src):
                        d.copy_(s, non_blocking=True)
                else:
                    torch._foreach_copy_(dst, src)
        extra = slot.extra
        torch.set_rng_state(extra["rng_cpu"])
        if "rng_cuda" in extra:
            torch.cuda.set_rng_state_all(extra["rng_cuda"])
        opt = self.watched.optimizer
        if opt is not None and "groups" in extra:
            for group, saved in zip(opt.param_groups, extra["groups"]):
                for k, v in saved.items():
                    group[k] = _hyper(v)
            for (gi, pi, key), v in extra.get("opt_plain", {}).items():
                try:
                    opt.state[opt.param_groups[gi]["params"][pi]][key] = copy.deepcopy(v)
                except (IndexError, KeyError):
                    missing.append(f"opt.{gi}.{pi}.{key}")
        if self.scheduler is not None and "scheduler" in extra:
            self.scheduler.load_state_dict(copy.deepcopy(extra["scheduler"]))
        return missing

    def state_dict(self, slot: Snapshot) -> dict:
        """The snapshot as a plain dict of CPU tensors and values (for ``torch.save`` when the run stops)."""
        if slot.event is not None:
            slot.event.synchronize()
        return {"step": slot.step, "tensors": dict(zip(slot.names, slot.buffers)),
                "groups": slot.extra.get("groups"), "scheduler": slot.extra.get("scheduler"),
                "rng_cpu": slot.extra.get("rng_cpu")}
