"""The :class:`Monitor` handle: hooks into a model, its GradScaler and optimizer, one record per step.

Step boundaries:

* with a ``GradScaler`` (enabled or not): ``scaler.update()`` ends a step;
* without one but with an optimizer: the optimizer's step post-hook ends it;
* with neither: each ``monitor.log(loss=...)`` is one step.

A step's record stays open after its end until the next step begins (the next
forward of the model, ``scaler.scale()`` or optimizer step), so values logged
right after the step (``monitor.log(acc=...)``) and the EMA update the
checklist does after ``scaler.update()`` are part of it. Then it is sealed:
its device tensors become one flat vector whose copy to the host starts
without a sync, and the sender thread takes it from there. A record still
open ``seal_grace`` seconds after its step ended (the loop stopped or hangs
right after a step) is sealed by the sender thread instead, without the EMA
divergence (training may change the weights the moment it resumes);
``_open_lock`` guards the hand-over of the open record between the two
threads. A sampled step of a CPU-trained model hands its record to the EMA
worker thread instead (agent/capture/ema_worker.py), which adds the
divergence, seals and submits it; every optimizer step and the next seal wait
for that job.

Every hook body runs under :meth:`Monitor._guard`: an exception is logged
once, that collector turns itself off, and training goes on.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from agent.capture import clip as clip_capture
from agent.capture.activations import CONTAINERS, activation_stats, batch_shape, count_nonfinite, first_tensor
from agent.capture.ema import EmaMatcher, check_ema, ema_divergence
from agent.capture.ema_worker import BARRIER_TIMEOUT, EmaWorker
from agent.capture.norms import grad_norms, tensor_norms
from agent.config import AgentConfig
from agent.record import StepRecord
from agent.sender import OnceLogger, Sender
from agent.spool import Spool
from agent.transport import HttpTransport
from agent.wire import NanHunt, StepAssembler

log = logging.getLogger("gradwatch.agent")


def _safe_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:100] or "_"


class Monitor:
    """Handle returned by :func:`agent.attach`.

    Example::

        monitor = agent.attach(model, scaler, ema=ema, run="exp-42")
        for x, y in loader:
            ...
            scaler.update()
            ema.update(model)
            monitor.log(acc=accuracy)       # optional extra scalars
        monitor.close()                      # or use `with agent.attach(...) as monitor:`
    """

    def __init__(self, model: torch.nn.Module, scaler=None, *, optimizer=None, ema=None,
                 config: Optional[AgentConfig] = None, transport=None,
                 clock: Callable[[], float] = time.perf_counter, wall_clock: Callable[[], float] = time.time):
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model={type(model).__name__}: pass the torch.nn.Module you train")
        if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")):
            raise ValueError(f"scaler={type(scaler).__name__}: pass a torch.amp.GradScaler (or None)")
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise ValueError(f"optimizer={type(optimizer).__name__}: pass a torch.optim.Optimizer (or None)")
        if ema is not None:
            check_ema(ema)
        self.config = config or AgentConfig()
        self.model, self.scaler, self.optimizer, self.ema = model, scaler, optimizer, ema
        self.clock, self.wall_clock = clock, wall_clock
        self.closed = False
        self._pid = os.getpid()
        self._warn = OnceLogger(log)
        self._disabled: set[str] = set()
        self._guards: dict[str, _Guard] = {}
        self._handles: list[Any] = []
        self._act_handles: list[Any] = []
        self._wrapped_scaler: dict[str, Any] = {}

        seen: set[int] = set()
        self._param_names: list[str] = []
        self._params: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._param_names.append(name)
                self._params.append(p)
        self._param_ids = seen
        self._param_id_list = [id(p) for p in self._params]
        self._all_index = list(range(len(self._params)))   # grad_index when every parameter has a grad (never modified)
        self._ema_matcher = EmaMatcher(self._param_names, self._params)
        # CPU-trained models compute the sampled EMA divergence on this thread (see ema_worker.py).
        self._ema_worker: Optional[EmaWorker] = EmaWorker(on_late=self._ema_late) if ema is not None else None
        self._modules = [(n, m) for n, m in model.named_modules() if n and not isinstance(m, CONTAINERS)]
        self._bns = [(n, m) for n, m in model.named_modules()
                     if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None]

        self.rank, self.world_size = 0, 1
        try:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        except Exception:  # noqa: BLE001
            pass

        self.hunt = NanHunt(self.config.nan_hunt, self.config.nan_hunt_steps)
        self.sender: Optional[Sender] = None
        if self.config.mode != "disabled":
            cfg = self.config
            spool_path = Path(cfg.spool_dir) / _safe_name(cfg.project) / _safe_name(cfg.run) / f"rank{self.rank}"
            self.sender = Sender(
                cfg,
                transport=transport or HttpTransport(cfg.server, cfg.token, cfg.http_timeout),
                spool=Spool(spool_path, cfg.spool_max_bytes),
                assembler=StepAssembler(self._param_names, [n for n, _ in self._modules],
                                        [n for n, _ in self._bns], self.hunt),
                header={"project": cfg.project, "run": cfg.run, "rank": self.rank, "world_size": self.world_size},
                meta=self._meta(),
                warn=self._warn,
            )

        self._reset_step_state()
        self.step = 0
        # The ended step whose record is still open, and when it ended (time.monotonic(), the
        # sender's clock). Both threads take it out under _open_lock; only the one that took it seals it.
        self._open: Optional[StepRecord] = None
        self._open_since = 0.0
        self._usual_gap = 0.0      # seconds a record usually stays open (training thread writes, sender reads)
        self._stale_sealed = False  # the sender sealed the last record (set under the lock; training thread clears)
        self._open_stream = None   # the training thread's CUDA stream at the last step end
        self._open_lock = threading.Lock()
        # Clear while the sender thread seals and submits a stale record (see _await_stale_seal).
        self._stale_submitted = threading.Event()
        self._stale_submitted.set()
        self._last_end: Optional[float] = None
        self._pending_scale = None
        self._pending_found_inf = None
        self._install()
        if self.sender is not None:
            self.sender.on_poll = self._seal_stale

    # ------------------------------------------------------------------ public API

    def log(self, loss=None, **values) -> None:
        """Record the loss (when there is no GradScaler) and any extra scalars for the current step.

        Tensors stay on their device (no sync); numbers are taken as they are.
        Called right after a step ends (before the next forward), values go to
        that step. With neither a scaler nor an optimizer, every call that
        carries ``loss=`` is one step.

        >>> monitor.log(loss=loss)                 # doctest: +SKIP
        >>> monitor.log(acc=0.91, tokens_seen=n)   # doctest: +SKIP
        """
        if self.closed or os.getpid() != self._pid:
            return
        with self._guard("log"):
            step_per_log = loss is not None and self.scaler is None and self._current_optimizer() is None
            if step_per_log:
                self._seal_open()
            with self._open_lock:   # the sender thread may be sealing the open record right now
                target = self._open.host if (self._open is not None and not step_per_log) else self._pending
                if loss is not None:
                    _accumulate(target, "logged_loss", loss)
                for key, value in values.items():
                    if isinstance(value, torch.Tensor):
                        if value.numel() != 1:
                            self._warn.warning("log:" + key,
                                               "gradwatch: monitor.log(%s=...) needs a scalar; ignored", key)
                            continue
                        target.setdefault("custom_dev", {})[key] = value.detach().reshape(())
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        target.setdefault("custom", {})[key] = float(value)
            if step_per_log:
                self._end_step()
                self._seal_open()

    def flush(self, timeout: float = 5.0) -> bool:
        """Send everything recorded so far; True when it reached the server or the spool in time."""
        if os.getpid() != self._pid or self.sender is None:
            return True
        deadline = time.monotonic() + timeout
        with self._guard("flush"):
            self._seal_open()
            self._await_stale_seal(timeout)
            self._ema_barrier()
        return self.sender.flush(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: Optional[float] = None, status: str = "finished") -> None:
        """Flush (at most ``timeout`` seconds, default ``exit_timeout``), remove every hook and wrapper."""
        if self.closed:
            return
        if os.getpid() == self._pid:
            try:
                self._seal_open()
                self._await_stale_seal(self.config.exit_timeout if timeout is None else timeout)
                if self._ema_worker is not None:
                    self._ema_worker.stop()   # its record reaches the sender before the close marker
            except Exception:  # noqa: BLE001
                pass
        self._uninstall()
        self.closed = True
        _forget(self)
        if self.sender is not None and os.getpid() == self._pid:
            self.sender.close(self.config.exit_timeout if timeout is None else timeout, status=status)

    detach = close

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(status="crashed" if exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
                   else "finished")

    @property
    def dropped_steps(self) -> int:
        """Steps lost so far (queue full, spool full or unwritable, batches rejected)."""
        if self.sender is None:
            return 0
        return self.sender.dropped_steps + (self.sender.queue_drops - self.sender._queue_drops_seen)

    # ------------------------------------------------------------------ installation

    def _install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True))
        clip_capture.register(self)
        if self.scaler is not None:
            for name in ("scale", "unscale_", "step", "update"):
                original = getattr(self.scaler, name)
                self._wrapped_scaler[name] = (name in self.scaler.__dict__, self.scaler.__dict__.get(name))
                setattr(self.scaler, name, getattr(self, "_wrap_" + name.rstrip("_"))(original))
        elif self.optimizer is not None:
            self._hook_optimizer(self.optimizer)
        if self._ema_worker is not None:
            # Any optimizer step (through the scaler or not) waits for an EMA divergence job reading
            # the weights it is about to change.
            self._handles.append(register_optimizer_step_pre_hook(self._ema_barrier_hook))

    def _hook_optimizer(self, optimizer) -> None:
        self._handles.append(optimizer.register_step_pre_hook(self._on_optimizer_pre))
        self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_post))

    def _uninstall(self) -> None:
        for h in self._handles + self._act_handles:
            try:
                h.remove()
            except Exception:  # noqa: BLE001
                pass
        self._handles, self._act_handles = [], []
        clip_capture.unregister(self)
        for name, (had_own, previous) in self._wrapped_scaler.items():
            try:
                if had_own:
                    setattr(self.scaler, name, previous)
                else:
                    self.scaler.__dict__.pop(name, None)
            except Exception:  # noqa: BLE001
                pass
        self._wrapped_scaler = {}

    def _meta(self) -> dict:
        amp = None
        try:
            if self.scaler is not None and getattr(self.scaler, "_enabled", False):
                amp = "float16"
        except Exception:  # noqa: BLE001
            pass
        return {
            "param_names": self._param_names,
            "module_names": [n for n, _ in self._modules],
            "bn_names": [n for n, _ in self._bns],
            "config": {**self.config.public(), "amp_dtype": amp, "scaler": self.scaler is not None,
                       "ema": type(self.ema).__name__ if self.ema is not None else None},
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "torch": torch.__version__.split("+")[0],
            "started_at": self.wall_clock(),
        }

    # ------------------------------------------------------------------ guarding

    def _guard(self, collector: str) -> "_Guard":
        """Never let the agent raise into training: log once, turn the collector off.

        One reusable context manager per collector (hooks use it several times a step; a
        generator-based one would be created and torn down at each use)."""
        g = self._guards.get(collector)
        if g is None:
            g = self._guards[collector] = _Guard(self, collector)
        return g

    def _failed(self, collector: str, e: BaseException) -> None:
        self._disabled.add(collector)
        self._warn.warning("guard:" + collector,
                           "gradwatch: the %s collector failed and is now off (training continues): %r",
                           collector, e)

    def _on(self, collector: str) -> bool:
        return collector not in self._disabled and not self.closed and _process.pid == self._pid

    # ------------------------------------------------------------------ step state

    def _reset_step_state(self) -> None:
        self._pending: dict[str, Any] = {}       # loss / custom values for the step in progress
        self._grads = None                         # (per-param norms, index, total) once computed
        self._clip_max_norm: Optional[float] = None
        self._forwards = 0
        self._samples = 0
        self._tokens = 0
        self._input_nonfinite = None
        self._acts: list[tuple[int, torch.Tensor]] = []
        self._acts_seen: set[int] = set()
        self._weights_before = None
        self._unscaled = False
        self._in_scaler_step = False

    def _sampled(self, every: int, step: Optional[int] = None) -> bool:
        return every > 0 and (self.step if step is None else step) % every == 0

    def _current_optimizer(self):
        return self.optimizer

    def _compute_grads(self) -> None:
        if self._grads is None and self.config.grad_norms and self._on("grad_norms"):
            with self._guard("grad_norms"):
                self._grads = grad_norms(self._params, self._all_index) or False

    def _snapshot_weights(self) -> None:
        if self._weights_before is None and self._sampled(self.config.weights_every) and self._on("weights"):
            with self._guard("weights"), torch.no_grad():
                self._weights_before = [p.detach().clone() for p in self._params]

    # ------------------------------------------------------------------ model hooks

    def _on_forward_pre(self, module, args, kwargs):
        if self.closed or _process.pid != self._pid:
            return None
        with self._guard("forward"):
            self._seal_open()
            if not torch.is_grad_enabled():
                return None   # evaluation pass: not part of a training step
            first = self._forwards == 0
            self._forwards += 1
            samples, tokens = batch_shape(args, kwargs)
            self._samples += samples
            self._tokens += tokens
            hunting = self.hunt.active
            if first and (hunting or self._sampled(self.config.inputs_every)) and self._on("inputs"):
                with self._guard("inputs"):
                    self._input_nonfinite = count_nonfinite(args, kwargs)
            if first and (hunting or self._sampled(self.config.activations_every)) and self._on("activations"):
                with self._guard("activations"):
                    # Removes these hooks after this forward; installed only on such steps, so the
                    # usual forward has no post hook to run.
                    self._act_handles.append(self.model.register_forward_hook(self._on_forward_post))
                    for i, (_, m) in enumerate(self._modules):
                        self._act_handles.append(m.register_forward_hook(self._activation_hook(i)))
        return None

    def _on_forward_post(self, module, args, output):
        if self._act_handles:
            for h in self._act_handles:
                h.remove()
            self._act_handles = []
        return None

    def _activation_hook(self, index: int):
        def hook(module, args, output):
            if index in self._acts_seen or "activations" in self._disabled:
                return None
            with self._guard("activations"):
                t = first_tensor(output)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                    self._acts_seen.add(index)
                    self._acts.append((index, activation_stats(t)))
            return None
        return hook

    # ------------------------------------------------------------------ scaler wrappers

    def _wrap_scale(self, original):
        def scale(outputs):
            if self._on("scaler"):
                with self._guard("scaler"):
                    self._seal_open()
                    if isinstance(outputs, torch.Tensor):
                        _accumulate(self._pending, "scaled_loss", outputs)
                    else:
                        outputs = list(outputs) if not isinstance(outputs, (list, tuple)) else outputs
                        for o in outputs:
                            if isinstance(o, torch.Tensor):
                                _accumulate(self._pending, "scaled_loss", o)
            return original(outputs)
        return scale

    def _wrap_unscale(self, original):
        def unscale_(optimizer):
            result = original(optimizer)
            if self._on("scaler"):
                self._unscaled = True
                if self._in_scaler_step:   # implicit unscale inside scaler.step(): grads are ready now
                    with self._guard("scaler"):
                        self._compute_grads()
            return result
        return unscale_

    def _wrap_step(self, original):
        def step(optimizer, *args, **kwargs):
            # An EMA divergence job reads the weights this step changes. The global optimizer
            # hook waits for it too, but only for torch optimizers; the scaler takes any object.
            self._ema_barrier()
            if self._on("scaler"):
                with self._guard("scaler"):
                    if self.optimizer is None:
                        self.optimizer = optimizer
                    self._snapshot_weights()
                    if self._unscaled or not getattr(self.scaler, "_enabled", True):
                        self._compute_grads()
                    self._in_scaler_step = True
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                self._in_scaler_step = False
        return step

    def _wrap_update(self, original):
        def update(new_scale=None):
            if self._on("scaler"):
                with self._guard("scaler"):
                    self._read_scaler_state()
            result = original(new_scale)
            if self._on("scaler"):
                with self._guard("scaler"):
                    self._end_step()
            return result
        return update

    def _read_scaler_state(self) -> None:
        """The scale used for this step and whether it overflowed: device tensors, cloned, no sync."""
        s = self.scaler
        self._pending_scale = self._pending_found_inf = None
        if not getattr(s, "_enabled", False) or getattr(s, "_scale", None) is None:
            return
        self._pending_scale = s._scale.detach().clone()
        states = s._per_optimizer_states
        if len(states) == 1:   # one optimizer (the usual case): no nested comprehension
            for state in states.values():
                found = list(state["found_inf_per_device"].values())
        else:
            found = [f for state in states.values() for f in state["found_inf_per_device"].values()]
        if len(found) == 1:
            self._pending_found_inf = found[0]   # update() only adds into it when there are several
        elif found:
            dev = s._scale.device
            self._pending_found_inf = torch.stack([f.to(dev, non_blocking=True).reshape(()) for f in found]).sum()

    # ------------------------------------------------------------------ optimizer hooks (no scaler)

    def _on_optimizer_pre(self, optimizer, args, kwargs):
        if self._on("optimizer"):
            with self._guard("optimizer"):
                self._snapshot_weights()
                self._compute_grads()
        return None

    def _on_optimizer_post(self, optimizer, args, kwargs):
        if self._on("optimizer"):
            with self._guard("optimizer"):
                self._end_step()
        return None

    # ------------------------------------------------------------------ clipping

    def on_clip(self, parameters: list, max_norm, norm_type, error_if_nonfinite, foreach, original):
        """Called by the clip_grad_norm_ patch. Returns (handled, total_norm)."""
        if not parameters or id(parameters[0]) not in self._param_ids or not self._on("clip"):
            return False, None
        try:
            if not isinstance(max_norm, torch.Tensor):
                self._clip_max_norm = float(max_norm)
            if (self._grads is None and not error_if_nonfinite and float(norm_type) == 2.0
                    and self.config.grad_norms and self._on("grad_norms")
                    and list(map(id, parameters)) == self._param_id_list):   # the model's parameters, in order
                grads = grad_norms(self._params, self._all_index)
                if grads:
                    self._grads = grads
                    clip_capture.clip_with_norm(parameters, max_norm, grads[2], foreach)
                    return True, grads[2]
            self._compute_grads()  # before the original clips the grads in place
        except Exception as e:  # noqa: BLE001
            self._disabled.add("clip")
            self._warn.warning("guard:clip", "gradwatch: clip capture failed and is now off: %r", e)
        return True, original(parameters, max_norm, norm_type=norm_type,
                              error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    # ------------------------------------------------------------------ step end / seal

    def _end_step(self) -> None:
        now = self.clock()
        rec = StepRecord(self.step)
        host = rec.host
        host.update(self._pending)
        host["time"] = self.wall_clock()
        step_time = now - self._last_end if self._last_end is not None else None
        host["step_time"] = step_time
        samples = self.config.batch_size or self._samples
        tokens = self.config.tokens_per_step or self._tokens
        if step_time and step_time > 0:
            host["samples_per_s"] = samples / step_time if samples else None
            host["tokens_per_s"] = tokens / step_time if tokens else None
        host["scaler_active"] = bool(self.scaler is not None and getattr(self.scaler, "_enabled", False))
        host["clip_max_norm"] = self._clip_max_norm

        if self._grads is None and self._on("grad_norms") and self.config.grad_norms and self.scaler is None \
                and self.optimizer is None:
            pass  # log-per-step mode: grads are only seen through clipping
        if self._grads:
            per, index, total = self._grads
            rec.add("grad_norm", total)
            rec.add("grad_norms", per)
            host["grad_index"] = index
        if self._pending_scale is not None:
            rec.add("loss_scale", self._pending_scale)
        if self._pending_found_inf is not None:
            rec.add("found_inf", self._pending_found_inf)
        self._pending_scale = self._pending_found_inf = None

        opt = self.optimizer
        if opt is not None and self._on("lr"):
            with self._guard("lr"):
                groups = opt.param_groups
                lr = groups[0].get("lr") if len(groups) == 1 else None
                if lr.__class__ is float:   # the usual case: one group, a float LR
                    host["lr"] = lr
                    groups = ()
                for i, g in enumerate(groups):
                    lr = g.get("lr")
                    key = "lr" if i == 0 else f"lr/{i}"
                    if isinstance(lr, torch.Tensor):
                        rec.add(key if i == 0 else "custom:" + key, lr.detach().clone())
                    elif lr is not None:
                        if i == 0:
                            host["lr"] = float(lr)
                        elif len(groups) > 1:
                            host.setdefault("custom", {})[key] = float(lr)

        if self._sampled(self.config.weights_every) and self._on("weights"):
            with self._guard("weights"):
                rec.add("weight_norm", tensor_norms(self._params))
                if self._weights_before is not None:
                    delta = torch._foreach_sub([p.detach() for p in self._params], self._weights_before)
                    rec.add("update_norm", tensor_norms(delta))
        self._weights_before = None

        if self._acts:
            host["act_index"] = [i for i, _ in self._acts]
            rec.add("act", torch.stack([s for _, s in self._acts]))
        if self._bns and self._sampled(self.config.bn_every) and self._on("bn"):
            with self._guard("bn"):
                rec.add("bn_mean", tensor_norms([m.running_mean for _, m in self._bns]))
                rec.add("bn_var", tensor_norms([m.running_var for _, m in self._bns]))
        if self._input_nonfinite is not None:
            rec.add("input_nonfinite", self._input_nonfinite)

        cuda = torch.cuda.is_initialized()   # implies available; a cheaper call
        if cuda:   # where this step's tensors were made, should the sender thread have to seal them
            self._open_stream = torch.cuda.current_stream()
        if self.config.memory and self._on("memory") and cuda:
            with self._guard("memory"):
                host["mem_peak"] = float(torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()

        self._reset_step_state()
        if self._open is not None:   # two step ends without a step start between them: send the first
            self._seal_open()
        with self._open_lock:
            self._open = rec
            self._open_since = time.monotonic()
        self._last_end = now
        self.step += 1
        if self.sender is not None and self.sender._thread is None:
            self.sender.ensure_started()   # it seals this step if the loop stops right here

    def _seal_open(self) -> None:
        """Training thread: seal the open record (if any) with everything, EMA divergence included."""
        if self._open is None:   # unlocked read: only the training thread ever sets it
            if self._stale_sealed:   # the sender sealed the last one: learn how long this gap was
                self._stale_sealed = False
                self._learn_gap()
            return
        with self._open_lock:
            rec, self._open = self._open, None
        if rec is not None:
            self._learn_gap()
            self._finish_record(rec, in_training_thread=True)

    def _learn_gap(self) -> None:
        # How long records usually stay open (a slow data loader keeps every step open a while):
        # a slowly decaying maximum (capped at 10 s, so that one real stall does not blunt the
        # detection for long), so that only a gap well beyond the usual one counts as a stall.
        gap = min(time.monotonic() - self._open_since, 10.0)
        self._usual_gap = gap if gap > self._usual_gap else 0.98 * self._usual_gap

    def _seal_stale(self) -> Optional[float]:
        """Sender thread: seal a record left open longer than ``seal_grace`` and twice the usual
        step-end-to-next-step gap (the loop stopped or hangs).

        Returns the seconds until the record now open would become due (None: none open), so
        that the sender wakes then rather than polling for it.
        """
        wait = max(self.config.seal_grace, 2.0 * self._usual_gap)
        if self._open is None or self.closed:
            return None
        left = self._open_since + wait - time.monotonic()
        if left > 0:
            return left
        with self._open_lock:
            rec = self._open
            if rec is None or time.monotonic() - self._open_since < wait:
                return None
            # Cleared before the record leaves _open: whoever sees it gone (flush, close) can
            # then wait for it to reach the sender's queue (see _await_stale_seal).
            self._stale_submitted.clear()
            self._open = None
            self._stale_sealed = True
        try:
            if torch.cuda.is_initialized():
                rec.stream = self._open_stream
            self._finish_record(rec, in_training_thread=False)
        finally:
            self._stale_submitted.set()
        return None

    def _await_stale_seal(self, timeout: float) -> None:
        """Wait until a record the sender thread is sealing right now is in its queue.

        flush() and close() put a marker in the sender's queue; a record sealed by the sender
        thread (``_seal_stale``) at that very moment would be queued behind the marker and
        miss the flush (or, at close, be lost). Taking the lock waits out a hand-over in
        progress; the event, a seal and submit in progress.
        """
        with self._open_lock:
            pass
        self._stale_submitted.wait(timeout)

    def _finish_record(self, rec: StepRecord, in_training_thread: bool) -> None:
        """Turn a taken-out open record into a sealed one and submit it (either thread; nobody else holds it)."""
        self._ema_barrier()   # the previous record's EMA job submits it first: records stay in step order
        host = rec.host
        loss = host.pop("logged_loss", None)
        if loss is None:
            loss = host.pop("scaled_loss", None)
        else:
            host.pop("scaled_loss", None)
        if isinstance(loss, torch.Tensor):
            rec.add("loss", loss)
        elif loss is not None:
            host["loss_host"] = float(loss)
        for key, t in (host.pop("custom_dev", None) or {}).items():
            rec.add("custom:" + key, t)
        # EMA divergence reads the EMA and the live weights, which the training thread may be
        # updating right now: a step sealed by the sender thread goes without it.
        if (in_training_thread and self.ema is not None and self._sampled(self.config.ema_every, rec.step)
                and self._on("ema")):
            if self._ema_offload():
                self._ema_worker.submit(lambda: self._ema_job(rec))
                return
            with self._guard("ema"), torch.no_grad():
                self._add_ema_divergence(rec)
        self._submit_sealed(rec)

    def _submit_sealed(self, rec: StepRecord) -> None:
        rec.seal()
        if self.sender is not None:
            self.sender.submit(rec)

    def _add_ema_divergence(self, rec: StepRecord) -> None:
        pair = ema_divergence(self.ema, self._param_names, self._params, self._ema_matcher)
        if pair is not None:
            rec.add("ema_diff", pair[0])
            rec.add("ema_ref", pair[1])

    # ------------------------------------------------------------------ EMA divergence off the training thread

    def _ema_offload(self) -> bool:
        """Whether this sampled step's EMA divergence goes to the worker thread: CPU weights
        (on a GPU it is three fused kernel launches) and an optimizer whose steps the
        barrier hook sees (with neither a scaler nor an optimizer the agent cannot tell
        when the weights change, so it computes inline). A worker that once ran late has
        turned the EMA collector off (``_ema_late``), so this is never asked again."""
        return (self._ema_worker is not None and bool(self._params) and self._params[0].is_cpu
                and (self.scaler is not None or self.optimizer is not None))

    def _ema_job(self, rec: StepRecord) -> None:
        """Worker thread: the divergence into the record, then seal and submit it (always)."""
        try:
            with torch.no_grad():
                self._add_ema_divergence(rec)
        except Exception as e:  # noqa: BLE001
            self._failed("ema", e)
        try:
            self._submit_sealed(rec)
        except Exception as e:  # noqa: BLE001
            self._warn.warning("ema:seal", "gradwatch: a step record could not be sealed and was dropped: %r", e)

    def _ema_barrier(self) -> None:
        # A forked child never has a job in flight (the worker thread did not fork with it),
        # even if it inherited the flag of one.
        if self._ema_worker is not None and _process.pid == self._pid:
            self._ema_worker.barrier()

    def _ema_barrier_hook(self, optimizer, args, kwargs):
        self._ema_barrier()
        return None

    def _ema_late(self) -> None:
        self._failed("ema", TimeoutError(f"the EMA divergence worker took over {BARRIER_TIMEOUT:.0f} s"))


class _Guard:
    """Monitor._guard's context manager: an exception in the block turns the collector off."""

    __slots__ = ("monitor", "collector")

    def __init__(self, monitor: Monitor, collector: str):
        self.monitor, self.collector = monitor, collector

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        self.monitor._failed(self.collector, exc)
        return True


