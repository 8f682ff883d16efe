"""The hand-over of a step's record from the training thread to the sender.

A step's record stays open after its step ended until the next step begins,
so that post-step values (the EMA update, ``monitor.log(acc=...)``) belong to
it. Then it is sealed — its device tensors become one flat vector whose copy to
the host starts without a sync — and submitted to the sender. Two threads may
seal it:

* the training thread, at the next step's start (:meth:`Sealer.seal_open`);
* the sender thread, when it is still open ``seal_grace`` seconds and twice
  the usual gap after its step ended (the loop stopped, hangs, or pauses for
  a validation or a checkpoint: :meth:`Sealer.seal_stale`).

Both take it out under one lock; whichever took it seals it, with everything
the step has: the collectors' ``at_seal`` parts (the EMA divergence) are
measured on either thread. While the sender thread seals, the training
thread's next step start, optimizer step and seal wait (:meth:`Sealer.seal_open`,
:meth:`Sealer.barrier`), so nothing changes the weights it reads (nor swaps their
storage, as an FSDP1 forward does) and records stay in step order.

Imports torch, :mod:`agent.capture.ema_worker` (its timeout), :mod:`agent.registry` (the pid) and
:mod:`agent.signals` (the custom scalars' part prefix).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

from gradwatch.agent.capture.ema_worker import BARRIER_TIMEOUT
from gradwatch.agent.registry import process
from gradwatch.agent.signals import CUSTOM_PART_PREFIX


class Sealer:
    # the signal it writes (agent/owners.py: one writer per signal, checked at attach)
    emits = ("loss",)

    def __init__(self, config: Any, sender: Any, guards: Any, at_seal: list, ema_worker: Any = None,
                 stale_finish: Optional[Callable[[Any], None]] = None):
        self.config = config
        self.sender = sender
        self.guards = guards
        self.at_seal = at_seal          # collectors with an at_seal part
        self.ema_worker = ema_worker    # its jobs read the weights too (CPU models)
        # How the sender thread finishes a stale record (the monitor's seam; default: finish()).
        self.stale_finish = stale_finish or (lambda rec: self.finish(rec, in_training_thread=False))
        # The ended step whose record is still open, and when it ended (time.monotonic(), the
        # sender's clock). Both threads take it out under the lock; only the one that took it seals it.
        self.open_record: Any = None
        self.open_since = 0.0
        self.usual_gap = 0.0       # seconds a record usually stays open (training thread writes, sender reads)
        self.stale_sealed = False  # the sender sealed the last record (set under the lock; training thread clears)
        self.open_stream = None    # the training thread's CUDA stream at the last step end
        self.lock = threading.Lock()
        # Clear while the sender thread seals and submits a stale record (see await_stale_seal).
        self.stale_submitted = threading.Event()
        self.stale_submitted.set()
        self.pid = guards.pid
        self._weights_read = ema_worker is not None   # whether anything off the training thread reads the weights

    # ------------------------------------------------------------------ training thread

    def open(self, rec: Any, cuda: bool) -> None:
        """A step ended: its record stays open until the next step begins."""
        if cuda:   # where this step's tensors were made, should the sender thread have to seal them
            self.open_stream = torch.cuda.current_stream()
        if self.open_record is not None:   # two step ends without a step start between them: send the first
            self.seal_open()
        with self.lock:
            self.open_record = rec
            self.open_since = time.monotonic()

    def seal_open(self) -> None:
        """Seal the open record (if any) with everything, EMA divergence included.

        Where the sender thread took it (a stale step) and is sealing it right now, wait until it is
        done: the step that begins here runs a forward next, and an FSDP1 forward swaps the weights'
        storage for the gathered tensors while the sender thread may still be reading them."""
        if self.open_record is None:   # unlocked read: only the training thread ever sets it
            if self.stale_sealed:   # the sender sealed the last one: learn how long this gap was
                self.stale_sealed = False
                self._learn_gap()
            self._await_sender()
            return
        with self.lock:
            rec, self.open_record = self.open_record, None
        if rec is not None:
            self._learn_gap()
            self.finish(rec, in_training_thread=True)
        else:   # the sender thread took it between the read above and the lock
            self._await_sender()

    def _await_sender(self) -> None:
        # the sender clears the event under the lock before it empties open_record, so a record found
        # gone is either sealed and submitted (set) or still being sealed (clear)
        if not self.stale_submitted.is_set() and process.pid == self.pid:
            self.stale_submitted.wait(BARRIER_TIMEOUT)

    def barrier(self) -> None:
        """Return once nothing off the training thread reads the weights (the usual case: two flag reads).

        Called before every optimizer step (the scaler.step() wrapper, a global optimizer
        pre-hook) and before the training thread seals a record."""
        # A forked child never has a job in flight (the threads did not fork with it), even if it
        # inherited the flag of one.
        if self._weights_read and process.pid == self.pid:
            self._await_sender()   # the sender thread may be sealing a stale step
            self.ema_worker.barrier()

    def _learn_gap(self) -> None:
        # How long records usually stay open (a slow data loader keeps every step open a while):
        # a slowly decaying maximum (capped at 10 s, so that one real stall does not blunt the
        # detection for long), so that only a gap well beyond the usual one counts as a stall.
        gap = min(time.monotonic() - self.open_since, 10.0)
        self.usual_gap = gap if gap > self.usual_gap else 0.98 * self.usual_gap

    # ------------------------------------------------------------------ sender thread

    def seal_stale(self) -> Optional[float]:
        """Sender thread: seal a record left open longer than ``seal_grace`` and twice the usual
        step-end-to-next-step gap (the loop stopped, hangs or pauses).

        Returns the seconds until the record now open would become due (None: none open), so
        that the sender wakes then rather than polling for it.
        """
        wait = max(self.config.seal_grace, 2.0 * self.usual_gap)
        if self.open_record is None or self.guards.closed:
            return None
        left = self.open_since + wait - time.monotonic()
        if left > 0:
            return left
        with self.lock:
            rec = self.open_record
            if rec is None or time.monotonic() - self.open_since < wait:
                return None
            # Cleared before the record leaves open_record: whoever sees it gone (flush, close,
            # the next optimizer step) can then wait for it to reach the sender's queue.
            self.stale_submitted.clear()
            self.open_record = None
            self.stale_sealed = True
        try:
            if torch.cuda.is_initialized():
                rec.stream = self.open_stream
            self.stale_finish(rec)
        finally:
            self.stale_submitted.set()
        return None

    def await_stale_seal(self, timeout: float) -> None:
        """Wait until a record the sender thread is sealing right now is in its queue.

        flush() and close() put a marker in the sender's queue; a record sealed by the sender
        thread at that very moment would be queued behind the marker and miss the flush (or,
        at close, be lost). Taking the lock waits out a hand-over in progress; the event, a
        seal and submit in progress.
        """
        with self.lock:
            pass
        self.stale_submitted.wait(timeout)

    # ------------------------------------------------------------------ either thread

    def finish(self, rec: Any, in_training_thread: bool) -> None:
        """Turn a taken-out open record into a sealed one and submit it (nobody else holds it)."""
        # The previous record's EMA job (or stale seal) submits it first: records stay in step order.
        if in_training_thread:
            self.barrier()
        elif self.ema_worker is not None:
            self.ema_worker.barrier()
        loss = rec.take_loss()   # the logged loss or the scaled one: the record's one choice
        if isinstance(loss, torch.Tensor):
            rec.add("loss", loss)
        elif loss is not None:
            rec.host["loss"] = float(loss)   # a loss logged as a number
        custom_dev, rec.custom_dev = rec.custom_dev, None
        for key, t in (custom_dev or {}).items():
            rec.add(CUSTOM_PART_PREFIX + key, t)
        for c in self.at_seal:
            if c.at_seal(rec, in_training_thread, self.submit_sealed):
                return   # the collector's worker seals and submits it
        self.submit_sealed(rec)

    def submit_sealed(self, rec: Any) -> None:
        rec.seal_unless_cpu()   # CPU parts: the sender thread seals them when it reads the record
        if self.sender is not None:
            self.sender.submit(rec)

