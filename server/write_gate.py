"""A first-come, first-served gate in front of the ingest write transaction.

Batches arrive on several threads of one process. Letting them all into their
transactions at once buys nothing — the GIL runs one at a time anyway, and
SQLite has a single writer — and costs the tail: SQLite's busy handler polls
the write lock with sleeps that grow to 100 ms, so an unlucky batch can wait
seconds while later ones slip in, and on PostgreSQL every batch in flight
slows all the others down. Behind a FIFO gate each batch waits only for the
ones that came before it, and the process's throughput is the same.

One permit on both databases by default: on PostgreSQL two let a batch
compute while another waits on the database, but measured at 1,000,000
values/s (bench/ingest.py --rate) they raised p99 from ~180 to ~240 ms.
``GRADWATCH_WRITE_CONCURRENCY`` raises it, e.g. for a PostgreSQL server far
away on the network.
"""
from __future__ import annotations

import threading
from collections import deque


class FifoGate:
    """A counting semaphore that admits waiters strictly in arrival order.

    >>> gate = FifoGate(1)
    >>> with gate:
    ...     pass
    """

    def __init__(self, permits: int = 1):
        if permits < 1:
            raise ValueError("permits must be >= 1")
        self._lock = threading.Lock()
        self._free = permits
        self._waiters: deque[threading.Event] = deque()

    def acquire(self) -> None:
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return
            turn = threading.Event()
            self._waiters.append(turn)
        turn.wait()            # release() hands its permit straight to us

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._free += 1

    def __enter__(self) -> "FifoGate":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
