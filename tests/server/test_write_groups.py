"""Group commit (server/write_groups.py): batches queued behind the gate go in one transaction;
a group that fails is written again batch by batch, and each caller gets its own outcome or error.

The write functions here are plain callables (the real ones, against SQLite and PostgreSQL,
run in tests/server/test_server_replicas.py and every ingest test): what is tested is the
hand-over between request threads, which needs threads and a gate, not a database."""
from __future__ import annotations

import threading

import pytest

from server.write_gate import FifoGate
from server.write_groups import GroupWriter
from tests.conftest import wait_until


def _writer(fail_on=None, max_batches=16, max_steps=20_000):
    calls: list[tuple[str, list]] = []
    groups: list[tuple[int, bool]] = []

    def write_group(batches):
        calls.append(("group", list(batches)))
        if fail_on is not None and fail_on in batches:
            raise RuntimeError("the database refused one batch")
        return [f"stored {b}" for b in batches]

    def write_one(b):
        calls.append(("one", [b]))
        if b == fail_on:
            raise ValueError(f"batch {b} is bad")
        return f"stored {b}"

    gate = FifoGate(1)
    w = GroupWriter(gate, write_group=write_group, write_one=write_one, max_batches=max_batches,
                    max_steps=max_steps, steps_of=lambda b: 100, on_group=lambda n, fb: groups.append((n, fb)))
    return w, gate, calls, groups


def _post_while_gate_held(w, gate, batches):
    """Start one thread per batch while the gate is held; release it once all are queued."""
    results: dict[int, object] = {}

    def post(b):
        try:
            results[b] = w.write(b)
        except Exception as e:  # noqa: BLE001
            results[b] = e
    gate.acquire()
    threads = [threading.Thread(target=post, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    wait_until(lambda: len(w._pending) == len(batches), timeout=10, what="every batch queued")
    gate.release()
    for t in threads:
        t.join(10)
    return results


def test_batches_queued_behind_the_gate_are_written_in_one_transaction():
    w, gate, calls, groups = _writer()
    results = _post_while_gate_held(w, gate, list(range(6)))
    assert results == {b: f"stored {b}" for b in range(6)}
    assert len(calls) == 1 and calls[0][0] == "group" and sorted(calls[0][1]) == list(range(6))
    assert groups == [(6, False)]


def test_a_failed_group_is_written_batch_by_batch_and_only_the_bad_batch_fails():
    w, gate, calls, groups = _writer(fail_on=3)
    results = _post_while_gate_held(w, gate, list(range(5)))
    assert isinstance(results.pop(3), ValueError)
    assert results == {b: f"stored {b}" for b in (0, 1, 2, 4)}
    assert calls[0][0] == "group" and sorted(b for kind, bs in calls[1:] for b in bs) == list(range(5))
    assert all(kind == "one" for kind, _ in calls[1:])
    assert groups == [(5, True)]


def test_group_size_is_bounded_by_batches_and_steps():
    w, gate, calls, _ = _writer(max_batches=4, max_steps=250)   # 100 steps a batch: at most 2
    results = _post_while_gate_held(w, gate, list(range(5)))
    assert results == {b: f"stored {b}" for b in range(5)}
    sizes = [len(bs) for _, bs in calls]
    assert sum(sizes) == 5 and max(sizes) <= 2, calls


def test_a_lone_batch_takes_the_single_batch_path():
    w, _, calls, groups = _writer()
    assert w.write(7) == "stored 7"
    assert calls == [("one", [7])] and groups == []


def test_max_batches_must_be_positive():
    with pytest.raises(ValueError):
        GroupWriter(FifoGate(1), write_group=list, write_one=str, max_batches=0)
