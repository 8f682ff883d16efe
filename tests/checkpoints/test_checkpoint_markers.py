"""The run page in headless Chromium draws a run's checkpoints on its step axis, live, and shows the rollback.

A real server (API and dashboard on one port), a run fed through ``POST /api/v1/ingest`` with
``checkpoint`` events as the agent sends them, and Debian's headless Chromium.
"""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, graph, mark_page, same_page, shared_server, wait_trace  # noqa: F401
from tests.dashboard.runs_feed import ingest, make_steps

pytestmark = pytest.mark.browser


def _ckpt(step: int) -> dict:
    return {"step": step, "kind": "checkpoint", "data": {"path": f"/ckpt/step-{step}.pt", "saved_at": 1.0}}


def _marks(drv, graph_id: str) -> dict:
    fig = graph(drv, graph_id) or {"shapes": []}
    return {s["x0"]: s["label"] for s in fig["shapes"] if (s["label"] or "").startswith("ckpt")}


def test_checkpoints_show_on_the_step_axis_and_the_alert_names_one(shared_server, browser):  # noqa: F811
    steps = make_steps(240, seed=7)
    run_id = ingest(shared_server, project="vision", run="ckpt-marks", steps=steps,
                    events=[_ckpt(100), _ckpt(200)])
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 240, what="loss drawn")
    assert wait_until(lambda: _marks(browser, "run-graph-loss") or None, timeout=WAIT, what="checkpoint marks") == \
        {100: "ckpt 100", 200: "ckpt 200"}
    # the step axis is shared: the other charts carry the same marks
    wait_until(lambda: _marks(browser, "run-graph-grad_norm") == {100: "ckpt 100", 200: "ckpt 200"},
               timeout=WAIT, what="marks on the grad-norm chart")
    mark_page(browser)

    # live, without a reload: a new checkpoint, then a NaN whose alert names it
    ingest(shared_server, project="vision", run="ckpt-marks", steps=make_steps(10, start=240, seed=8), meta=False,
           events=[_ckpt(250)])
    wait_until(lambda: 250 in _marks(browser, "run-graph-loss"), timeout=WAIT, what="the new checkpoint's mark")
    bad = make_steps(1, start=260, seed=9)
    bad[0]["loss"] = "NaN"
    ingest(shared_server, project="vision", run="ckpt-marks", steps=bad, meta=False)
    # the last checkpoint at or before the NaN; the window starts there and spans PaLM's 200 batches
    advice = "Roll back to /ckpt/step-250.pt (step 250) and skip batches 250–449"

    def card_text():
        cards = browser.find_elements("css selector", "#run-alerts .gw-alert[data-rule='A1']")
        return cards[0].text if cards else ""
    wait_until(lambda: advice in card_text(), timeout=WAIT, what="the rollback advice on the alert card")
    assert set(_marks(browser, "run-graph-loss")) == {100, 200, 250}, "the alert redraw kept the checkpoint marks"
    assert same_page(browser), "the page reloaded"
    save_screenshot(browser, "run-page-checkpoints")
