"""A rewind in headless Chromium (issue 44, "Visible"): the run page draws it on every chart and lists it in a
card, live, without a reload; the incident page of the alert it acted on lists it in its timeline.

A real server (API and dashboard on one port), a run fed through ``POST /api/v1/ingest`` with the
``rewind`` event as the agent's Rewind policy sends it (docs/wire-format.md), and Debian's headless Chromium.
"""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, graph, mark_page, same_page, shared_server, text_of, texts, wait_trace  # noqa: F401
from tests.dashboard.runs_feed import ingest, make_steps

pytestmark = pytest.mark.browser

LABEL = "rewind → 300"


def _rewind_marks(drv, graph_id: str) -> dict:
    fig = graph(drv, graph_id) or {"shapes": []}
    return {s["x0"]: s["label"] for s in fig["shapes"] if (s["label"] or "").startswith(("rewind", "LR ×", "gave up"))}


def test_a_rewind_is_drawn_on_every_chart_and_listed_in_a_card(shared_server, browser):  # noqa: F811
    steps = make_steps(410, seed=11)
    steps[405]["loss"] = "NaN"
    run_id = ingest(shared_server, project="heal", run="rewound", steps=steps)
    a1 = shared_server.get(f"/api/v1/alerts?run={run_id}&rule=A1")[1]["alerts"][0]
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 410, what="loss drawn")
    assert not _rewind_marks(browser, "run-graph-loss")
    assert text_of(browser, "run-rewinds") == "", "no rewinds: no card, no heading"
    mark_page(browser)

    # the agent's Rewind policy acted on A1 at step 412 and the run goes on (the step axis does not go back)
    rewind = {"step": 412, "kind": "rewind", "data": {
        "from_step": 412, "to_step": 300, "batches_skipped": 112, "lr_factor": 0.5, "cool_steps": 200,
        "trigger": {"rule": "A1", "alert_id": a1["id"], "step": 405, "name": "loss_nonfinite"},
        "snapshot_age_steps": 112, "rewind_number": 1, "max_rewinds": 3, "action": "rewind"}}
    ingest(shared_server, project="heal", run="rewound", steps=make_steps(30, start=410, seed=12), meta=False,
           events=[rewind])

    # the mark, live, on the headline and the other step charts, and on the per-layer charts
    for graph_id in ("run-graph-loss", "run-graph-grad_norm", "run-graph-lr", "run-graph-update_ratio",
                     "run-heatmap-grad_norm"):
        wait_until(lambda: _rewind_marks(browser, graph_id) == {412: LABEL}, timeout=WAIT,
                   what=f"the rewind mark on {graph_id}")

    # its card, with the sentence the webhooks send and the numbers it is made of
    cards = wait_until(lambda: texts(browser, "#run-rewinds .gw-rewind") or None, timeout=WAIT, what="the card")
    assert len(cards) == 1
    assert "Rewound to step 300, skipped 112 batches, LR ×0.5 for 200 steps (A1 loss_nonfinite at step 405; " \
           "rewind 1 of 3)" in cards[0]
    facts = cards[0].lower()     # a fact's key is drawn in small capitals right before its value
    assert "step 412" in facts and "to step300" in facts and "snapshot age112 steps" in facts
    assert "rewinds1 of 3" in facts
    assert text_of(browser, "run-rewinds").startswith("Rewinds")

    # the alert it acted on says so
    def a1_card():
        found = texts(browser, "#run-alerts .gw-alert[data-rule='A1']")
        return found[0] if found else ""
    wait_until(lambda: "Acted on at step 412 by the Rewind policy: rewound to step 300" in a1_card(),
               timeout=WAIT, what="the acted-on line on the A1 card")
    assert same_page(browser), "the page reloaded"
    save_screenshot(browser, "run-page-rewind")

    # the incident page: the rewind in the timeline, its card, the mark on the incident's charts
    browser.get(f"{shared_server.url}/incidents/{a1['id']}")
    wait_until(lambda: texts(browser, "#incident-timeline [data-kind='rewind']") or None, timeout=WAIT,
               what="the rewind on the incident timeline")
    line = texts(browser, "#incident-timeline [data-kind='rewind']")[0]
    assert "step 412" in line and "Rewound to step 300, skipped 112 batches" in line and "7 steps after" in line
    assert len(texts(browser, "#incident-rewinds .gw-rewind")) == 1
    wait_until(lambda: _rewind_marks(browser, "incident-graph-loss") == {412: LABEL}, timeout=WAIT,
               what="the rewind mark on the incident's loss chart")
    save_screenshot(browser, "incident-page-rewind")
