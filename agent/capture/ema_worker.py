"""A thread that computes the EMA divergence of CPU-trained models off the training thread.

Why: on a CPU the divergence is ~450 small kernels run one after another (a
difference and two norms per parameter tensor; CPU has no fused multi-tensor
kernels), about 1 ms for a 150-tensor model. That is 5 % of a 20 ms step on the
sampled step, and enough to move the median step time. On a GPU the same
work is three fused kernel launches, so it stays inline there.

When it is safe: the job starts when the training thread seals a step's record,
which happens at the next step's start (its first forward, ``scaler.scale()`` or
optimizer step), after the user's EMA update. From then until the next optimizer
step, nothing writes the weights or the EMA tensors (forward and backward only
read them), so the job reads a consistent state. Every optimizer step waits for
the job first (:meth:`EmaWorker.barrier`, called by the ``scaler.step()`` wrapper and
by a global optimizer step pre-hook; on an ordinary step it only reads one flag),
and so does the sealing of the next record, so records still reach the sender in
step order.

One job at a time: the barrier guarantees a job is done before the next one can
be submitted.

>>> w = EmaWorker(); box = []
>>> w.submit(lambda: box.append(1)); w.barrier(); box
[1]
>>> w.stop()
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger("gradwatch.agent")

BARRIER_TIMEOUT = 30.0
"""Seconds the training thread waits for a job before it gives up on the worker (a job takes
about a millisecond; only a wedged thread gets near this)."""


class EmaWorker:
    def __init__(self, on_late: Optional[Callable[[], None]] = None):
        self._job: Optional[Callable[[], None]] = None
        self._go = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._on_late = on_late   # a barrier timed out (the monitor turns its EMA collector off)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the worker thread (call :meth:`barrier` before the next submit).

        The job must not raise; wrap it so that it reports its own failures."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gradwatch-ema", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._job = job
        self._go.set()

    def barrier(self) -> None:
        """Return once no job is running (the usual case: at once, one flag read)."""
        if self._idle.is_set():
            return
        if not self._idle.wait(BARRIER_TIMEOUT):
            self._idle.set()   # let the other waiters go; the late job still submits its record
            if self._on_late is not None:
                self._on_late()

    def stop(self) -> None:
        """Finish the running job, then end the thread."""
        self.barrier()
        self._stopping = True
        self._go.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(BARRIER_TIMEOUT)

    def _run(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stopping:
                return
            job, self._job = self._job, None
            try:
                if job is not None:
                    job()
            except Exception:  # noqa: BLE001 -- jobs report their own failures; never die here
                log.exception("gradwatch: EMA worker job failed")
            finally:
                self._idle.set()
