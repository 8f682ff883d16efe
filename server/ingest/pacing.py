"""How often each rank of a run should send: the ``pace`` of the ingest reply.

Each agent sends a batch every ``flush_interval`` (0.5 s), so a run of W ranks would make 2 W batches a
second (512 at 256 ranks), and a batch's server cost is mostly fixed: its transaction, the run's row
lock (which serialises a run's batches across threads and replicas: the rules' state is
read-modify-write), the rules' state. The reply therefore asks every rank but rank 0 to send at most
every ``pace`` seconds, so that a run's batches together hold its lock for at most ``RUN_LOCK_SHARE`` of
the time, and never more than ``RUN_BATCHES_PER_S`` batches a second. The steps still all arrive, a few
more to a batch.

The hold time is *measured* (``LockHoldMeter``: from the run's row lock granted to the commit, a
moving average over this process's recent batches), not assumed, because it differs by a factor of
two between backends on one machine (a 4-step batch of a 256-rank run: 4.2 ms on SQLite, 7.5 ms on a
local PostgreSQL, more on a remote one: every statement a round trip) and grows with a loaded
database. A pace from a fixed batch budget kept SQLite's 256-rank run at p99 61 ms and left
PostgreSQL's 0.2 ms a batch over its budget, behind by seconds (docs/performance.md, "One run of many
ranks"). Replicas each measure their own batches; they see the same run lock and database, so they
ask about the same pace.

Each paced rank sends in its own slot of the pace (agent/pacing.py), so a run's batches come one every
``pace / world_size`` seconds rather than all together. Rank 0 keeps its cadence (and the live one while a page watches it: the headline charts read it); a
non-finite step is still sent at once by every rank (agent/sender.py), so the alerts that must come
within a second do. docs/integrations.md, "How often each rank sends".
"""
from __future__ import annotations

import math
import threading
import time

# RUN_BATCHES_PER_S: the most batches a second one run's ranks are asked to send together, however cheap
# a batch; MAX_PACE_S (10 s): the longest pause asked for, the longest the agent obeys (agent/sender.py;
# the silent-rank rule F4 waits minutes or 200 steps, far beyond it; agent/pace_bounds.py says why 10).
# Shared with the agent, which assumes a pace before the first reply and spreads a run's batches over it:
# a leaf module of the agent's with no imports, not its sending code.
from gradwatch.agent.pace_bounds import FIRST_HOLD_FACTOR, MAX_PACE_S, RUN_BATCHES_PER_S

# the share of the time a run's batches may hold its row lock: at one half, a batch waits for the
# others about as long as it takes itself (queueing at 50 % load), inside the p99 target of 200 ms
RUN_LOCK_SHARE = 0.5
# the hold at which the pace is the RUN_BATCHES_PER_S one: the figure before any batch is measured
LEAST_HOLD_S = RUN_LOCK_SHARE / RUN_BATCHES_PER_S
# weight of the newest batch in the moving average: ~200 batches, a few seconds at the pace's rate
HOLD_EWMA_WEIGHT = 0.005
# the grid the pace's hold is rounded up to: four steps per doubling, 19 % apart
HOLD_STEPS_PER_OCTAVE = 4
# how far (in steps) the average must leave its step's range before the figure moves: half a step
HOLD_MARGIN_STEPS = 0.5
# the least seconds between two moves of the figure, unless the average is this many steps above it
HOLD_MIN_CHANGE_S = 20.0
HOLD_URGENT_STEPS = 2.0


