"""A resumed run: where its step numbers continue, and what the training state looked like at attach.

Checklist section 7.3: a run resumed from a checkpoint must restore the optimizer, the GradScaler,
the EMA, the BatchNorm statistics, the LR schedule and the RNG. The agent cannot know what the
checkpoint held, but it can look at what the training process holds right after loading it, once,
and the server compares that with the run's stored history before the resume (rules G1-G6,
``server/rules/catalog/resume.py``). docs/resume.md tells the whole story.

Step numbers (the data-loss bug: a resumed process numbering its steps from 0 wrote nothing, every
step collided with a stored one). ``step_origin`` says where the first number came from:

* ``"given"``: ``attach(..., step=N)`` or ``monitor.step = N`` (the HF and Lightning callbacks pass the
  trainer's global step). Stored as given; steps numbered like stored ones are never written over
  (the server skips them and says how many in its reply; the sender warns once, loudly);
* ``"optimizer"``: inferred from the optimizer state's step counters (Adam's ``state[p]["step"]``), read
  once, when the optimizer is first known (attach, or the first ``scaler.step(optimizer)``);
* ``"process"``: neither; counted from 0 by this process.

The last two are guesses: the server continues them after the run's last stored step when they would
collide (``server/ingest/resume.py``), so a run resumed under its own name never loses its new steps, and the
sender logs where they went.

Everything here runs once per attach (one host read of the scale and of the BatchNorm buffers: a
sync, once), except the RNG hash the ``rng_state`` collector takes at every step end (:func:`rng_states`
copied there, :func:`hash_rng_states` on the sender thread; no device sync). Imports torch,
:mod:`agent.capture.ema_pairs`, :mod:`agent.record` (its byte reader) and :mod:`agent.unwrap` only.
"""
from __future__ import annotations

import zlib
from typing import Any, Optional

import torch

from gradwatch.agent.capture.ema_pairs import ema_tensors
from gradwatch.agent.record import cpu_bytes
from gradwatch.agent.unwrap import scaler_enabled

# event data is bounded (64 KB): a model with thousands of BatchNorm layers names the first ones
_MAX_NAMES = 50


def rng_hash() -> int:
    """CRC-32 of torch's CPU RNG state and, once CUDA is initialised, the current device's.

    The CUDA generator's state is its seed and offset, kept on the host: no device sync.

    >>> _ = torch.manual_seed(1); first = rng_hash(); _ = torch.rand(1)
    >>> first == rng_hash(), (torch.manual_seed(1) and first == rng_hash())
    (False, True)
    """
    return hash_rng_states(rng_states())


def rng_states() -> tuple:
    """Copies of the RNG states :func:`rng_hash` hashes: (CPU state, CUDA state or None)."""
    return torch.default_generator.get_state(), (torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None)


def hash_rng_states(states: tuple) -> int:
    """:func:`rng_hash` of states taken by :func:`rng_states` (the sender thread hashes a step's copies)."""
    cpu, cuda = states
    h = zlib.crc32(cpu_bytes(cpu))   # numpy is not a dependency of the agent
    if cuda is not None:
        h = zlib.crc32(cpu_bytes(cuda), h)
    return h


def optimizer_steps(optimizer: Any) -> Optional[int]:
    """The largest per-parameter step counter in ``optimizer.state`` (Adam, AdamW, RMSprop, …), or None
    when the state holds none (a fresh optimizer, SGD). One parameter per group is read: a group's
    parameters step together (a fused / capturable Adam keeps the counter on the device: one sync)."""
    best: Optional[float] = None
    state = getattr(optimizer, "state", None) or {}
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            st = state.get(p)
            if not isinstance(st, dict) or "step" not in st:
                continue
            raw = st["step"]
            value = float(raw.item()) if isinstance(raw, torch.Tensor) else float(raw)
            best = value if best is None else max(best, value)
            break
    return None if best is None else int(best)


