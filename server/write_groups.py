"""Group commit: ingest batches queued behind the write gate are written together, in one transaction.

Why: a batch's write has a fixed cost besides its rows (on PostgreSQL about
15 round trips: the run's row lock, the batch id, the stored-steps check, one
COPY per table, the rule states, the commit), ~10 ms per batch measured at
10–700 steps per batch (docs/performance.md, "PostgreSQL write path"). Many
agents sending small batches spend most of the server's time there and fall
behind. When batches are already waiting for the gate, the thread that gets
it writes all of them (up to ``max_batches`` and ``max_steps``) in one
transaction: one commit, and the fixed costs shared.

Nothing changes for a batch's outcome: each batch is still all or nothing,
idempotent on its batch id, and rule-evaluated in arrival order within its
run. If the group's transaction fails for any reason (a value PostgreSQL
refuses, a deadlock), it is rolled back whole and every batch in it is
written again on its own, exactly as without grouping, so one bad batch gets
its own 4xx and the others are stored.

Lock order: a group locks several runs' rows (``SELECT … FOR UPDATE``); it
takes them sorted by (project, run), the same order in every replica, so two
replicas' groups cannot deadlock each other on run rows.

>>> from server.write_gate import FifoGate
>>> w = GroupWriter(FifoGate(1), write_group=lambda bs: [b * 10 for b in bs], write_one=lambda b: b * 10)
>>> w.write(4)
40
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Optional, Sequence

from .write_gate import FifoGate

log = logging.getLogger("gradwatch.ingest")


class _Item:
    __slots__ = ("batch", "done", "outcome", "error")

    def __init__(self, batch: Any):
        self.batch = batch
        self.done = False
        self.outcome: Any = None
        self.error: Optional[BaseException] = None


class GroupWriter:
    """``write(batch)`` from any request thread; returns the batch's outcome or raises its error.

    ``write_group(batches) -> outcomes`` writes several batches in one transaction (raising
    if anything fails, with nothing committed); ``write_one(batch) -> outcome`` writes one
    with its own retries and error mapping. ``max_batches=1`` turns grouping off.
    """

    def __init__(self, gate: FifoGate, *, write_group: Callable[[list], Sequence[Any]],
                 write_one: Callable[[Any], Any], max_batches: int = 16, max_steps: int = 20_000,
                 steps_of: Callable[[Any], int] = lambda b: 0,
                 on_group: Callable[[int, bool], None] = lambda batches, fell_back: None):
        if max_batches < 1:
            raise ValueError("max_batches must be >= 1")
        self._gate = gate
        self._write_group, self._write_one = write_group, write_one
        self.max_batches, self.max_steps, self._steps_of = max_batches, max_steps, steps_of
        self._lock = threading.Lock()
        self._pending: deque[_Item] = deque()
        self._on_group = on_group     # (batches in the group, rolled back and written one by one?)

    def write(self, batch: Any) -> Any:
        item = _Item(batch)
        with self._lock:
            self._pending.append(item)
        with self._gate:
            # Whoever holds the gate writes what is queued, ours included; a batch that an
            # earlier holder already wrote is done by the time its own thread gets here.
            while not item.done:
                self._run(self._take())
        if item.error is not None:
            raise item.error
        return item.outcome

    def _take(self) -> list[_Item]:
        with self._lock:
            group: list[_Item] = []
            steps = 0
            while self._pending and len(group) < self.max_batches:
                n = self._steps_of(self._pending[0].batch)
                if group and steps + n > self.max_steps:
                    break
                group.append(self._pending.popleft())
                steps += n
            return group

    def _run(self, group: list[_Item]) -> None:
        if len(group) > 1:
            try:
                outcomes = self._write_group([i.batch for i in group])
            except Exception as e:  # noqa: BLE001 - rolled back whole: each batch goes again on its own
                self._on_group(len(group), True)
                log.info("a group of %d batches was rolled back (%r); writing them one by one", len(group), e)
            else:
                self._on_group(len(group), False)
                for i, outcome in zip(group, outcomes):
                    i.outcome, i.done = outcome, True
                return
        for i in group:
            try:
                i.outcome = self._write_one(i.batch)
            except BaseException as e:  # noqa: BLE001 - handed to the batch's own request thread
                i.error = e
            i.done = True
