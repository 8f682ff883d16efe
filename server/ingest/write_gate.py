"""A first-come, first-served gate in front of the ingest write transaction.

Batches arrive on several threads of one process. Letting them all into their
transactions at once buys nothing — the GIL runs one at a time anyway, and
SQLite has a single writer — and costs the tail: SQLite's busy handler polls
the write lock with sleeps that grow to 100 ms, so an unlucky batch can wait
seconds while later ones slip in, and on PostgreSQL every batch in flight
slows all the others down. Behind a FIFO gate each batch waits only for the
ones that came before it, and the process's throughput is the same.

Permits by default (``default_permits``): one on SQLite, which has a single
writer anyway; two on PostgreSQL, so that one batch's Python (parse, rules,
rollups) runs while another waits on PostgreSQL's COPYs and commit. Measured
at 1,000,000 values/s with bench/ingest.py --rate (docs/performance.md,
"Write permits on PostgreSQL"): with 16 agents one permit fell behind
(0.80–0.98 M values/s, p99 0.45–4.9 s) where two kept up better (0.89–1.0 M,
p99 0.16–2.4 s); with 8 agents they tied (p99 83–112 ms). (Earlier, before
the garbage-collector tuning, two had measured worse: p99 ~240 vs ~180 ms.)
``GRADWATCH_WRITE_CONCURRENCY`` sets it, e.g. higher for a PostgreSQL server
far away on the network.
"""
from __future__ import annotations

import threading
from collections import deque


def default_permits(dialect: str) -> int:
    """Write permits when ``GRADWATCH_WRITE_CONCURRENCY`` is not set (see the module docstring),
    by SQLAlchemy dialect name.

    >>> default_permits("sqlite"), default_permits("postgresql")
    (1, 2)
    """
    return 2 if dialect == "postgresql" else 1


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
