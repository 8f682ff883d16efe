"""The early-warning badge on the runs list and the setup advice on the run page, in headless Chromium.

Real runs through the real agent against a real server (API and dashboard on one port): their
``run_setup`` events raise H5-H9 notes at ingest, and the pages show them.
"""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, _start_server, severe_console_entries
from tests.dashboard.runs_feed import ingest, make_steps
from tests.advice.setup_loop import PROJECT, train

pytestmark = pytest.mark.browser


@pytest.fixture
def server(tmp_path):
    srv = _start_server(tmp_path)
    yield srv
    srv.stop()


def cells(drv) -> dict[str, dict]:
    """Runs table: run name -> its early-warning cell (text, badge text, advice mark text)."""
    rows = drv.execute_script("""
        return Array.from(document.querySelectorAll('#runs-table tr.gw-run-row'), (r) => {
          const c = r.querySelector('td.gw-early-cell');
          const badge = c && c.querySelector('.gw-early'), mark = c && c.querySelector('.gw-advice-mark');
          return [r.querySelector('td').innerText.trim(), {
            badge: badge ? badge.innerText.trim() : null, badge_class: badge ? badge.className : null,
            title: badge ? badge.title : null, advice: mark ? mark.innerText.trim() : null,
            advice_title: mark ? mark.title : null}];
        });""")
    return dict(rows)


def alerts_of(server, run: str) -> dict[str, dict]:
    _, body = server.get(f"/api/v1/runs?project={PROJECT}&name={run}")
    run_id = next(r["id"] for r in body["runs"] if r["name"] == run)
    _, body = server.get(f"/api/v1/alerts?run={run_id}")
    return {a["rule"]: a for a in body["alerts"]}


def test_runs_list_badge_names_early_warnings_and_marks_advice(server, browser):
    train(server.url, "warned", order="clip_without_unscale", ema=0.5)        # H9 warning, H7 info
    train(server.url, "advised", transformer=True, clip=None,                 # H6 and H8 info
          scheduler=lambda opt: __import__("torch").optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50))
    train(server.url, "by-the-checklist", ema=0.999)                          # nothing
    crashed = make_steps(20, seed=2)
    crashed[19]["loss"] = "NaN"                                               # A1 critical: not an early warning
    ingest(server, project=PROJECT, run="crashed", steps=crashed, status="crashed")

    browser.get(server.url + "/")
    rows = wait_until(lambda: len(r := cells(browser)) == 4 and r, timeout=WAIT, what="four runs listed")
    assert rows["warned"]["badge"] == "early warning: H9 clip_before_unscale", rows["warned"]
    assert "gw-early-warning" in rows["warned"]["badge_class"] and "(warning)" in rows["warned"]["title"]
    assert rows["warned"]["advice"] == "advice · 1" and "H7 ema_decay_off_range" in rows["warned"]["advice_title"]
    assert rows["advised"]["badge"] is None, rows["advised"]
    assert rows["advised"]["advice"] == "advice · 2"
    assert "H6 transformer_unclipped" in rows["advised"]["advice_title"]
    assert "H8 cosine_floor_too_low" in rows["advised"]["advice_title"]
    assert rows["by-the-checklist"] == {"badge": None, "badge_class": None, "title": None, "advice": None,
                                        "advice_title": None}
    assert rows["crashed"]["badge"] is None and rows["crashed"]["advice"] is None
    save_screenshot(browser, "runs-early-warning")

    # acknowledged, still firing: the badge stays (someone saw it; the clip order is still wrong)
    status, _ = server.post(f"/api/v1/alerts/{alerts_of(server, 'warned')['H9']['id']}/ack", {})
    assert status == 200
    browser.refresh()
    wait_until(lambda: (cells(browser).get("warned") or {}).get("badge"), timeout=WAIT, what="badge after ack")

    # the next process of the run follows the checklist: its notes resolve and the badge goes, live (it is a
    # fresh model under the run's name, so the resume rules G2/G3 fire: warnings, but not early ones)
    train(server.url, "warned", order="unscale_clip_step", ema=0.999)
    found = alerts_of(server, "warned")
    assert {r: a["status"] for r, a in found.items() if r.startswith("H")} == {"H9": "resolved", "H7": "resolved"}
    assert {r for r, a in found.items() if a["status"] == "firing"} == {"G2", "G3"}
    wait_until(lambda: cells(browser)["warned"]["badge"] is None and cells(browser)["warned"]["advice"] is None,
               timeout=WAIT, what="badge gone after the fixed resume")
    assert severe_console_entries(browser) == []


def test_run_page_shows_the_setup_advice_notice_and_cards(server, browser):
    train(server.url, "advised", transformer=True, clip=None, order="clip_without_unscale", ema=0.5)
    run_id = next(r["id"] for r in server.get(f"/api/v1/runs?project={PROJECT}")[1]["runs"])
    browser.get(f"{server.url}/runs/{run_id}")

    def notice():
        items = browser.execute_script("""
            const n = document.getElementById('run-setup-advice');
            return n && Array.from(n.querySelectorAll('li'), (li) => [li.id, li.dataset.severity, li.innerText]);""")
        return items or None
    items = wait_until(notice, timeout=WAIT, what="setup advice notice")
    # H6 (no clip: no clip order to judge either) and H7, info; the fix named under each
    assert [i[:2] for i in items] == [["run-advice-H6", "info"], ["run-advice-H7", "info"]], items
    assert "Transformer without gradient clipping" in items[0][2] and "Fix: After `scaler.unscale_" in items[0][2]
    assert "EMA decay 0.5 too low" in items[1][2]
    cards = wait_until(lambda: browser.execute_script(
        "return Array.from(document.querySelectorAll('#run-alerts .gw-alert'), (c) => [c.dataset.rule, c.dataset.severity]);")
        or None, timeout=WAIT, what="alert cards")
    assert sorted(cards) == [["H6", "info"], ["H7", "info"]]
    save_screenshot(browser, "run-setup-advice")
    assert severe_console_entries(browser) == []
