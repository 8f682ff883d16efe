"""Runs, alerts, compare and settings pages in headless Chromium, against a real server."""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import (WAIT, approx_list, choose_option, click, graph, mark_page, same_page,
                                      severe_console_entries, texts, trace, wait_trace)
from tests.dashboard.runs_feed import ingest, make_steps

pytestmark = pytest.mark.browser


def _rows(drv) -> dict[str, list[str]]:
    """Runs table: run name -> the row's cell texts."""
    rows = drv.execute_script(
        "return Array.from(document.querySelectorAll('#runs-table tr.gw-run-row'),"
        " (r) => Array.from(r.querySelectorAll('td'), (c) => c.innerText.trim()));")
    return {r[0]: r for r in rows}


def test_runs_page_lists_filters_and_updates_live(dash_server, browser):
    ingest(dash_server, project="vision", run="resnet-a", steps=make_steps(50, seed=1), status="finished")
    crashed = make_steps(40, seed=2)
    crashed[39]["loss"] = "NaN"
    ingest(dash_server, project="vision", run="resnet-b", steps=crashed, status="crashed")
    ingest(dash_server, project="nlp", run="gpt-c", steps=make_steps(30, seed=3))

    browser.get(dash_server.url + "/")
    rows = wait_until(lambda: len(r := _rows(browser)) == 3 and r, timeout=WAIT, what="three runs listed")
    assert rows["resnet-a"][1:4] == ["vision", "finished", "healthy"]
    assert rows["resnet-a"][4] == ""     # no early warning
    assert rows["resnet-a"][5] == "49"
    assert rows["resnet-b"][2] == "crashed"
    assert rows["resnet-b"][3].startswith("critical"), rows["resnet-b"]   # the NaN loss opened an A1 alert
    assert rows["resnet-b"][6] == "NaN"
    assert rows["gpt-c"][1:3] == ["nlp", "running"]
    save_screenshot(browser, "runs-page")
    mark_page(browser)

    choose_option(browser, "runs-filter-status", "finished")
    wait_until(lambda: list(_rows(browser)) == ["resnet-a"], timeout=WAIT, what="status filter")
    choose_option(browser, "runs-filter-status", "crashed")
    wait_until(lambda: list(_rows(browser)) == ["resnet-b"], timeout=WAIT, what="status filter (crashed)")
    click(browser, "#runs-filter-status .dash-dropdown-clear")
    wait_until(lambda: len(_rows(browser)) == 3, timeout=WAIT, what="status filter cleared")

    choose_option(browser, "runs-filter-project", "vision")
    wait_until(lambda: sorted(_rows(browser)) == ["resnet-a", "resnet-b"], timeout=WAIT, what="project filter")
    browser.find_element("id", "runs-filter-name").send_keys("-b")
    wait_until(lambda: list(_rows(browser)) == ["resnet-b"], timeout=WAIT, what="name filter")

    # A new run and new steps show up without a reload.
    ingest(dash_server, project="vision", run="resnet-d-b", steps=make_steps(10, seed=4))
    wait_until(lambda: sorted(_rows(browser)) == ["resnet-b", "resnet-d-b"], timeout=WAIT, what="new run listed live")
    ingest(dash_server, project="vision", run="resnet-d-b", steps=make_steps(5, start=10, seed=5), meta=False)
    wait_until(lambda: _rows(browser)["resnet-d-b"][5] == "14", timeout=WAIT, what="last step updated live")
    assert same_page(browser)
    assert severe_console_entries(browser) == []


