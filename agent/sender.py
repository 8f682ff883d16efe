"""The background thread: assembles steps, batches them, spools them, POSTs them.

The training thread only calls :meth:`Sender.submit` (a non-blocking
``put_nowait`` on a bounded queue; a full queue drops the step and counts it).
Everything else happens here, in one daemon thread started on first use:

* every ``flush_interval`` seconds, every ``max_batch_steps`` steps, or as soon
  as a critical step (non-finite loss or grads) is taken (the thread wakes at
  least every ``poll_interval``, 0.2 s) the assembled steps become one batch
  with a fresh ``batch_id``;
* the batch is written to the spool first, then the spool is replayed oldest
  first, deleting each file the server accepted. A server that is down or slow
  therefore only makes the spool grow (up to ``spool_max_mb``); order is kept
  and a retried batch is a duplicate the server ignores;
* drops (queue full, spool full or unwritable, batch rejected) are counted and
  reported in a later batch as a ``dropped`` event.

Example (tests inject the transport, STYLE point 7)::

    sender = Sender(cfg, transport=HttpTransport(cfg.server), spool=Spool(dir, cfg.spool_max_bytes),
                    assembler=StepAssembler(...), header={...}, meta={...})
    sender.submit(record); sender.close(timeout=5, status="finished")
"""
from __future__ import annotations

import json
import logging
import os
import collections
import threading
import time
import uuid
from typing import Callable, Optional

from agent.config import AgentConfig
from agent.record import StepRecord
from agent.spool import Spool
from agent.transport import HttpTransport
from agent.wire import StepAssembler

log = logging.getLogger("gradwatch.agent")


class _Marker:
    def __init__(self, kind: str, status: Optional[str] = None):
        self.kind = kind
        self.status = status
        self.done = threading.Event()


class OnceLogger:
    """Logs each distinct problem once, so a broken collector cannot flood the training log."""

    def __init__(self, logger: logging.Logger = log):
        self._seen: set[str] = set()
        self._logger = logger

    def warning(self, key: str, message: str, *args) -> None:
        if key in self._seen:
            return
        self._seen.add(key)
        try:
            self._logger.warning(message, *args)
        except Exception:  # noqa: BLE001 - logging itself must not hurt training
            pass


