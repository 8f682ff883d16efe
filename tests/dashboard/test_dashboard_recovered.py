"""Issue 42 in headless Chromium: a run that recovered says so (run page and runs list), a heatmap labels
every row it draws and leaves out the rows with no data, and the NaN-origin mark sits at its step."""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, graph, texts
from tests.dashboard.runs_feed import MODULE_NAMES, PARAM_NAMES, ingest, make_steps

pytestmark = pytest.mark.browser

# the rendered y-axis labels and the shapes of a chart, as the browser drew them
AXIS_JS = """
const el = document.getElementById(arguments[0]);
const gd = el && (el.classList.contains('js-plotly-plot') ? el : el.querySelector('.js-plotly-plot'));
if (!gd || !gd._fullLayout || !gd.data || !gd.data.length) { return null; }
return {
  labels: Array.from(gd.querySelectorAll('.ytick text'), (t) => t.textContent),
  rows: Array.from(gd.data[0].y || []),
  shapes: (gd.layout.shapes || []).filter((s) => s.xref === 'x' && s.yref === 'y')
            .map((s) => ({x0: s.x0, x1: s.x1, y0: s.y0, y1: s.y1})),
};
"""


def test_recovered_run_labelled_heatmap_rows_and_the_nan_origin_at_its_step(shared_server, browser):
    steps = make_steps(300, layers_every=10)
    steps[80]["loss"] = 60.0               # one loss spike: C3 fires at 80 and resolves once the loss is back
    # the max attention logit exists for the attention modules only: the other modules' rows hold no data
    attention = [k for k, name in enumerate(MODULE_NAMES) if name.endswith(".attn")]
    for s in steps:
        if "layers" in s:
            s["layers"]["attn_logit_max"] = [v if k in attention else None
                                             for k, v in enumerate(s["layers"]["attn_logit_max"])]
    run_id = ingest(shared_server, project="vision", run="recovered-run", steps=steps, status="finished",
                    events=[{"step": 200, "kind": "nan_origin", "data": {"module": "blocks.1.mlp",
                                                                       "where": "activation"}}])
    _, body = shared_server.get(f"/api/v1/alerts?run={run_id}")
    c3 = [a for a in body["alerts"] if a["rule"] == "C3"]
    assert c3 and all(a["status"] == "resolved" for a in c3), body
    assert not [a for a in body["alerts"] if a["status"] == "firing" and a["severity"] != "info"], body

    browser.get(f"{shared_server.url}/runs/{run_id}")
    badge = wait_until(lambda: [t for t in texts(browser, "#run-header .gw-badge") if "recovered" in t],
                       timeout=WAIT, what="the recovered badge on the run page")
    # the latest episode it recovered from (the NaN-origin note at 200), and how many resolved (C3's too)
    assert badge == ["recovered from A3 at step 200 · 2 resolved"], badge

    # every drawn row labelled; the attention heatmap draws the attention modules only
    def drawn(graph_id):
        got = browser.execute_script(AXIS_JS, graph_id)
        return got if got and got["rows"] and len(got["labels"]) >= len(got["rows"]) else None
    grad = wait_until(lambda: drawn("run-heatmap-grad_norm"), timeout=WAIT, what="grad-norm heatmap labelled")
    assert grad["labels"] == grad["rows"] == PARAM_NAMES, grad
    attn = wait_until(lambda: drawn("run-heatmap-attn_logit_max"), timeout=WAIT, what="attention heatmap")
    assert attn["labels"] == attn["rows"] == [MODULE_NAMES[k] for k in attention], attn
    # the activation heatmap carries the NaN origin (a module): a box on its row at step 200, not the whole axis
    act = wait_until(lambda: (a := drawn("run-heatmap-act_std")) and a["shapes"] and a, timeout=WAIT,
                     what="the NaN-origin mark")
    assert act["labels"] == act["rows"] == MODULE_NAMES, act
    (box,) = act["shapes"]
    assert box["x0"] < 200 < box["x1"] and box["x1"] - box["x0"] <= 10, box
    row = MODULE_NAMES.index("blocks.1.mlp")
    assert box["y0"] < row < box["y1"], box
    assert graph(browser, "run-heatmap-act_std")["xrange"][1] - graph(browser, "run-heatmap-act_std")["xrange"][0] > 100
    save_screenshot(browser, "run-page-recovered")

    # the runs list: the same state, never a bare "healthy"
    browser.get(shared_server.url + "/")
    cell = wait_until(lambda: [t for t in texts(browser, f"#runs-row-{run_id} .gw-badge") if "recovered" in t],
                      timeout=WAIT, what="the recovered badge in the runs list")
    assert cell == ["recovered from A3 at step 200 · 2 resolved"], cell


def test_compare_with_no_run_picked_says_what_to_do(shared_server, browser):
    """No blank charts on a -1…6 axis: a hint, and the charts appear once runs are picked."""
    browser.get(shared_server.url + "/compare")
    hint = wait_until(lambda: texts(browser, "#compare-hint") or None, timeout=WAIT, what="the empty-state hint")
    assert hint[0].startswith("No runs picked yet: pick two or more"), hint
    assert not browser.find_element("id", "compare-grid").is_displayed()
