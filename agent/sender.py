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
  reported in a later batch as a ``dropped`` event;
* the crash tail (:mod:`agent.tail`): every step and event taken is appended to the
  run's journal at once, before it waits for its batch, so a process killed with
  SIGKILL loses at most the step still open in the sealer. With a journal, a
  submit wakes the thread when it sleeps (spaced by ``TAIL_LAG_S`` less the
  step time, at least ``TAIL_MIN_GAP``), instead of waiting for the next poll.
* each batch asks for the run's alerts since the last reply's cursor
  (``alerts_after``); the replies' alerts go to ``inbox``
  (:class:`~agent.loop_alerts.AlertInbox`), from which the training thread takes
  them at its next step boundary (docs/alerts-in-the-loop.md).

Example (tests inject the transport, STYLE point 7)::

    sender = Sender(cfg, transport=HttpTransport(cfg.server), spool=Spool(dir, cfg.spool_max_bytes),
                    assembler=StepAssembler(...), header={...}, meta={...})
    sender.submit(record); sender.close(timeout=5, status="finished")
"""
from __future__ import annotations

import json
import math
import logging
import os
import collections
import threading
import time
import uuid
from typing import Callable, Optional

from gradwatch.agent.config import AgentConfig
from gradwatch.agent.loop_alerts import AlertInbox
from gradwatch.agent.pacing import MAX_PACE_S, initial_pace, seconds_to_slot
from gradwatch.agent.record import StepRecord
from gradwatch.agent.spool import Spool
from gradwatch.agent.tail import TailJournal
from gradwatch.agent.transport import HttpTransport
from gradwatch.agent.wire import StepAssembler

log = logging.getLogger("gradwatch.agent")

# The least time between two wakes a submit causes, so that a fast loop batches its journal
# writes instead of waking the thread for every step: the gap is TAIL_LAG_S less the loop's step
# time, never below TAIL_MIN_GAP. Every wake costs the training thread (a GIL hand-over in the
# middle of its step): woken every step, a 18 ms CPU reference step took 1.036-1.041x the bare
# loop's (bench/agent_overhead.py --interleaved-steps 400) against 1.016 without the journal; with
# this gap, 1.016-1.018. A killed process loses the open step plus the steps that ended within the
# gap: at 10 steps/s or slower (steps of 100 ms or more) the gap is 10 ms, at most the open step
# lost (tests/checkpoints/test_crash_tail.py); a faster loop loses at most its last ~100 ms of steps.
TAIL_MIN_GAP = 0.01
TAIL_LAG_S = 0.1
# How long one reply's "live" (a run page is watching; server/ingest/live_news.py) keeps the sender at
# live_flush_interval: a few batches, so a page closed meanwhile costs the server little, and a
# watched run's replies keep renewing it.
LIVE_HOLD_S = 2.0
# The longest pause between batches a server's ``pace`` can get from this agent: what server/ingest/pacing.py
# asks at most (agent/pacing.py's MAX_PACE_S, 10 s); a bad reply no more than this.
MAX_OBEYED_PACE_S = MAX_PACE_S
# When the spool cannot take a batch (disabled with spool_max_mb=0, unwritable) and the server did not
# answer, the batch waits in memory, up to this many bytes, and is sent again with the same batch_id:
# a post that timed out after the server stored it is then a duplicate the server ignores, not steps
# counted as dropped, and its ``dropped`` event is reported once. Beyond this, batches are dropped and
# counted, as before.
HELD_MAX_BYTES = 16 * 1024 * 1024


def _steps_in(body: bytes) -> int:
    try:
        return len(json.loads(body)["steps"])
    except Exception:  # noqa: BLE001 - a body we wrote ourselves; 0 rather than a crash
        return 0


class _Marker:
    def __init__(self, kind: str, status: Optional[str] = None):
        self.kind = kind
        self.status = status
        self.done = threading.Event()
        self.deadline = math.inf     # time.monotonic() by which the caller stops waiting


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


def _why(status, body: str) -> str:
    """A transport failure in a few words: "connection refused" rather than "URLError ... [Errno 111]"."""
    text = str(body or "")
    for needle, words in (("Errno 111", "connection refused"), ("Connection refused", "connection refused"),
                          ("timed out", "timed out"), ("Name or service not known", "unknown host"),
                          ("nodename nor servname", "unknown host"), ("Errno -2", "unknown host")):
        if needle in text:
            return words
    return f"HTTP {status}" if isinstance(status, int) and status > 0 else (text[:120] or "no answer")


class Sender:
    def __init__(self, config: AgentConfig, *, transport: HttpTransport, spool: Spool,
                 assembler: StepAssembler, header: dict, meta: Optional[dict] = None,
                 clock: Callable[[], float] = time.monotonic, warn: Optional[OnceLogger] = None,
                 journal: Optional[TailJournal] = None, inbox: Optional[AlertInbox] = None,
                 wall_clock: Callable[[], float] = time.time):
        self.config = config
        # Where the replies' alerts go (None: batches do not ask for them).
        self.inbox = inbox
        self.transport = transport
        self.spool = spool
        self.assembler = assembler
        self.header = dict(header)
        self.meta = meta
        self.clock = clock
        # the pace's slots are wall-clock instants shared by the ranks' hosts (agent/pacing.py)
        self.wall_clock = wall_clock
        self.warn = warn or OnceLogger()
        self.journal = journal if journal is not None and journal.on else None
        # True while the thread sleeps with nothing taken: a submit wakes it (crash tail only)
        self._idle = False
        self._last_drain = 0.0
        self._step_s = 0.0        # the loop's step time as the drains see it (EMA), for the journal's gap
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
        self._steps: list[str] = []          # assembled steps, as JSON (written once: journal and batch)
        self._events: list[dict] = []
        self._batch_id = uuid.uuid4().hex     # the id the batch being assembled will carry
        self._journaled = (0, 0)              # steps and events of it already in the journal
        self._posting = False      # a POST is in flight and the thread journals meanwhile (_post)
        self._ship_due = False     # a critical or full batch taken during a POST: ship it right after
        self._backoff = 0.0
        self._retry_at = 0.0
        # batches the spool could not take and the server did not answer: (body, steps), oldest first
        self._held: collections.deque = collections.deque()
        self._held_bytes = 0
        # Counters for users and tests.
        self.delivered_batches = 0
        self.spooled_batches = 0
        self.dropped_steps = 0
        self.sent_steps = 0
        self.taken_steps = 0     # step records taken off the queue (the journal gap reads the rate)
        # the server's word on this process's step numbers (agent/resume.py, server/ingest/resume.py)
        self.step_shift = 0
        self.already_stored = 0
        # until when (sender clock) a run page is watching the run, by the server's replies
        self._live_until = 0.0
        # the least seconds between batches the server asked of this rank (a run of many ranks); None
        # until a reply says, meanwhile a rank of a large run assumes agent/pacing.py's initial_pace
        self._pace: Optional[float] = None

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
        if self._idle:   # crash tail: take it now, not at the next poll
            self._idle = False
            self._wake.set()

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
        marker.deadline = deadline
        self._queue.append(marker)   # markers are never dropped
        self._wake.set()
        try:
            return marker.done.wait(max(0.0, deadline - time.monotonic()))
        except RuntimeError:  # interpreter shutting down
            return False

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        next_tick = self._next_tick(self.clock())
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
                if self.journal is not None:
                    gap = self._last_drain + max(TAIL_MIN_GAP, TAIL_LAG_S - self._step_s) - time.monotonic()
                    if gap > 0:
                        time.sleep(gap)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                return
            try:
                due = None
                if self.on_poll is not None:
                    try:
                        due = self.on_poll()
                    except Exception as e:  # noqa: BLE001 - a failing seal must not stop the sending
                        self.warn.warning("sender:on_poll", "gradwatch: could not seal an open step: %r", e)
                before = self.taken_steps
                stop = self._drain_queue()
                if stop:
                    return
                taken = self.taken_steps - before
                now = self.clock()
                if now >= next_tick or len(self._steps) >= self.config.max_batch_steps:
                    self._ship()
                    next_tick = self._next_tick(now)
                if self._ship_due:      # a critical or full batch taken while a POST was in flight
                    self._ship_due = False
                    self._ship()
                self._write_journal()   # what waits for the next batch
                if self._retry_at and self.clock() >= self._retry_at:
                    self._replay()
                if self.journal is not None:
                    drained_at = time.monotonic()
                    if taken and self._last_drain:
                        per_step = (drained_at - self._last_drain) / taken
                        self._step_s = per_step if not self._step_s else 0.8 * self._step_s + 0.2 * per_step
                    self._last_drain = drained_at
                    self._idle = True
                    if self._queue:   # submitted after the drain: take it without waiting
                        self._idle = False
                        self._wake.set()
            except Exception as e:  # noqa: BLE001 - the sender must outlive any bug of its own
                self.warn.warning("sender:" + type(e).__name__, "gradwatch: sender error (continuing): %r", e)

    def _next_tick(self, now: float) -> float:
        """When (sender clock) the next batch goes: ``live_flush_interval`` after ``now`` while a run page
        watches the run (the last reply said so, within LIVE_HOLD_S), else ``flush_interval`` after it,
        or, when the server's ``pace`` for this rank is longer (a run of many ranks: server/ingest/pacing.py),
        this rank's next slot of the pace (agent/pacing.py: the ranks' batches spread evenly over it)."""
        if now < self._live_until:
            return now + min(self.config.live_flush_interval, self.config.flush_interval)
        rank, world = self.header.get("rank") or 0, self.header.get("world_size") or 1
        pace = self._pace if self._pace is not None else initial_pace(rank, world)
        if pace <= self.config.flush_interval:
            return now + self.config.flush_interval
        at = self.clock()    # after the batch's round trip: the slot is counted from the present
        return at + seconds_to_slot(self.wall_clock(), pace, rank=rank, world_size=world)

    def _drain_queue(self, journal_only: bool = False) -> bool:
        """Take everything submitted so far; True when a stop marker was handled.

        ``journal_only`` (a POST in flight, :meth:`_post`): take the step records and events at the head of
        the queue only, up to the first flush or stop marker (the main loop's, after the POST) or until a
        batch is full (the batch bound and the queue's drop count hold), and journal them."""
        held_since = time.perf_counter()
        while True:
            if journal_only and (not self._queue or isinstance(self._queue[0], _Marker)
                                 or len(self._steps) >= self.config.max_batch_steps):
                self._write_journal()     # this thread is the only one that takes from the queue
                return False
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
                    if item.kind == "stop":
                        self._give_up_held(item.deadline)
                    if item.kind == "stop" and self.journal is not None:
                        self.journal.close()   # the last batch is stored: nothing left to recover
                finally:
                    item.done.set()
                if item.kind == "stop":
                    return True

    def _take(self, record: StepRecord) -> None:
        self.taken_steps += 1
        try:
            step, events, critical = self.assembler.assemble(record)
        except Exception as e:  # noqa: BLE001
            self.warn.warning("assemble", "gradwatch: could not read a step's values (dropped): %r", e)
            self._count_drop("unreadable step", 1)
            return
        self._steps.append(json.dumps(step))
        self._events.extend(events)
        # Critical steps do not wait for the next tick. The size cap is checked per step, not
        # after a whole drain: after a pause of the sender (or a fast loop) one drain can take
        # thousands of records, and a batch that outgrows the spool bound could never be spooled.
        if critical or len(self._steps) >= self.config.max_batch_steps:
            if self._posting:
                self._ship_due = True    # not inside the POST in flight: right after it
            else:
                self._ship()

    def _write_journal(self) -> None:
        """Append the steps and events taken since the last write to the crash-tail journal."""
        j = self.journal
        if j is None:
            return
        n_steps, n_events = self._journaled
        if n_steps == len(self._steps) and n_events == len(self._events):
            return
        try:
            j.write(self._batch_id, self.header, self.meta, self._steps[n_steps:],
                    [json.dumps(e) for e in self._events[n_events:]])
        except Exception as e:  # noqa: BLE001 - the tail is a safety net; batches go out without it
            j.last_error = repr(e)
            j.close()
        if not j.on:
            self.warn.warning("tail", "gradwatch: crash-tail journal off (batches still sent): %s", j.last_error)
            self.journal = None
        self._journaled = (len(self._steps), len(self._events))

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
        batch_id, self._batch_id = self._batch_id, uuid.uuid4().hex
        events = events + [{"step": None, "kind": "dropped", "data": {"steps": n, "reason": reason}}
                           for reason, n in drops.items()]
        rest: dict = {"events": events}
        if self.inbox is not None:
            # The cursor as it is now; a batch replayed later from the spool asks from an older cursor,
            # which only repeats alerts the inbox already has.
            rest["alerts_after"] = self.inbox.cursor
        if self.meta is not None:
            rest["meta"] = self.meta
        if status is not None:
            rest["status"] = status
        # the steps were serialised once, when taken (the journal wrote the same text)
        body = (json.dumps({"batch_id": batch_id, **self.header})[:-1] + ', "steps": [' + ", ".join(steps)
                + "], " + json.dumps(rest)[1:]).encode()
        stored = self._store(body, final)
        self._release_tail()   # stored, or counted as dropped: either way not the tail's any more
        if stored:
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
            self._release_tail()        # the spool holds it: the journal is the next batch's before the POST
            self._replay(force=final)
            return True
        self.warn.warning("spool", "gradwatch: spool not usable (%s); sending without it", self.spool.last_error)
        if self.spool.has_backlog():
            self._replay(force=final)            # the server may be back: make room
            if self.spool.has_backlog():
                return False  # sending past the backlog would break the order
            if self.spool.append(body):
                self.spooled_batches += 1
                self._release_tail()
                self._replay(force=True)
                return True
        if self._held:
            if self._held_bytes + len(body) > HELD_MAX_BYTES:
                self._replay(force=True)
            if self._held_bytes + len(body) > HELD_MAX_BYTES:
                return False   # the server is still silent and memory holds enough: drop, counted
            self._hold(body)
            self._replay(force=final)   # after the held ones, in order
            return True
        delivery = self._post(body)
        if delivery.accepted:
            self.delivered_batches += 1
            self._read_reply(delivery.body)
            return True
        self.warn.warning("post:%d" % delivery.status, "gradwatch: server did not take a batch (%s %s)",
                          delivery.status, delivery.body[:300])
        if delivery.retryable and len(body) <= HELD_MAX_BYTES:
            self._hold(body)
            self._back_off()
            return True
        return False

    def _tail_free(self) -> bool:
        """Whether the journal holds nothing but the batch being assembled. Between a batch's swap
        (:meth:`_ship`) and its safe arrival in the spool it still holds that batch, and nothing of the
        next may be added: the journal's next write would empty it (:meth:`TailJournal.write`)."""
        j = self.journal
        return j is None or j.batch_id in (None, self._batch_id)

    def _release_tail(self) -> None:
        """The batch just shipped is the journal's no more: empty it (once) for the batch now assembled."""
        if self._tail_free():
            return
        self._journaled = (0, 0)
        self.journal.reset()

    def _post(self, body: bytes):
        """``transport.post(body)``; with a crash-tail journal free for the next batch, the POST runs on a
        short-lived thread while this one keeps taking the submitted steps into the journal.

        Why: a POST to a slow server (hundreds of ms on a loaded host) used to hold this thread, and
        the steps sealed meanwhile waited, unjournaled, in the queue: a SIGKILL then lost more than
        the open step (seen at load ~15: two steps, tests/checkpoints/test_crash_tail.py). Nothing
        is shipped while a POST is in flight (a critical step ships right after it), and no more
        than ``max_batch_steps`` are taken, so the batch bound and the queue's drop count hold."""
        if self.journal is None or not self._tail_free() or self._posting:
            return self.transport.post(body)
        box: dict = {}
        done = threading.Event()

        def post() -> None:
            try:
                box["delivery"] = self.transport.post(body)
            except BaseException as e:  # noqa: BLE001 - raised again on the sender thread
                box["error"] = e
            finally:
                done.set()
                self._wake.set()

        self._posting = True
        try:
            threading.Thread(target=post, name="gradwatch-post", daemon=True).start()
            while not done.is_set():
                self._idle = True        # a submit wakes this loop (see submit)
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                self._idle = False
                self._drain_queue(journal_only=True)
        finally:
            self._posting = False
        if "error" in box:
            raise box["error"]
        return box["delivery"]

    def _hold(self, body: bytes) -> None:
        self._held.append(body)
        self._held_bytes += len(body)

    def _back_off(self) -> None:
        self._backoff = min(max(self._backoff * 2, 0.25), 5.0)
        self._retry_at = self.clock() + self._backoff

    def _read_reply(self, text: str) -> None:
        """A reply, parsed once: the run's alerts for the inbox, and what the server did with this
        process's step numbers."""
        alerts = self.inbox is not None and '"alerts_cursor"' in text
        if (not alerts and "step_shift" not in text and "already_stored" not in text and '"live"' not in text
                and '"pace"' not in text):
            return
        try:
            reply = json.loads(text)
        except ValueError:
            return
        if not isinstance(reply, dict):
            return
        self._numbering_reply(reply)
        pace = reply.get("pace")
        if isinstance(pace, (int, float)) and not isinstance(pace, bool):
            # the server's word on how often this rank should send; bounded so a bad reply cannot
            # silence a rank (its critical steps are sent at once whatever the pace)
            self._pace = min(max(float(pace), 0.0), MAX_OBEYED_PACE_S) if pace == pace else 0.0
        if reply.get("live") is True:
            # an open run page is watching: send every live_flush_interval for a while (server/ingest/live_news.py)
            self._live_until = self.clock() + LIVE_HOLD_S
        if alerts:
            self._heard(reply)

    def _numbering_reply(self, reply: dict) -> None:
        """What the server did with this process's step numbers: continued them after the run's
        stored steps (a resumed run), or found some already stored. Said once, loudly: nothing a
        resumed run sends may vanish without a word (docs/resume.md)."""
        shift = reply.get("step_shift") or 0
        if shift and shift != self.step_shift:
            self.step_shift = shift
            self.warn.warning("step_shift", "gradwatch: run %r already holds steps before this process's: its steps "
                              "are stored %d steps on (continuing the run). Pass attach(..., step=N) to number "
                              "them yourself.", self.header.get("run"), shift)
        stored = reply.get("already_stored") or 0
        if stored:
            self.already_stored += stored
            self.warn.warning("already_stored", "gradwatch: run %r: %d step(s) of this process were NOT written, "
                              "the run already holds steps of those numbers (resumed from an earlier checkpoint?). "
                              "Stored steps are never overwritten: continue the numbering (attach(step=...)) or "
                              "log the new branch under a new run name. monitor.already_stored_steps counts them.",
                              self.header.get("run"), stored)

    def _replay(self, force: bool = False) -> None:
        """Send spooled batches oldest first, then the ones held in memory; stop at the first failure and
        back off."""
        if not force and self._retry_at and self.clock() < self._retry_at:
            return
        if self._held and not self.spool.has_backlog():
            self._send_held()
            return
        for path in self.spool.pending():
            body = self.spool.read(path)
            if body is None:
                continue
            delivery = self._post(body)
            if delivery.accepted:
                self.spool.remove(path)
                self.delivered_batches += 1
                self._read_reply(delivery.body)
                self._backoff, self._retry_at = 0.0, 0.0
                continue
            if not delivery.retryable:
                self.warn.warning("rejected:%d" % delivery.status,
                                  "gradwatch: server rejected a batch (%s): %s", delivery.status, delivery.body[:500])
                self.spool.remove(path)
                self._count_drop(f"rejected by server ({delivery.status})", _steps_in(body))
                continue
            # what happens and what to run, not a raw URLError (issue 42); said once per process
            self.warn.warning("unreachable", "gradwatch: server %s not reachable (%s). Training goes on: the steps "
                              "are kept on disk in %s and sent in order as soon as the server answers. Start it "
                              "(`gradwatch serve`), or upload this spool later: `gradwatch sync %s --server URL`.",
                              self.config.server, _why(delivery.status, delivery.body), self.spool.directory,
                              self.spool.directory)
            self._back_off()
            return
        self._backoff, self._retry_at = 0.0, 0.0

    def _send_held(self) -> None:
        """The batches held in memory (the spool could not take them), oldest first, with their own
        batch_id: one the server already stored is acknowledged again and not stored twice."""
        while self._held:
            body = self._held[0]
            delivery = self._post(body)
            if not delivery.accepted and delivery.retryable:
                self._back_off()
                return
            self._held.popleft()
            self._held_bytes -= len(body)
            if delivery.accepted:
                self.delivered_batches += 1
                self._read_reply(delivery.body)
            else:
                self.warn.warning("rejected:%d" % delivery.status, "gradwatch: server rejected a batch (%s): %s",
                                  delivery.status, delivery.body[:500])
                self._count_drop(f"rejected by server ({delivery.status})", _steps_in(body))
        self._backoff, self._retry_at = 0.0, 0.0

    def _give_up_held(self, deadline: float) -> None:
        """At the stop: the held batches are tried again until shortly before close()'s caller stops
        waiting; those the server never answered are lost with the process, and counted."""
        while self._held and time.monotonic() + max(self._backoff, 0.05) < deadline - 0.2:
            time.sleep(max(self._backoff, 0.05))
            self._send_held()
        if not self._held:
            return
        lost = sum(_steps_in(b) for b in self._held)
        self._held.clear()
        self._held_bytes = 0
        self.dropped_steps += lost
        self.warn.warning("held_lost", "gradwatch: %d step(s) were not sent: the server did not answer and the "
                          "spool could not hold them (%s)", lost, self.spool.last_error or "spool disabled")

    def _heard(self, answer: dict) -> None:
        """A reply's alerts into the inbox (this thread; the training thread takes them at a step boundary)."""
        try:
            self.inbox.receive(answer.get("alerts") or (), answer.get("alerts_cursor"))
        except Exception as e:  # noqa: BLE001 - an odd reply loses the news, never the batch
            self.warn.warning("reply", "gradwatch: could not read the alerts in the server's reply: %r", e)