def test_alerts_page_filters_by_severity_and_rule(dash_server, browser):
    nan_run = make_steps(60, seed=1)
    nan_run[50]["loss"] = "NaN"
    ingest(dash_server, project="nlp", run="gpt-nan", steps=nan_run,
           events=[{"step": 50, "kind": "nan_origin", "data": {"module": "blocks.1.mlp", "where": "activation"}}])
    code, body = dash_server.get("/api/v1/alerts")
    rules = {a["rule"]: a["severity"] for a in body["alerts"]}
    assert rules.get("A1") == "critical" and rules.get("A3") == "warning", rules

    browser.get(dash_server.url + "/alerts")
    wait_until(lambda: len(texts(browser, "#alerts-list .gw-alert")) == len(body["alerts"]), timeout=WAIT,
               what="every alert listed")
    cards = texts(browser, "#alerts-list .gw-alert")
    assert any("nlp / gpt-nan" in c for c in cards)

    choose_option(browser, "alerts-filter-severity", "warning")
    wait_until(lambda: browser.execute_script(
        "return Array.from(document.querySelectorAll('#alerts-list .gw-alert'), (e) => e.dataset.severity);")
        == ["warning"] * sum(1 for s in rules.values() if s == "warning"), timeout=WAIT, what="severity filter")
    choose_option(browser, "alerts-filter-severity", "critical")
    wait_until(lambda: browser.execute_script(
        "return Array.from(document.querySelectorAll('#alerts-list .gw-alert'), (e) => e.dataset.rule);")
        == sorted((r for r, s in rules.items() if s == "critical"), key=lambda r: r != "A1") or None,
        timeout=WAIT, what="critical alerts only")
    choose_option(browser, "alerts-filter-rule", "A1 loss_nonfinite")
    wait_until(lambda: browser.execute_script(
        "return Array.from(document.querySelectorAll('#alerts-list .gw-alert'), (e) => e.dataset.rule);")
        == ["A1"], timeout=WAIT, what="rule filter")
    save_screenshot(browser, "alerts-page")
    assert severe_console_entries(browser) == []


def test_compare_overlays_two_runs(shared_server, browser):
    a_steps = make_steps(150, seed=1)
    b_steps = make_steps(100, seed=2, loss0=5.0, overflow_every=30)
    a = ingest(shared_server, project="vision", run="baseline", steps=a_steps, status="finished")
    b = ingest(shared_server, project="vision", run="higher-lr", steps=b_steps, status="finished")
    browser.get(f"{shared_server.url}/compare?runs={a},{b}")
    label_a, label_b = f"vision / baseline (#{a})", f"vision / higher-lr (#{b})"
    wait_trace(browser, "compare-graph-loss", label_b, lambda t: len(t["x"]) == 100, what="second run drawn")
    loss = graph(browser, "compare-graph-loss")
    assert approx_list(trace(loss, label_a)["y"], [s["loss"] for s in a_steps])
    assert approx_list(trace(loss, label_b)["y"], [s["loss"] for s in b_steps])
    scale = graph(browser, "compare-graph-loss_scale")
    assert scale["ytype"] == "log"
    assert approx_list(trace(scale, label_b)["y"], [s["loss_scale"] for s in b_steps])
    assert trace(scale, label_a)["y"][-1] == 65536.0
    save_screenshot(browser, "compare-page")
    assert severe_console_entries(browser) == []


