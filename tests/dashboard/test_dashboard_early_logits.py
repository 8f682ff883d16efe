"""The run page draws the early-warning logits (H2, H3) from the signal table: the "Attention and output
logits" panel and the per-module max-attention-logit heatmap, with no console errors."""
from __future__ import annotations

import math

import pytest

from tests.conftest import wait_until
from tests.dashboard.conftest import approx_list, graph, severe_console_entries, wait_trace
from tests.dashboard.runs_feed import MODULE_NAMES, ingest, make_steps

pytestmark = pytest.mark.browser

ATTN = [MODULE_NAMES.index("blocks.0.attn"), MODULE_NAMES.index("blocks.1.attn")]


def test_run_page_draws_the_logit_panel_and_the_attention_logit_heatmap(shared_server, browser):
    steps = make_steps(120, layers_every=10, seed=3)
    for s in steps:
        i = s["step"]
        s["attn_logit_max"] = 2.0 + 0.05 * i
        s["output_logit_max"] = 8.0 + 0.01 * i
        s["output_log_z"] = 4.0 + 0.02 * i
        if i % 10 == 0:
            per = [None] * len(MODULE_NAMES)       # only the attention modules have a value
            per[ATTN[0]], per[ATTN[1]] = 1.0 + 0.05 * i, 2.0 + 0.05 * i
            s["layers"]["attn_logit_max"] = per
    run_id = ingest(shared_server, project="early", run="logits-panel", steps=steps, status="finished")
    browser.get(f"{shared_server.url}/runs/{run_id}")

    for name, key in [("max attention logit", "attn_logit_max"), ("max output logit", "output_logit_max"),
                      ("mean log Z", "output_log_z")]:
        t = wait_trace(browser, "run-graph-early_logits", name, lambda t: len(t["x"]) == 120, what=f"{name} drawn")
        assert approx_list(t["y"], [s[key] for s in steps])
    heat = wait_until(lambda: (g := graph(browser, "run-heatmap-attn_logit_max")) and g["data"]
                      and g["data"][0].get("y") and g, timeout=30, what="attention-logit heatmap")
    cell = heat["data"][0]
    # only the rows that hold data are drawn (issue 42): the two attention modules, in the model's order;
    # "embed" and the other modules have no attention logit, so they get no empty band
    assert cell["y"] == [MODULE_NAMES[i] for i in ATTN] and cell["x"] == list(range(0, 120, 10))
    assert math.isclose(cell["z"][1][3], math.log10(2.0 + 0.05 * 30), rel_tol=1e-5)
    assert math.isclose(cell["z"][0][3], math.log10(1.0 + 0.05 * 30), rel_tol=1e-5)
    assert severe_console_entries(browser) == []
