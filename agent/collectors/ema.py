"""EMA divergence ‖θ_ema − θ‖/‖θ‖, every ``ema_every`` steps, measured when the step's record is sealed.

The record is sealed after the post-step EMA update: on the training thread at
the next step's start, or on the sender thread for a step left open past
``seal_grace`` (then the training thread's next optimizer step and seal wait for
it, see :class:`agent.sealer.Sealer`; on CUDA the kernels go on the training
thread's stream). A CPU-trained model's divergence goes to the EMA worker
thread instead (:mod:`agent.capture.ema_worker`), which seals and submits the record.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradwatch.agent.capture.ema_pairs import EmaMatcher, ema_divergence
from gradwatch.agent.capture.ema_worker import BARRIER_TIMEOUT, EmaWorker
from gradwatch.agent.collectors.base import Collector, scatter_measured
from gradwatch.agent.signals import per_rank


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


def on_stream(stream):
    """The training thread's CUDA stream for work done on another thread (None: the current one)."""
    return torch.cuda.stream(stream) if stream is not None else _NoStream()


def ema_worker(guards: Any) -> EmaWorker:
    """The worker thread for CPU models; one that runs late turns the EMA collector off."""
    return EmaWorker(on_late=lambda: guards.failed(
        "ema", TimeoutError(f"the EMA divergence worker took over {BARRIER_TIMEOUT:.0f} s")))


class EmaDivergence(Collector):
    name = "ema"
    order = 90
    every = "ema_every"
    needs = ("ema",)
    # the divergence's numerator and denominator (agent/derived.py divides), and per parameter: what a
    # sharded run's ranks send of their pieces, for the server to combine (one process sends none of them)
    emits = ("ema_diff", "ema_ref", "layers.ema_diff", "layers.ema_ref")

    def __init__(self, watched, guards):
        super().__init__(watched, guards)
        self.matcher = EmaMatcher(watched.param_names, watched.params)
        self.worker = ema_worker(guards)   # started at its first job (CPU models only)

    def at_seal(self, rec, in_training_thread: bool, submit: Callable[[Any], None]) -> bool:
        if not self.due(rec.step) or not self.guards.on("ema"):
            return False
        if in_training_thread and self._offload():
            self.worker.submit(lambda: self._job(rec, submit))
            return True
        with self.guards.guard("ema"), torch.no_grad(), on_stream(rec.stream):
            self._add(rec)
        return False

    def _add(self, rec) -> None:
        w = self.watched
        got = ema_divergence(w.ema, w.param_names, w.params, self.matcher, per_param=True)
        if got is None:
            return
        rec.add("ema_diff", got[0])
        rec.add("ema_ref", got[1])
        # per parameter (sharded: this rank's pieces, under their per-rank names), for the server to combine
        # into the full parameters' divergence; parameters the EMA does not hold: "not measured"
        diff_norms, weight_norms, index = got[2:]
        rec.add(per_rank("layers.ema_diff", w.local), scatter_measured(diff_norms, index, len(w.params)))
        rec.add(per_rank("layers.ema_ref", w.local), scatter_measured(weight_norms, index, len(w.params)))

    def _offload(self) -> bool:
        """Whether this sampled step's EMA divergence goes to the worker thread: CPU weights
        (on a GPU it is three fused kernel launches) and an optimizer whose steps the
        barrier hook sees (with neither a scaler nor an optimizer the agent cannot tell
        when the weights change, so it computes inline), and a forward that leaves the
        weights where they are (FSDP1 swaps them for the gathered tensors while it runs,
        and the job may still be running then). A worker that once ran late has turned
        the EMA collector off, so this is never asked again."""
        w = self.watched
        return (self.worker is not None and bool(w.params) and w.params[0].is_cpu
                and (w.scaler is not None or w.optimizer is not None) and not w.forward_swaps_weights)

    def _job(self, rec, submit: Callable[[Any], None]) -> None:
        """Worker thread: the divergence into the record, then seal and submit it (always)."""
        try:
            with torch.no_grad():
                self._add(rec)
        except Exception as e:  # noqa: BLE001
            self.guards.failed("ema", e)
        try:
            submit(rec)
        except Exception as e:  # noqa: BLE001
            self.guards.warn.warning("ema:seal", "gradwatch: a step record could not be sealed and was dropped: %r", e)