class LockHoldMeter:
    """How long this process's ingest transactions hold their run's lock: a moving average
    (``average``), and the figure the pace is computed from (``seconds``): the average rounded up to a
    grid of ``HOLD_STEPS_PER_OCTAVE`` steps per doubling (the figure may sit up to half a step, 9 %,
    below the average), moved to another step only once the average has left its own range by
    ``HOLD_MARGIN_STEPS``, and at most once every ``HOLD_MIN_CHANGE_S``
    seconds unless the average has risen ``HOLD_URGENT_STEPS`` above it (the server falling behind).

    Why it moves so rarely: every change of the pace puts the ranks, as each hears of it at its next
    reply, on another grid of slots (agent/pacing.py), and while they move their batches bunch. Measured
    (bench/ingest.py --ranks 256, SQLite, 30 s): with a one-second average and a tenth of a step of
    margin the figure moved every few seconds (paces 2.0-4.8 s asked at once), and each move gave a
    second of batches 3-4x as dense, p50 ~200 ms in it; p99 over the run 191-263 ms.

    Starts at the hold time that makes the pace the ``RUN_BATCHES_PER_S`` one, until batches are measured.

    >>> clock = iter(range(0, 10_000, 1)).__next__          # one second a batch
    >>> m = LockHoldMeter(clock=clock)
    >>> round(m.seconds * 1000, 2)
    3.91
    >>> for _ in range(1500):
    ...     m.observe(0.008)
    >>> round(m.average * 1000, 2), round(m.seconds * 1000, 2)     # on its step (2^-7 s), within half a step
    (8.0, 7.81)
    >>> for _ in range(1500):
    ...     m.observe(0.0105)         # past half a step above: moved, to half a step above the average
    >>> round(m.seconds * 1000, 2)
    11.05
    >>> for _ in range(1500):
    ...     m.observe(0.004)
    >>> round(m.seconds * 1000, 2)
    4.65
    """

    def __init__(self, initial_s: float = LEAST_HOLD_S, clock=time.monotonic):
        self.average = self._seconds = initial_s
        self._step = math.ceil(math.log2(initial_s) * HOLD_STEPS_PER_OCTAVE)
        self._clock = clock
        self._moved_at = -math.inf
        self._lock = threading.Lock()   # batches finish on several threads of the pool

    @property
    def seconds(self) -> float:
        return self._seconds

    def observe(self, held_s: float) -> None:
        if not held_s > 0.0:            # NaN, nothing or a clock step back: nothing learned
            return
        with self._lock:
            self.average += HOLD_EWMA_WEIGHT * (held_s - self.average)
            x = math.log2(self.average) * HOLD_STEPS_PER_OCTAVE
            # its step's range is (step - 1, step]: moved once x is half a step beyond either end
            if x <= self._step + HOLD_MARGIN_STEPS and x >= self._step - 1 - HOLD_MARGIN_STEPS:
                return
            now = self._clock()
            if now - self._moved_at < HOLD_MIN_CHANGE_S and x < self._step + HOLD_URGENT_STEPS:
                return
            # to the step half a step above the average: room to move within before it moves again
            self._step, self._moved_at = math.ceil(x + HOLD_MARGIN_STEPS), now
            self._seconds = 2.0 ** (self._step / HOLD_STEPS_PER_OCTAVE)


# A young run's ranks send their dearest batches (each process's first, with its meta and layout; the
# first combinations of a sharded run) while the measured hold is still that of other runs or of none:
# for this long after the run's first batch, the pace is at least the one of batches FIRST_HOLD_FACTOR
# times as dear as the least (what a rank assumes before its first reply, agent/pacing.py, but up to
# MAX_PACE_S). Measured (bench/ingest.py --ranks 256 --sharded, a slow machine, --timeline): the first
# replies asked 2-2.8 s, the ranks' second batches came at ~90 a second while each held the lock ~20 ms,
# and the batches of seconds 5-12 waited up to 3.4 s; from second 15 on, at 8-10 s, no more than ~0.2 s.
YOUNG_RUN_S = 30.0


def reply_pace(world_size: int, rank: int, hold_s: float, run_age_s: float) -> float:
    """The pace of an ingest reply: ``rank_pace``, and for a run younger than ``YOUNG_RUN_S`` at least
    that of batches ``FIRST_HOLD_FACTOR`` times as dear as the least.

    >>> reply_pace(256, 3, 0.004, run_age_s=100.0), reply_pace(256, 3, 0.004, run_age_s=5.0)
    (2.048, 8.0)
    >>> reply_pace(256, 0, 0.004, run_age_s=5.0), reply_pace(8, 3, 0.004, run_age_s=5.0)
    (0.0, 0.25)
    """
    pace = rank_pace(world_size, rank, hold_s)
    if pace > 0.0 and 0.0 <= run_age_s < YOUNG_RUN_S:
        pace = max(pace, rank_pace(world_size, rank, FIRST_HOLD_FACTOR * LEAST_HOLD_S))
    return pace


def rank_pace(world_size: int, rank: int, hold_s: float = LEAST_HOLD_S) -> float:
    """Seconds the agent of ``rank`` should wait at least between batches (0: its own flush_interval), for a
    run of ``world_size`` ranks whose batches hold the run's lock ``hold_s`` seconds each.

    >>> rank_pace(256, 0), rank_pace(1, 0), rank_pace(256, 3)
    (0.0, 0.0, 2.0)
    >>> rank_pace(256, 3, hold_s=0.0075)      # batches twice as dear: half as many
    3.84
    >>> rank_pace(256, 3, hold_s=0.001), rank_pace(1024, 3, hold_s=0.5)   # at most 128/s; at most 10 s
    (2.0, 10.0)
    >>> rank_pace(256, 3, hold_s=0.02)        # 20 ms a batch (256 sharded ranks on a slow machine)
    10.0
    """
    if rank <= 0 or world_size <= 1:
        return 0.0
    batches_per_s = min(RUN_BATCHES_PER_S, RUN_LOCK_SHARE / hold_s) if hold_s > 0 else RUN_BATCHES_PER_S
    return round(min(MAX_PACE_S, world_size / batches_per_s), 3)