def test_settings_webhook_add_test_delivery_and_delete(shared_server, browser, webhook_receiver):
    ingest(shared_server, project="vision", run="settings-webhook", steps=make_steps(5))
    browser.get(shared_server.url + "/settings")
    wait_until(lambda: texts(browser, "#settings-endpoints td.gw-empty"), timeout=WAIT, what="empty endpoint list")
    choose_option(browser, "settings-webhook-project", "vision")
    browser.find_element("id", "settings-webhook-url").send_keys(webhook_receiver.url)
    click(browser, "#settings-webhook-add")
    wait_until(lambda: texts(browser, "#settings-endpoints .gw-endpoint-url") == [webhook_receiver.url],
               timeout=WAIT, what="endpoint listed")
    assert "vision" in texts(browser, "#settings-endpoints .gw-endpoint-row")[0]

    click(browser, "#settings-endpoints .gw-endpoint-row button.gw-button:not(.gw-button-danger)")
    received = webhook_receiver.wait_for(lambda r: r.path == "/hook", timeout=WAIT)
    body = received.json()
    assert "gradwatch" in str(body).lower()
    wait_until(lambda: browser.execute_script(
        "return Array.from(document.querySelectorAll('#settings-deliveries tr.gw-delivery-row'),"
        " (r) => r.dataset.status);") == ["delivered"], timeout=WAIT, what="delivery log shows the delivery")
    save_screenshot(browser, "settings-page")

    # A bad URL is refused with the server's message.
    browser.find_element("id", "settings-webhook-url").send_keys("ftp://nope")
    click(browser, "#settings-webhook-add")
    wait_until(lambda: "url" in " ".join(texts(browser, "#settings-webhook-message")).lower(), timeout=WAIT,
               what="validation message")
    assert len(texts(browser, "#settings-endpoints .gw-endpoint-row")) == 1

    click(browser, "#settings-endpoints .gw-endpoint-row button.gw-button-danger")
    wait_until(lambda: texts(browser, "#settings-endpoints td.gw-empty"), timeout=WAIT, what="endpoint deleted")
    assert severe_console_entries(browser) == []


def test_settings_rule_threshold_override(shared_server, browser):
    ingest(shared_server, project="vision", run="settings-rules", steps=make_steps(5))
    browser.get(shared_server.url + "/settings")
    field = "input[id*='\"rule\":\"A2\"'][id*='\"key\":\"factor\"']"
    wait_until(lambda: browser.find_elements("css selector", f"#settings-rules {field}"), timeout=WAIT,
               what="A2 factor field")
    el = browser.find_element("css selector", f"#settings-rules {field}")
    el.clear()
    el.send_keys("25")
    click(browser, "#settings-rules button[id*='\"index\":\"A2\"']")
    wait_until(lambda: "saved" in " ".join(texts(browser, "#settings-rules-message")), timeout=WAIT,
               what="saved message")
    code, body = shared_server.get("/api/v1/rules?project=vision")
    assert code == 200
    assert next(r for r in body["rules"] if r["id"] == "A2")["factor"] == 25
    wait_until(lambda: "overridden: factor" in " ".join(texts(browser, "#settings-rule-A2")), timeout=WAIT,
               what="A2 shows its override")
    assert severe_console_entries(browser) == []


def test_html_in_run_and_layer_names_is_shown_as_text_never_rendered(shared_server, browser):
    """A run or layer named with HTML (hostile-input report: `<a href>` became a clickable link in the
    compare legend and the heatmap labels) is drawn as the characters it is."""
    evil = '<a href="http://evil.example/">x</a>'
    steps = make_steps(20, seed=3)
    for s in steps:
        s["layers"] = {"grad_norm": [0.5, 0.25]}
    st, body = shared_server.post("/api/v1/ingest", {
        "batch_id": "hostile-names", "project": "hostile", "run": evil, "steps": steps, "status": "finished",
        "meta": {"param_names": [evil, "b.weight"]}})
    assert st == 200, body
    a = body["run_id"]
    b = ingest(shared_server, project="hostile", run="plain", steps=make_steps(20, seed=4), status="finished")
    read = ("return [Array.from(document.querySelectorAll(arguments[0] + ' .legendtext, ' + arguments[0] + ' .ytick'),"
            " (t) => t.textContent), document.querySelectorAll(arguments[0] + ' a').length];")
    browser.get(f"{shared_server.url}/compare?runs={a},{b}")
    texts_, links = wait_until(lambda: (lambda r: r if any(evil in t for t in r[0]) else None)(
        browser.execute_script(read, "#compare-graph-loss")), timeout=WAIT, what="the run's name in the legend")
    assert links == 0
    browser.get(f"{shared_server.url}/runs/{a}")
    texts_, links = wait_until(lambda: (lambda r: r if evil in r[0] else None)(
        browser.execute_script(read, "#run-heatmap-grad_norm")), timeout=WAIT, what="the layer's name on the heatmap")
    assert links == 0