class Sender:
    def __init__(self, config: AgentConfig, *, transport: HttpTransport, spool: Spool,
                 assembler: StepAssembler, header: dict, meta: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic, warn: Optional[OnceLogger] = None):
        self.config = config
        self.transport = transport
        self.spool = spool
        self.assembler = assembler
        self.header = dict(header)
        self.meta = meta
        self.clock = clock
        self.warn = warn or OnceLogger()
        # A deque, not a queue.Queue: append/popleft are atomic and wake nobody, so the
        # training thread never hands the GIL to the sender at submit time.
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        # How often the thread wakes to take the submitted steps: the longest a critical step
        # (non-finite loss) waits before it is sent. Every wake costs the training process CPU
        # (a GIL hand-over and two context switches, ~0.1-0.2 ms on a busy 2-core machine), so
        # it is not shorter than an alert needs; flush() and close() wake the thread at once.
        self.poll_interval = min(0.2, config.flush_interval)
        # Called by the sender thread at every wake, before it drains the queue: the
        # monitor seals a step record that has stayed open past ``seal_grace`` (a
        # loop that stopped or hangs right after a step), so that step is sent now.
        # It returns the seconds until the open record would become due (None: nothing
        # open), so the thread wakes right then instead of polling for it.
        self.on_poll: Optional[Callable[[], Optional[float]]] = None
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._start_lock = threading.Lock()
        self._closed = False
        # Written by the training thread only; the sender thread reads it.
        self.queue_drops = 0
        # Sender thread state.
        self._queue_drops_seen = 0
        self._drops: dict[str, int] = {}
        self._steps: list[dict] = []
        self._events: list[dict] = []
        self._backoff = 0.0
        self._retry_at = 0.0
        # Counters for users and tests.
        self.delivered_batches = 0
        self.spooled_batches = 0
        self.dropped_steps = 0
        self.sent_steps = 0

    # ------------------------------------------------------------------ training thread side

    def submit(self, item) -> None:
        """Hand over a sealed StepRecord (or an event dict). Never blocks, never raises."""
        if self._closed or os.getpid() != self._pid:
            return
        if self._thread is None:
            self._start()
        if len(self._queue) >= self.config.queue_size:
            self.queue_drops += 1
            return
        self._queue.append(item)

    def ensure_started(self) -> None:
        """Start the thread now (it seals open steps even before the first submit)."""
        if self._thread is None and not self._closed and os.getpid() == self._pid:
            self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                t = threading.Thread(target=self._run, name="gradwatch-sender", daemon=True)
                t.start()
                self._thread = t

    def flush(self, timeout: float) -> bool:
        """Ship everything submitted so far; True when the thread finished within ``timeout``."""
        return self._send_marker(_Marker("flush"), timeout)

    def close(self, timeout: float, status: Optional[str] = None) -> bool:
        if self._closed:
            return True
        done = self._send_marker(_Marker("stop", status), timeout)
        self._closed = True
        return done

    def _send_marker(self, marker: _Marker, timeout: float) -> bool:
        if os.getpid() != self._pid:
            return False
        if self._thread is None:
            self._start()
        deadline = time.monotonic() + timeout
        self._queue.append(marker)   # markers are never dropped
        self._wake.set()
        try:
            return marker.done.wait(max(0.0, deadline - time.monotonic()))
        except RuntimeError:  # interpreter shutting down
            return False

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        next_tick = self.clock() + self.config.flush_interval
        due: Optional[float] = None   # seconds until the open step record may be sealed here
        while True:
            try:
                # Wake at the next flush tick, when the open record becomes due, or after
                # poll_interval, whichever comes first.
                wait = min(self.poll_interval, next_tick - self.clock())
                if due is not None:
                    wait = min(wait, due)
                self._wake.wait(max(wait, 0.001))
                self._wake.clear()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                return
            try:
                due = None
                if self.on_poll is not None:
                    try:
                        due = self.on_poll()
                    except Exception as e:  # noqa: BLE001 - a failing seal must not stop the sending
                        self.warn.warning("sender:on_poll", "gradwatch: could not seal an open step: %r", e)
                stop = self._drain_queue()
                if stop:
                    return
                now = self.clock()
                if now >= next_tick or len(self._steps) >= self.config.max_batch_steps:
                    self._ship()
                    next_tick = now + self.config.flush_interval
                if self._retry_at and self.clock() >= self._retry_at:
                    self._replay()
            except Exception as e:  # noqa: BLE001 - the sender must outlive any bug of its own
                self.warn.warning("sender:" + type(e).__name__, "gradwatch: sender error (continuing): %r", e)

    def _drain_queue(self) -> bool:
        """Take everything submitted so far; True when a stop marker was handled."""
        held_since = time.perf_counter()
        while True:
            try:
                item = self._queue.popleft()
            except IndexError:
                return False
            if isinstance(item, StepRecord):
                self._take(item)
                # Let the training thread have the GIL back after about half a millisecond of
                # records (tens of them), not after each one: every hand-over costs both threads.
                if time.perf_counter() - held_since > 0.0005:
                    time.sleep(0)
                    held_since = time.perf_counter()
            elif isinstance(item, dict):
                self._events.append(item)
            elif isinstance(item, _Marker):
                try:
                    self._ship(status=item.status if item.kind == "stop" else None, final=item.kind == "stop")
                finally:
                    item.done.set()
                if item.kind == "stop":
                    return True

    def _take(self, record: StepRecord) -> None:
        try:
            step, events, critical = self.assembler.assemble(record)
        except Exception as e:  # noqa: BLE001
            self.warn.warning("assemble", "gradwatch: could not read a step's values (dropped): %r", e)
            self._count_drop("unreadable step", 1)
            return
        self._steps.append(step)
        self._events.extend(events)
        # Critical steps do not wait for the next tick. The size cap is checked per step, not
        # after a whole drain: after a pause of the sender (or a fast loop) one drain can take
        # thousands of records, and a batch that outgrows the spool bound could never be spooled.
        if critical or len(self._steps) >= self.config.max_batch_steps:
            self._ship()

    def _count_drop(self, reason: str, steps: int) -> None:
        self._drops[reason] = self._drops.get(reason, 0) + steps
        self.dropped_steps += steps

    def _ship(self, status: Optional[str] = None, final: bool = False) -> None:
        new_queue_drops = self.queue_drops - self._queue_drops_seen
        if new_queue_drops:
            self._queue_drops_seen += new_queue_drops
            self._count_drop("queue full", new_queue_drops)
        if not self._steps and not self._events and status is None:
            if self._retry_at or (self._drops and self.spool.has_backlog()):
                self._replay()
            if not self._drops or self.spool.has_backlog():
                return   # drops alone are reported once the backlog is through
        steps, events, drops = self._steps, self._events, self._drops
        self._steps, self._events, self._drops = [], [], {}
        events = events + [{"step": None, "kind": "dropped", "data": {"steps": n, "reason": reason}}
                           for reason, n in drops.items()]
        batch = {"batch_id": uuid.uuid4().hex, **self.header, "steps": steps, "events": events}
        if self.meta is not None:
            batch["meta"] = self.meta
        if status is not None:
            batch["status"] = status
        body = json.dumps(batch).encode()
        if self._store(body, final):
            self.meta = None  # sent (or safely spooled) once per process
            self.sent_steps += len(steps)
        else:
            for reason, n in drops.items():  # not reported after all: report them later
                self._drops[reason] = self._drops.get(reason, 0) + n
            self._count_drop(self._drop_reason(), len(steps))

    def _drop_reason(self) -> str:
        return "spool full" if "full" in (self.spool.last_error or "") else "server unreachable, spool unavailable"

    def _store(self, body: bytes, final: bool) -> bool:
        """True when the batch reached the server or the spool."""
        if self.config.mode == "offline":
            if self.spool.append(body):
                self.spooled_batches += 1
                return True
            self.warn.warning("spool", "gradwatch: dropping steps: %s", self.spool.last_error)
            return False
        if self.spool.append(body):
            self.spooled_batches += 1
            self._replay(force=final)
            return True
        self.warn.warning("spool", "gradwatch: spool not usable (%s); sending without it", self.spool.last_error)
        if self.spool.has_backlog():
            self._replay(force=final)            # the server may be back: make room
            if self.spool.has_backlog():
                return False  # sending past the backlog would break the order
            if self.spool.append(body):
                self.spooled_batches += 1
                self._replay(force=True)
                return True
        delivery = self.transport.post(body)
        if delivery.accepted:
            self.delivered_batches += 1
            return True
        self.warn.warning("post:%d" % delivery.status, "gradwatch: server did not take a batch (%s %s)",
                          delivery.status, delivery.body[:300])
        return False

    def _replay(self, force: bool = False) -> None:
        """Send spooled batches oldest first; stop at the first failure and back off."""
        if not force and self._retry_at and self.clock() < self._retry_at:
            return
        for path in self.spool.pending():
            body = self.spool.read(path)
            if body is None:
                continue
            delivery = self.transport.post(body)
            if delivery.accepted:
                self.spool.remove(path)
                self.delivered_batches += 1
                self._backoff, self._retry_at = 0.0, 0.0
                continue
            if not delivery.retryable:
                self.warn.warning("rejected:%d" % delivery.status,
                                  "gradwatch: server rejected a batch (%s): %s", delivery.status, delivery.body[:500])
                self.spool.remove(path)
                try:
                    self._count_drop(f"rejected by server ({delivery.status})", len(json.loads(body)["steps"]))
                except Exception:  # noqa: BLE001
                    pass
                continue
            self.warn.warning("unreachable", "gradwatch: server %s not reachable (%s %s); spooling to %s",
                              self.config.server, delivery.status, delivery.body[:200], self.spool.directory)
            self._backoff = min(max(self._backoff * 2, 0.25), 5.0)
            self._retry_at = self.clock() + self._backoff
            return
        self._backoff, self._retry_at = 0.0, 0.0
