"""Which runs just got new steps, and which runs an open run page is watching: the live push.

The run page used to poll twice a second and the agent to send every 0.5 s, so a step reached an
open page 0.7 s (p50) to 1.1 s (p95) after it ended. Two hand-overs now cut the waits:

* **steps reach the page as soon as they are stored.** The page's live callback parks in
  :meth:`LiveNews.wait` (a long poll, at most :data:`WAIT_S`) and the ingest route wakes it with
  :meth:`LiveNews.published` right after the batch's commit. Only the process that stored the batch
  can wake its own pages: a page on another replica of the same database finds the steps by re-reading
  the run every :data:`RECHECK_S` while it waits (``recheck``), so it is never later than that.
* **the agent sends faster while someone looks.** :meth:`LiveNews.watching` says whether a page
  waited on the run in the last :data:`WATCH_HOLD_S`; the ingest reply carries it as ``live`` and the
  agent then sends every ``live_flush_interval`` (0.1 s) instead of every ``flush_interval``
  (0.5 s). A run nobody looks at costs the server what it did before.

A waiting page holds one of the dashboard's WSGI threads (``server/app.py`` gives it
:data:`DASHBOARD_THREADS`); at most :data:`MAX_WAITERS` wait at once so clicks and page loads always
find a free thread; a page beyond that polls as before.

Torch-free, no database: plain threading, shared by the API routes and the dashboard of one process.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

WAIT_S = 1.0            # the longest a live callback parks before it answers "nothing new"
RECHECK_S = 0.25        # while parked, re-read the run this often (steps stored by another replica)
WATCH_HOLD_S = 3.0      # a run counts as watched this long after a page last waited on it
DASHBOARD_THREADS = 32  # a2wsgi's worker threads for the dashboard (its default is 10)
MAX_WAITERS = 20        # parked live callbacks at once; the rest answer at once (the page polls)


class LiveNews:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._generation: dict[int, int] = {}   # run id -> batches stored since this process started
        self._watched: dict[int, float] = {}    # run id -> clock reading of the last wait on it
        self._waiters = 0

    def published(self, run_id: int) -> None:
        """A batch of ``run_id`` was committed: wake the pages waiting on it."""
        with self._cond:
            self._generation[run_id] = self._generation.get(run_id, 0) + 1
            self._cond.notify_all()

    def watch(self, run_id: int) -> None:
        """An open page is looking at ``run_id`` now (every live tick says so, parked or not)."""
        now = self._clock()
        self._watched[run_id] = now
        if len(self._watched) > 4 * MAX_WAITERS:   # forget runs nobody has watched for a while
            for rid, seen in list(self._watched.items()):
                if now - seen > WATCH_HOLD_S:
                    self._watched.pop(rid, None)

    def watching(self, run_id: int) -> bool:
        """Whether an open page waited on ``run_id`` within the last :data:`WATCH_HOLD_S` seconds."""
        seen = self._watched.get(run_id)
        return seen is not None and self._clock() - seen <= WATCH_HOLD_S

    def wait(self, run_id: int, recheck: Optional[Callable[[], bool]] = None,
             timeout: float = WAIT_S) -> Optional[bool]:
        """Park until a batch of ``run_id`` is stored here or ``recheck()`` (called every
        :data:`RECHECK_S`) says there is news: True then, False after ``timeout`` without either;
        None at once when :data:`MAX_WAITERS` callbacks are parked already (the caller polls)."""
        self.watch(run_id)
        now = self._clock()
        with self._cond:
            if self._waiters >= MAX_WAITERS:
                return None
            self._waiters += 1
            start = self._generation.get(run_id, 0)
        try:
            deadline = now + timeout
            while True:
                with self._cond:
                    left = deadline - self._clock()
                    if self._generation.get(run_id, 0) != start:
                        return True
                    if left <= 0:
                        return False
                    self._cond.wait(min(left, RECHECK_S))
                    if self._generation.get(run_id, 0) != start:
                        return True
                if recheck is not None and recheck():
                    return True
        finally:
            with self._cond:
                self._waiters -= 1
            self.watch(run_id)
