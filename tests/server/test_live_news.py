"""LiveNews, the live push's hand-over (server/ingest/live_news.py): real threads, no mocks.

Time is LiveNews's injected ``clock`` (a list the test moves), not the wall clock: a parked wait ends
when news comes, when a recheck says so, or when the test moves the clock past its timeout, never
because a busy machine was slow (docs/testing.md, "No wall-clock thresholds"). ``join(HANG_S)`` only
bounds how long a broken test hangs."""
from __future__ import annotations

import threading

from gradwatch.server.ingest import live_news
from gradwatch.server.ingest.live_news import LiveNews
from tests.conftest import wait_until

HANG_S = 60.0     # a hang bound, not a timing: every wait below ends at an event or a clock move


class Clock:
    """A clock the test moves by hand; ``reads`` counts how often LiveNews looked at it."""

    def __init__(self, now: float = 100.0):
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def _park(news: LiveNews, run_id: int, out: list, **kw) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(news.wait(run_id, **kw)), daemon=True)
    t.start()
    return t


def _parked(news: LiveNews, n: int) -> None:
    wait_until(lambda: news._waiters == n, what=f"{n} parked waits")


def test_a_stored_batch_wakes_the_pages_waiting_on_its_run_only():
    clock = Clock()
    news = LiveNews(clock=clock)
    mine, other = [], []
    a, b = _park(news, 1, mine, timeout=5.0), _park(news, 2, other, timeout=5.0)
    _parked(news, 2)                  # both parked before the news (their generation read)
    news.published(1)
    a.join(HANG_S)
    # the clock has not moved: run 1's wait can only have ended on the news
    assert not a.is_alive() and mine == [True]
    assert b.is_alive() and other == []       # run 2's page heard nothing and is still parked
    clock.now += 5.0                          # its timeout passes: it answers "nothing new"
    b.join(HANG_S)
    assert not b.is_alive() and other == [False]


def test_a_wait_without_news_times_out_and_a_recheck_can_end_it():
    clock = Clock()
    news = LiveNews(clock=clock)
    out = []
    t = _park(news, 7, out, timeout=0.3)
    _parked(news, 1)
    clock.now += 0.29                         # short of the timeout: still parked
    # a wait that returns reads the clock twice more (its deadline, then watch() on the way out); three
    # reads after the move mean it looked at the new time and parked again, at least twice
    seen = clock.reads
    wait_until(lambda: clock.reads >= seen + 3, what="the parked wait looking at the clock again")
    assert t.is_alive() and out == []
    clock.now += 0.01                         # at the timeout: False
    t.join(HANG_S)
    assert out == [False] and news._waiters == 0

    calls = []

    def recheck():   # another replica stored steps: found by re-reading, no wake-up
        calls.append(clock.now)
        return len(calls) >= 2
    # the clock stands still, so only the recheck can end this wait: every RECHECK_S of waiting
    assert news.wait(7, recheck=recheck, timeout=5.0) is True
    assert len(calls) == 2


def test_beyond_max_waiters_a_page_is_told_to_poll_at_once():
    clock = Clock()
    news = LiveNews(clock=clock)
    done = []
    parked = [_park(news, 3, done, timeout=5.0) for _ in range(live_news.MAX_WAITERS)]
    _parked(news, live_news.MAX_WAITERS)
    # the clock stands still: a wait that parked would never end; this one answers None at once
    extra = []
    t = _park(news, 3, extra, timeout=5.0)
    t.join(HANG_S)
    assert not t.is_alive() and extra == [None]
    news.published(3)
    for p in parked:
        p.join(HANG_S)
    assert done == [True] * live_news.MAX_WAITERS
    assert news._waiters == 0


def test_a_run_counts_as_watched_for_a_while_after_a_page_looked():
    clock = [100.0]
    news = LiveNews(clock=lambda: clock[0])
    assert not news.watching(5)
    news.watch(5)
    clock[0] += live_news.WATCH_HOLD_S - 0.1
    assert news.watching(5) and not news.watching(6)
    clock[0] += 0.2
    assert not news.watching(5)