def _stateless(optimizer: Any) -> bool:
    """An optimizer that keeps no state at all, so that an empty state says nothing: plain SGD
    without momentum (torch's SGD adds a momentum buffer only when momentum != 0)."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    return all(not g.get("momentum") for g in optimizer.param_groups)


def optimizer_part(optimizer: Any) -> dict:
    groups = optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    state = optimizer.state
    n_params = sum(len(g.get("params", ())) for g in groups)
    return {
        "optimizer": {"class": type(optimizer).__name__, "state_entries": len(state), "params": n_params,
                      "step": optimizer_steps(optimizer), "stateless": _stateless(optimizer)},
        "lr": None if lr is None else float(lr),
    }


def scaler_part(scaler: Any) -> Optional[dict]:
    """The scale the next step will use and the growth tracker, as ``load_state_dict`` left them
    (before the first ``scale()`` they live in ``_init_scale`` / ``_init_growth_tracker``)."""
    if not scaler_enabled(scaler):
        return None
    tracker = getattr(scaler, "_growth_tracker", None)
    tracker = int(tracker.item()) if isinstance(tracker, torch.Tensor) else int(
        getattr(scaler, "_init_growth_tracker", 0))
    return {"scale": float(scaler.get_scale()), "growth_tracker": tracker,
            "growth_factor": float(scaler.get_growth_factor()), "backoff_factor": float(scaler.get_backoff_factor()),
            "growth_interval": int(scaler.get_growth_interval())}


def ema_part(ema: Any, names: list, params: list) -> Optional[dict]:
    """Whether the EMA shadow holds exactly the live weights (it was re-initialised from them).
    One host read for all tensors (a device model: one sync, once)."""
    if ema is None:
        return None
    shadow = ema_tensors(ema) or {}
    differs = []
    for name, p in zip(names, params):
        s = shadow.get(name)
        if s is None:   # AveragedModel / ModelEmaV2 name their parameters like the model, or "module."-prefixed
            s = shadow.get("module." + name)
        if not isinstance(s, torch.Tensor) or s.shape != p.shape:
            continue
        differs.append((s.detach().to(p.device, p.dtype) != p.detach()).any().to(params[0].device))
    if not differs:
        return {"compared": 0, "equal_to_weights": False}
    return {"compared": len(differs), "equal_to_weights": not bool(torch.stack(differs).any())}


def batchnorm_part(bns: list) -> Optional[dict]:
    """The BatchNorm layers whose running statistics are at their init values (mean 0, var 1, no batch
    tracked): what a layer holds when the model's buffers were not loaded."""
    if not bns:
        return None
    at_init = []
    for name, m in bns:
        tracked = getattr(m, "num_batches_tracked", None)
        if tracked is not None and int(tracked) != 0:
            continue
        if bool(torch.all(m.running_mean == 0)) and bool(torch.all(m.running_var == 1)):
            at_init.append(name)
    return {"layers": len(bns), "at_init": len(at_init), "at_init_names": at_init[:_MAX_NAMES]}


class ResumeState:
    """The state at attach, completed when the optimizer is first known, sent once as a
    ``resume_state`` event at the first step's end (with that step's number)."""

    def __init__(self, watched: Any, *, step: Optional[int], rng: bool):
        w = self.watched = watched
        self.origin = "given" if step is not None else "process"
        self.start = int(step) if step is not None else 0
        self.data: dict[str, Any] = {"scaler": scaler_part(w.scaler),
                                     "ema": ema_part(w.ema, w.param_names, w.params),
                                     "batchnorm": batchnorm_part(w.bns),
                                     "rng_hash": rng_hash() if rng else None}
        self.optimizer_read = False
        if w.optimizer is not None:
            self.optimizer_known(w.optimizer)

    def optimizer_known(self, optimizer: Any) -> None:
        """The optimizer, before its first step: its state as loaded, and maybe the step to continue from."""
        if self.optimizer_read:
            return
        self.optimizer_read = True
        self.data.update(optimizer_part(optimizer))
        if self.origin == "process":
            n = self.data["optimizer"]["step"]
            if n:
                self.origin, self.start = "optimizer", n

    def given(self, step: int) -> None:
        """``monitor.step = N`` before the first step ended."""
        self.origin, self.start = "given", int(step)

    def event(self, step: int) -> dict:
        return {"step": int(step), "kind": "resume_state",
                "data": {k: v for k, v in {**self.data, "step_origin": self.origin}.items() if v is not None}}
