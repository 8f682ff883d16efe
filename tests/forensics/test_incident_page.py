"""The incident page and the links to it, on a real run through a real server, webhook receiver and
headless Chromium.

The run is the precursor run of tests/forensics/loops.py (one layer's grad norm grows from step 150,
the loss goes NaN at 230), with checkpoints recorded at steps 100 and 200 as run events of kind
``checkpoint``: the page must offer the one at 100 (the last before the first deviation, ~150), not
the one at 200 (inside the excursion). The webhook payload carries ``incident_url``, Slack and
Discord messages link it, the run page's alert card links it.
"""
from __future__ import annotations

import json
import uuid

from tests.conftest import http_json, save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, graph, texts
from tests.forensics.loops import GROWING_PARAM, precursor_loop
from tests.scenarios.test_scenarios import run_alerts

PUBLIC = "http://gw.test"


def _checkpoints(srv, run: str, steps) -> None:
    status, out = srv.post("/api/v1/ingest", {
        "batch_id": uuid.uuid4().hex, "project": "forensics", "run": run, "steps": [],
        "events": [{"step": s, "kind": "checkpoint", "data": {"path": f"/ckpt/{run}/step-{s}.pt", "step": s}}
                   for s in steps]})
    assert status == 200, out


def test_incident_page_and_links(server_factory, sqlite_url, webhook_receiver, browser):
    srv = server_factory(sqlite_url, extra_args=["--webhook", webhook_receiver.url + "/json"],
                         env={"GRADWATCH_PUBLIC_URL": PUBLIC})
    for fmt in ("slack", "discord"):
        status, ep = srv.post("/api/v1/webhooks", {"project": "forensics", "url": f"{webhook_receiver.url}/{fmt}",
                                                   "format": fmt})
        assert status == 201, ep
    precursor_loop(nan_at=230, grow_from=150).run(server=srv.url, project="forensics", run="growing")
    _checkpoints(srv, "growing", (100, 200))
    a1 = next(a for a in run_alerts(srv, "forensics", "growing") if a["rule"] == "A1")
    url = f"{PUBLIC}/incidents/{a1['id']}"

    # the webhook payload and the chat formats link the incident page
    body = webhook_receiver.wait_for(lambda r: r.path.endswith("/json") and r.json()["rule"] == "A1").json()
    assert body["incident_url"] == url and body["dashboard_url"] == f"{PUBLIC}/runs/{a1['run_id']}"
    assert body["evidence"]["precursors"] and GROWING_PARAM in body["diagnosis"]
    slack = webhook_receiver.wait_for(lambda r: r.path.endswith("/slack") and "A1" in r.json()["text"]).json()
    assert f"<{url}|Open the incident>" in json.dumps(slack)
    discord = webhook_receiver.wait_for(
        lambda r: r.path.endswith("/discord") and r.json()["embeds"][0]["title"].startswith("A1")).json()
    assert discord["embeds"][0]["url"] == url
    assert any(url in f["value"] for f in discord["embeds"][0]["fields"])

    # the page itself
    browser.get(f"{srv.url}/incidents/{a1['id']}")
    wait_until(lambda: texts(browser, "#incident-timeline li"), timeout=WAIT, what="the timeline")
    items = texts(browser, "#incident-timeline li")
    first_precursor = next(i for i, t in enumerate(items) if GROWING_PARAM in t and "normal band" in t)
    failure = next(i for i, t in enumerate(items) if "A1 loss_nonfinite" in t)
    assert first_precursor < failure, items                       # step order: the deviation came first
    assert "steps before" in items[first_precursor]
    assert any("checkpoint /ckpt/growing/step-100.pt" in t for t in items)
    assert texts(browser, "#incident-rollback-path") == ["/ckpt/growing/step-100.pt"]
    assert GROWING_PARAM in texts(browser, "#incident-summary")[0]
    fig = wait_until(lambda: (g := graph(browser, "incident-graph-grad_norm")) and g["data"] and g, timeout=WAIT,
                     what="the grad norm chart")
    xs = [x for t in fig["data"] for x in t["x"] if x is not None]
    lo, hi = fig["xrange"]
    assert lo <= 150 and hi >= 230 and xs and min(xs) >= lo - 1   # the window around the incident
    labels = {s["label"] for s in fig["shapes"]}
    assert {"first deviation", "checkpoint", "A1"} <= labels, labels
    assert graph(browser, "incident-heatmap-grad_norm")["data"]
    save_screenshot(browser, "incident-page")       # test-artifacts/ (docs/screenshots/incident.png)

    # reached from the run page's alert card
    browser.get(f"{srv.url}/runs/{a1['run_id']}")
    link = f"#run-ack-incident-{a1['id']}"
    wait_until(lambda: browser.find_elements("css selector", link), timeout=WAIT, what="the incident link")
    browser.find_element("css selector", link).click()
    wait_until(lambda: browser.current_url.endswith(f"/incidents/{a1['id']}") and texts(browser, "#incident-title"),
               timeout=WAIT, what="the incident page after the click")


