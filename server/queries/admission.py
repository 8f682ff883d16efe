"""Admission control for heavy reads: one memory budget per server process, a short queue, then a refusal.

Leaf module (standard library only). A per-layer heatmap within every per-request bound still holds
up to a few hundred MB while it is built (the layer values it reads, their masks and partial arrays,
the pages SQLite caches, the cells); twenty of them at once took a server to 2 GB. Each heavy read
therefore declares what it will hold (``heatmap_cost``) and takes that much of the process's budget
(``GRADWATCH_HEAVY_READ_BUDGET_MB``, 384 by default) before it reads anything:

- the budget has room: it runs;
- it has not: the read waits in a FIFO queue, at most ``wait_s`` (API requests: 5 s);
- the wait runs out: ``HeavyReadBusy`` (the API answers 503 with ``Retry-After``);
- more than ``max_waiting`` reads already wait: ``HeavyReadBusy`` at once (429 with ``Retry-After``).

A read larger than the whole budget runs alone. When the last heavy read of a burst is done, the C
allocator is asked to give the freed memory back (glibc ``malloc_trim``, with its trim threshold fixed:
``_malloc_trim``), so RSS returns near its baseline instead of staying at the burst's peak.
docs/deployment.md, "Hostile input", has the figures.

>>> gate = HeavyReadGate(budget_bytes=100, max_waiting=0)
>>> with gate.admit(60, wait_s=0):
...     try:
...         with gate.admit(60, wait_s=0):
...             pass
...     except HeavyReadBusy as e:
...         print(e.status, e.retry_after_s)
429 2
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

# bytes a heatmap holds per layer value it reads and per cell it answers (the cells are float64 arrays,
# encoded a block of rows at a time: server/api/layer_matrix_json.py). Raw rows: the blob, its bit
# matrix, three masks, the values reduced, SQLite's cached pages; partials of a rollup level: the
# (rows, 6, width) float32 partials besides. Peak RSS above the baseline of one read, this checkout
# (2026-12-06): 53,000 raw steps × 150 layers (8 M values read) into 6,666 columns (1 M cells)
# 173 MB (agg max) / 230 MB (mean); 6,666 raw steps × 150 into 1 M cells 41 / 52 MB; 3,313 level-16
# partials × 150 (0.5 M values) into 0.25 M cells 49 / 51 MB. 28 × 8 M + 32 × 1 M = 256 MB.
BYTES_PER_VALUE_READ = 28
BYTES_PER_PARTIAL_VALUE_READ = 80
BYTES_PER_CELL = 32


def heatmap_cost(values_read: int, cells: int, *, from_partials: bool = False) -> int:
    per_value = BYTES_PER_PARTIAL_VALUE_READ if from_partials else BYTES_PER_VALUE_READ
    return int(values_read) * per_value + int(cells) * BYTES_PER_CELL


class HeavyReadBusy(RuntimeError):
    """The server's budget for heavy reads is taken: try again after ``retry_after_s``."""

    def __init__(self, message: str, *, status: int, retry_after_s: int):
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