def _accumulate(target: dict, key: str, value) -> None:
    """Sum of a step's micro-batch losses, kept on the device."""
    if key not in target and value.__class__ is torch.Tensor and value.dtype is torch.float32 \
            and value.dim() == 0:   # the usual call: one fp32 loss per step
        target[key] = value.detach()
        return
    if isinstance(value, torch.Tensor):
        v = value.detach()
        if v.dim() > 0:
            v = v.sum()
        if v.dtype != torch.float32:
            v = v.float()
    else:
        v = float(value)
    prev = target.get(key)
    if prev is None:
        target[key] = v
    elif isinstance(prev, torch.Tensor) or isinstance(v, torch.Tensor):
        target[key] = prev + v
    else:
        target[key] = prev + v


# ---------------------------------------------------------------------- registry, exit, fork

class _Process:
    """The current pid, refreshed after fork, so hooks compare an attribute instead of calling getpid()."""
    pid = os.getpid()


_process = _Process()
_registry: dict[int, Monitor] = {}
_registry_lock = threading.Lock()


def _remember(model: torch.nn.Module, monitor: Monitor) -> None:
    with _registry_lock:
        _registry[id(model)] = monitor


def _forget(monitor: Monitor) -> None:
    with _registry_lock:
        for key, m in list(_registry.items()):
            if m is monitor:
                del _registry[key]


def _existing(model: torch.nn.Module) -> Optional[Monitor]:
    with _registry_lock:
        m = _registry.get(id(model))
    if m is not None and (m.closed or m.model is not model):
        return None
    return m


def close_all(status: str = "finished") -> None:
    with _registry_lock:
        monitors = list(_registry.values())
    for m in monitors:
        try:
            m.close(status=status)
        except Exception:  # noqa: BLE001
            pass


def _after_fork_in_child() -> None:
    # DataLoader workers and other forks inherit the hooks but must do nothing:
    # every hook checks the pid; here we only drop the parent's monitors.
    global _registry_lock
    _process.pid = os.getpid()
    _registry_lock = threading.Lock()
    _registry.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