def test_incident_without_checkpoint_or_precursor(server_factory, sqlite_url, browser):
    srv = server_factory(sqlite_url)
    precursor_loop(nan_at=230, grow_from=None).run(server=srv.url, project="forensics", run="sudden")
    a1 = next(a for a in run_alerts(srv, "forensics", "sudden") if a["rule"] == "A1")
    browser.get(f"{srv.url}/incidents/{a1['id']}")
    wait_until(lambda: texts(browser, "#incident-rollback-none"), timeout=WAIT, what="the rollback card")
    assert texts(browser, "#incident-rollback-none") == ["no checkpoint recorded before step 230"]
    assert texts(browser, "#incident-summary")[0].startswith("What deviated first: no signal left its normal band")
    # a page for an alert that does not exist says so
    browser.get(f"{srv.url}/incidents/999999")
    wait_until(lambda: "Incident not found" in browser.page_source, timeout=WAIT, what="not found")
    status, _ = http_json("GET", f"{srv.url}/api/health")
    assert status == 200


def _batch(run: str, rank: int, *, nan_at: int, start: int = 0, n: int = 40, events=()) -> dict:
    steps = [{"step": i, "time": 1.7e9 + i, "loss": "NaN" if i == nan_at else 1.0 - i * 0.0001,
              "grad_norm": "NaN" if i == nan_at else 0.5, "loss_scale": 65536.0, "overflow": i == nan_at,
              "lr": 1e-3} for i in range(start, start + n)]
    return {"batch_id": uuid.uuid4().hex, "project": "forensics", "run": run, "rank": rank, "world_size": 2,
            "steps": steps, "events": list(events)}


def test_incident_of_two_ranks_lists_its_alerts(server_factory, sqlite_url, browser):
    """Rank 1's loss goes NaN at step 20, rank 0's at 21 (one A1 across ranks), and rank 1 names the NaN
    origin (an A3 warning; F1 sees rank 1 diverge): the page shows both ranks and the A3 as an alert of
    the incident; an alert far from it (a later A1 episode) is not. The JSON route says the same."""
    srv = server_factory(sqlite_url)
    origin = {"step": 20, "kind": "nan_origin", "data": {"module": "blocks.1.attn", "where": "activation"}}
    for body in (_batch("ddp", 1, nan_at=20, events=[origin]), _batch("ddp", 0, nan_at=21),
                 _batch("ddp", 0, nan_at=900, start=40, n=900)):
        status, out = srv.post("/api/v1/ingest", body)
        assert status == 200, out
    alerts = run_alerts(srv, "forensics", "ddp")
    a1, later = sorted((a for a in alerts if a["rule"] == "A1"), key=lambda a: a["first_step"])
    assert later["first_step"] == 900
    assert a1["rank"] == 1 and sorted(a1["evidence"]["ranks"]) == [0, 1]
    a3 = next(a for a in alerts if a["rule"] == "A3")
    browser.get(f"{srv.url}/incidents/{a1['id']}")
    wait_until(lambda: texts(browser, "#incident-alerts .gw-alert-rule"), timeout=WAIT, what="the incident's alerts")
    rules = texts(browser, "#incident-alerts .gw-alert-rule")
    assert any(r.startswith("A1") for r in rules) and any(r.startswith("A3") for r in rules), rules
    assert browser.find_elements("css selector", f"#incident-ack-card-{a3['id']}")
    assert not browser.find_elements("css selector", f"#incident-ack-card-{later['id']}")   # another incident
    head = browser.find_element("css selector", ".gw-run-title").text
    assert "ranks 0, 1" in head, head
    items = texts(browser, "#incident-timeline li")
    assert any("NaN origin: blocks.1.attn" in t for t in items), items
    # the same incident as JSON, for scripts
    status, inc = srv.get(f"/api/v1/alerts/{a1['id']}/incident")
    assert status == 200, inc
    # A3 (rank 1 named the origin) and F1 (rank 1 went non-finite while rank 0 had not) at step 20
    assert {a["rule"] for a in inc["alerts"]} == {"A3", "F1"} and inc["rollback"] is None, inc["alerts"]
    assert later["id"] not in {a["id"] for a in inc["alerts"]}
    assert inc["first_anomalous_step"] == 20 and inc["run"]["name"] == "ddp"
    kinds = [t["kind"] for t in inc["timeline"]]
    assert kinds[0] == "nan_origin" and set(kinds[1:]) == {"alert"} and len(kinds) == 4, inc["timeline"]
    assert srv.get("/api/v1/alerts/999999/incident")[0] == 404
