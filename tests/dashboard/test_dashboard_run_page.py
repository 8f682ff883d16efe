"""The run page in headless Chromium: every chart drawn with the run's data, live
appends without a reload, a NaN raising an alert on screen, zoom refetching at
full resolution, and no console errors."""
from __future__ import annotations

import math

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import (WAIT, approx_list, click, graph, mark_page, same_page, severe_console_entries, text_of, texts,
                                      trace, wait_trace)
from tests.dashboard.runs_feed import MODULE_NAMES, PARAM_NAMES, ingest, make_steps

pytestmark = pytest.mark.browser


def test_finished_run_page_draws_every_chart_with_its_data(shared_server, browser):
    steps = make_steps(300, overflow_every=70, layers_every=10)
    steps[120]["loss"] = "NaN"   # a NaN step must show as a marker, not vanish
    run_id = ingest(shared_server, project="vision", run="resnet-finished", steps=steps, status="finished",
                    events=[{"step": 120, "kind": "nan_origin", "data": {"module": "blocks.1.mlp",
                                                                       "where": "activation"}}])

    browser.get(f"{shared_server.url}/runs/{run_id}")

    # Loss: one point per step (300 steps < the chart's bucket budget: raw), the NaN step a gap...
    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 300, what="loss drawn")
    assert loss["x"] == list(range(300))
    expected = [None if i == 120 else steps[i]["loss"] for i in range(300)]
    assert approx_list(loss["y"], expected)
    # ...and a marker on the NaN rug.
    assert trace(graph(browser, "run-graph-loss"), "NaN / Inf")["x"] == [120]

    # each chart is drawn by its own callback: wait until every one holds its 300 steps
    # before reading it (a chart read the moment the loss appeared can still be empty)
    for graph_id, name in [("run-graph-grad_norm", "grad norm"), ("run-graph-loss_scale", "loss scale"),
                           ("run-graph-lr", "lr"), ("run-graph-ema_divergence", "EMA divergence"),
                           ("run-graph-memory", "peak allocated")]:
        wait_trace(browser, graph_id, name, lambda t: len(t["x"]) == 300, what=f"{graph_id} drawn")
    grad = graph(browser, "run-graph-grad_norm")
    assert approx_list(trace(grad, "grad norm")["y"], [s["grad_norm"] for s in steps])
    assert set(trace(grad, "clip max_norm")["y"]) == {1.0}
    assert trace(grad, "clipped step")["x"] == [s["step"] for s in steps if s["clipped"]]
    assert grad["ytype"] == "log"

    scale = graph(browser, "run-graph-loss_scale")
    assert scale["ytype"] == "log"
    assert approx_list(trace(scale, "loss scale")["y"], [s["loss_scale"] for s in steps])
    overflow_steps = [s["step"] for s in steps if s["overflow"]]
    assert overflow_steps == [70, 140, 210, 280]
    assert trace(scale, "overflow (skipped step)")["x"] == overflow_steps
    assert approx_list(trace(scale, "overflow (skipped step)")["y"], [65536.0 / 2 ** k for k in range(4)])

    lr = graph(browser, "run-graph-lr")
    assert approx_list(trace(lr, "lr")["y"], [s["lr"] for s in steps])
    ema = graph(browser, "run-graph-ema_divergence")
    assert approx_list(trace(ema, "EMA divergence")["y"], [s["ema_divergence"] for s in steps])
    mem = graph(browser, "run-graph-memory")
    assert approx_list(trace(mem, "peak allocated")["y"], [s["mem_peak"] / (1 << 30) for s in steps], rel=1e-5)
    # a signal declared after the first 14 (stored in steps.extra): its panel comes from the signal table
    zeros = wait_trace(browser, "run-graph-grad_zero_fraction", "zero grad elements", lambda t: t["x"],
                       what="zero-gradient share drawn")
    assert zeros["x"] == list(range(0, 300, 10))
    assert approx_list(zeros["y"], [steps[i]["grad_zero_fraction"] for i in range(0, 300, 10)])

    # Per-layer heatmaps: layer names on y, one column per sampled step, log10 values.
    # a heatmap is first drawn empty (no traces) while its data loads: wait for the trace
    heat = wait_until(lambda: (g := graph(browser, "run-heatmap-grad_norm")) and g["data"] and g["data"][0].get("y")
                      and g, timeout=WAIT, what="grad-norm heatmap")
    cell = heat["data"][0]
    assert cell["y"] == PARAM_NAMES
    assert cell["x"] == list(range(0, 300, 10))
    assert math.isclose(cell["z"][2][3], math.log10(steps[30]["layers"]["grad_norm"][2]), rel_tol=1e-5)
    act = wait_until(lambda: (g := graph(browser, "run-heatmap-act_std")) and g["data"] and g["data"][0].get("y")
                     and g, timeout=WAIT, what="act-std heatmap")
    assert act["data"][0]["y"] == MODULE_NAMES

    # The NaN origin is named, and the loss NaN raised an alert whose card shows diagnosis and actions.
    wait_until(lambda: "blocks.1.mlp" in text_of(browser, "run-nan-origin"), timeout=WAIT, what="NaN origin notice")
    card = wait_until(lambda: texts(browser, "#run-alerts .gw-alert[data-rule='A1']"),
                      timeout=WAIT, what="A1 alert card")[0]
    assert "loss_nonfinite" in card and "DIAGNOSIS" in card.upper() and "WHAT TO DO" in card.upper()
    # Every chart marks the alert's step.
    wait_until(lambda: 120 in [s["x0"] for s in (graph(browser, "run-graph-lr") or {}).get("shapes", [])],
               timeout=WAIT, what="alert line on the lr chart")

    save_screenshot(browser, "run-page")
    assert severe_console_entries(browser) == []


