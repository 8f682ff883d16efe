"""When a paced rank sends: its batches in slots spread evenly over the pace, one slot per rank.

A run of many ranks is paced by the server: the ingest reply asks every rank but rank 0 to leave at
least ``pace`` seconds between batches (server/ingest/pacing.py). Ranks started together and given the same
pace at the same moment would then send together, every rank's batch in the same half second once
every pace: at 256 ranks a burst of 255 batches that a server takes a second or more to work off,
every time (measured: bench/ingest.py --ranks 256, p50 0.6-0.7 s, p99 1.7-2.4 s). So a paced rank
sends at the wall-clock instants ``k * pace + pace * rank / world_size``: rank r of W in its own slot,
the run's batches one every ``pace / W`` seconds. Wall clock (``time.time()``), because the ranks run on
different hosts: NTP keeps them within milliseconds, and a slot is ``pace / W`` wide (~15 ms at 256
ranks). Before the first reply, a rank of a large run already knows its world size, so its first batch
goes in its slot of a pace it assumes (``initial_pace``), instead of all ranks' first batches at once.

>>> round(seconds_to_slot(100.0, 4.0, rank=1, world_size=4), 6)   # slots at ..., 101, 105, ...
5.0
>>> round(seconds_to_slot(100.0, 4.0, rank=3, world_size=4), 6)   # its slots at 103, 107, ...
3.0
"""
from __future__ import annotations

import math

# the bounds the server's pace keeps to, shared with it through a leaf module (agent/pace_bounds.py)
from gradwatch.agent.pace_bounds import FIRST_HOLD_FACTOR, MAX_PACE_S, RUN_BATCHES_PER_S  # noqa: F401 (sender.py)

# the longest pace a rank assumes before the first reply (initial_pace): its first batch is late by up
# to this much, and the ranks' first batches in slots of 5 s were measured to keep a server up
FIRST_MAX_PACE_S = 5.0


def initial_pace(rank: int, world_size: int) -> float:
    """The pace a rank assumes before the server's first reply: that of batches holding the run's lock
    ``FIRST_HOLD_FACTOR`` times as long as the least the server assumes, at most ``FIRST_MAX_PACE_S``.

    A process's first batch is its dearest (its meta, its layout, the run's config merged), and every
    rank sends it in the same few seconds after start: at 256 ranks on PostgreSQL (bench/ingest.py
    --ranks 256, 20 s runs) their first batches in slots of 2 s (128 a second) put the server behind,
    p99 over the run 256 and 901 ms; in slots of 5 s, 125 and 146 ms. A late first batch costs nothing
    else (a critical step goes at once).

    >>> initial_pace(0, 256), initial_pace(3, 256), initial_pace(3, 64), initial_pace(3, 8)
    (0.0, 5.0, 2.0, 0.25)
    """
    if rank <= 0 or world_size <= 1:
        return 0.0
    return min(FIRST_MAX_PACE_S, FIRST_HOLD_FACTOR * world_size / RUN_BATCHES_PER_S)


def seconds_to_slot(wall: float, pace: float, *, rank: int, world_size: int) -> float:
    """Seconds from ``wall`` (``time.time()``) to this rank's next slot at least half a pace away: a
    rank that sent in its slot (the reply taking less than half a pace) waits exactly ``pace``; one
    whose pace just changed waits between half and one and a half of the new pace."""
    offset = pace * (rank % max(world_size, 1)) / max(world_size, 1)
    k = math.ceil((wall + pace / 2 - offset) / pace)
    return k * pace + offset - wall