class HeavyReadGate:
    """A byte budget shared by every heavy read of the process, handed out first come, first served."""

    def __init__(self, budget_bytes: int, *, max_waiting: int = 32, trim=None):
        self.budget = max(1, int(budget_bytes))
        self.max_waiting = max_waiting
        self.in_use = 0
        self.peak_in_use = 0
        self.refused = 0
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._trim = _malloc_trim() if trim is None else trim

    @contextmanager
    def admit(self, cost: int, *, wait_s: float = 30.0, release: Optional[Callable[[], None]] = None
              ) -> Iterator[None]:
        """Hold ``cost`` bytes of the budget for the ``with`` block. ``release``: called once before the
        read would wait (the caller's database connection goes back to the pool: twenty waiting reads
        holding one each left ``/api/health`` waiting 5.7 s for a connection)."""
        cost = min(max(0, int(cost)), self.budget)      # larger than the budget: it runs alone
        ticket = object()
        if release is not None:
            with self._cond:
                busy = bool(self._queue) or self.in_use + cost > self.budget
            if busy:
                release()
        with self._cond:
            if self._queue or self.in_use + cost > self.budget:
                if len(self._queue) >= self.max_waiting:
                    self.refused += 1
                    raise HeavyReadBusy(f"{len(self._queue)} heavy reads are already waiting for this server's "
                                        f"read budget: try again shortly", status=429, retry_after_s=2)
                self._queue.append(ticket)
                deadline = time.monotonic() + wait_s
                try:
                    while self._queue[0] is not ticket or self.in_use + cost > self.budget:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            self.refused += 1
                            raise HeavyReadBusy(f"this server's read budget ({self.budget // 2**20} MB for heavy "
                                                f"reads at once) stayed taken for {wait_s:g} s: try again shortly",
                                                status=503, retry_after_s=max(1, round(wait_s)))
                        self._cond.wait(left)
                finally:
                    self._queue.remove(ticket)
                    self._cond.notify_all()
            self.in_use += cost
            self.peak_in_use = max(self.peak_in_use, self.in_use)
        try:
            yield
        finally:
            held = _held_until_sent.get()
            if held is not None:
                held.append(lambda: self._release(cost))     # the answer is built and sent: then
            else:
                self._release(cost)

    def _release(self, cost: int) -> None:
        with self._cond:
            self.in_use -= cost
            idle = self.in_use == 0
            self._cond.notify_all()
        if idle and cost > 16 * 2**20:
            self._trim()
            # and once more a moment later: what the sent answer frees would otherwise stay resident
            # until the next heavy read
            timer = threading.Timer(2.0, self._trim_if_idle)
            timer.daemon = True
            timer.start()

    def _trim_if_idle(self) -> None:
        with self._cond:
            idle = self.in_use == 0
        if idle:
            self._trim()


# Inside an API request (HoldUntilSent), a read's budget is given back when the answer has been sent,
# not when the read returns: the route still streams up to a million cells as JSON from the read's
# arrays, which the budget (BYTES_PER_CELL) covers too
_held_until_sent: ContextVar[Optional[list]] = ContextVar("gradwatch_heavy_read_held", default=None)


class HoldUntilSent:
    """ASGI middleware: heavy reads admitted while answering an API request keep their share of the
    budget until the response is sent (sync routes run in a worker thread with a copy of this context; the
    list is shared)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        # the API only: one heatmap per request there. A dashboard callback reads several in one request,
        # and holding the first's share would make the next wait for it
        if scope["type"] != "http" or not scope.get("path", "").startswith("/api/"):
            await self.app(scope, receive, send)
            return
        held: list = []
        token = _held_until_sent.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _held_until_sent.reset(token)
            for release in held:
                release()


# glibc's M_TRIM_THRESHOLD: a thread's heap whose free top grows past this is shrunk when memory is freed
M_TRIM_THRESHOLD = -1
TRIM_THRESHOLD_BYTES = 4 * 2**20


def _malloc_trim():
    """glibc's ``malloc_trim(0)``: freed heap pages back to the OS (elsewhere: nothing to do).

    Also fixes glibc's trim threshold at ``TRIM_THRESHOLD_BYTES`` (unless ``MALLOC_TRIM_THRESHOLD_`` is
    set). By default glibc raises it (and the size above which it maps memory of its own) each time a large
    block is freed, up to 64 MB; each worker thread's heap then kept its free top, which
    ``malloc_trim`` leaves alone in any heap but the main one: after twenty heatmaps, nine worker
    heaps held 34 MB each, free but resident (``malloc_info``), and RSS stayed 230–330 MB above its
    baseline. With the threshold fixed, a heap gives its free top back as it is freed, and large
    blocks (numpy arrays) are mapped and unmapped on their own. bench/ingest.py showed no cost.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ and hasattr(libc, "mallopt"):
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


# The process's gate: create_app sets it from the settings; reads outside an app (the CLI, tests of the
# query layer) share a default one
_gate: list[HeavyReadGate] = [HeavyReadGate(384 * 2**20)]


def heavy_reads() -> HeavyReadGate:
    return _gate[0]


def set_heavy_reads(gate: HeavyReadGate) -> Optional[HeavyReadGate]:
    old, _gate[0] = _gate[0], gate
    return old
