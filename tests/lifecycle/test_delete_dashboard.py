"""The runs page's Delete action in headless Chromium against a real server: sizes shown, a confirmation
that names the run and its size, cancel keeps it, confirm deletes every row of it; the settings page shows
the database's size."""
from __future__ import annotations

import pytest

from tests.conftest import save_screenshot, wait_until
from tests.dashboard.conftest import WAIT, click, dash_server, texts  # noqa: F401 - dash_server is a fixture
from tests.dashboard.runs_feed import ingest, make_steps
from tests.lifecycle.lifecycle_data import assert_no_orphans, ids_of, rows_of_run

pytestmark = pytest.mark.browser


def _rows(drv) -> dict[str, list[str]]:
    rows = drv.execute_script(
        "return Array.from(document.querySelectorAll('#runs-table tr.gw-run-row'),"
        " (r) => Array.from(r.querySelectorAll('td'), (c) => c.innerText.trim()));")
    return {r[0]: r for r in rows}


def _confirm_text(drv, accept: bool) -> str:
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    alert = WebDriverWait(drv, WAIT).until(EC.alert_is_present())
    text = alert.text
    alert.accept() if accept else alert.dismiss()
    return text


def test_delete_a_run_from_the_runs_page_after_confirming(dash_server, browser):
    keep = ingest(dash_server, project="vision", run="keep", steps=make_steps(40, seed=1), status="finished")
    drop = ingest(dash_server, project="vision", run="drop", steps=make_steps(300, seed=2), status="finished")
    browser.get(dash_server.url + "/")
    rows = wait_until(lambda: len(r := _rows(browser)) == 2 and r, timeout=WAIT, what="two runs listed")
    # the Size column: the API's estimate, as the CLI prints it
    _, listed = dash_server.get("/api/v1/runs")
    size = {r["name"]: r["bytes"] for r in listed["runs"]}
    assert size["drop"] > size["keep"] > 0
    assert rows["drop"][9].endswith("kB") or rows["drop"][9].endswith("MB"), rows["drop"]

    # cancel: nothing happens
    click(browser, f"#runs-row-{drop} button")
    text = _confirm_text(browser, accept=False)
    assert "drop" in text and "vision" in text and "cannot be undone" in text
    assert rows_of_run(dash_server.db_url, drop)["steps"] == 300
    # confirm: the run and its rows go, the other stays
    alerts = ids_of(dash_server.db_url, "SELECT id FROM alerts WHERE run_id = :r", r=drop)
    groups = ids_of(dash_server.db_url, "SELECT id FROM notification_groups WHERE run_id = :r", r=drop)
    click(browser, f"#runs-row-{drop} button")
    _confirm_text(browser, accept=True)
    wait_until(lambda: list(_rows(browser)) == ["keep"], timeout=WAIT, what="the deleted run gone from the list")
    wait_until(lambda: "deleted run 'drop'" in " ".join(texts(browser, "#runs-delete-status")), timeout=WAIT,
               what="the delete reported")
    save_screenshot(browser, "runs-page-after-delete")
    assert dash_server.get(f"/api/v1/runs/{drop}")[0] == 404
    assert_no_orphans(dash_server.db_url, drop, alerts, groups)
    assert rows_of_run(dash_server.db_url, keep)["steps"] == 40

    browser.get(dash_server.url + "/settings")
    line = wait_until(lambda: (t := texts(browser, "#settings-storage")) and t[0], timeout=WAIT,
                      what="the database size on the settings page")
    assert line.startswith("Database: SQLite, ") and ("kB" in line or "MB" in line), line
