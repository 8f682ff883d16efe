"""LiveNews, the live push's hand-over (server/live_news.py): real threads, no mocks."""
from __future__ import annotations

import threading
import time

from gradwatch.server import live_news
from gradwatch.server.live_news import LiveNews


def _park(news: LiveNews, run_id: int, out: list, **kw) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append((news.wait(run_id, **kw), time.monotonic())))
    t.start()
    return t


def test_a_stored_batch_wakes_the_pages_waiting_on_its_run_only():
    news = LiveNews()
    mine, other = [], []
    a, b = _park(news, 1, mine, timeout=5.0), _park(news, 2, other, timeout=0.5)
    time.sleep(0.1)
    published = time.monotonic()
    news.published(1)
    a.join(5)
    b.join(5)
    assert mine[0][0] is True and mine[0][1] - published < 0.5
    assert other[0][0] is False     # run 2 got nothing: it waited out its timeout


def test_a_wait_without_news_times_out_and_a_recheck_can_end_it():
    news = LiveNews()
    t0 = time.monotonic()
    assert news.wait(7, timeout=0.3) is False
    assert time.monotonic() - t0 >= 0.3
    calls = []

    def recheck():   # another replica stored steps: found by re-reading, no wake-up
        calls.append(1)
        return len(calls) >= 2
    t0 = time.monotonic()
    assert news.wait(7, recheck=recheck, timeout=5.0) is True
    assert len(calls) == 2 and time.monotonic() - t0 < 2.5 * live_news.RECHECK_S + 0.5


def test_beyond_max_waiters_a_page_is_told_to_poll_at_once():
    news = LiveNews()
    done = []
    parked = [_park(news, 3, done, timeout=5.0) for _ in range(live_news.MAX_WAITERS)]
    deadline = time.monotonic() + 5
    while news._waiters < live_news.MAX_WAITERS and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    assert news.wait(3, timeout=5.0) is None
    assert time.monotonic() - t0 < 0.5
    news.published(3)
    for t in parked:
        t.join(5)
    assert [ok for ok, _ in done] == [True] * live_news.MAX_WAITERS
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
