"""D4 (the floor of the peak device memory rising window after window: a leak) through the real ingest path."""
from __future__ import annotations

import random

from tests.rules.conftest import run_name, step

GIB = float(1 << 30)


def mem_steps(held_of, n: int = 800, jitter: float = 0.3, seed: int = 0) -> list[dict]:
    """Steps whose peak memory is the memory held across steps plus a batch's own, which varies."""
    rng = random.Random(seed)
    return [step(i, loss=1.0, grad_norm=0.5, lr=1e-3, mem_peak=held_of(i) * (1 + jitter * rng.random()))
            for i in range(n)]


def test_d4_fires_on_a_leak_and_names_the_floors(rdb):
    name = run_name()
    rdb.feed(name, mem_steps(lambda i: 8 * GIB * (1 + 1e-3 * i)), batch=37)   # +0.1 % a step: a kept loss graph
    a = rdb.rules(name)["D4"]
    assert a.severity == "warning"
    assert a.first_step == 500            # windows 0-4 complete when window 5 begins; +40 % > 20 %
    floors = a.evidence["floors_gib"]
    assert len(floors) == 5 and floors == sorted(floors) and floors[-1] / floors[0] >= 1.2
    assert a.evidence["since_step"] == 0 and "GiB" in a.message


def test_d4_stays_quiet_on_a_level_run_a_warmup_and_a_slow_cache(rdb):
    level = run_name()
    rdb.feed(level, mem_steps(lambda i: 8 * GIB), batch=50)
    warm = run_name()     # the optimizer's state allocated in the first steps: one rise, then level
    rdb.feed(warm, mem_steps(lambda i: 8 * GIB * (0.5 if i < 3 else 1.0)), batch=50)
    cache = run_name()    # a cache that levels off: +10 % over the run, under the 20 % default
    rdb.feed(cache, mem_steps(lambda i: 8 * GIB * (1 + 0.1 * min(i, 600) / 600), jitter=0.0), batch=50)
    for name in (level, warm, cache):
        assert "D4" not in rdb.rules(name), name