def test_live_run_appends_points_and_shows_a_nan_alert_without_reload(shared_server, browser):
    steps = make_steps(200, seed=3)
    run_id = ingest(shared_server, project="nlp", run="gpt-live", steps=steps)
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 200, what="initial 200 steps")
    mark_page(browser)

    more = make_steps(30, start=200, seed=4)
    ingest(shared_server, project="nlp", run="gpt-live", steps=more, meta=False)
    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 230, what="30 appended steps")
    assert loss["x"] == list(range(230))
    assert approx_list(loss["y"][200:], [s["loss"] for s in more])
    assert len(wait_trace(browser, "run-graph-grad_norm", "grad norm", lambda t: len(t["x"]) == 230)["y"]) == 230

    bad = make_steps(1, start=230, seed=5)
    bad[0]["loss"] = "NaN"
    ingest(shared_server, project="nlp", run="gpt-live", steps=bad, meta=False)
    wait_until(lambda: browser.find_elements("css selector", "#run-alerts .gw-alert[data-rule='A1']"),
               timeout=WAIT, what="A1 alert card on the live page")
    wait_trace(browser, "run-graph-loss", "NaN / Inf", lambda t: t["x"] == [230], what="NaN marker at step 230")
    wait_until(lambda: 230 in [s["x0"] for s in graph(browser, "run-graph-loss")["shapes"]], timeout=WAIT,
               what="alert line on the loss chart")
    assert same_page(browser), "the page reloaded"
    save_screenshot(browser, "run-page-live-nan")

    # Acknowledge from the alerts panel.
    click(browser, "#run-alerts .gw-alert[data-rule='A1'] .gw-ack")
    wait_until(lambda: shared_server.get(f"/api/v1/alerts?run={run_id}&rule=A1")[1]["alerts"][0]["acknowledged"],
               timeout=WAIT, what="alert acknowledged in the database")
    wait_until(lambda: texts(browser, "#run-alerts .gw-alert[data-rule='A1'] .gw-ack") == ["acknowledged"],
               timeout=WAIT, what="button shows the acknowledgement")
    assert severe_console_entries(browser) == []


def test_big_run_is_downsampled_and_zoom_fetches_full_resolution(shared_server, browser):
    steps = make_steps(6000, seed=7, layers_every=0)
    steps[2345]["loss"] = 50.0          # a one-step spike must survive downsampling
    steps[4321]["grad_norm"] = "NaN"    # and so must a NaN marker
    run_id = ingest(shared_server, project="vision", run="long-run", steps=steps, status="finished", batch=2000)
    browser.get(f"{shared_server.url}/runs/{run_id}")

    loss = wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) > 0, what="downsampled loss")
    assert len(loss["x"]) < 6000 / 2, "the whole run should arrive downsampled"
    assert max(y for y in loss["y"] if y is not None) == pytest.approx(50.0)
    nan_x = trace(graph(browser, "run-graph-grad_norm"), "NaN / Inf")["x"]
    assert len(nan_x) == 1 and nan_x[0] <= 4321 < nan_x[0] + 10

    # Zoom the loss chart: every chart follows, and the visible range comes back raw.
    browser.execute_script(
        "Plotly.relayout(document.querySelector('#run-graph-loss .js-plotly-plot'), "
        "{'xaxis.range[0]': 2300, 'xaxis.range[1]': 2400});")
    loss = wait_trace(browser, "run-graph-loss", "loss",
                      lambda t: t["x"] and t["x"][0] >= 2290 and len(t["x"]) >= 100, what="full-resolution zoom")
    assert list(range(2300, 2401)) == [x for x in loss["x"] if 2300 <= x <= 2400]
    assert approx_list([y for x, y in zip(loss["x"], loss["y"]) if 2300 <= x <= 2400],
                       [steps[i]["loss"] for i in range(2300, 2401)])
    for other in ("run-graph-grad_norm", "run-graph-lr", "run-graph-loss_scale"):
        wait_until(lambda: (g := graph(browser, other)) and abs(g["xrange"][0] - 2300) < 1
                   and abs(g["xrange"][1] - 2400) < 1, timeout=WAIT, what=f"{other} follows the zoom")
    grad = trace(graph(browser, "run-graph-grad_norm"), "grad norm")
    assert [x for x in grad["x"] if 2300 <= x <= 2400] == list(range(2300, 2401))
    save_screenshot(browser, "run-page-zoomed")
    assert severe_console_entries(browser) == []


