"""The ingest write gate admits batches first come, first served, never more than its permits at once."""
from __future__ import annotations

import threading
import time

import pytest

from gradwatch.server.ingest.write_gate import FifoGate


def test_waiters_enter_in_arrival_order_and_never_more_than_the_permits():
    for permits in (1, 2, 3):
        gate = FifoGate(permits)
        inside, most, entered = [0], [0], []
        lock = threading.Lock()
        gate.acquire()                          # hold one permit while the waiters line up
        held_back = [gate.acquire() for _ in range(permits - 1)]
        assert len(held_back) == permits - 1

        def worker(i):
            with gate:
                with lock:
                    entered.append(i)
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                time.sleep(0.002)
                with lock:
                    inside[0] -= 1

        threads = []
        for i in range(12):
            t = threading.Thread(target=worker, args=(i,))
            t.start()
            threads.append(t)
            # each thread is queued before the next starts: arrival order is 0, 1, 2, ...
            deadline = time.monotonic() + 5
            while len(gate._waiters) < i + 1 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert len(gate._waiters) == i + 1
        for _ in range(permits):
            gate.release()
        for t in threads:
            t.join(10)
        # admitted in arrival order; with p permits the p admitted together may record in any order,
        # but nobody overtakes by more than that
        assert sorted(entered) == list(range(12))
        if permits == 1:
            assert entered == list(range(12))
        assert all(i <= k + permits - 1 for k, i in enumerate(entered)), (permits, entered)
        assert most[0] <= permits
        # every permit came back: as many fresh acquires as permits succeed at once
        for _ in range(permits):
            gate.acquire()
        assert not gate._waiters


def test_an_exception_inside_gives_the_permit_back():
    gate = FifoGate(1)
    with pytest.raises(RuntimeError):
        with gate:
            raise RuntimeError("batch failed")
    done = threading.Event()
    threading.Thread(target=lambda: (gate.acquire(), done.set())).start()
    assert done.wait(5)


def test_permits_must_be_positive():
    with pytest.raises(ValueError):
        FifoGate(0)


def test_default_permits_are_one_on_sqlite_and_two_on_postgresql():
    from gradwatch.server.ingest.write_gate import default_permits
    from gradwatch.server.storage.db import make_engine
    for url, permits in (("sqlite:////tmp/gw-permits.db", 1), ("postgresql+psycopg://postgres@127.0.0.1:5432/gw", 2)):
        engine = make_engine(url)   # no connection made: only the dialect is read
        try:
            assert default_permits(engine.dialect.name) == permits
        finally:
            engine.dispose()
