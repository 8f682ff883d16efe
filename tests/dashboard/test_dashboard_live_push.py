"""The live push (server/ingest/live_news.py): an open run page waits on the server for new steps, the
server says "live" to the run's rank 0 while a page watches, and the agent then sends faster.

Real parts: a ``gradwatch serve`` process, Chromium on the run page, batches over HTTP and a real
training loop with the agent. The latency itself is measured by bench/live_latency.py (no timing
assertions here)."""
from __future__ import annotations

import itertools
import threading
import time
import uuid

import pytest
import torch

from gradwatch import agent
from tests.conftest import wait_until
from tests.dashboard.conftest import WAIT, same_page, mark_page, severe_console_entries, wait_trace
from tests.dashboard.runs_feed import ingest, make_steps

pytestmark = pytest.mark.browser


def _post(server, run: str, steps: list[dict], rank: int = 0) -> dict:
    code, answer = server.post("/api/v1/ingest", {"batch_id": uuid.uuid4().hex, "project": "push", "run": run,
                                                 "rank": rank, "world_size": 1, "steps": steps})
    assert code == 200, answer
    return answer


def test_steps_sent_one_per_batch_all_reach_the_open_page_in_order(shared_server, browser):
    """Ten 1-step batches a second while the page is open: every step on the loss chart, once, in
    order. (The live tails are one query per signal; with one cursor for all of them, a batch stored
    between two of those queries was lost from the charts.)"""
    steps = make_steps(160, seed=21, layers_every=0)
    run_id = ingest(shared_server, project="push", run="one-per-batch", steps=steps[:20])
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 20, what="the first 20 steps")
    mark_page(browser)
    for s in steps[20:]:
        _post(shared_server, "one-per-batch", [s])
        time.sleep(0.05)
    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) >= 160 and t["x"][-1] == 159,
                      what="all 160 steps on the loss chart")
    assert loss["x"] == list(range(160))
    # the charts below the headline follow at most a second behind, with the same steps
    step_time = wait_trace(browser, "run-graph-step_time", "step time", lambda t: len(t["x"]) >= 160,
                           what="all 160 steps on the step-time chart")
    assert step_time["x"] == list(range(160))
    assert same_page(browser), "the page reloaded"
    assert severe_console_entries(browser) == []


def test_the_server_says_live_to_rank_0_while_a_page_watches_the_run(shared_server, browser):
    steps = make_steps(11, seed=22, layers_every=0)
    run_id = ingest(shared_server, project="push", run="watched", steps=steps[:10])
    assert _post(shared_server, "watched", [steps[10]])["live"] is False     # nobody looks yet
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 11, what="the page drawn")
    numbers = itertools.count(11)

    def next_step_live(rank: int = 0) -> bool:   # one more step of rank 0 (or rank 1): does the reply say live?
        return _post(shared_server, "watched", [dict(steps[-1], step=next(numbers))], rank=rank)["live"]
    wait_until(next_step_live, timeout=WAIT, interval=0.2, what="the reply to rank 0 says live")
    assert next_step_live(rank=1) is False   # rank 0 only
    browser.get("about:blank")   # the page is closed: after the hold the run is not watched any more
    wait_until(lambda: not next_step_live(), timeout=WAIT, interval=0.2, what="the reply no longer live")


def test_the_agent_sends_faster_while_its_run_page_is_open(shared_server, browser):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    monitor = agent.attach(model, scaler, optimizer=opt, project="push", run="agent-live", server=shared_server.url)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    stop = threading.Event()
    losses = []

    def loop():   # a training loop at ~20 steps/s in its own thread, as long as the test needs
        while not stop.is_set():
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            time.sleep(0.05)
    t = threading.Thread(target=loop)
    t.start()
    try:
        def batches_in(seconds: float) -> tuple[int, int]:
            b0, s0 = monitor.sender.delivered_batches, len(losses)
            time.sleep(seconds)
            return monitor.sender.delivered_batches - b0, len(losses) - s0
        run_id = wait_until(lambda: shared_server.get("/api/v1/runs?project=push&name=agent-live")[1]["runs"],
                            timeout=WAIT, what="the run stored")[0]["id"]
        unwatched, unwatched_steps = batches_in(3.0)
        browser.get(f"{shared_server.url}/runs/{run_id}")
        wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) > 0, what="the page drawn")
        time.sleep(1.0)    # the next reply tells the agent
        watched, watched_steps = batches_in(3.0)
    finally:
        stop.set()
        t.join(10)
        monitor.close()
    # per step: a batch per 0.5 s unwatched (about 10 steps each), per 0.1 s watched (about 2 each)
    assert unwatched_steps > 0 and watched_steps > 0
    assert watched / watched_steps >= 2 * unwatched / unwatched_steps, (watched, watched_steps, unwatched,
                                                                        unwatched_steps)
    code, run = shared_server.get(f"/api/v1/runs/{run_id}")
    assert code == 200 and run["last_step"] == len(losses) - 1    # nothing lost on the way