def test_run_page_loads_in_stages_and_every_chart_ends_filled(shared_server, browser):
    """The headline charts load first, then the other charts and the heatmaps on the same step range
    (docs/dashboard.md, "Big runs"): after the first load, a zoom and its reset, every stage ends
    drawn with the run's data on the shared range; plotly.js is our scatter + heatmap bundle."""
    steps = make_steps(1500, seed=11, layers_every=10)
    run_id = ingest(shared_server, project="vision", run="staged-load", steps=steps, status="finished")
    browser.get(f"{shared_server.url}/runs/{run_id}")
    lines = ("run-graph-loss", "run-graph-grad_norm", "run-graph-lr", "run-graph-throughput", "run-graph-step_time",
             "run-graph-memory")

    def every_chart_shows(x_range: list, xs_ok):
        """Every chart on ``x_range``; ``xs_ok(x values in the range)`` for each line chart's first trace."""
        def check():
            charts = {gid: graph(browser, gid) for gid in (*lines, "run-heatmap-grad_norm")}
            if any(not c or not c["data"] or not c["xrange"] for c in charts.values()):
                return False
            on_range = all(abs(c["xrange"][0] - x_range[0]) < 1 and abs(c["xrange"][1] - x_range[1]) < 1
                           for c in charts.values())
            return on_range and all(xs_ok([x for x in charts[gid]["data"][0]["x"] if x_range[0] <= x <= x_range[1]])
                                    for gid in lines)
        return check

    # The whole run (1,500 steps) arrives downsampled: 600 buckets at most, each drawn as two points.
    wait_until(every_chart_shows([0, 1499], lambda xs: xs and xs[0] == 0 and len(xs) < 1500),
               timeout=WAIT, what="every chart drawn, whole run")
    heat = graph(browser, "run-heatmap-grad_norm")["data"][0]
    assert heat["y"] == PARAM_NAMES and heat["x"] == list(range(0, 1500, 10))

    # Zoom: the headline charts, then the others, come back at full resolution for the range.
    browser.execute_script(
        "Plotly.relayout(document.querySelector('#run-graph-loss .js-plotly-plot'), "
        "{'xaxis.range[0]': 700, 'xaxis.range[1]': 760});")
    wait_until(every_chart_shows([700, 760], lambda xs: xs == list(range(700, 761))), timeout=WAIT,
               what="every chart zoomed at full resolution")
    lr = trace(graph(browser, "run-graph-lr"), "lr")
    assert approx_list([y for x, y in zip(lr["x"], lr["y"]) if 700 <= x <= 760],
                       [steps[i]["lr"] for i in range(700, 761)])

    click(browser, "#run-reset")
    wait_until(every_chart_shows([0, 1499], lambda xs: xs and xs[0] == 0 and len(xs) < 1500),
               timeout=WAIT, what="every chart back to the whole run")

    loaded = browser.execute_script("return performance.getEntriesByType('resource').map((e) => e.name);")
    assert any("/assets/plotly-scatter-heatmap-" in name for name in loaded)
    assert not any(name.split("?")[0].endswith("/plotly.min.js") for name in loaded), "the full plotly.js was loaded"
    assert severe_console_entries(browser) == []


def test_charts_follow_the_window_when_it_resizes(shared_server, browser):
    """With the resize that changes nothing skipped (assets/gradwatch.js), a window resize that changes
    the charts' boxes still redraws them at the new width, and back."""
    run_id = ingest(shared_server, project="vision", run="resized", steps=make_steps(200, seed=3), status="finished")
    browser.get(f"{shared_server.url}/runs/{run_id}")
    wait_trace(browser, "run-graph-loss", "loss", lambda t: len(t["x"]) == 200, what="loss drawn")
    size = ("var gd = document.querySelector('#run-graph-loss .js-plotly-plot');"
            "return [gd._fullLayout.width, gd.getBoundingClientRect().width];")
    assert browser.execute_script("return Plotly.Plots.resize.gradwatch === true")
    drawn, box = browser.execute_script(size)
    assert abs(drawn - box) <= 1
    # Below 1,100 px the page is one column (style.css): every chart's box is about twice as wide.
    browser.set_window_size(1000, 1000)
    wait_until(lambda: browser.execute_script(size)[0] > 1.5 * drawn, timeout=WAIT, what="loss chart widened")
    wide, box = browser.execute_script(size)
    assert abs(wide - box) <= 1
    browser.set_window_size(1400, 1000)
    wait_until(lambda: abs(browser.execute_script(size)[0] - drawn) <= 1, timeout=WAIT, what="loss chart narrowed")
    assert severe_console_entries(browser) == []
